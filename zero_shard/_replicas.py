"""Models replicated on every rank, plain (``ReplicatedKind``: zero-shard reduces the grads,
[Note: grad reduction]) or under DDP (``DDPKind``: DDP does): zero-shard shards the optimizer by
rows over the 1-D data-parallel mesh, in buckets, and gathers the params ([Note: param gather])."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from offload import use_device
from optimizers import HostStep, OffloadPolicy

from ._aliases import check_moved, counter_sharing, own_counter_view
from ._buckets import Bucket, ShardedParam, build_buckets, local_tensors, storage_expired
from ._collectives import AllGather, broadcast_tensors, launch_all_gather
from ._compiled import CompileAwareHook
from ._gather import DelayedUpdate, HostWrites, ParamGatherer
from ._hooks import register_param_waits
from ._kind import (
    SUPPORTED_TP,
    Kind,
    Meshes,
    Trainable,
    refuse_delayed_update,
    watch_state_dict_entries,
)
from ._norms import HOST_ROW
from ._outer_ddp import register_outer_ddp_check
from ._owners import is_claimed
from ._reduce import GradReducer
from ._released_ops import DeferredClip, EarlyCopies, ReleasedGradOps
from ._stale import ReplicaWrites
from ._tp import describe_layout, joint_mesh, local_tensor, tp_mesh_of
from ._units import UnitPlan, Units, plan_units, resolve_units
from ._verdict import start_any_rank_each

if TYPE_CHECKING:
    from ._optimizer import ZeroShardOptimizer

__all__ = ["DDPKind", "ReplicatedKind", "gather_group"]

logger = logging.getLogger("zero_shard")


def _timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta | None:
    """The group's collective timeout, where the backend tells it."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def gather_group(mesh: DeviceMesh, device: torch.device) -> dist.ProcessGroup | None:
    """A new group over the mesh's ranks, backend and timeout, for the param gathers alone (see
    [Note: param gather]); ``None`` for a mesh of one rank, which gathers nothing. Every rank of
    the mesh calls it, in the same order."""
    if mesh.size() == 1:
        return None
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


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def default_mesh(device: torch.device, ddp_group: dist.ProcessGroup | None) -> DeviceMesh:
    if ddp_group is not None:  # the ranks DDP averages the grads over
        return DeviceMesh.from_group(ddp_group, device.type)
    if not dist.is_initialized():
        return one_process_mesh(device)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def one_process_mesh_supported() -> bool:
    """Whether this torch builds a ``DeviceMesh`` with no process group (``_rank`` given)."""
    return "_rank" in inspect.signature(DeviceMesh.__init__).parameters


def one_process_mesh(device: torch.device) -> DeviceMesh:
    """The mesh of one process alone, with no process group behind it: a mesh of one rank runs
    no collective here (its reductions, gathers, broadcasts and agreements are identities), and
    DTensor and DCP need none on it. ``torch.distributed`` stays uninitialized, so that a later
    ``init_process_group`` works and other libraries (HF Trainer, accelerate) see no
    distributed run."""
    return DeviceMesh(device.type, [0], _init_backend=False, _rank=0)


