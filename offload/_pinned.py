"""Host buffers in a few large blocks, pinned when possible, handed out as aligned views.

[Note: pinned blocks]
``cudaHostAlloc`` costs about a millisecond per call and PyTorch's caching host allocator rounds
every request up to a power of two. So the buffers of one optimizer are packed into few blocks
whose sizes are powers of two (``block_bytes`` each, the last one sized down), and each buffer
is a view into a block. The blocks live as long as this object; views keep their block alive.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["HostBufferRequest", "HostBuffers"]

_ALIGN_BYTES = 512
_DEFAULT_BLOCK_BYTES = 1 << 30
_pin_failure_warned = False


class HostBufferRequest(NamedTuple):
    """One 1-D host buffer to allocate.

    Attributes:
        numel: the buffer's number of elements.
        dtype: its element dtype.
    """

    numel: int
    dtype: torch.dtype


@dataclass
class _Placement:
    block: int
    offset: int  # bytes from the block's start


def _align(num_bytes: int) -> int:
    return (num_bytes + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES


def _next_power_of_two(num_bytes: int) -> int:
    return 1 << max(num_bytes - 1, 0).bit_length()


def _largest_power_of_two_at_most(num_bytes: int) -> int:
    return 1 << (num_bytes.bit_length() - 1)


def _choose_block_bytes(remaining: int, first: int, block_bytes: int) -> int:
    """Size of the next block for ``remaining`` bytes of buffers whose first is ``first`` bytes."""
    if remaining >= block_bytes:
        size = block_bytes
    elif _next_power_of_two(remaining) * 8 <= remaining * 9:
        size = _next_power_of_two(remaining)  # rounding up wastes at most 1/9
    else:
        size = _largest_power_of_two_at_most(remaining)  # fill a smaller block, then the rest
    return max(size, _next_power_of_two(first))


def _plan_blocks(sizes: Sequence[int], block_bytes: int) -> tuple[list[_Placement], list[int]]:
    """Places buffers of ``sizes`` bytes, in order, into blocks whose sizes are powers of two.

    Returns each buffer's placement and the block sizes. The tail is split into smaller powers of
    two rather than rounded up once, so little more than the requested bytes is allocated.
    """
    aligned = [_align(size) for size in sizes]
    placements: list[_Placement] = []
    block_sizes: list[int] = []
    index = 0
    while index < len(aligned):
        capacity = _choose_block_bytes(sum(aligned[index:]), aligned[index], block_bytes)
        used = 0
        while index < len(aligned) and used + aligned[index] <= capacity:
            placements.append(_Placement(block=len(block_sizes), offset=used))
            used += aligned[index]
            index += 1
        block_sizes.append(_next_power_of_two(used))
    return placements, block_sizes


def _allocate_block(num_bytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    global _pin_failure_warned
    if pin:
        try:
            return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as err:
            if not _pin_failure_warned:
                _pin_failure_warned = True
                warnings.warn(
                    f"zero-shard could not pin {num_bytes} bytes of host memory ({err}); "
                    "falling back to pageable memory: host-device copies will be slower and "
                    "synchronous. Free host memory or set pin_memory=False to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return torch.empty(num_bytes, dtype=torch.uint8), False


class HostBuffers:
    """1-D host buffers for ``requests``, packed into few blocks; pinned when ``pin`` and possible.

    A failed pin (CPU-only torch, or the OS refusing) falls back to pageable memory with one
    warning per process; ``pinned`` says what was obtained.

    Args:
        requests: the buffers to allocate; ``views`` holds one per request, in their order.
        pin: pin the blocks where possible.
        block_bytes: bytes per block, a positive power of two (a larger buffer gets a larger
            block; the last block is sized down). Default ``1 << 30`` (1 GiB).

    Example:
        >>> bufs = HostBuffers([HostBufferRequest(10, torch.bfloat16)], pin=False)
        >>> bufs.views[0].shape
        torch.Size([10])
    """

    views: list[torch.Tensor]  # 1-D, one per request, in request order
    pinned: bool  # True only if every block is pinned
    num_bytes: int  # bytes held by the blocks
    _blocks: list[torch.Tensor]  # 1-D uint8

    def __init__(
        self,
        requests: Sequence[HostBufferRequest],
        *,
        pin: bool,
        block_bytes: int = _DEFAULT_BLOCK_BYTES,
    ) -> None:
        if block_bytes <= 0 or block_bytes & (block_bytes - 1):
            raise ValueError(f"block_bytes must be a positive power of two, got {block_bytes}")
        sizes = [request.numel * request.dtype.itemsize for request in requests]
        placements, block_sizes = _plan_blocks(sizes, block_bytes)
        self._blocks = []
        self.pinned = bool(block_sizes) and pin
        for size in block_sizes:
            block, pinned = _allocate_block(size, pin)
            self._blocks.append(block)
            self.pinned = self.pinned and pinned
        self.num_bytes = sum(block_sizes)
        self.views = []
        for request, size, placement in zip(requests, sizes, placements, strict=True):
            raw = self._blocks[placement.block][placement.offset : placement.offset + size]
            self.views.append(raw.view(request.dtype))
