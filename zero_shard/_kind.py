"""Each kind of model is one class behind ``Kind``: whatever differs between them.

- ``ReplicatedKind`` (``_replicas.py``): a plain module on every rank. zero-shard reduces the grads
  bucket by bucket during backward (``GradReducer``) and gathers the updated params
  (``ParamGatherer``).
- ``DDPKind`` (``_replicas.py``): ``DistributedDataParallel`` all-reduces the grads; zero-shard
  steps this rank's rows of them and gathers the params.
- ``FSDPKind`` (``_fsdp.py``): FSDP2 reduce-scatters the grads and gathers the params itself; the
  shards zero-shard steps are the params' local tensors, written in place.
- ``FSDPHostKind`` (``_fsdp.py``): the same with FSDP2's ``CPUOffloadPolicy``: params and grads
  live on the host and are stepped there, in place, on the rank's threads.

Tensor parallelism is a layout of the params within each kind ([Note: tensor parallelism under
zero-shard's sharding] in ``_tp.py``). ``choose_kind`` (``_setup.py``) picks the class from the
model. The optimizer then calls the kind in this order: the checks of ``wrap`` (``check_options``,
``check_param``, ``offload_policy``, ``units``, on every rank alike), ``build`` (the shards),
``install`` (hooks, once the hybrid optimizer exists), and at each step ``finalize_grads``,
``after_step`` and the rest below.
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

from optimizers import HostStep, OffloadPolicy

from ._buckets import Bucket, ShardedParam
from ._clip import DeferredClip
from ._collectives import AllGather
from ._copies import mark_hook
from ._host_group import ReplicaWrites
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
        return [self.verdict_mesh.get_group(dim) for dim in self.sum_dims]


class Kind(Protocol):
    """One kind of model: who communicates, and everything else that differs between kinds."""

    module: nn.Module  # the model, unwrapped from DDP
    meshes: Meshes
    sharded: list[ShardedParam]  # made by build(): one per trainable param, in param-group order
    buckets: list[Bucket]  # made by build(); none where zero-shard communicates nothing
    writes: ReplicaWrites | None  # replicas at more than one rank: they agree on param writes
    clip: DeferredClip | None  # made by install(): the clip applied at the step, if it is

    # -- wrap: checks of rank-local input, run on every rank alike (see check_inputs) ----------

    def check_options(self, policy: OffloadPolicy, all_gather: AllGather | None) -> None:
        """Refuses options this kind cannot honour."""

    def check_param(self, param: torch.Tensor, fqn: str) -> None:
        """Refuses a trainable param this kind cannot shard."""

    def offload_policy(self, policy: OffloadPolicy) -> OffloadPolicy:
        """The policy the hybrid optimizer is built with: ``policy``, checked and adapted."""

    def units(self, trainable: list[Trainable], units: Units) -> list[tuple[str, nn.Module]]:
        """The units other than the root whose forward waits for their params (see [Note:
        units]); checks the params' layouts where FSDP2 lays them out."""

    # -- wrap: after the checks ----------------------------------------------------------------

    def build(
        self,
        trainable: list[Trainable],
        units: list[tuple[str, nn.Module]],
        *,
        device: torch.device,
        stage: int,
        bucket_mb: float,
        all_gather: AllGather | None,
    ) -> None:
        """Lays out the shards (``sharded``, ``buckets``); collective."""

    def install(self, optimizer: ZeroShardOptimizer, *, overlap: bool) -> list[Any]:
        """Installs the model hooks once the optimizer's hybrid exists; returns their handles."""

    # -- each step -------------------------------------------------------------------------------

    @property
    def need_order(self) -> list[int] | None:
        """The hybrid's param indices in the order the next forward needs them, if any."""

    @property
    def pending(self) -> bool:
        """Whether some params may not hold the latest step's weights yet."""

    def finalize_grads(self, *, reduce: bool = True) -> None:
        """Makes each shard's ``.grad`` its reduced grad (or ``None``), as of the current stream;
        ``reduce=False``: with no collective."""

    def checked_grads(self) -> list[torch.Tensor]:
        """What the non-finite check reads."""

    def grads_marker(self) -> Any:
        """Changes when the grads do."""

    def host_threads(self) -> contextlib.AbstractContextManager:
        """The threads for passes over grads that live on the host."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside accumulate grads with no communication."""

    def after_step(self, host_step: HostStep | None, *, delayed: bool = False) -> None:
        """The step's new weights go to the params (``delayed``: at the next step)."""

    def finish(self) -> None:
        """Waits until the params hold the last step's weights."""

    def flush(self) -> None:
        """As ``finish``, applying a delayed update in flight first."""

    def reset(self) -> None:
        """``zero_grad``."""

    def end_window(self) -> None:
        """A step took the grads."""

    def refresh_shards(self, records: Sequence[ShardedParam]) -> None:
        """The params' values into the shards of ``records``."""

    def raise_if_written_elsewhere(self, here: list[bool], device: torch.device) -> None:
        """``stale_params="error"`` at a step: raises where other ranks saw writes this one did
        not and would not agree on otherwise."""

    def device_bytes(self) -> int:
        """Accelerator bytes held beside the hybrid optimizer's."""


def refuse_delayed_update(policy: OffloadPolicy, what: str) -> None:
    if policy.delayed_update:
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
