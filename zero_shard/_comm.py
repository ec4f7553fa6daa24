"""Who moves grads and params, one object per kind of model, each owning its lifecycle.

- ``ReplicatedComm``: a plain module on every rank. zero-shard reduces the grads bucket by
  bucket during backward (``GradReducer``) and gathers the updated params (``ParamGatherer``).
- ``DDPComm``: ``DistributedDataParallel`` all-reduces the grads; zero-shard steps this rank's
  rows of them and gathers the params.
- ``FSDPComm``: FSDP2 reduce-scatters the grads and gathers the params itself; the shards
  zero-shard steps are the params' local tensors, written in place.

Each gives the optimizer the same calls: ``finalize_grads`` (each shard's ``.grad`` is its
reduced grad; ``reduce=False``: with no collective), ``checked_grads`` (what the non-finite
check reads), ``no_sync``, ``after_step`` (the step's new weights reach the params), ``finish``
(they have), ``reset`` (``zero_grad``), ``end_window`` (a step took the grads),
``grads_marker`` (changes when the grads do), ``refresh_shards`` (the params' values into the
shards).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from offload import use_device
from optimizers import HostStep

from ._buckets import Bucket, ShardedParam, build_buckets, fsdp_sharded_param, shard_grads
from ._collectives import AllGather, launch_all_gather
from ._compiled import CompileAwareHook
from ._copies import mark_hook
from ._gather import HostWrites, ParamGatherer
from ._hooks import register_param_waits
from ._outer_ddp import register_outer_ddp_check
from ._reduce import GradReducer
from ._units import UnitPlan

__all__ = ["Comm", "DDPComm", "FSDPComm", "ReplicatedComm", "gather_group"]

Trainable = tuple[torch.Tensor, str, int]  # (param, fqn, param-group index)


def _timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta | None:
    """The group's collective timeout, where the backend tells it."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def gather_group(mesh: DeviceMesh, device: torch.device) -> dist.ProcessGroup:
    """A new group over the mesh's ranks, backend and timeout, for the param gathers alone (see
    [Note: param gather]). Every rank of the mesh calls it, in the same order."""
    group = mesh.get_group()
    mine = dist.get_process_group_ranks(group)
    options = {"timeout": _timeout(group, device), "backend": dist.get_backend(group)}
    if mesh._get_root_mesh().mesh.numel() == dist.get_world_size():
        # Every rank wraps, and each rank's mesh may be another slice of a bigger one
        # (mesh["dp"]): each makes every rank's group, in one order, as new_group requires.
        everyone: list[Any] = [None] * dist.get_world_size()
        with use_device(device):
            dist.all_gather_object(everyone, mine)
        made = None
        for ranks in sorted({tuple(ranks) for ranks in everyone}):
            new = dist.new_group(list(ranks), **options)
            if list(ranks) == mine:
                made = new
        if made is None:
            raise AssertionError(f"expected a group over ranks {mine} among those made")
        return made
    # Only the mesh's ranks wrap (a DDP model over a subgroup): they make the group alone. torch
    # names such a group by how many groups each rank made before, which must then agree.
    counts: list[Any] = [None] * len(mine)
    with use_device(device):
        dist.all_gather_object(counts, len(distributed_c10d._world.pg_names), group=group)
    if len(set(counts)) > 1:
        raise RuntimeError(
            f"the ranks {mine} made different numbers of process groups before wrap ({counts}), "
            "so they cannot make the gathers' group alone; make process groups in the same order "
            "on these ranks, or call zero_shard.wrap on every rank"
        )
    return dist.new_group(mine, use_local_synchronization=True, **options)


def grads_marker(records: Sequence[ShardedParam]) -> Any:
    """What changes when the model's grads do (a backward, a clear, an in-place edit): each
    param's ``.grad`` object and the version counter of its memory."""
    marker = []
    for sharded in records:
        grad = sharded.param.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        marker.append(None if grad is None else (id(grad), local._version))
    return tuple(marker)