def check_mesh(mesh: Any, device: torch.device, ddp_group: dist.ProcessGroup | None) -> DeviceMesh:
    """Refuses a mesh that is not a 1-D mesh of this rank over the params' device type, one whose
    whole mesh leaves out ranks of the default group (``init_device_mesh("cuda", (8,))`` run on 16
    ranks), and, for a DDP model, one over other ranks than DDP's group. The same on every rank of
    the mesh, so that no rank waits for one that refused."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be the 1-D data-parallel mesh, got {mesh.ndim} dims "
            f"{mesh.mesh_dim_names or ''}; pass its data-parallel dim (mesh['dp'])"
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"mesh is a {mesh.device_type!r} mesh but the params are on {device}; build the mesh "
            f"with init_device_mesh({device.type!r}, ...)"
        )
    world_size = dist.get_world_size()
    root_ranks = _ranks(mesh._get_root_mesh())  # the mesh that mesh['dp'] was taken from
    if mesh.get_coordinate() is None or len(root_ranks) != world_size:
        raise ValueError(
            f"mesh covers ranks {_ranks(mesh)} (of a mesh over ranks {root_ranks}), but the "
            f"process group has {world_size} ranks (this is rank {dist.get_rank()}); build the "
            f"mesh over every rank (init_device_mesh({device.type!r}, ({world_size},))) and pass "
            "it, or its data-parallel dim (mesh['dp'])"
        )
    if ddp_group is not None:
        ddp_ranks = dist.get_process_group_ranks(ddp_group)
        if _ranks(mesh) != ddp_ranks:
            raise ValueError(
                f"mesh covers ranks {_ranks(mesh)}, but the DDP model averages its grads over "
                f"ranks {ddp_ranks}; pass the mesh of DDP's process group, or mesh=None"
            )
    return mesh


def _default_dp_mesh(tp_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dim of the 2-D mesh ``tp_mesh`` was taken from."""
    root = tp_mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if root.ndim != 2 or tp_name not in names:
        raise ValueError(
            f"the model is tensor-parallel over {tp_mesh}, which is not a named dim of a 2-D "
            "mesh: build the mesh as init_device_mesh(device_type, (dp, tp), mesh_dim_names="
            "('dp', 'tp')) (dp may be 1), parallelize over mesh['tp'], and wrap (or pass "
            "mesh=mesh['dp'] where the mesh has more dims)"
        )
    return root[next(name for name in names if name != tp_name)]


def _replica_meshes(
    model: nn.Module, mesh: Any, device: torch.device, ddp_group: dist.ProcessGroup | None
) -> Meshes:
    """The mesh the optimizer shards over, the 2-D mesh of a tensor-parallel model's state, and
    the groups its global sums reduce over. Depends only on what every rank of the mesh has
    alike."""
    trained = [(p, name) for name, p in model.named_parameters() if p.requires_grad]
    tp_mesh = tp_mesh_of(trained)
    if mesh is None and tp_mesh is not None:
        mesh = _default_dp_mesh(tp_mesh)
    if mesh is None:
        mesh = default_mesh(device, ddp_group)
    else:
        mesh = check_mesh(mesh, device, ddp_group)
    if tp_mesh is None:
        return Meshes(mesh, None, (0,))
    return Meshes(mesh, joint_mesh(mesh, tp_mesh), (0, 1))


