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
    "broadcast_tensors",
    "choose_reduce_scaling",
    "launch_all_gather",
    "launch_reduction",
    "num_row_pieces",
    "pack_grads",
    "padded_rows",
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
    division elsewhere (gloo); for fp16, divisions split around the sum so that neither the
    scaled grads nor their sum overflow (as FSDP2 does)."""
    if world_size == 1:
        return ReduceScaling(dist.ReduceOp.SUM, None, None)
    if device.type == "cuda" and dtype in (torch.float32, torch.bfloat16):
        return ReduceScaling(dist.ReduceOp.AVG, None, None)
    if dtype == torch.float16:
        pre = 1
        while world_size % (pre * 2) == 0 and world_size / (pre * 2) >= pre * 2:
            pre *= 2
        return ReduceScaling(dist.ReduceOp.SUM, float(pre), world_size / pre)
    return ReduceScaling(dist.ReduceOp.SUM, None, float(world_size))


def padded_rows(
    buffer: torch.Tensor,
    layout: BucketLayout,
    position: int,
    spec: ShardSpec,
    *,
    world_size: int,
    segment_numel: int,
) -> torch.Tensor:
    """The padded shards of the bucket's ``position``-th parameter in ``buffer`` (``world_size``
    segments of ``segment_numel``), as a (world_size, rows_per_rank, row_numel) view."""
    offset = layout.offsets[position]
    segments = buffer.view(world_size, segment_numel)
    return segments[:, offset : offset + spec.padded_numel].view(
        world_size, spec.rows_per_rank, spec.row_numel
    )


def _full_ranks(spec: ShardSpec) -> tuple[int, int]:
    """(ranks whose shard has all ``rows_per_rank`` rows, rows of the next rank's shard)."""
    if spec.rows_per_rank == 0:
        return 0, 0
    full = spec.dim0 // spec.rows_per_rank
    return full, spec.dim0 - full * spec.rows_per_rank


def num_row_pieces(spec: ShardSpec) -> int:
    """How many ranks hold rows of the parameter: the pieces ``unpack_params`` copies into it (a
    multi-tensor copy bumps its version counter once a piece)."""
    full, rest = _full_ranks(spec)
    return full + (1 if rest else 0)


def _row_pairs(
    padded: torch.Tensor, rows: torch.Tensor, spec: ShardSpec
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a rank's padded shard, the same rows of the parameter) for every rank with rows: both
    contiguous, so that a whole bucket's pairs go into one multi-tensor copy."""
    full, rest = _full_ranks(spec)
    per = spec.rows_per_rank
    pairs = [(padded[rank], rows[rank * per : (rank + 1) * per]) for rank in range(full)]
    if rest:
        pairs.append((padded[full, :rest], rows[full * per :]))
    return pairs


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def pack_grads(
    out: torch.Tensor,
    layout: BucketLayout,
    specs: Sequence[ShardSpec],
    grads: Sequence[torch.Tensor | None],
    world_size: int,
) -> None:
    """Writes ``grads`` (full-size, one per bucket parameter; ``None``: no grad on this rank)
    into ``out``, zero-filled, ``world_size`` segments of ``layout.segment_numel``; sets each
    parameter's flag in every segment to 1 where this rank has its grad."""
    segment = layout.segment_numel
    dsts, srcs = [], []
    for position, (spec, grad) in enumerate(zip(specs, grads, strict=True)):
        if grad is None:
            continue
        padded = padded_rows(
            out, layout, position, spec, world_size=world_size, segment_numel=segment
        )
        for in_padded, in_rows in _row_pairs(padded, grad.reshape(spec.dim0, spec.row_numel), spec):
            dsts.append(in_padded)
            srcs.append(in_rows)
    _copy_all(dsts, srcs)
    flags = out.view(world_size, segment)[:, layout.shard_numel :]
    if all(grad is not None for grad in grads):
        flags.fill_(1)
    else:
        for position, grad in enumerate(grads):
            if grad is not None:
                flags[:, position].fill_(1)


def unpack_params(
    gathered: torch.Tensor,
    layout: BucketLayout,
    specs: Sequence[ShardSpec],
    params: Sequence[torch.Tensor | None],
    world_size: int,
) -> None:
    """Copies every rank's shards from an all-gather output into the full parameters (a
    ``None`` param is left as it is), in one multi-tensor copy."""
    dsts, srcs = [], []
    for position, (spec, param) in enumerate(zip(specs, params, strict=True)):
        if param is None:
            continue
        padded = padded_rows(
            gathered,
            layout,
            position,
            spec,
            world_size=world_size,
            segment_numel=layout.shard_numel,
        )
        rows = param.detach().view(spec.dim0, spec.row_numel)
        for in_padded, in_rows in _row_pairs(padded, rows, spec):
            dsts.append(in_rows)
            srcs.append(in_padded)
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
