"""PageTwin ([Note: page moves] in offload/_page_moves.py): the twin's contents become the live
tensor's, which keeps its address, its version counter and every view taken of it; pages move
where the host allows it, and anything else is copied."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from offload import PageTwin, anonymous_ranges, page_moves_available
from offload import _page_moves as page_moves

MOVED = (3 << 20) // 4 + 5  # fp32 elements: whole pages of more than 1 MiB, and a ragged tail


def _moves_here() -> bool:
    return page_moves_available()


@pytest.mark.parametrize("numel", [0, 1, 5, 4099, MOVED, 1 << 24])
@pytest.mark.parametrize("offset", [0, 3])
def test_the_twin_moves_into_the_live_tensor_keeping_its_address_and_views(
    numel: int, offset: int
) -> None:
    """A live tensor at an odd offset into its storage (its first and last pages are shared with
    other bytes, which stay as they were), moved into three times: each time it reads the twin's
    values, through itself and through a view taken before; its neighbours and counter do not
    change."""
    base = torch.randn(numel + offset + 7)
    live = base[offset : offset + numel]
    view = live[1:]
    neighbours = torch.cat([base[:offset], base[offset + numel :]]).clone()
    address, version = live.data_ptr(), live._version
    twin = PageTwin(live)
    expected_moves = _moves_here() and numel * 4 >= (1 << 20) + 2 * mmap.PAGESIZE
    assert twin.moves_pages == expected_moves
    for round_ in range(3):
        new = torch.randn(numel)
        twin.twin.copy_(new)
        twin.move_into_live()
        assert torch.equal(live, new), round_
        assert torch.equal(view, new[1:]), round_
        assert live.data_ptr() == address and live._version == version
        assert torch.equal(torch.cat([base[:offset], base[offset + numel :]]), neighbours)


def test_what_cannot_move_is_copied() -> None:
    """Memory that is not the process's private anonymous memory (a shared mapping, as
    ``share_memory_()`` makes), and hosts without ``MREMAP_DONTUNMAP``: a copy, the same values."""
    shared = torch.randn(MOVED).share_memory_()
    twin = PageTwin(shared)
    assert not twin.moves_pages
    twin.twin.fill_(2.0)
    twin.move_into_live()
    assert torch.equal(shared, torch.full_like(shared, 2.0))
    assert all(
        not (start <= shared.data_ptr() < end) for start, end in anonymous_ranges()
    )  # (the shared mapping is no anonymous range)


def test_without_mremap_everything_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_moves, "page_moves_available", lambda: False)
    live = torch.randn(MOVED)
    twin = PageTwin(live)
    assert not twin.moves_pages and page_moves.anonymous_ranges() == []
    new = torch.randn(MOVED)
    twin.twin.copy_(new)
    twin.move_into_live()
    assert torch.equal(live, new)


def test_the_twins_memory_is_returned_when_it_goes() -> None:
    """The twin's mappings are unmapped once the twin and its tensor are gone (no address range
    of it stays mapped)."""
    if not _moves_here():
        pytest.skip("this host moves no pages")
    live = torch.randn(MOVED)
    twin = PageTwin(live)
    twin.twin.fill_(1.0)
    twin.move_into_live()
    start = twin.twin.data_ptr()
    assert any(lo <= start < hi for lo, hi in anonymous_ranges())
    del twin
    gc.collect()
    assert not any(lo <= start < hi for lo, hi in anonymous_ranges())
    assert torch.equal(live, torch.ones_like(live))  # (the live pages are the live tensor's)


def test_a_live_tensor_that_is_not_contiguous_is_refused() -> None:
    with pytest.raises(AssertionError, match="contiguous CPU tensor"):
        PageTwin(torch.randn(4, 6).t())


def test_a_move_that_fails_first_is_a_copy_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """mremap refusing to move the live pages aside (its range split between mappings since the
    twin was made, say) leaves everything as it was: the twin is copied in, now and after."""
    if not _moves_here():
        pytest.skip("this host moves no pages")
    live = torch.randn(MOVED)
    twin = PageTwin(live)
    assert twin.moves_pages
    moved = page_moves._move
    monkeypatch.setattr(page_moves, "_move", lambda *args: False)
    new = torch.randn(MOVED)
    twin.twin.copy_(new)
    twin.move_into_live()
    assert torch.equal(live, new) and not twin.moves_pages
    monkeypatch.setattr(page_moves, "_move", moved)
    newer = torch.randn(MOVED)
    twin.twin.copy_(newer)
    twin.move_into_live()
    assert torch.equal(live, newer)


def test_without_mappings_to_spare_the_twin_is_copied_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the process's limit of mappings (vm.max_map_count) the twin's own cannot be made: a
    twin of ordinary memory, copied in."""

    def refused(num_bytes: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(page_moves, "_reserve", refused)
    live = torch.randn(MOVED)
    twin = PageTwin(live)
    assert not twin.moves_pages
    new = torch.randn(MOVED)
    twin.twin.copy_(new)
    twin.move_into_live()
    assert torch.equal(live, new)
