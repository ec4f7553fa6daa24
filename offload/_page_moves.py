"""Buffers whose contents move into a live tensor by moving memory pages, not by copying.

[Note: page moves]
A speculative host step writes a chunk's new state beside the live state, and when the step
stands, that new state must become the live state. A copy costs a pass over host memory as long as
the step itself (the step is bound by host memory bandwidth too), and the live tensors cannot be
pointed elsewhere: torch's optimizer state, DTensors over it and whatever the user read from
``optimizer.state`` hold their addresses. So the new state is written into a twin buffer laid out
so that its pages can take the live tensor's place. ``PageTwin.move_into_live`` then exchanges the
physical pages behind the two address ranges with Linux's ``mremap``: every alias of the live
tensor reads the new values at once, and the twin holds the old ones (it is overwritten by the
next speculation). Only the page tables change.

- The twin sits at the same address as the live tensor modulo 2 MiB (one page-middle-directory
  entry), so the kernel moves whole page tables of 512 pages where it can: a 256 MiB move takes
  about 0.25 ms, against about 10 ms page by page and far more as a copy.
- The exchange goes through a third range of our own in three ``mremap`` calls with
  ``MREMAP_DONTUNMAP`` (Linux 5.7+): each source range stays mapped, empty, so no range we own or
  the live tensor's is ever unmapped, and no other thread's ``mmap`` can land in it meanwhile.
  Between the first and second call the live range reads zeros: the caller moves only while no
  other thread reads the tensor (the host step's worker, at the step; zero-shard's own reads wait
  for it). A move that fails leaves the twin's pages where they are, and they are copied in.
- Only whole pages inside the live tensor move; the bytes of its first and last page (which may
  hold other allocations, and the allocator's records) are copied. Live memory that is not
  private anonymous memory of the process (the allocator's own, ``[heap]`` included; not a file
  or shared mapping, nor pinned memory: the device's driver holds its pages) or is under 1 MiB is
  copied whole, as everything is where ``mremap`` lacks ``MREMAP_DONTUNMAP``
  (``page_moves_available``).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass
from functools import cache

import torch

__all__ = ["PageTwin", "anonymous_ranges", "page_moves_available"]

_PAGE = mmap.PAGESIZE
_PMD = 2 << 20  # what one page-middle-directory entry maps on x86-64 and arm64 (4 KiB pages)
_MIN_MOVE_BYTES = 1 << 20
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_MOVE_FLAGS = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
_FAILED = ctypes.c_void_p(-1).value


@cache
def _mremap() -> ctypes._CFuncPtr | None:
    if sys.platform != "linux":
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).mremap
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    ]  # fmt: skip
    return function


def _address(region: mmap.mmap) -> int:
    pointer = ctypes.c_char.from_buffer(region)  # (an export: the mapping stays while it lives)
    address = ctypes.addressof(pointer)
    del pointer
    return address


def _reserve(num_bytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of ``num_bytes`` (untouched: no memory until written) and its
    address."""
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, _address(region)


def _move(function: ctypes._CFuncPtr, source: int, target: int, num_bytes: int) -> bool:
    result = function(source, num_bytes, num_bytes, _MOVE_FLAGS, target)
    return result is not None and result != _FAILED and result == target


def _exchange(function: ctypes._CFuncPtr, live: int, twin: int, spare: int, num_bytes: int) -> bool:
    """Moves the twin's pages into ``live`` and the live ones into ``twin``, through ``spare``
    (see [Note: page moves]). Returns whether ``live`` holds the twin's pages; where not, it
    holds its own or none (mapped, empty) and the twin still holds its pages: the caller copies
    them in. A failure of the last move leaves the twin empty, which is no loss: a twin is
    written whole before it is read."""
    if not _move(function, live, spare, num_bytes):
        return False
    if not _move(function, twin, live, num_bytes):
        _move(function, spare, live, num_bytes)  # the live pages back, where it can
        return False
    _move(function, spare, twin, num_bytes)
    return True


@cache
def page_moves_available() -> bool:
    """Whether this host moves pages with ``mremap(MREMAP_DONTUNMAP)`` (Linux 5.7+), tried once
    on mappings of our own."""
    function = _mremap()
    if function is None:
        return False
    try:
        regions = [_reserve(2 * _PMD) for _ in range(3)]
    except (OSError, ValueError):
        return False
    (_, live), (_, twin), (_, spare) = ((r, a + (-a % _PMD)) for r, a in regions)  # fmt: skip
    ctypes.memset(live, 1, _PAGE)
    ctypes.memset(twin, 2, _PAGE)
    try:
        exchanged = _exchange(function, live, twin, spare, _PAGE)
        exchanged = exchanged and ctypes.string_at(live, 1) == b"\x02"
        return exchanged and ctypes.string_at(twin, 1) == b"\x01"
    finally:
        for region, _ in regions:
            region.close()


