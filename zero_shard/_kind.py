"""Each kind of model is one class behind ``Kind``: whatever differs between kinds of model.

A plain or DDP model, replicated on every rank (``ReplicatedKind``, ``DDPKind`` in
``_replicas.py``); an FSDP2 one, whose shards are its params' local tensors (``FSDPKind``,
``FSDPHostKind`` under ``CPUOffloadPolicy``, in ``_fsdp.py``); with tensor parallelism or not.
``choose_kind`` (``_setup.py``) picks the class.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from offload import intra_op_threads
from optimizers import HostStep, OffloadPolicy

from ._buckets import Bucket, ShardedParam, norm_copies, norm_grads, shard_grads
from ._collectives import AllGather
from ._copies import mark_hook
from ._gather import DelayedUpdate
from ._norms import HOST_ROWS_FROM
from ._released_ops import DeferredClip
from ._stale import ReplicaWrites
from ._units import Units

if TYPE_CHECKING:
    from ._optimizer import ZeroShardOptimizer

__all__ = [
    "SUPPORTED_TP",
    "Kind",
    "Meshes",
    "Trainable",
    "grads_marker",
    "refuse_delayed_update",
    "watch_state_dict_entries",
]

Trainable = tuple[torch.Tensor, str, int]  # (param, fqn, param-group index)

SUPPORTED_TP = (
    "zero-shard supports tensor parallelism (parallelize_module over mesh['tp']) on a model "
    "replicated over mesh['dp'] (zero_shard.wrap(opt, model, mesh=mesh['dp'])), under DDP "
    "(device_mesh=mesh['dp']), or under FSDP2 (fully_shard over mesh['dp'])"
)


class Meshes(NamedTuple):
    """Where the optimizer shards, and where its sums go."""

    mesh: DeviceMesh  # the data-parallel mesh zero-shard shards over (FSDP2's mesh under FSDP2)
    joint: DeviceMesh | None  # with tensor parallelism under zero-shard's sharding: the 2-D
    #                           (dp, tp) mesh the state lies on
    sum_dims: tuple[int, ...]  # dims of verdict_mesh that global norms and non-finite checks
    #                            reduce over: those some param is sharded over (or, under FSDP2,
    #                            holds copies over: summed_dims)

    @property
    def verdict_mesh(self) -> DeviceMesh:
        """The ranks that must agree on every check: all that share a step's collectives."""
        return self.joint if self.joint is not None else self.mesh

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups of ``sum_dims`` over more than one rank (a sum over one is the term)."""
        mesh = self.verdict_mesh
        return [mesh.get_group(dim) for dim in self.sum_dims if mesh.size(dim) > 1]


class Kind(Protocol):
    """One kind of model: who communicates, and everything else that differs between kinds. The
    kinds subclass it for its defaults: what a kind with nothing to do there does."""

    module: nn.Module  # the model, unwrapped from DDP
    meshes: Meshes
    sharded: list[ShardedParam]  # made by build(): one per trainable param, in param-group order
    buckets: list[Bucket]  # made by build(); none where zero-shard communicates nothing
    writes: ReplicaWrites | None  # replicas at more than one rank: they agree on param writes
    copies_grads_early: bool = False  # whether install() hands reduced grads to the host as
    #                                   backward reduces them (the hybrid's grads_ready)
    clip: DeferredClip | None  # made by install(): the clip applied at the step, if it is

    # At wrap, on every rank alike (check_inputs): refusals, the hybrid's policy, the units.
    def check_options(self, delay: DelayedUpdate | None, all_gather: AllGather | None) -> None:
        pass

    def check_param(self, param: torch.Tensor, fqn: str) -> None:
        pass

    def offload_policy(self, policy: OffloadPolicy) -> OffloadPolicy:
        return policy

    def units(self, trainable: list[Trainable], units: Units) -> list[tuple[str, nn.Module]]: ...

    # Then the shards (collective), and the hooks once the optimizer's hybrid exists.
    def build(self, trainable: list[Trainable], units: list[tuple[str, nn.Module]], *,
              device: torch.device, reduce_device: torch.device, stage: int, bucket_mb: float,
              offload_fraction: float, all_gather: AllGather | None) -> None: ...  # fmt: skip
    def install(self, optimizer: ZeroShardOptimizer, *, overlap: bool) -> list[Any]: ...

    # Each step. finalize_grads: each shard's .grad is its reduced grad (reduce=False: with no
    # collective); after_step: the step's weights go to the params (a delayed update's, at the
    # next step);
    # finish: they have; flush: a delayed update in flight too; reset: zero_grad; end_window: a
    # step took the grads; refresh_shards: the params' values into the shards.
    def finalize_grads(self, *, reduce: bool = True) -> None: ...
    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def after_step(self, host_step: HostStep | None) -> None: ...
    def finish(self) -> None: ...

    def flush(self) -> None:
        self.finish()

    def reset(self) -> None:
        pass

    def end_window(self) -> None:
        pass

    def holds_unstepped_grads(self) -> bool:
        """Whether grads a backward reduced into zero-shard's own buffers wait for a step (the
        model's ``.grad`` then holds placeholders); DDP's and FSDP2's stay in ``.grad``."""
        return False

    def refresh_shards(self, records: Sequence[ShardedParam]) -> None:
        pass  # the shards are the params' memory

    @property
    def need_order(self) -> list[int] | None:  # the hybrid's param indices, as forward needs them
        return None

    @property
    def pending(self) -> bool:  # some params may not hold the latest step's weights yet
        return False

    def checked_grads(self) -> list[torch.Tensor]:  # what the non-finite check reads
        return shard_grads(self.sharded)

    def edited_grads(self) -> list[torch.Tensor]:  # what a clip or an unscale multiplies
        return self.checked_grads()

    # The grads the model's params hold for code to read between an unscale and the step (DDP's
    # and FSDP2's own; a plain model's are placeholders): fp16 ones keep the loss scale there.
    def model_grads(self) -> list[torch.Tensor]:
        return []

    # A global norm's inputs: the grads this rank counts, and its copies of grads another rank
    # counts (see [Note: uncounted copies in the verdict] in _norms.py); host pieces of
    # norm_rows_from elements or more are reduced by rows (global_norm).
    norm_rows_from: int = HOST_ROWS_FROM

    def norm_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return norm_grads(self.sharded), norm_copies(self.sharded)

    def grads_marker(self) -> Any:  # changes when the grads do
        return grads_marker(self.sharded)

    def host_threads(self) -> contextlib.AbstractContextManager:  # for passes over the grads
        return intra_op_threads(None)  # torchrun's: the grads are not on the host

    def raise_if_written_elsewhere(self, here: list[bool], device: torch.device) -> None:
        pass  # stale_params="error": where other ranks may see writes this one did not

    def device_bytes(self) -> int:  # held on the accelerator beside the hybrid's
        return 0