class FSDPComm:
    """An FSDP2 model: FSDP2 communicates; the shards are its params' local tensors."""

    sharded: list[ShardedParam]
    buckets: list[Bucket]  # none
    _module: nn.Module

    def __init__(
        self,
        module: nn.Module,
        trainable: Sequence[Trainable],
        mesh: DeviceMesh,
        reduced_dims: Sequence[int],
    ) -> None:
        self._module = module
        self.sharded = [
            fsdp_sharded_param(p, fqn, g, mesh, reduced_dims) for p, fqn, g in trainable
        ]
        self.buckets = []

    def install(self, mesh: DeviceMesh, *, device: torch.device, overlap: bool) -> list[Any]:
        """Makes the model's state dicts watched as its params are (see [Note: FSDP2 versions])."""
        return watch_state_dict_entries(self._module, self.sharded)

    @property
    def pending(self) -> bool:
        return False

    @property
    def need_order(self) -> list[int] | None:
        return None

    def finalize_grads(self, *, reduce: bool = True) -> None:
        for sharded in self.sharded:
            grad = sharded.param.grad
            if grad is not None and grad.placements != sharded.param.placements:
                # FSDP2 leaves grads laid out as their params (with tensor parallelism too); a
                # partial or otherwise placed grad would step the local tensor with other values.
                raise RuntimeError(
                    f"the grad of FSDP2 param {sharded.fqn!r} has placements {grad.placements}, "
                    f"the param {sharded.param.placements}: zero-shard steps each local tensor "
                    "with its own local grad, so they must match; set .grad to a DTensor laid "
                    "out as its param"
                )
            sharded.shard.grad = None if grad is None else grad._local_tensor.detach()

    def checked_grads(self) -> list[torch.Tensor]:
        return shard_grads(self.sharded)

    def grads_marker(self) -> Any:
        return grads_marker(self.sharded)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        modules = [m for m in self._module.modules() if hasattr(m, "set_requires_gradient_sync")]
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    def after_step(self, host_step: HostStep | None, *, delayed: bool = False) -> None:
        if delayed:
            raise AssertionError("expected no delayed update under FSDP2 (refused at wrap)")
        if host_step is not None:
            host_step.wait()  # the step writes the params' local shards in place
        for sharded in self.sharded:
            sharded.record_version()

    def flush(self) -> None:
        self.finish()

    def finish(self) -> None:
        """Checks that every shard still is its param's memory: the step writes the shards, and
        FSDP2 all-gathers from the params' local tensors."""
        for sharded in self.sharded:
            local = sharded.param._local_tensor
            if sharded.shard.numel() and (
                local.data_ptr() != sharded.shard.data_ptr() or local.shape != sharded.shard.shape
            ):
                raise RuntimeError(
                    f"the local tensor of FSDP2 param {sharded.fqn!r} was replaced since the "
                    "optimizer was built (FSDP2 does so when a param's memory changes: "
                    "model.to(...), torch.utils.swap_tensors): the optimizer would update memory "
                    "FSDP2 no longer reads. Change the params' memory before zero_shard.wrap, or "
                    "wrap the torch optimizer again after"
                )

    def reset(self) -> None:
        pass

    def end_window(self) -> None:
        pass  # FSDP2 owns the grads

    def refresh_shards(self, records: Sequence[ShardedParam]) -> None:
        pass  # the shards are the model's own memory

    def device_bytes(self) -> int:
        return 0


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


