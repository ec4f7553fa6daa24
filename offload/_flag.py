"""A one-element flag on the accelerator, read on the host without stalling it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._streams import (
    Event,
    Stream,
    current_stream,
    record_event,
    use_stream,
    wait_event,
    wait_for_event,
)

__all__ = ["HostFlag"]


class HostFlag:
    """A device flag's copy in pinned host memory, queued behind an event and read once it lands.

    :meth:`send` queues the copy of a one-element tensor on a stream (the current one by
    default) and returns at once; :meth:`arrived` says whether it has landed, without blocking;
    :meth:`read` waits for it if needed. The host buffer is reused by the next :meth:`send`: its
    caller must have read (or stopped caring about) the previous value. On a CPU-only device the
    copy is synchronous and always arrived.
    """

    _host: torch.Tensor  # 1 element, fp32; pinned on an accelerator
    _event: Event | None  # after the copy into _host; None when it is done (or was synchronous)

    def __init__(self, device: torch.device) -> None:
        self._host = torch.zeros(1, pin_memory=torch.device(device).type != "cpu")
        self._event = None

    def send(
        self,
        flag: torch.Tensor,
        *,
        stream: Stream | None = None,
        after: Sequence[Event | None] = (),
    ) -> None:
        """Queues the copy of ``flag`` (one element, fp32) on ``stream`` once the events in
        ``after`` completed; ``stream=None`` is the flag's device's current stream."""
        if flag.device.type == "cpu":
            self._host.copy_(flag.detach().reshape(1))
            self._event = None
            return
        stream = stream or current_stream(flag.device)
        for event in after:
            wait_for_event(stream, event)
        with use_stream(stream):
            self._host.copy_(flag.detach().reshape(1), non_blocking=True)
        flag.record_stream(stream)  # the caller may drop the flag at once
        self._event = record_event(stream)

    def arrived(self) -> bool:
        """Whether the last value sent is on the host (no blocking)."""
        return self._event is None or self._event.query()

    def read(self) -> float:
        """The last value sent, once it is on the host (blocking until then)."""
        wait_event(self._event)
        return float(self._host[0])