def refuse_delayed_update(delay: DelayedUpdate | None, what: str) -> None:
    if delay is not None:
        raise ValueError(
            f"OffloadPolicy(delayed_update=True) needs a plain model that zero-shard shards, "
            f"got a {what} model: its backward writes the grads that the delayed CPU "
            "step may still be copying. Pass the module itself (without DDP or fully_shard), "
            "or delayed_update=False"
        )


def grads_marker(records: Sequence[ShardedParam]) -> Any:
    """What changes when the model's grads do (a backward, a clear, an in-place edit): each
    param's ``.grad`` object and the version counter of its memory."""
    marker = []
    for sharded in records:
        grad = sharded.param.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        marker.append(None if grad is None else (id(grad), local._version))
    return tuple(marker)


def watch_state_dict_entries(module: nn.Module, records: Sequence[ShardedParam]) -> list[Any]:
    """State-dict post-hooks on the modules holding DTensor params (FSDP2's, tensor
    parallelism's): see ``_share_local_counters``. Returns their handles."""
    record_of = {id(s.param): s for s in records if isinstance(s.param, DTensor)}
    handles = []
    for child in module.modules():
        names = {
            name: record_of[id(param)]
            for name, param in child._parameters.items()
            if param is not None and id(param) in record_of
        }
        if names:
            hook = mark_hook(functools.partial(_share_local_counters, names=names))
            handles.append(child.register_state_dict_post_hook(hook))
    return handles


def _share_local_counters(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    *,
    names: dict[str, ShardedParam],
) -> None:
    """A state_dict post-hook: each DTensor param's entry (``param.detach()``, a DTensor whose
    local tensor has a version counter of its own) gets a local tensor sharing the counter that
    zero-shard watches, so that ``dcp.load`` into ``model.state_dict()``, which writes the local
    tensors, shows as a write of the params. ``keep_vars`` entries are the params themselves and
    stay."""
    for name, sharded in names.items():
        value = state_dict.get(prefix + name)
        if value is sharded.param or not isinstance(value, DTensor):
            continue
        watched = sharded.watched.shard  # the local tensor, or a leaf sharing its counter
        local = value._local_tensor
        if local.shape == watched.shape and local.data_ptr() == watched.data_ptr():
            value._local_tensor = watched.detach()  # the same memory, and its counter
