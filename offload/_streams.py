"""Side streams that vanish on a CPU-only device, so the same ordering code runs in CI.

``None`` stands for "no stream": work runs at once on the calling thread, and an event of
``None`` is complete (as in ``_copy_engine.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "current_stream",
    "record_event",
    "side_stream",
    "use_device",
    "use_stream",
    "wait_event",
    "wait_for_event",
    "wait_stream",
]

Stream = Any
Event = Any


def side_stream(device: torch.device) -> Stream | None:
    """A new stream on ``device``, or ``None`` on the CPU."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device).Stream(device=device)


def current_stream(device: torch.device) -> Stream | None:
    """The device's current stream, or ``None`` on the CPU."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device).current_stream(device)


def use_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` the calling thread's current device inside the block (nothing on the
    CPU): allocations without a device, object collectives over NCCL, and a new thread, whose
    current device starts at the first one, go to this rank's."""
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    return torch.get_device_module(device).device(device)


@contextlib.contextmanager
def use_stream(stream: Stream | None) -> Iterator[None]:
    """Makes ``stream`` current inside the block (nothing for ``None``)."""
    if stream is None:
        yield
        return
    with torch.get_device_module(stream.device).stream(stream):
        yield


def wait_stream(waiter: Stream | None, waited: Stream | None) -> None:
    """Orders later work on ``waiter`` after the work already queued on ``waited``.

    Take ``waited`` before entering ``use_stream(waiter)``: inside it, the current stream is
    ``waiter`` itself, and a stream waiting on itself orders nothing.

    Args:
        waiter: the stream whose later work waits; ``None`` (CPU): nothing is done.
        waited: the stream whose queued work is waited for; ``None`` (CPU): nothing is done.
    """
    if waiter is not None and waited is not None:
        waiter.wait_stream(waited)


def record_event(stream: Stream | None) -> Event | None:
    """An event after the work queued on ``stream`` so far (``None`` on the CPU)."""
    if stream is None:
        return None
    event = torch.get_device_module(stream.device).Event()
    event.record(stream)
    return event


def wait_for_event(stream: Stream | None, event: Event | None) -> None:
    """Orders later work on ``stream`` after ``event`` without blocking the host (nothing for
    ``None`` on either side).

    Args:
        stream: the stream that waits; ``None`` on the CPU.
        event: the event it waits for; ``None``: nothing in flight.
    """
    if stream is not None and event is not None:
        stream.wait_event(event)


def wait_event(event: Event | None) -> None:
    """Blocks the calling host thread until ``event`` completed (``None``: already done).

    The wait releases the GIL, so a worker thread waiting here lets the main thread run on. An
    event already complete is seen by a query, which keeps the GIL: on a busy host, each release
    may wait for another thread to hand the GIL back.
    """
    if event is not None and not event.query():
        event.synchronize()
