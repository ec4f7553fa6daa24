"""One record per sharded parameter, and the buckets that hold their shards and reduced grads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._bucket_layout import BucketLayout, ShardSpec, offload_start, plan_buckets, shard_spec
from ._collectives import RowCopies, plan_row_copies
from ._released import GradWatch, check_unconverted
from ._tp import StateLayout, dtensor_layout, local_tensor, placements_over, rows_layout

__all__ = [
    "Bucket",
    "FlagsBefore",
    "NormRuns",
    "ShardedParam",
    "build_buckets",
    "fsdp_sharded_param",
    "local_tensors",
    "model_versions",
    "norm_grads",
    "shard_grads",
    "stale_flags",
]


@dataclass(frozen=True)
class DTensorCounters:
    """A DTensor param's two version counters, read as one (FSDP2's, or tensor parallelism's).

    [Note: FSDP2 versions]
    A DTensor and its local tensor have separate version counters: an in-place op on the DTensor
    (``param.copy_``, ``module.load_state_dict``, ``set_model_state_dict``, ``torch.nn.init``)
    bumps the DTensor's alone (its local tensor is written below autograd), and a write into the
    local tensor (``dcp.load`` into ``model.state_dict()``, which fills ``to_local()``) bumps the
    local tensor's alone. A model-only load may take either route, so both are watched: each
    counter only grows, and their sum changes exactly when one does. The local counter is read
    through the shard, which shares it (a ``detach`` of the local tensor); FSDP2 may give an
    empty shard a new local tensor (at its lazy init), never a non-empty one while the param
    object stays (``FSDPKind`` checks that the shard still is the param's memory). A
    tensor-parallel param that zero-shard shards itself is read through its local tensor.
    """

    param: DTensor
    shard: torch.Tensor  # the local tensor, or a leaf sharing its memory and counter

    @property
    def _version(self) -> int:
        return self.param._version + self.shard._version


class StorageRef:
    """A weak reference to a tensor's storage (its memory's owner): ``expired()`` once the tensor
    was given other memory and nothing else holds the old. Copies share it: the handle is freed
    once, when the last holder is collected; it does not pickle."""

    __slots__ = ("handle",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.handle = tensor.untyped_storage()._weak_ref()

    def expired(self) -> bool:
        return storage_expired(self.handle)

    def __del__(self) -> None:
        _FREE(self.handle)

    def __copy__(self) -> StorageRef:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> StorageRef:
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a weak reference to a storage cannot be pickled")


# Held here: torch's module may be torn down before the last StorageRef at interpreter exit.
# Checks over every param call storage_expired(ref.handle): a C function, no Python call a param.
storage_expired = torch.UntypedStorage._expired
_FREE = torch.UntypedStorage._free_weak_ref


@dataclass
class ShardedParam:
    """A model parameter and this rank's shard of it."""

    param: torch.Tensor  # the model's parameter: full (replicated models) or an FSDP2 DTensor
    fqn: str
    group_index: int  # the param group it belongs to
    shard: torch.Tensor  # leaf in the model dtype holding the rows this rank owns: what the
    #                      HybridDeviceOptimizer steps (a view of the bucket's shard buffer, or of
    #                      the FSDP2 param's local tensor)
    spec: ShardSpec | None  # the rows of its local tensor it owns; None under FSDP2 (the
    #                         DTensor's placements say)
    layout: StateLayout  # where its state lies over the ranks (its shard's place in the param)
    bucket: int = -1  # index of its bucket; -1 under FSDP2
    position: int = -1  # its place inside the bucket
    grad_slot: torch.Tensor | None = None  # the shard's slot in the bucket's grad buffer, while
    #                                        it holds one
    version: int = 0  # the model param's version counter when zero-shard last wrote or read it
    changed: bool = False  # written by someone else since: its main weight must be reloaded
    watch: GradWatch | None = None  # whether the param's .grad was cleared since its grad was
    #                                 reduced (replicated models; [Note: released grads])
    aliased: bool = False  # the shard is the param's own memory (one rank: no copy of the params)
    grad_factor: torch.Tensor | None = None  # a clip's factor the shard's grad is still to be
    #                                          multiplied by ([Note: clip at the step])
    counted: bool = True  # this rank's shard counts in global norms: False where the param is
    #                       replicated over a mesh dim the norm sums over and this rank is not
    #                       that dim's first (tensor parallelism's replicated norms and biases,
    #                       and FSDP2 params on the dp dim alone: [Note: FSDP2 params on a
    #                       sub-mesh])
    own_counter: torch.Tensor | None = None  # where the param shares its version counter with
    #                                          another param: a view of its memory with a
    #                                          counter of its own, which the gathers write
    #                                          ([Note: shared version counters] in _aliases.py)
    memory: int = 0  # its local tensor's data_ptr when zero-shard last checked it (replicated
    #                  models): other memory is checked again at the step (check_moved)
    storage: StorageRef | None = None  # that memory's storage, weakly: expired, the param was
    #                                    given other memory, even at the same address (.half()
    #                                    then .float() may land there)
    recorded: int = 0  # the data_ptr of the memory last recorded on the gathers' stream
    #                    ([Note: memory the job uses] in _gather.py)

    @property
    def local(self) -> torch.Tensor:
        """The param's memory on this rank that the shard's rows come from and are gathered
        into: the param, or a tensor-parallel param's local tensor."""
        return local_tensor(self.param)

    @property
    def watched(self) -> torch.Tensor | DTensorCounters:
        """What holds the version counter that tells if the model param was written: the param,
        or under FSDP2 the param and its local shard together (see [Note: FSDP2 versions])."""
        if isinstance(self.param, DTensor):  # under FSDP2 the shard is the local tensor
            return DTensorCounters(self.param, self.shard if self.spec is None else self.local)
        return self.param

    def note_memory(self) -> None:
        """Notes the param's memory as it is now (see ``memory``)."""
        local = self.local
        self.memory = local.data_ptr()
        self.storage = StorageRef(local)
        self.recorded = 0

    def record_version(self) -> None:
        """Notes that the model param holds what zero-shard knows (its main weight, rounded)."""
        self.version = self.watched._version
        self.changed = False

    def is_stale(self) -> bool:
        """Whether the model param was written since zero-shard last recorded it (or, aliased,
        given other memory: ``param.data = t``)."""
        moved = self.aliased and self.param.data_ptr() != self.shard.data_ptr()
        return moved or self.changed or self.watched._version != self.version

    def alias(self) -> None:
        """Makes the shard (all of the param's rows) a view of the param's own memory: the step
        then writes the param itself, and the params are not held twice. The param never moves,
        so views taken of it before (a state dict) stay its memory. The shard is a new tensor
        with a version counter of its own: the param's counts only the writes of others."""
        if self.spec is None or self.spec.num_rows != self.spec.dim0:
            raise AssertionError(f"expected a shard of all of {self.fqn!r}'s rows")
        param = self.param
        shard = torch.empty(0, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            shard.set_(param.untyped_storage(), param.storage_offset(), param.shape, param.stride())
        self.shard = shard.requires_grad_(True)
        self.aliased = True

    def realias(self) -> None:
        """The param was given other memory (``param.data = t``) and its values were copied into
        the shard: it becomes a view of the shard's memory again (its first memory; ``t`` itself
        no longer follows the training)."""
        check_unconverted(self.param, self.fqn, self.shard.dtype, self.shard.device)
        self.param.data = self.shard.detach()
        self.note_memory()


def model_versions(records: Sequence[ShardedParam]) -> list[int]:
    """Each record's ``watched._version``, with no call per plain param."""
    return [
        s.watched._version if isinstance(s.param, DTensor) else s.param._version for s in records
    ]


def local_tensors(records: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """Each record's ``local``, with no call per plain param."""
    return [s.local if isinstance(s.param, DTensor) else s.param for s in records]


def stale_flags(records: Sequence[ShardedParam]) -> list[bool]:
    """Each record's ``is_stale()``, read at every step: a plain param's inline (no call per
    param), a DTensor's through its two counters."""
    return [
        s.is_stale()
        if isinstance(s.param, DTensor)
        else (
            s.changed
            or s.param._version != s.version
            or (s.aliased and s.param.data_ptr() != s.shard.data_ptr())
        )
        for s in records
    ]


def shard_grads(records: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """The shards' grads, where they have one."""
    return [s.shard.grad for s in records if s.shard.grad is not None]


def norm_grads(records: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """The shards' grads that count in a global norm: each element once over all ranks."""
    return [s.shard.grad for s in records if s.counted and s.shard.grad is not None]


def norm_copies(records: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """The shards' grads that another rank counts in a global norm (see ``counted``)."""
    return [s.shard.grad for s in records if not s.counted and s.shard.grad is not None]


class FlagsBefore(Enum):
    """A dropped grad buffer's presence flags where no copy of them was kept."""

    NO_GRADS = "no grads were held yet"
    ALL_PRESENT = "every param had a grad"


class SlotCuts(NamedTuple):
    """A grad buffer cut by ``split_with_sizes`` into this rank's shards and the gaps between,
    planned at wrap: the buffer is new at each backward after the grads were cleared."""

    sizes: tuple[int, ...]  # in memory order: shards, gaps, the flags
    places: tuple[int, ...]  # each param's piece


class NormRuns(NamedTuple):
    """A grad buffer's shard elements as runs (start, end) for global norms, planned at wrap:
    each run is consecutive params' slots with the padding between them, those this rank
    counts apart from those another rank does (see ``ShardedParam.counted``). The flags are in
    none. A norm over a run is its params' norm: padding holds zeros, as does the slot of a
    param with no grad (no rank had one, or its ``.grad`` was cleared after the reduction)."""

    counted: tuple[tuple[int, int], ...]
    copies: tuple[tuple[int, int], ...]


def _norm_runs(
    layout: BucketLayout, specs: Sequence[ShardSpec], counted: Sequence[bool]
) -> NormRuns:
    runs: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    last = None  # whether the param before counted
    for offset, spec, counts in zip(layout.offsets, specs, counted, strict=True):
        if counts == last:  # the run goes on, over the padding in between
            start, _ = runs[counts].pop()
        else:
            start = offset
        runs[counts].append((start, offset + spec.numel))
        last = counts
    nonempty = {counts: tuple(r for r in found if r[1] > r[0]) for counts, found in runs.items()}
    return NormRuns(counted=nonempty[True], copies=nonempty[False])


def _slot_cuts(layout: BucketLayout, specs: Sequence[ShardSpec]) -> SlotCuts:
    sizes: list[int] = []
    places = []
    end = 0
    for offset, spec in zip(layout.offsets, specs, strict=True):
        if offset > end:
            sizes.append(offset - end)
        places.append(len(sizes))
        sizes.append(spec.numel)
        end = offset + spec.numel
    sizes.append(layout.segment_numel - end)
    return SlotCuts(tuple(sizes), tuple(places))


@dataclass
class Bucket:
    """Parameters whose grads are reduced and whose shards are gathered together."""

    layout: BucketLayout
    params: list[ShardedParam]
    shard_buffer: torch.Tensor  # 1-D, model dtype, layout.shard_numel: the all-gather input; the
    #                             shards are views of it
    reduce_copies: RowCopies  # the params' rows in a reduction's packed grads
    gather_copies: RowCopies  # the params' rows in an all-gather's output
    slot_cuts: SlotCuts  # the params' shards in the grad buffer
    norm_runs: NormRuns  # the grad buffer's runs a global norm reads
    grad_buffer: torch.Tensor | None = None  # 1-D, layout.segment_numel: this rank's reduced
    #   grads, then one flag per param; held from the first reduction after zero_grad until the
    #   grads are cleared ([Note: reduced grads held]); always None when grads arrive reduced (DDP)
    # The presence flags of the last grads held, once dropped: a copy (on the accelerator) where
    # some param lacked a grad, else ALL_PRESENT (every flag set), or NO_GRADS before any grads.
    flags_before: torch.Tensor | FlagsBefore = FlagsBefore.NO_GRADS
    ready: set[int] = field(default_factory=set)  # positions whose grad hook fired this backward
    aliased: bool = False  # its params are their own shards (one rank): nothing to gather
    shares_counters: bool = False  # some param gathers through its own_counter view
    missing: bool = False  # since the grads were last written whole, some param lacked one here

    @property
    def has_grads(self) -> bool:
        """A reduction since the grads were last cleared: the next one may add to it."""
        return self.grad_buffer is not None

    @property
    def grad_bytes(self) -> int:
        """The size of the grad buffer, held or not."""
        return self.layout.segment_numel * self.layout.dtype.itemsize

    def hold_grads(self, buffer: torch.Tensor) -> None:
        """Takes ``buffer`` as the grad buffer: each param's slot becomes a view of it."""
        self.grad_buffer = buffer
        pieces = buffer.split_with_sizes(self.slot_cuts.sizes)
        for sharded, place in zip(self.params, self.slot_cuts.places, strict=True):
            shard = sharded.shard
            sharded.grad_slot = (
                pieces[place] if shard.dim() == 1 else pieces[place].view(shard.shape)
            )

    def norm_pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The held grad buffer's elements that this rank counts in a global norm, and its
        copies of elements another rank counts, in a few 1-D pieces (see ``NormRuns``)."""
        buffer = self.grad_buffer
        if buffer is None:
            raise AssertionError("expected a held grad buffer, got none")
        counted, copies = self.norm_runs
        return [buffer[a:b] for a, b in counted], [buffer[a:b] for a, b in copies]

    def drop_grads(self) -> None:
        """Frees the grad buffer (the grads were cleared) and the shards' ``.grad`` views of it,
        keeping its flags, which a zeroed grad reads (``_flag_zeroed_as_before``). Call it on a
        stream that waited for the buffer's last writes: the flags are copied there."""
        if self.grad_buffer is None:
            return
        # Where every param had a grad here (not ``missing``), every reduced flag is set (the step
        # skips reading them on the same grounds) and nothing is copied: a copy is a 512-byte
        # block a bucket, held beside the next backward's activations at the peak.
        self.flags_before = FlagsBefore.ALL_PRESENT
        if self.missing:
            self.flags_before = self.grad_buffer[self.layout.shard_numel :].clone()
        self.grad_buffer = None
        for sharded in self.params:
            sharded.grad_slot = None
            sharded.shard.grad = None


def _leaf_view(buffer: torch.Tensor, start: int, shape: Sequence[int]) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    view = buffer[start : start + numel].view(tuple(shape))
    # A leaf that requires grad, sharing the buffer's memory: the sub-optimizer steps it.
    return view.detach().requires_grad_(True)


def build_buckets(
    params: Sequence[torch.Tensor],
    fqns: Sequence[str],
    group_indices: Sequence[int],
    *,
    mesh: DeviceMesh,
    joint: DeviceMesh | None,
    bucket_bytes: int,
    units: Sequence[int] | None = None,
    offload_fraction: float = 0.0,
) -> tuple[list[ShardedParam], list[Bucket]]:
    """Shards ``params`` (replicated over the 1-D ``mesh``; tensor-parallel ones by their local
    tensors, their state on the ``joint`` mesh: see [Note: tensor parallelism under zero-shard's
    sharding]) by rows and packs them into buckets, keeping ``units`` whole as ``plan_buckets``
    does; a bucket starts where the CPU's share of ``offload_fraction`` does (``offload_start``).

    Each shard is filled with this rank's rows of its parameter; no bucket holds grads yet.
    """
    # The rank in the mesh's group, which the reductions and gathers index by (a mesh may list
    # its ranks in another order); a mesh of one rank needs none (a one-process mesh has none).
    rank, world_size = 0 if mesh.size() == 1 else mesh.get_local_rank(), mesh.size()
    locals_ = [local_tensor(p) for p in params]
    specs = [shard_spec(local.shape, rank, world_size) for local in locals_]
    dtypes = [p.dtype for p in params]
    cut = offload_start([local.numel() for local in locals_], offload_fraction)
    layouts = plan_buckets(
        specs, dtypes, world_size, bucket_bytes, units, cut=cut, groups=group_indices
    )
    sharded: list[ShardedParam] = [None] * len(params)  # type: ignore[list-item]
    buckets = []
    for bucket_index, layout in enumerate(layouts):
        device = params[layout.param_indices[0]].device
        shard_buffer = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=device)
        members = []
        for position, (index, offset) in enumerate(
            zip(layout.param_indices, layout.offsets, strict=True)
        ):
            param, spec = params[index], specs[index]
            shard = _filled_shard(shard_buffer, offset, locals_[index], spec)
            state_layout = rows_layout(param, fqns[index], spec, mesh, joint)
            record = ShardedParam(
                param=param,
                fqn=fqns[index],
                group_index=group_indices[index],
                shard=shard,
                spec=spec,
                layout=state_layout,
                bucket=bucket_index,
                position=position,
                counted=state_layout.counted_here(range(state_layout.mesh.ndim)),
            )
            sharded[index] = record
            members.append(record)
        member_specs = [specs[index] for index in layout.param_indices]
        buckets.append(_bucket(layout, members, shard_buffer, member_specs, world_size))
    return sharded, buckets


def _filled_shard(
    buffer: torch.Tensor, offset: int, local: torch.Tensor, spec: ShardSpec
) -> torch.Tensor:
    """This rank's rows of ``local``, copied into ``buffer`` at ``offset``: the shard's leaf."""
    shard = _leaf_view(buffer, offset, spec.local_shape(local.shape))
    with torch.no_grad():
        shard.view(-1).copy_(local.detach().reshape(-1)[spec.start : spec.start + spec.numel])
    return shard


def _bucket(
    layout: BucketLayout,
    members: list[ShardedParam],
    shard_buffer: torch.Tensor,
    member_specs: list[ShardSpec],
    world_size: int,
) -> Bucket:
    """A bucket with its copy plans (reduction and gather), slot cuts and norm runs."""
    reduce_copies, gather_copies = (
        plan_row_copies(layout, member_specs, world_size=world_size, segment_numel=numel)
        for numel in (layout.segment_numel, layout.shard_numel)
    )
    slot_cuts = _slot_cuts(layout, member_specs)
    norm_runs = _norm_runs(layout, member_specs, [s.counted for s in members])
    return Bucket(layout, members, shard_buffer, reduce_copies, gather_copies, slot_cuts, norm_runs)


def fsdp_sharded_param(
    param: DTensor, fqn: str, group_index: int, mesh: DeviceMesh, reduced_dims: Sequence[int]
) -> ShardedParam:
    """The record of an FSDP2 (DTensor) param, whose shard is a leaf sharing the memory of the
    param's local tensor: the sharded storage FSDP2 all-gathers from, never a copy. Any layout
    ``check_fsdp_layout`` accepts: the optimizer is elementwise, so the local tensor steps alone,
    whatever rows and columns of the param it holds. ``mesh`` is the model's mesh of most dims
    (the param's, or one it lies on named dims of: [Note: FSDP2 params on a sub-mesh]), and
    ``reduced_dims`` those of its dims that global norms sum over."""
    layout = dtensor_layout(param)  # its local tensor is where torch places it: check_fsdp_layout
    shard = param._local_tensor.detach().requires_grad_(True)
    placements = placements_over(param, mesh)
    if placements is None:
        raise AssertionError(f"expected param {fqn!r}'s mesh to be {mesh} or named dims of it")
    over_mesh = StateLayout(mesh, placements, layout.shape, layout.stride)
    return ShardedParam(
        param=param,
        fqn=fqn,
        group_index=group_index,
        shard=shard,
        spec=None,
        layout=layout,
        counted=over_mesh.counted_here(reduced_dims),
    )