class _Replicas(Kind):
    """What the replicated and DDP kinds share: buckets of shards, gathered after each step."""

    clip: DeferredClip | None = None  # a plain model with a CPU share's (see ReplicatedKind)
    gatherer: ParamGatherer  # made by install()
    _plan: UnitPlan
    _group: dist.ProcessGroup | None  # the mesh's group, the grads are sharded over it; None
    #                                   at one rank
    _device: torch.device  # the params'
    _bucket_indices: list[list[int]]  # per bucket, its shards' param indices in the hybrid
    _all_gather: AllGather  # the params' gather: launch_all_gather, or wrap(all_gather=...)

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        mesh: Any,
        device: torch.device,
        ddp_group: dist.ProcessGroup | None,
    ) -> None:
        self.module = module
        self.meshes = _replica_meshes(model, mesh, device, ddp_group)
        self.sharded, self.buckets = [], []

    # -- wrap ------------------------------------------------------------------------------------

    def check_param(self, param: torch.Tensor, fqn: str) -> None:
        if not local_tensor(param).is_contiguous():
            raise ValueError(
                f"param {fqn!r} is not contiguous (stride {local_tensor(param).stride()}, e.g. "
                "channels_last); zero-shard shards params by rows of their memory: make it "
                "contiguous (param.data = param.data.contiguous()) before wrapping"
            )

    def units(self, trainable: list[Trainable], units: Units) -> list[tuple[str, nn.Module]]:
        return resolve_units(self.module, units)

    def build(
        self,
        trainable: list[Trainable],
        units: list[tuple[str, nn.Module]],
        *,
        device: torch.device,
        reduce_device: torch.device,
        stage: int,
        bucket_mb: float,
        offload_fraction: float,
        all_gather: AllGather | None,
    ) -> None:
        # Replicas agree on the params written at each step: at one rank there is nothing to agree.
        one_rank = self.meshes.mesh.size() == 1
        self.writes = None if one_rank else ReplicaWrites(self.meshes.verdict_mesh, reduce_device)
        self._plan = plan_units(self.module, units)
        self._device = device
        self._all_gather = all_gather or launch_all_gather
        self._group = self.meshes.mesh.get_group() if self.meshes.mesh.size() > 1 else None
        # Buckets go in unit order (root first), then model order inside a unit: the next
        # forward needs the first buckets first ([Note: units]), and backward makes the last
        # buckets' grads first. Inside a bucket, by param group (see plan_buckets).
        owner = self._plan.owner
        model_order = {id(p): place for place, p in enumerate(self.module.parameters())}
        ordered = sorted(trainable, key=lambda item: (owner[id(item[0])], model_order[id(item[0])]))
        sharded, self.buckets = build_buckets(
            [p for p, _, _ in ordered],
            [fqn for _, fqn, _ in ordered],
            [g for _, _, g in ordered],
            mesh=self.meshes.mesh,
            joint=self.meshes.joint,
            bucket_bytes=int(bucket_mb * (1 << 20)),
            units=[owner[id(p)] for p, _, _ in ordered],
            offload_fraction=offload_fraction,
        )
        record_of = {id(record.param): record for record in sharded}
        self.sharded = [record_of[id(p)] for p, _, _ in trainable]
        index_of = {id(record): index for index, record in enumerate(self.sharded)}
        self._bucket_indices = [[index_of[id(s)] for s in b.params] for b in self.buckets]
        _note_memory(self.buckets)

    def install(self, optimizer: ZeroShardOptimizer, *, overlap: bool) -> list[Any]:
        """Creates the gathers' group and the model hooks; returns the hooks' handles."""
        group = gather_group(self.meshes.mesh, self._device)
        self.gatherer = ParamGatherer(
            self.buckets, group, device=self._device, overlap=overlap, all_gather=self._all_gather
        )
        waits = register_param_waits(
            self.module, self._plan, self.buckets, self.gatherer, overlap=overlap
        )
        # Tensor-parallel DTensor params: as under FSDP2 (see [Note: FSDP2 versions]).
        return [*waits, *watch_state_dict_entries(self.module, self.sharded)]

    # -- each step -------------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return self.gatherer.pending

    @property
    def need_order(self) -> list[int]:
        """The hybrid's param indices in bucket order: the order the next forward needs them."""
        return [index for indices in self._bucket_indices for index in indices]

    def after_step(self, host_step: HostStep | None) -> None:
        """Gathers the shards into the params once ``host_step`` (the CPU's share of a step, if
        any) has written them; see [Note: param gather]. A delayed update's: at the next step,
        and the last step's now (see [Note: delayed update])."""
        writes = None if host_step is None else HostWrites(host_step, self._bucket_indices)
        if writes is not None and host_step.delayed:
            self.gatherer.after_delayed_step(writes)
        else:
            self.gatherer.after_step(writes)

    def finish(self) -> None:
        """Waits for the gathers in flight, and checks the params given other memory since the
        last step (``model.to(memory_format=...)``, ``param.data = t``): the next gathers write
        there."""
        self.gatherer.finish()
        records = self.sharded
        moved = [
            s for s, local in zip(records, local_tensors(records), strict=True)
            if local.data_ptr() != s.memory or (
                s.memory != 0 and s.storage is not None and storage_expired(s.storage.handle)
            )
        ]  # fmt: skip
        if moved:
            check_moved(moved, records)

    def flush(self) -> None:
        """Gathers a delayed update still deferred (collective), then waits for every gather."""
        self.gatherer.flush()

    @torch.no_grad()
    def refresh_shards(self, records: Sequence[ShardedParam]) -> None:
        # The params are taken as they are: memory given since the last check (model.to(d)
        # copying to an equal device, as accelerate does on CPUs) is noted, so that the
        # gathers after this do not count it as written after a step.
        moved = [
            s for s in records if s.memory and (
                s.local.data_ptr() != s.memory
                or (s.storage is not None and storage_expired(s.storage.handle))
            )
        ]  # fmt: skip
        if moved:
            check_moved(moved, self.sharded)
        for sharded in records:
            rows = sharded.local.detach().reshape(-1)
            spec = sharded.spec
            sharded.shard.view(-1).copy_(rows[spec.start : spec.start + spec.numel])
            if sharded.aliased and sharded.param.data_ptr() != sharded.shard.data_ptr():
                sharded.realias()  # given other memory since (param.data = t)

    def device_bytes(self) -> int:
        """Bytes of the shard buffers."""
        return sum(b.shard_buffer.numel() * b.shard_buffer.element_size() for b in self.buckets)


