"""HostFlag: a device flag's value on the host, behind the events it is sent after.

On CUDA the device writes the value into pinned host memory ([Note: flags written by the
device]); a write that skips its wait shows up as the value from before the producer's kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from offload import HostFlag, current_stream, record_event, side_stream


def test_on_cpu_the_value_is_there_at_once() -> None:
    flag = HostFlag(torch.device("cpu"))
    assert not flag.written_by_device
    for value in (0.0, 1.0, -0.0, float("inf"), float("nan"), 0.25):
        flag.send(torch.tensor([value]))
        assert flag.arrived()
        read = flag.read()
        assert math.isnan(read) if math.isnan(value) else read == value
        assert math.copysign(1.0, read) == math.copysign(1.0, value)


@pytest.mark.cuda
def test_on_cuda_the_device_writes_the_value_behind_the_events_it_waits_for() -> None:
    device = torch.device("cuda")
    flag = HostFlag(device)
    assert flag.written_by_device  # the mapped view of the pinned buffer was had
    producer, flags_stream = side_stream(device), side_stream(device)
    values = (1.0, 0.0, -0.0, float("inf"), float("nan"), 0.3125, 7.0)
    for value in values:
        source = torch.full((1,), -1.0, device=device)
        with torch.cuda.stream(producer):
            producer.wait_stream(current_stream(device))
            torch.cuda._sleep(50_000_000)  # the value is final long after the host moves on
            source.fill_(value)
            final = record_event(producer)
        flag.send(source, stream=flags_stream, after=[final])
        read = flag.read()
        assert math.isnan(read) if math.isnan(value) else read == value  # not the -1
        assert math.copysign(1.0, read) == math.copysign(1.0, value)
        assert flag.arrived()
    # The current stream's order where no stream is given (the skip count's use).
    source = torch.zeros(1, device=device)
    torch.cuda._sleep(50_000_000)
    source.fill_(3.0)
    flag.send(source)
    assert flag.read() == 3.0
