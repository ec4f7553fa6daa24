"""Asynchronous host<->device chunk copies on two side streams, ordered by events.

On an accelerator every copy runs on the engine's device-to-host (D2H) or host-to-device (H2D)
stream and returns the event recorded after it. On a CPU-only device there are no streams: the
copies run at once, synchronously, and the returned event is ``None``, which everywhere in
zero-shard means "nothing in flight". The pipeline code above is therefore the same on both and
runs in CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._streams import Event, Stream, record_event, side_stream, use_stream, wait_for_event

__all__ = ["CopyEngine", "CopyPair", "copy_async"]


class CopyPair(NamedTuple):
    """One copy: ``dst.copy_(src)``; both 1-D with the same numel (dtypes may differ).

    Attributes:
        dst: the tensor copied into.
        src: the tensor copied from.
    """

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
    agree; a dtype cast belongs on the host side (see docs/design.md: few bytes on the wire).

    Args:
        pairs: the copies, queued in one call.
        stream: the stream to queue them on; ``None``: they run synchronously instead.
        after: events ``stream`` waits for before the copies (``None`` entries are skipped, and
            all of them where ``stream`` is ``None``). Default ``()``.
    """
    if stream is None:
        _copy_all(pairs, non_blocking=False)
        return None
    for event in after:
        wait_for_event(stream, event)
    with use_stream(stream):
        _copy_on(stream, pairs)
    return record_event(stream)


def _copy_on(stream: Stream, pairs: Sequence[CopyPair]) -> None:
    """Queues the copies on ``stream`` (current). Each device tensor records the stream, so that
    the caller may drop it at once: the allocator reuses its memory only after the copy."""
    on_device: dict[int, torch.Tensor] = {}  # one tensor per device allocation
    _copy_all(pairs, non_blocking=True)
    for pair in pairs:
        for tensor in pair:
            if tensor.device.type != "cpu":
                on_device.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    for tensor in on_device.values():
        tensor.record_stream(stream)


@torch.no_grad()
def _copy_all(pairs: Sequence[CopyPair], *, non_blocking: bool) -> None:
    """One call for all the copies (a chunk of many small params holds a pair each): the
    dispatch and the release of the GIL, which a busy worker thread may hold for a while before
    handing it back, once, not once a pair. Without grad mode: no copy is part of a graph (a
    copier thread runs with grad mode on, and grads made by ``create_graph=True`` require
    grad)."""
    if len(pairs) == 1:
        pairs[0].dst.copy_(pairs[0].src, non_blocking=non_blocking)
    elif pairs:
        torch._foreach_copy_(
            [pair.dst for pair in pairs], [pair.src for pair in pairs], non_blocking=non_blocking
        )


class CopyEngine:
    """The D2H and H2D streams of one device; each copy returns the event that follows it.

    Args:
        device: the accelerator the copies go to and from. For ``cpu`` there are no streams and
            every copy is synchronous (see the module note).
    """

    device: torch.device
    d2h_stream: Stream | None  # device -> pinned host: grads
    h2d_stream: Stream | None  # pinned host -> device: updated params

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.d2h_stream = side_stream(self.device)
        self.h2d_stream = side_stream(self.device)

    @property
    def is_async(self) -> bool:
        return self.d2h_stream is not None

    def d2h(self, pairs: Sequence[CopyPair], *, after: Sequence[Event | None] = ()) -> Event | None:
        """Device-to-host copies on the D2H stream; see :func:`copy_async`."""
        return copy_async(pairs, self.d2h_stream, after=after)

    def h2d(self, pairs: Sequence[CopyPair], *, after: Sequence[Event | None] = ()) -> Event | None:
        """Host-to-device copies on the H2D stream; see :func:`copy_async`."""
        return copy_async(pairs, self.h2d_stream, after=after)
