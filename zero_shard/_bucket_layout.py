"""Which rows of each parameter a rank owns, and how parameters are packed into buckets.

Pure bookkeeping over shapes and numbers; no tensors are touched here.

[Note: bucket layout]
Every parameter is sharded along dim 0 with ``torch.chunk`` semantics (as DTensor's ``Shard(0)``
and FSDP2 do): with ``rows_per_rank = ceil(dim0 / world)``, rank ``r`` owns rows
``[r * rows_per_rank, (r + 1) * rows_per_rank)`` clipped to ``dim0``; trailing ranks may own none.
For communication each rank's share is padded to ``rows_per_rank`` rows. A bucket packs several
parameters; one rank's *segment* holds the padded shards of the bucket's parameters one after
the other (``offsets``), each aligned, so that a collective over ``world`` equal segments moves
whole shards:

    segment of rank r:  [shard of p0 | pad | shard of p1 | pad | ... ]  (``shard_numel`` elements)
    all-gather output:  [segment 0 | segment 1 | ... | segment world-1]

Reductions use segments of ``segment_numel = shard_numel + num_params``: the extra elements carry
one flag per parameter ("this rank had a grad for it"), so that after the reduction every rank
knows whether *any* rank had one, at no extra collective.

[Note: 0-dim params]
A 0-dim param (CLIP's ``logit_scale``) has no dim 0 to shard, and a DTensor of shape ``()`` can
only be replicated: every rank holds its one element and steps it (its state is a few scalars),
and its shard is the param's shape, ``()``, so the optimizer steps it as torch does. Its spec
says rows ``[0, 1)`` on every rank (``replicated``), so packing and unpacking read rank 0's
segment alone. Every rank must step it with the same reduced grad, bit for bit, or the ranks'
copies drift apart; a reduce-scatter does not promise that (each rank's segment is summed in an
order of its own), so stage 2 all-reduces these grads beside the bucket's reduce-scatter, and
stage 1 takes them from segment 0 of its all-reduce (``_reduce.py``). Its state shows as torch
shows the state of a plain param beside FSDP2's DTensors (FSDP2 refuses 0-dim params unless
``ignored_params``): plain 0-dim tensors, which DCP saves and loads as it does a replicated
DTensor of shape ``()``. Global norms count it on the mesh's first rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["BucketLayout", "ShardSpec", "offload_start", "plan_buckets", "shard_spec"]

_ALIGN_BYTES = 128  # each shard starts on this boundary inside a segment (vector loads, NCCL)


class ShardSpec(NamedTuple):
    """The rows of one parameter that one rank owns."""

    dim0: int  # the parameter's rows (its size along dim 0)
    row_numel: int  # elements per row (the product of the other dims)
    rows_per_rank: int  # every rank's padded share: ceil(dim0 / world)
    start_row: int  # first row this rank owns
    num_rows: int  # rows this rank owns: rows_per_rank, fewer on the last, 0 past the end
    replicated: bool = False  # a 0-dim param, held whole by every rank ([Note: 0-dim params])

    @property
    def numel(self) -> int:
        """Elements of this rank's shard."""
        return self.num_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements of every rank's shard padded for communication."""
        return self.rows_per_rank * self.row_numel

    @property
    def start(self) -> int:
        """Offset of this rank's first element in the flattened parameter."""
        return self.start_row * self.row_numel

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if self.replicated:
            return tuple(shape)
        return (self.num_rows, *shape[1:])


def shard_spec(shape: Sequence[int], rank: int, world_size: int) -> ShardSpec:
    """The dim-0 shard of a parameter of ``shape`` that ``rank`` of ``world_size`` owns; all of a
    0-dim parameter, on every rank (see [Note: 0-dim params])."""
    if not 0 <= rank < world_size:
        raise AssertionError(f"expected rank in [0, {world_size}), got {rank}")
    if len(shape) == 0:
        return ShardSpec(
            dim0=1, row_numel=1, rows_per_rank=1, start_row=0, num_rows=1, replicated=True
        )
    dim0 = shape[0]
    rows_per_rank = math.ceil(dim0 / world_size)
    start_row = min(rank * rows_per_rank, dim0)
    end_row = min(start_row + rows_per_rank, dim0)
    return ShardSpec(dim0, math.prod(shape[1:]), rows_per_rank, start_row, end_row - start_row)


@dataclass(frozen=True)
class BucketLayout:
    """Parameters reduced and gathered together; see [Note: bucket layout]."""

    param_indices: tuple[int, ...]  # positions in the list of sharded parameters
    offsets: tuple[int, ...]  # start of each parameter's padded shard inside a segment
    shard_numel: int  # elements of one rank's segment for the all-gather (no flags)
    dtype: torch.dtype
    replicated_offsets: tuple[int, ...] = ()  # where the 0-dim params' element lies inside a
    #                                           segment ([Note: 0-dim params])

    @property
    def num_params(self) -> int:
        return len(self.param_indices)

    @property
    def segment_numel(self) -> int:
        """Elements of one rank's segment for a reduction: the shards, then one flag each."""
        return self.shard_numel + self.num_params