class _GatheredComm:
    """What the replicated and DDP kinds share: buckets of shards, gathered after each step."""

    sharded: list[ShardedParam]  # in param-group order, as the hybrid's param indices
    buckets: list[Bucket]
    gatherer: ParamGatherer  # made by install()
    _module: nn.Module
    _plan: UnitPlan
    _group: dist.ProcessGroup  # the mesh's group: the grads are sharded over it
    _bucket_indices: list[list[int]]  # per bucket, its shards' param indices in the hybrid
    _all_gather: AllGather  # the params' gather: launch_all_gather, or wrap(all_gather=...)

    def _build(
        self,
        module: nn.Module,
        trainable: Sequence[Trainable],
        plan: UnitPlan,
        mesh: DeviceMesh,
        joint: DeviceMesh | None,
        *,
        bucket_mb: float,
        all_gather: AllGather | None,
    ) -> None:
        self._module = module
        self._plan = plan
        self._all_gather = all_gather or launch_all_gather
        self._group = mesh.get_group()
        # Buckets go in unit order (root first), then model order inside a unit: the next
        # forward needs the first buckets first ([Note: units]), and backward makes the last
        # buckets' grads first.
        model_order = {id(p): place for place, p in enumerate(module.parameters())}
        ordered = sorted(
            trainable, key=lambda item: (plan.owner[id(item[0])], model_order[id(item[0])])
        )
        sharded, self.buckets = build_buckets(
            [p for p, _, _ in ordered],
            [fqn for _, fqn, _ in ordered],
            [g for _, _, g in ordered],
            mesh=mesh,
            joint=joint,
            bucket_bytes=int(bucket_mb * (1 << 20)),
            units=[plan.owner[id(p)] for p, _, _ in ordered],
        )
        record_of = {id(record.param): record for record in sharded}
        self.sharded = [record_of[id(p)] for p, _, _ in trainable]
        index_of = {id(record): index for index, record in enumerate(self.sharded)}
        self._bucket_indices = [[index_of[id(s)] for s in b.params] for b in self.buckets]

    def install(self, mesh: DeviceMesh, *, device: torch.device, overlap: bool) -> list[Any]:
        """Creates the gathers' group and the model hooks; returns the hooks' handles."""
        group = gather_group(mesh, device)
        self.gatherer = ParamGatherer(
            self.buckets, group, device=device, overlap=overlap, all_gather=self._all_gather
        )
        waits = register_param_waits(self._module, self._plan, self.buckets, self.gatherer)
        # Tensor-parallel DTensor params: as under FSDP2 (see [Note: FSDP2 versions]).
        return [*waits, *watch_state_dict_entries(self._module, self.sharded)]

    @property
    def pending(self) -> bool:
        return self.gatherer.pending

    @property
    def need_order(self) -> list[int]:
        """The hybrid's param indices in bucket order: the order the next forward needs them."""
        return [index for indices in self._bucket_indices for index in indices]

    def after_step(self, host_step: HostStep | None, *, delayed: bool = False) -> None:
        """Gathers the shards into the params once ``host_step`` (the CPU's share of a step, if
        any) has written them; see [Note: param gather]. ``delayed``: at the next step instead,
        and the last step's now (see [Note: delayed update])."""
        writes = None if host_step is None else HostWrites(host_step, self._bucket_indices)
        if delayed and writes is not None:
            self.gatherer.after_delayed_step(writes)
        else:
            self.gatherer.after_step(writes)

    def finish(self) -> None:
        """Waits for the gathers in flight."""
        self.gatherer.finish()

    def flush(self) -> None:
        """Gathers a delayed update still deferred (collective), then waits for every gather."""
        self.gatherer.flush()

    @torch.no_grad()
    def refresh_shards(self, records: Sequence[ShardedParam]) -> None:
        for sharded in records:
            rows = sharded.local.detach().reshape(-1)
            spec = sharded.spec
            sharded.shard.view(-1).copy_(rows[spec.start : spec.start + spec.numel])
            if sharded.aliased and sharded.param.data_ptr() != sharded.shard.data_ptr():
                sharded.realias()  # given other memory since (param.data = t)

    def device_bytes(self) -> int:
        """Bytes of the shard buffers."""
        return sum(b.shard_buffer.numel() * b.shard_buffer.element_size() for b in self.buckets)


class DDPComm(_GatheredComm):
    """A DDP model: DDP all-reduces the grads, zero-shard steps its rows and gathers params."""

    _ddp: nn.parallel.DistributedDataParallel

    def __init__(
        self,
        ddp: nn.parallel.DistributedDataParallel,
        trainable: Sequence[Trainable],
        plan: UnitPlan,
        mesh: DeviceMesh,
        joint: DeviceMesh | None,
        *,
        bucket_mb: float,
        all_gather: AllGather | None = None,
    ) -> None:
        self._ddp = ddp
        self._build(
            ddp.module, trainable, plan, mesh, joint, bucket_mb=bucket_mb, all_gather=all_gather
        )

    def finalize_grads(self, *, reduce: bool = True) -> None:
        for sharded in self.sharded:
            grad = sharded.param.grad
            if grad is None:
                sharded.shard.grad = None
            elif sharded.spec.replicated:  # a 0-dim param: every rank's ([Note: 0-dim params])
                sharded.shard.grad = grad.detach()
            else:  # this rank's rows of the reduced grad, a view
                spec = sharded.spec
                sharded.shard.grad = grad.detach()[spec.start_row : spec.start_row + spec.num_rows]

    def checked_grads(self) -> list[torch.Tensor]:
        return shard_grads(self.sharded)

    def grads_marker(self) -> Any:
        return grads_marker(self.sharded)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._ddp.no_sync():
            yield

    def after_step(self, host_step: HostStep | None, *, delayed: bool = False) -> None:
        """As for any gathered model; and the current stream waits until the step's copies read
        the grads, which are the model's: ``zero_grad(set_to_none=False)`` or a backward right
        after ``step()`` writes them in place (the copies were queued as the step started: a
        stream wait, the CPU step goes on)."""
        if host_step is not None:
            host_step.wait_grads_copied()
        super().after_step(host_step, delayed=delayed)

    def reset(self) -> None:
        pass  # the grads are the model's: zero_grad clears them

    def end_window(self) -> None:
        pass


