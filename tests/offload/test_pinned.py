import itertools
import warnings

import pytest
import torch

from offload import HostBufferRequest, HostBuffers, _pinned


@pytest.mark.parametrize(
    "sizes",
    [[100] * 10, [300 << 20] * 4, [64 << 20] * 17, [5], [], [3 << 30], [1, 1 << 20, 7, 1 << 29]],
)
def test_plan_blocks_powers_of_two_disjoint_and_tight(sizes: list[int]) -> None:
    placements, blocks = _pinned._plan_blocks(sizes, 1 << 30)
    assert all(b & (b - 1) == 0 and b > 0 for b in blocks)
    spans = {}
    for size, place in zip(sizes, placements, strict=True):
        assert place.offset % _pinned._ALIGN_BYTES == 0
        assert place.offset + size <= blocks[place.block]
        spans.setdefault(place.block, []).append((place.offset, place.offset + size))
    for block_spans in spans.values():
        block_spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(block_spans))
    if sizes and max(sizes) <= 1 << 29:
        # Few blocks, and little over-allocation from the power-of-two rounding.
        aligned = sum(_pinned._align(s) for s in sizes)
        assert sum(blocks) <= 1.5 * aligned + 4096


def test_host_buffers_views_have_requested_shape_and_do_not_overlap() -> None:
    requests = [
        HostBufferRequest(7, torch.bfloat16),
        HostBufferRequest(0, torch.float32),
        HostBufferRequest(1000, torch.float32),
        HostBufferRequest(3, torch.float16),
    ]
    buffers = HostBuffers(requests, pin=False, block_bytes=2048)
    assert not buffers.pinned
    for view, request in zip(buffers.views, requests, strict=True):
        assert view.shape == (request.numel,) and view.dtype == request.dtype
    for index, view in enumerate(buffers.views):
        view.fill_(index + 1)
    for index, view in enumerate(buffers.views):
        assert torch.all(view == index + 1)
    assert buffers.num_bytes >= sum(r.numel * r.dtype.itemsize for r in requests)


def test_block_bytes_must_be_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two, got 1000"):
        HostBuffers([HostBufferRequest(1, torch.float32)], pin=False, block_bytes=1000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA does")
def test_pin_failure_falls_back_to_pageable_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_pinned, "_pin_failure_warned", False)
    with pytest.warns(RuntimeWarning, match="pageable memory"):
        first = HostBuffers([HostBufferRequest(10, torch.float32)], pin=True)
    assert not first.pinned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = HostBuffers([HostBufferRequest(10, torch.float32)], pin=True)
    assert not second.pinned
    second.views[0].fill_(2.0)
    assert second.views[0].sum().item() == 20.0


def test_refused_pin_falls_back_to_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The OS refusing to pin (ulimit -l, a full host), simulated: runs with a CUDA torch too.
    real_empty = torch.empty

    def refuse_pin(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(_pinned, "_pin_failure_warned", False)
    monkeypatch.setattr(_pinned.torch, "empty", refuse_pin)
    with pytest.warns(RuntimeWarning, match=r"could not pin 4096 bytes .*simulated cudaHostAlloc"):
        buffers = HostBuffers([HostBufferRequest(1000, torch.float32)], pin=True)
    assert not buffers.pinned and not buffers.views[0].is_pinned()
    buffers.views[0].fill_(3.0)
    assert buffers.views[0].sum().item() == 3000.0


@pytest.mark.cuda
def test_pinned_blocks_on_cuda() -> None:
    buffers = HostBuffers([HostBufferRequest(1 << 20, torch.bfloat16)] * 3, pin=True)
    assert buffers.pinned and all(view.is_pinned() for view in buffers.views)