def _align(numel: int, dtype: torch.dtype) -> int:
    step = max(_ALIGN_BYTES // dtype.itemsize, 1)
    return (numel + step - 1) // step * step


def plan_buckets(
    specs: Sequence[ShardSpec],
    dtypes: Sequence[torch.dtype],
    world_size: int,
    bucket_bytes: int,
    units: Sequence[int] | None = None,
    *,
    cut: int | None = None,
    groups: Sequence[int] | None = None,
) -> list[BucketLayout]:
    """Packs parameters, in order, into buckets of at most ``bucket_bytes`` (unsharded, padded).

    A parameter larger than a bucket gets a bucket of its own; a bucket never mixes dtypes.
    ``units`` (one per parameter, equal for consecutive parameters of one unit) keeps units
    whole: a unit that does not fit in what is left of a bucket starts a new one, and a unit
    spread over several buckets shares none of them with the next unit. So a bucket holds whole
    units, or a part of one (see [Note: units] in ``_units.py``). Parameter ``cut`` starts a
    bucket whatever the sizes (``offload_start``). Inside a bucket the parameters go by
    ``groups`` (their param groups), in order within each: the pieces of one CPU chunk (one
    param group) then lie back to back in the bucket's buffers and move in a few copies, not one
    a param, between the norms and biases of a group of their own.
    """
    if bucket_bytes < 1:
        raise AssertionError(f"expected a positive bucket size, got {bucket_bytes}")
    sizes = [_align(spec.padded_numel, dtype) for spec, dtype in zip(specs, dtypes, strict=True)]
    unit_bytes = _unit_bytes(sizes, dtypes, world_size, units)
    buckets: list[BucketLayout] = []
    indices: list[int] = []
    used = 0  # aligned elements of one segment so far
    dtype: torch.dtype | None = None
    mid_unit = False  # the open bucket began inside a unit that started in an earlier bucket

    def close() -> None:
        if not indices:
            return
        members = indices if groups is None else sorted(indices, key=lambda i: groups[i])
        offsets = list(itertools.accumulate((sizes[i] for i in members[:-1]), initial=0))
        replicated = tuple(
            offset
            for index, offset in zip(members, offsets, strict=True)
            if specs[index].replicated
        )
        buckets.append(BucketLayout(tuple(members), tuple(offsets), used, dtype, replicated))

    for index, (size, param_dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        unit_starts = units is None or index == 0 or units[index] != units[index - 1]
        if indices:
            grown = (used + size) * world_size * param_dtype.itemsize
            split = param_dtype != dtype or grown > bucket_bytes or index == cut
            if unit_starts and units is not None and not split:
                # A unit that does not fit whole starts a bucket; so does the unit after a unit
                # that was spread over buckets.
                held = used * world_size * param_dtype.itemsize
                split = mid_unit or held + unit_bytes[index] > bucket_bytes
            if split:
                close()
                indices, used = [], 0
                mid_unit = not unit_starts
        dtype = param_dtype
        indices.append(index)
        used += size
    close()
    return buckets


def offload_start(numels: Sequence[int], fraction: float) -> int | None:
    """The first of the parameters (in bucket order) that the CPU takes elements of, at offload
    ``fraction`` of their elements (taken from the end, as the hybrid optimizer's split does);
    ``None`` where it takes none, or all.

    A bucket starts there: the buckets before it are stepped on the accelerator alone, so the
    next forward's first units need not wait for the CPU step; and the CPU's share has buckets
    of its own, whose grads are final (and copied to the host) while backward goes on. The
    hybrid splits each rank's shards, not the whole parameters, so on some ranks the CPU's share
    may start a parameter off; the buckets must be the same on every rank.
    """
    total = sum(numels)
    remaining = min(total, math.floor(fraction * total + 0.5))
    if remaining in (0, total):
        return None
    for index in reversed(range(len(numels))):
        remaining -= numels[index]
        if remaining <= 0:
            return index if index > 0 else None
    raise AssertionError(f"expected the CPU's share within {total} elements, got {fraction}")


def _unit_bytes(
    sizes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    world_size: int,
    units: Sequence[int] | None,
) -> list[int]:
    """For the first parameter of each unit, the unsharded bytes of the whole unit (else 0)."""
    if units is None:
        return [0] * len(sizes)
    totals = [0] * len(sizes)
    first = 0
    for index, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        if index and units[index] != units[index - 1]:
            first = index
        totals[first] += size * world_size * dtype.itemsize
    return totals