class ReplicatedComm(_GatheredComm):
    """A plain module on every rank: zero-shard reduces grads and gathers params."""

    reducer: GradReducer

    def __init__(
        self,
        module: nn.Module,
        trainable: Sequence[Trainable],
        plan: UnitPlan,
        mesh: DeviceMesh,
        joint: DeviceMesh | None,
        *,
        device: torch.device,
        bucket_mb: float,
        stage: int,
        all_gather: AllGather | None = None,
    ) -> None:
        self._build(
            module, trainable, plan, mesh, joint, bucket_mb=bucket_mb, all_gather=all_gather
        )
        if mesh.size() == 1:  # one rank: the params become views of the shard buffers
            _alias_params(self.buckets)
        self.reducer = GradReducer(self.buckets, self._group, stage=stage, device=device)

    def install(self, mesh: DeviceMesh, *, device: torch.device, overlap: bool) -> list[Any]:
        handles = super().install(mesh, device=device, overlap=overlap)
        # The reductions write the grad buffers that the last step's D2H copies read: the step
        # must be complete first (the gathers waited for every CPU chunk), whatever the forward
        # waited for (see [Note: deferred host step]); a delayed update's CPU step runs on, but
        # its copies of the grads must be done (see [Note: delayed update]).
        gatherer = weakref.ref(self.gatherer)

        def before_first_reduction() -> None:
            alive = gatherer()
            if alive is not None:
                alive.finish()
                alive.wait_deferred_reads()

        self.reducer.before_first = before_first_reduction
        reducer = weakref.ref(self.reducer)

        def before_forward(module: nn.Module, args: Any) -> None:
            alive = reducer()
            if alive is not None:
                alive.forget_aborted_backward()
                alive.drop_cleared()

        # Compiled code runs it at a graph break, or not at all ([Note: compiled models]).
        hook = CompileAwareHook.of(before_forward, self.gatherer)
        aborted = self._module.register_forward_pre_hook(hook)
        outer_ddp = register_outer_ddp_check(self._module, (s.param for s in self.sharded))
        return [*handles, aborted, outer_ddp, *self.reducer.register_hooks()]

    def finalize_grads(self, *, reduce: bool = True) -> None:
        self.reducer.finish(reduce=reduce)

    def reduced_grads(self, bucket: Bucket) -> dict[int, torch.Tensor]:
        """The bucket's reduced grads by the hybrid optimizer's param index (1-D views of its
        grad buffer; a param no rank had a grad for has zeros there)."""
        indices = self._bucket_indices[bucket.params[0].bucket]
        return {
            index: sharded.grad_slot.view(-1)
            for index, sharded in zip(indices, bucket.params, strict=True)
        }

    def checked_grads(self) -> list[torch.Tensor]:
        # Each bucket's reduced grads in one piece: its gaps and padding hold zeros.
        return [b.grad_buffer[: b.layout.shard_numel] for b in self.buckets if b.has_grads]

    def device_bytes(self) -> int:
        """Bytes of the shard buffers and of the reduced grads (held from backward to
        ``zero_grad``)."""
        return super().device_bytes() + sum(b.grad_bytes for b in self.buckets)

    def grads_marker(self) -> Any:
        return self.reducer.num_changes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = True

    def reset(self) -> None:
        self.reducer.reset()

    def end_window(self) -> None:
        self.reducer.end_window()


def _alias_params(buckets: Sequence[Bucket]) -> None:
    """One rank holds every row: in a bucket of plain params, each param's shard becomes a view
    of the param itself, so that the params are not held twice, and the bucket has no shard
    buffer left to gather from. A bucket holding a tensor-parallel param (whose local tensor
    keeps a shard of its own) is gathered, into each of its params: a plain one there keeps its
    shard too, or the gather would write the bucket's copy over the step's update."""
    for bucket in buckets:
        if any(isinstance(sharded.param, DTensor) for sharded in bucket.params):
            continue
        for sharded in bucket.params:
            sharded.alias()
        bucket.aliased = True
        bucket.shard_buffer = bucket.shard_buffer.new_empty(0)


Comm = ReplicatedComm | DDPComm | FSDPComm