class DDPKind(_Replicas):
    """A DDP model: DDP all-reduces the grads, zero-shard steps its rows and gathers params."""

    _ddp: nn.parallel.DistributedDataParallel
    _ignored: set[int]  # ids of the params DDP ignores (each rank's own): refused
    _num_hooks_checked: int  # DDP comm hooks seen by _check_comm_hooks

    def __init__(
        self, ddp: nn.parallel.DistributedDataParallel, mesh: Any, device: torch.device
    ) -> None:
        for name, param in ddp.module.named_parameters():
            if isinstance(param, DTensor):
                raise ValueError(
                    f"param {name!r} of the DDP model is a DTensor with {describe_layout(param)}, "
                    "but DDP reduces plain tensors: build DDP with device_mesh=mesh['dp'], which "
                    f"turns tensor-parallel params into local tensors. {SUPPORTED_TP}"
                )
        self._ddp = ddp
        # (DDP lists the params it all-reduces after backward, delay_all_reduce_named_params,
        # among those it ignores.)
        delayed = {id(p) for _, p in getattr(ddp, "_delay_all_reduce_params", ())}
        ignored = ddp.parameters_to_ignore
        self._ignored = {
            id(p) for n, p in ddp.module.named_parameters() if n in ignored and id(p) not in delayed
        }
        self._num_hooks_checked = 0
        _check_comm_hooks(ddp)
        if mesh is None:
            mesh = getattr(ddp, "device_mesh", None)
        super().__init__(ddp, ddp.module, mesh, device, ddp.process_group)

    def check_param(self, param: torch.Tensor, fqn: str) -> None:
        if id(param) in self._ignored:
            raise ValueError(
                f"param {fqn!r} is one that DDP was told to ignore "
                "(_set_params_and_buffers_to_ignore_for_model): DDP neither reduces nor "
                "broadcasts it, so each rank holds its own, and zero-shard, which steps each "
                "rank's rows of a param replicated on every rank, would mix the ranks' values. "
                "Step such params with an optimizer of their own, outside the one you wrap"
            )
        super().check_param(param, fqn)

    def check_options(self, delay: DelayedUpdate | None, all_gather: AllGather | None) -> None:
        refuse_delayed_update(delay, "DDP")

    def offload_policy(self, policy: OffloadPolicy) -> OffloadPolicy:
        # DDP's grads are the model's: they may be zeroed in place right after step(), so
        # every chunk's are copied as the step starts (see after_step).
        return dataclasses.replace(policy, host_staging="per_chunk")

    def build(self, trainable: list[Trainable], units: list[tuple[str, nn.Module]], *,
              stage: int, **options: Any) -> None:  # fmt: skip
        if stage == 2:
            logger.info(
                "zero-shard: the model is DDP, which all-reduces the grads; its reduced grads "
                "are used as they are (stage 1). Pass the unwrapped module for stage 2."
            )
        super().build(trainable, units, stage=stage, **options)

    def finish(self) -> None:
        """As for any gathered model; and a comm hook registered since the last check is checked
        here, before the step's first collective (see ``_check_comm_hooks``)."""
        super().finish()
        self._check_new_comm_hooks()

    def _check_new_comm_hooks(self) -> None:
        hooks = getattr(self._ddp, "_comm_hooks", ())
        if len(hooks) != self._num_hooks_checked:  # a comm hook registered since wrap
            _check_comm_hooks(self._ddp)
            self._num_hooks_checked = len(hooks)

    def finalize_grads(self, *, reduce: bool = True) -> None:
        self._check_new_comm_hooks()  # a clip finalizes before any step
        for sharded in self.sharded:
            grad = sharded.param.grad
            if grad is None:
                sharded.shard.grad = None
            elif sharded.spec.replicated:  # a 0-dim param: every rank's ([Note: 0-dim params])
                sharded.shard.grad = grad.detach()
            else:  # this rank's rows of the reduced grad, a view
                spec = sharded.spec
                sharded.shard.grad = grad.detach()[spec.start_row : spec.start_row + spec.num_rows]

    def edited_grads(self) -> list[torch.Tensor]:
        # Each reduced grad whole, not this rank's rows (the shards' grads are views of them):
        # torch's clip, or code reading .grad after an unscale or a clip, sees every element.
        return self.model_grads()

    def model_grads(self) -> list[torch.Tensor]:
        return [s.param.grad.detach() for s in self.sharded if s.param.grad is not None]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._ddp.no_sync():
            yield

    def after_step(self, host_step: HostStep | None) -> None:
        """As for any gathered model; and the current stream waits until the step's copies read
        the grads, which are the model's: ``zero_grad(set_to_none=False)`` or a backward right
        after ``step()`` writes them in place (the copies were queued as the step started: a
        stream wait, the CPU step goes on)."""
        if host_step is not None:
            host_step.wait_grads_copied()
        super().after_step(host_step)


