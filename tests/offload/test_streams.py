"""Side-stream ordering helpers: a wait that is skipped shows up as a read before the write."""

from __future__ import annotations

import pytest
import torch

from offload import current_stream, record_event, side_stream, use_stream, wait_stream


def test_on_cpu_there_are_no_streams() -> None:
    cpu = torch.device("cpu")
    assert side_stream(cpu) is None and current_stream(cpu) is None
    with use_stream(None):
        wait_stream(None, None)
    assert record_event(None) is None


@pytest.mark.cuda
def test_side_stream_waits_for_the_current_stream() -> None:
    device = torch.device("cuda")
    value = torch.zeros(1, device=device)
    side = side_stream(device)
    for _ in range(3):
        value.zero_()
        torch.cuda._sleep(50_000_000)  # the write below lands long after the host moves on
        value.fill_(1.0)
        wait_stream(side, current_stream(device))
        with use_stream(side):
            copy = value.clone()
        event = record_event(side)
        event.synchronize()
        assert copy.item() == 1.0  # a skipped wait would have copied the 0