def _anonymous_ranges() -> list[tuple[int, int]]:
    """The process's private anonymous read-write mappings, one range each (``mremap`` moves a
    range within one mapping only)."""
    ranges: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            anonymous = not path or path == "[heap]" or path.startswith("[anon:")
            if fields[1] == "rw-p" and fields[4] == "0" and anonymous:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def _movable(tensor: torch.Tensor, first: int, last: int, ranges: list[tuple[int, int]]) -> bool:
    if last - first < _MIN_MOVE_BYTES or tensor.is_pinned():
        return False
    return any(start <= first and last <= end for start, end in ranges)


@dataclass
class _Pages:
    """The whole pages of a live tensor that move: byte offsets into it, and the twin's range."""

    head: int  # bytes before the first whole page (copied)
    num_bytes: int  # bytes of whole pages (moved)
    twin: int  # address of the twin's first byte
    spare: int  # address of the spare range's first whole page


class PageTwin:
    """A buffer of ``live``'s dtype and size whose contents ``move_into_live`` makes ``live``'s,
    by moving pages where it can (see [Note: page moves]), else by a copy.

    Args:
        live: a contiguous CPU tensor; its memory must stay allocated while this twin is used.
        ranges: the process's anonymous mappings (``anonymous_ranges()``), read once for several
            twins; ``None`` reads them.
    """

    live: torch.Tensor
    twin: torch.Tensor  # written by the caller, then moved into ``live``
    moves_pages: bool  # False: ``move_into_live`` copies
    _pages: _Pages | None
    _regions: tuple[mmap.mmap, ...]  # the twin's and the spare range's mappings (unmapped when
    #                                  the twin and its tensor are gone)

    def __init__(self, live: torch.Tensor, ranges: list[tuple[int, int]] | None = None) -> None:
        if live.device.type != "cpu" or not live.is_contiguous():
            raise AssertionError(
                f"expected a contiguous CPU tensor, got one on {live.device} "
                f"({'' if live.is_contiguous() else 'not '}contiguous)"
            )
        self.live = live
        self._pages, self._regions = None, ()
        num_bytes = live.numel() * live.element_size()
        start = live.data_ptr()
        first = start + (-start % _PAGE)
        last = (start + num_bytes) // _PAGE * _PAGE
        moves = page_moves_available() and num_bytes > 0
        if moves:
            moves = _movable(live, first, last, _anonymous_ranges() if ranges is None else ranges)
        regions = None
        if moves:  # (no mapping to spare, past the process's limit of them: a copy instead)
            try:
                regions = _reserve(num_bytes + 2 * _PMD), _reserve(last - first + 2 * _PMD)
            except (OSError, ValueError):
                regions = None
        if regions is None:
            self.twin = torch.empty_like(live)
            self.moves_pages = False
            return
        # The twin at live's address modulo 2 MiB, the spare range too (see [Note: page moves]).
        (twin_region, twin_base), (spare_region, spare_base) = regions
        twin = twin_base + (start - twin_base) % _PMD
        spare = spare_base + (first - spare_base) % _PMD
        self._regions = (twin_region, spare_region)
        self._pages = _Pages(first - start, last - first, twin, spare)
        offset = twin - twin_base
        self.twin = torch.frombuffer(
            twin_region, dtype=live.dtype, count=live.numel(), offset=offset
        ).view(live.shape)
        self.moves_pages = True

    @property
    def num_bytes(self) -> int:
        """Bytes of memory the twin holds once written."""
        return self.twin.numel() * self.twin.element_size()

    def move_into_live(self) -> None:
        """``live`` takes the twin's contents; the twin's are undefined after it. Call it while
        no other thread reads or writes either (see [Note: page moves])."""
        # Through an alias with a version counter of its own: the move is the optimizer's write,
        # which moves no counter (views share theirs: a counted write here would read as someone
        # else's write to every other piece of the same buffer).
        live_bytes = _uncounted_bytes(self.live)
        twin_bytes = self.twin.view(-1).view(torch.uint8)
        pages = self._pages
        if pages is None:
            live_bytes.copy_(twin_bytes)
            return
        function = _mremap()
        if function is None:
            raise AssertionError("expected mremap where pages were found movable")
        end = pages.head + pages.num_bytes
        live_bytes[: pages.head].copy_(twin_bytes[: pages.head])
        live_bytes[end:].copy_(twin_bytes[end:])
        live = self.live.data_ptr() + pages.head
        if not _exchange(function, live, pages.twin + pages.head, pages.spare, pages.num_bytes):
            # (the live range changed mappings since, say): copied in, now and from then on
            self._pages, self.moves_pages = None, False
            live_bytes[pages.head : end].copy_(twin_bytes[pages.head : end])


def anonymous_ranges() -> list[tuple[int, int]]:
    """The process's private anonymous memory, for building several ``PageTwin`` at once; empty
    where pages cannot move."""
    return _anonymous_ranges() if page_moves_available() else []


def _uncounted_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, 1-D, through an alias with a version counter of its own."""
    alias = torch.empty(0, dtype=torch.uint8)
    size = tensor.numel() * tensor.element_size()
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(),
                      (size,), (1,))  # fmt: skip