class ReplicatedKind(_Replicas):
    """A plain module on every rank: zero-shard reduces grads and gathers params."""

    copies_grads_early = True

    reducer: GradReducer  # made by install()
    _stage: int
    _released_ops: ReleasedGradOps  # torch's clip on the placeholders the reducer leaves

    def __init__(self, module: nn.Module, mesh: Any, device: torch.device) -> None:
        super().__init__(module, module, mesh, device, None)

    def build(self, trainable: list[Trainable], units: list[tuple[str, nn.Module]], *,
              device: torch.device, stage: int, **options: Any) -> None:  # fmt: skip
        # DDP does the same at construction; FSDP2's shards differ by rank.
        mesh = self.meshes.mesh
        if mesh.size() > 1:
            broadcast_tensors(_module_tensors(self.module, mesh, device), mesh.get_group())
        super().build(trainable, units, device=device, stage=stage, **options)
        self._stage = stage
        if self.meshes.mesh.size() == 1:  # one rank: the params become views of the shard buffers
            _alias_params(self.buckets)

    def install(self, optimizer: ZeroShardOptimizer, *, overlap: bool) -> list[Any]:
        handles = super().install(optimizer, overlap=overlap)
        hybrid, early = optimizer._hybrid, None
        if hybrid.memory_report().num_host_elements:  # see [Note: clip at the step]
            self.clip = DeferredClip(self.sharded, optimizer._edits, hybrid)
            if hybrid.copies_grads_early:  # else no per-bucket work in backward's hooks
                # Steps speculated from the copies take the wrapper's options as they are then.
                sync = optimizer._sync_hybrid_groups if hybrid.speculates else None
                early = EarlyCopies(hybrid, self.buckets, self._bucket_indices, sync)
        held = {id(s.param) for s in self.sharded}
        self.reducer = GradReducer(
            self.buckets, self._group, stage=self._stage, device=self._device,
            gatherer=self.gatherer, clip=self.clip, early=early,
            outside=[
                p for p in self.module.parameters()
                if id(p) not in held and not isinstance(p, DTensor)
            ],
        )  # fmt: skip
        reducer = weakref.ref(self.reducer)

        def before_forward(module: nn.Module, args: Any) -> None:
            alive = reducer()
            if alive is not None:
                alive.forget_aborted_backward()
                alive.drop_cleared()

        def outer_ddp_forward(sync: bool) -> None:
            alive = reducer()
            if alive is not None:
                alive.outer_unsynced = not sync

        # Compiled code runs it at a graph break, or not at all ([Note: compiled models]).
        hook = CompileAwareHook.of(before_forward, self.gatherer)
        aborted = self.module.register_forward_pre_hook(hook)
        params = (s.param for s in self.sharded)
        outer_ddp = register_outer_ddp_check(self.module, params, outer_ddp_forward)
        handles = [*handles, aborted, outer_ddp, *self.reducer.register_hooks()]
        self._released_ops = ReleasedGradOps(optimizer)
        for index, sharded in enumerate(self.sharded):
            sharded.watch.placeholder.link(self._released_ops, index)
        return handles

    def finalize_grads(self, *, reduce: bool = True) -> None:
        self.reducer.finish(reduce=reduce)

    def checked_grads(self) -> list[torch.Tensor]:
        # Each bucket's reduced grads in one piece: its gaps and padding hold zeros.
        return [b.grad_buffer[: b.layout.shard_numel] for b in self.buckets if b.has_grads]

    norm_rows_from = HOST_ROW  # a bucket's long pieces: as accurate as the grads' own norms

    def norm_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Each bucket's reduced grads in a few pieces, as the non-finite check reads them.
        counted: list[torch.Tensor] = []
        copies: list[torch.Tensor] = []
        for bucket in self.buckets:
            if bucket.has_grads:
                mine, others = bucket.norm_pieces()
                counted += mine
                copies += others
        return counted, copies

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

    def holds_unstepped_grads(self) -> bool:
        # (grads cleared through the model, model.zero_grad(), hold nothing any more)
        return self.reducer.reduced_in_window and any(
            s.param.grad is not None for s in self.sharded
        )


