"""Asynchronous host<->device chunk copies on two side streams, ordered by events.

On an accelerator every copy runs on the engine's device-to-host (D2H) or host-to-device (H2D)
stream and returns the event recorded after it. On a CPU-only device there are no streams: the
copies run at once, synchronously, and the returned event is ``None``, which everywhere in
zero-shard means "nothing in flight". The pipeline code above is therefore the same on both and
runs in CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["CopyEngine", "CopyPair", "copy_async", "wait_event"]

Event = Any  # the device module's Event type (torch.cuda.Event, ...)
Stream = Any


class CopyPair(NamedTuple):
    """One copy: ``dst.copy_(src)``; both 1-D with the same numel (dtypes may differ)."""

    dst: torch.Tensor
    src: torch.Tensor


def copy_async(
    pairs: Sequence[CopyPair],
    stream: Stream | None,
    *,
    after: Sequence[Event | None] = (),
) -> Event | None:
    """Copies every pair on ``stream`` once the events in ``after`` completed.

    Returns the event recorded on ``stream`` after the copies, or ``None`` when ``stream`` is
    ``None`` (the copies have then run synchronously on the calling thread).

    A copy between pinned host memory and the device overlaps with compute only when its dtypes
    agree; a dtype cast belongs on the host side (see DESIGN.md: few bytes on the wire).
    """
    if stream is None:
        for pair in pairs:
            pair.dst.copy_(pair.src)
        return None
    module = torch.get_device_module(stream.device)
    for event in after:
        if event is not None:
            stream.wait_event(event)
    with module.stream(stream):
        _copy_on(stream, pairs)
        event = module.Event()
        event.record(stream)
    return event


def _copy_on(stream: Stream, pairs: Sequence[CopyPair]) -> None:
    """Queues the copies on ``stream`` (current). Each device tensor records the stream, so that
    the caller may drop it at once: the allocator reuses its memory only after the copy."""
    on_device: dict[int, torch.Tensor] = {}  # one tensor per device allocation
    for pair in pairs:
        pair.dst.copy_(pair.src, non_blocking=True)
        for tensor in pair:
            if tensor.device.type != "cpu":
                on_device.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    for tensor in on_device.values():
        tensor.record_stream(stream)


def wait_event(event: Event | None) -> None:
    """Blocks the calling host thread until ``event`` completed (``None``: already done).

    The wait releases the GIL, so a worker thread waiting here lets the main thread run on.
    """
    if event is not None:
        event.synchronize()


class CopyEngine:
    """The D2H and H2D streams of one device, and the events that order work between them.

    Args:
        device: the accelerator the copies go to and from. For ``cpu`` there are no streams and
            every copy is synchronous (see the module note).
    """

    device: torch.device
    d2h_stream: Stream | None  # device -> pinned host: grads
    h2d_stream: Stream | None  # pinned host -> device: updated params

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self.d2h_stream = None
            self.h2d_stream = None
            return
        module = torch.get_device_module(self.device)
        self.d2h_stream = module.Stream(device=self.device)
        self.h2d_stream = module.Stream(device=self.device)

    @property
    def is_async(self) -> bool:
        return self.d2h_stream is not None

    def record_current(self) -> Event | None:
        """Records an event on the device's current stream (``None`` on CPU)."""
        if not self.is_async:
            return None
        module = torch.get_device_module(self.device)
        event = module.Event()
        event.record(module.current_stream(self.device))
        return event

    def d2h_behind_current(self, pairs: Sequence[CopyPair]) -> None:
        """Queues D2H copies behind the work already on the current stream, recording no event
        of their own (cheap enough for a per-param backward hook); :meth:`mark_d2h` later gives
        one event that covers them all."""
        if not self.is_async:
            copy_async(pairs, None)
            return
        module = torch.get_device_module(self.device)
        self.d2h_stream.wait_stream(module.current_stream(self.device))
        with module.stream(self.d2h_stream):
            _copy_on(self.d2h_stream, pairs)

    def mark_d2h(self) -> Event | None:
        """An event on the D2H stream: done once every D2H queued so far is done."""
        if not self.is_async:
            return None
        event = torch.get_device_module(self.device).Event()
        event.record(self.d2h_stream)
        return event

    def wait_on_current(self, event: Event | None) -> None:
        """Makes the current stream wait for ``event`` without blocking the host."""
        if event is not None:
            torch.get_device_module(self.device).current_stream(self.device).wait_event(event)

    def d2h(self, pairs: Sequence[CopyPair], *, after: Sequence[Event | None] = ()) -> Event | None:
        """Device-to-host copies on the D2H stream; see :func:`copy_async`."""
        return copy_async(pairs, self.d2h_stream, after=after)

    def h2d(self, pairs: Sequence[CopyPair], *, after: Sequence[Event | None] = ()) -> Event | None:
        """Host-to-device copies on the H2D stream; see :func:`copy_async`."""
        return copy_async(pairs, self.h2d_stream, after=after)
