"""The collectives and the copies around them, as free functions over explicit tensors and groups.

Copies between a parameter (or its grad) and a bucket's padded, rank-major layout are in
[Note: bucket layout] (``_bucket_layout.py``). Each function here does one thing and returns
what the caller needs to order later work (a ``Work`` handle, or nothing for stream-ordered copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ._bucket_layout import BucketLayout, ShardSpec

__all__ = [
    "AllGather",
    "ReduceScaling",
    "RowCopies",
    "broadcast_tensors",
    "choose_reduce_scaling",
    "chunk_pack_grads",
    "chunk_packable",
    "launch_all_gather",
    "launch_reduction",
    "pack_grads",
    "plan_row_copies",
    "replicated_grads",
    "unpack_params",
    "write_replicated",
]

Work = Any  # torch.distributed's Work handle


class AllGather(Protocol):
    """Gathers every rank's ``shard`` (equal sizes) into ``out``, rank-major, as
    ``dist.all_gather_into_tensor(out, shard, group=group, async_op=True)`` does; returns a handle
    whose ``wait()`` makes the current stream (the caller's, on the gathering thread) see ``out``.
    """

    def __call__(
        self, shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup
    ) -> Work: ...


# all_gather_single / reduce_scatter_single replace the *_into_tensor / *_tensor names in newer
# torch (the old ones warn there); the signatures are the same.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceScaling(NamedTuple):
    """How a sum over ranks becomes a mean: the op, and divisions before and after it."""

    op: Any  # dist.ReduceOp
    pre_divide: float | None  # applied to the packed grads before the collective
    post_divide: float | None  # applied to the result


def choose_reduce_scaling(
    world_size: int, device: torch.device, dtype: torch.dtype
) -> ReduceScaling:
    """The mean over ``world_size`` ranks: NCCL's AVG for fp32 and bf16 on CUDA; a sum and one
    division elsewhere (gloo); for fp16, each grad divided by ``world_size`` before the sum, as
    DDP divides them: a sum of finite fp16 grads may overflow where their mean does not (two
    ranks' 40000 each), and a step that torch takes would be skipped as non-finite."""
    if world_size == 1:
        return ReduceScaling(dist.ReduceOp.SUM, None, None)
    if device.type == "cuda" and dtype in (torch.float32, torch.bfloat16):
        return ReduceScaling(dist.ReduceOp.AVG, None, None)
    if dtype == torch.float16:
        return ReduceScaling(dist.ReduceOp.SUM, float(world_size), None)
    return ReduceScaling(dist.ReduceOp.SUM, None, float(world_size))


class RowCopies(NamedTuple):
    """Where each rank's rows of a bucket's params lie in a buffer of ``world_size`` segments
    (a reduction's packed grads, or an all-gather's output), planned once at wrap so that a
    step cuts the buffer and each param with one ``split_with_sizes`` each, with no work per
    param and rank on the host (see [Note: bucket layout])."""

    buffer_sizes: tuple[int, ...]  # the flat buffer cut in memory order: the rows, the gaps
    param_sizes: tuple[tuple[int, ...], ...]  # per param, its flat elements cut by rank (the
    #                                           ranks with rows: full shards, then a partial one)
    places: tuple[tuple[int, ...], ...]  # per param, the buffer piece each of its pieces goes to
    back_to_back: bool  # every param's padded rows follow the last's with no gap, and no param
    #                     is 0-dim or empty: torch's chunk_cat lays out a segment's shards


def plan_row_copies(
    layout: BucketLayout, specs: Sequence[ShardSpec], *, world_size: int, segment_numel: int
) -> RowCopies:
    """The copies between the bucket's params and a buffer of ``world_size`` segments of
    ``segment_numel`` elements: rank ``r``'s rows of the ``p``-th param at ``offsets[p]`` of
    segment ``r``, padded to ``rows_per_rank`` rows. Every rank with rows is one piece, so that
    a whole bucket's pieces go into one multi-tensor copy, each contiguous."""
    param_sizes = []
    at: dict[tuple[int, int], int] = {}  # (rank, position) -> the piece's start in the buffer
    for position, (spec, offset) in enumerate(zip(specs, layout.offsets, strict=True)):
        per = spec.rows_per_rank
        full = spec.dim0 // per if per else 0  # ranks whose shard has all rows_per_rank rows
        rest = spec.dim0 - full * per  # rows of the next rank's shard
        sizes = [per * spec.row_numel] * full + ([rest * spec.row_numel] if rest else [])
        param_sizes.append(tuple(sizes))
        for rank in range(len(sizes)):
            at[rank, position] = rank * segment_numel + offset
    buffer_sizes: list[int] = []
    index_of: dict[tuple[int, int], int] = {}
    end = 0  # of the pieces cut so far
    # In memory order; an empty piece (a param with no elements) before one at its start.
    for key in sorted(at, key=lambda key: (at[key], param_sizes[key[1]][key[0]])):
        if at[key] > end:
            buffer_sizes.append(at[key] - end)
        index_of[key] = len(buffer_sizes)
        numel = param_sizes[key[1]][key[0]]
        buffer_sizes.append(numel)
        end = at[key] + numel
    if world_size * segment_numel > end:
        buffer_sizes.append(world_size * segment_numel - end)
    if sum(buffer_sizes) != world_size * segment_numel:
        raise AssertionError(
            f"expected pieces of {world_size} x {segment_numel}, got {buffer_sizes}"
        )
    places = [
        tuple(index_of[rank, position] for rank in range(len(sizes)))
        for position, sizes in enumerate(param_sizes)
    ]
    return RowCopies(
        tuple(buffer_sizes), tuple(param_sizes), tuple(places), _back_to_back(layout, specs)
    )


def _back_to_back(layout: BucketLayout, specs: Sequence[ShardSpec]) -> bool:
    """Whether the bucket's padded shards fill a segment's shard part with no gap (their sizes
    were multiples of the alignment), each param with elements and at least one dim."""
    end = 0
    for spec, offset in zip(specs, layout.offsets, strict=True):
        if spec.replicated or spec.dim0 * spec.row_numel == 0 or offset != end:
            return False
        end += spec.padded_numel
    return end == layout.shard_numel


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def pack_grads(
    out: torch.Tensor,
    layout: BucketLayout,
    copies: RowCopies,
    grads: Sequence[torch.Tensor | None],
    world_size: int,
) -> None:
    """Writes ``grads`` (full-size, one per bucket parameter; ``None``: no grad on this rank)
    into ``out``, zero-filled, ``world_size`` segments of ``layout.segment_numel`` (``copies``
    planned for them); sets each parameter's flag in every segment to 1 where this rank has its
    grad. A param in one piece (one rank, or rows for one) is copied whole, with no split."""
    pieces = out.split_with_sizes(copies.buffer_sizes)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for sizes, places, grad in zip(copies.param_sizes, copies.places, grads, strict=True):
        if grad is not None:
            flat = grad if grad.dim() == 1 else grad.reshape(-1)
            srcs += [flat] if len(sizes) == 1 else flat.split_with_sizes(sizes)
            dsts += map(pieces.__getitem__, places)
    _copy_all(dsts, srcs)
    flags = out.view(world_size, layout.segment_numel)[:, layout.shard_numel :]
    if all([grad is not None for grad in grads]):
        flags.fill_(1)
    else:
        for position, grad in enumerate(grads):
            if grad is not None:
                flags[:, position].fill_(1)


def chunk_packable(
    copies: RowCopies, grads: Sequence[torch.Tensor | None], dtype: torch.dtype
) -> bool:
    """Whether ``chunk_pack_grads`` can pack ``grads``: the bucket's shards lie back to back and
    every param has a contiguous grad of the packed ``dtype``."""
    return copies.back_to_back and all(
        [grad is not None and grad.dtype == dtype and grad.is_contiguous() for grad in grads]
    )


def chunk_pack_grads(out: torch.Tensor, grads: Sequence[torch.Tensor], world_size: int) -> None:
    """What ``pack_grads`` writes for a bucket where ``chunk_packable`` holds, in one call to
    torch's ``_chunk_cat`` (one kernel on CUDA, no view per param or rank on the host): each grad
    cut into ``world_size`` chunks of rows, padded with zeros, and chunk ``r`` of every grad, then
    the flags (all 1), in segment ``r``. Every element of ``out`` is written: it needs no zero
    fill."""
    flags = torch.ones(world_size, len(grads), dtype=out.dtype, device=out.device)
    segments = out.view(world_size, -1)
    torch._chunk_cat([*grads, flags], 0, world_size, out=segments)
    if segments.data_ptr() != out.data_ptr() or segments.numel() != out.numel():
        # chunk_cat resizes an out= of another size (new memory, a warning): out left unwritten
        raise AssertionError(
            f"expected the grads to fill {tuple(out.view(world_size, -1).shape)}, got "
            f"{tuple(segments.shape)} from shapes {[tuple(g.shape) for g in grads]}"
        )


def unpack_params(
    gathered: torch.Tensor, copies: RowCopies, params: Sequence[torch.Tensor | None]
) -> None:
    """Copies every rank's shards from an all-gather output (``copies`` planned for its
    segments) into the full parameters (a ``None`` param is left as it is), in one multi-tensor
    copy: a param's version counter counts one write a piece (``copies.param_sizes``)."""
    pieces = gathered.split_with_sizes(copies.buffer_sizes)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for sizes, places, param in zip(copies.param_sizes, copies.places, params, strict=True):
        if param is not None:
            flat = param.detach().view(-1)
            dsts += [flat] if len(sizes) == 1 else flat.split_with_sizes(sizes)
            srcs += map(pieces.__getitem__, places)
    _copy_all(dsts, srcs)


def replicated_grads(packed: torch.Tensor, layout: BucketLayout, world_size: int) -> torch.Tensor:
    """The packed grads of the bucket's 0-dim params, copied out of rank 0's segment, where
    ``pack_grads`` puts them: 1-D, one element each (see [Note: 0-dim params])."""
    first = packed.view(world_size, -1)[0]
    return torch.stack([first[offset] for offset in layout.replicated_offsets])


def write_replicated(segment: torch.Tensor, layout: BucketLayout, values: torch.Tensor) -> None:
    """Writes ``values`` (from ``replicated_grads``, reduced) into one rank's ``segment``."""
    dsts = [segment[offset] for offset in layout.replicated_offsets]
    _copy_all(dsts, list(values.unbind()))


def launch_reduction(
    packed: torch.Tensor,
    out: torch.Tensor | None,
    group: dist.ProcessGroup,
    scaling: ReduceScaling,
) -> Work:
    """Starts the reduction of ``packed``: a reduce-scatter into ``out`` (one segment), or, with
    ``out=None``, an all-reduce of ``packed`` in place. Applies ``scaling.pre_divide`` first."""
    if scaling.pre_divide is not None:
        packed.div_(scaling.pre_divide)
    if out is None:
        return dist.all_reduce(packed, op=scaling.op, group=group, async_op=True)
    return _reduce_scatter(out, packed, op=scaling.op, group=group, async_op=True)


def launch_all_gather(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Work:
    """Starts gathering every rank's ``shard`` (equal sizes) into ``out``, rank-major."""
    return _all_gather(out, shard, group=group, async_op=True)


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, *, bucket_bytes: int = 64 << 20
) -> None:
    """Overwrites ``tensors`` (the same shapes and dtypes on every rank of ``group``, in one
    order) with the values of the group's first rank, as DDP does at construction: packed per
    dtype into broadcasts of up to ``bucket_bytes``."""
    src = dist.get_global_rank(group, 0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for members in by_dtype.values():
        chunk: list[torch.Tensor] = []
        num_bytes = 0
        for tensor in members:
            size = tensor.numel() * tensor.element_size()
            if chunk and num_bytes + size > bucket_bytes:
                _broadcast_chunk(chunk, group, src)
                chunk, num_bytes = [], 0
            chunk.append(tensor)
            num_bytes += size
        if chunk:
            _broadcast_chunk(chunk, group, src)


@torch.no_grad()
def _broadcast_chunk(chunk: list[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in chunk])
    dist.broadcast(flat, src, group=group)
    if dist.get_rank() == src:
        return  # its tensors hold the values already
    pieces = flat.split([tensor.numel() for tensor in chunk])
    for tensor, piece in zip(chunk, pieces, strict=True):
        tensor.detach().copy_(piece.view(tensor.shape))