def _module_tensors(
    module: nn.Module, mesh: DeviceMesh, device: torch.device
) -> list[torch.Tensor]:
    """The module's params and buffers on ``device``: what makes replicas equal. Params another
    wrapper shards are equal already (and are its to write). Every rank must broadcast the same
    tensors, and whether a wrapper is still alive differs by rank (a dropped one is collected
    when each rank's garbage collector gets to it): a param is left out where any rank's live
    wrapper shards it (one all-reduce of the flags)."""
    params = list(module.parameters())
    claimed = start_any_rank_each(
        [is_claimed(p) for p in params], group=None, mesh=mesh, device=device
    )()
    params = [local_tensor(p) for p, skip in zip(params, claimed, strict=True) if not skip]
    tensors = params + list(module.buffers())
    return [tensor for tensor in tensors if tensor.device == device]


def _check_comm_hooks(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Refuses a DDP comm hook known not to average the grads over the ranks: zero-shard steps
    each rank's rows of the reduced grads, which must be alike on every rank (torch's averaging
    hooks, compressed or not, give that). Known by its name: a local-SGD hook wrapped in another
    function (``fp16_compress_wrapper(post_localSGD_hook)``, a ``partial``) is not seen."""
    for hook, _ in getattr(ddp, "_comm_hooks", ()):
        if getattr(hook, "__name__", "") == "post_localSGD_hook":
            raise ValueError(
                "the DDP model has post_localSGD_hook, whose grads are each rank's own once local "
                "SGD starts: zero-shard steps each rank's rows of grads replicated on every rank, "
                "and would mix the ranks' updates. Use a DDP with an averaging comm hook (or "
                "none), or step local SGD with a torch optimizer"
            )


def _note_memory(buckets: Sequence[Bucket]) -> None:
    """Notes each param's memory, and gives the params that share a version counter with
    another their ``own_counter`` views ([Note: shared version counters] in ``_aliases.py``)."""
    records = [sharded for bucket in buckets for sharded in bucket.params]
    locals_ = [sharded.local for sharded in records]
    for sharded, local, shares in zip(records, locals_, counter_sharing(locals_), strict=True):
        sharded.note_memory()
        if shares:
            sharded.own_counter = own_counter_view(local)
            buckets[sharded.bucket].shares_counters = True


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
