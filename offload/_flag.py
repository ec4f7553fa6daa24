"""A one-element flag on the accelerator, read on the host without stalling it.

[Note: flags written by the device]
The worker reads a step's flags (found_inf, the clip's factor) before its first chunk, so they
must reach the host as soon as they are final. A copy of them is a DMA on the copy engine, which
takes copies in the order they were released, whatever their stream: queued behind the D2H copies
of another stream (as the early copies of backward's last buckets are), a 4-byte flag lands only
after all of them (docs/benchmarks/e2e.md measures the wait). On CUDA the flag is therefore not
copied: a one-element kernel writes it straight into the pinned host buffer, which a kernel may
address by its host pointer (unified addressing: all memory from ``cudaHostAlloc`` or
``cudaHostRegister`` is mapped), and that kernel runs on the SMs, not behind the copies.
Elsewhere (another accelerator, or where the view cannot be had) the flag is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
    """A device flag's value in pinned host memory, sent behind events and read once it lands.

    :meth:`send` queues the value of a one-element tensor for the host on a stream (the current
    one by default) and returns at once; :meth:`arrived` says whether it has landed, without
    blocking; :meth:`read` waits for it if needed. The host buffer is reused by the next
    :meth:`send`: its caller must have read (or stopped caring about) the previous value. On
    CUDA the device writes the value into the host buffer (see [Note: flags written by the
    device]); on a CPU-only device the copy is synchronous and always arrived.
    """

    _host: torch.Tensor  # 1 element, fp32; pinned on an accelerator
    _device_view: torch.Tensor | None  # _host as a CUDA tensor (the same memory); None: copied
    _event: Event | None  # after the write into _host; None when it is done (or was synchronous)

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        self._host = torch.zeros(1, pin_memory=device.type != "cpu")
        self._device_view = _mapped_view(self._host, device)
        self._event = None

    @property
    def written_by_device(self) -> bool:
        """Whether the device writes the value into host memory (no copy engine involved)."""
        return self._device_view is not None

    def send(
        self,
        flag: torch.Tensor,
        *,
        stream: Stream | None = None,
        after: Sequence[Event | None] = (),
    ) -> None:
        """Queues the value of ``flag`` (one element, fp32) for the host on ``stream`` once the
        events in ``after`` completed; ``stream=None`` is the flag's device's current stream."""
        if flag.device.type == "cpu":
            self._host.copy_(flag.detach().reshape(1))
            self._event = None
            return
        stream = stream or current_stream(flag.device)
        for event in after:
            wait_for_event(stream, event)
        with use_stream(stream):
            if self._device_view is not None:
                # A kernel (times one: the same bits, NaN and -0.0 included), not a copy, which
                # the runtime would hand to the copy engine ([Note: flags written by the device]).
                torch.mul(flag.detach().reshape(1), 1, out=self._device_view)
            else:
                self._host.copy_(flag.detach().reshape(1), non_blocking=True)
        flag.record_stream(stream)  # the caller may drop the flag at once
        self._event = record_event(stream)

    def arrived(self) -> bool:
        """Whether the last value sent is on the host (no blocking)."""
        return self._event is None or self._event.query()

    def read(self) -> float:
        """The last value sent, once it is on the host (blocking until then: the event follows
        the write, whose stores the host sees once it completed)."""
        wait_event(self._event)
        return float(self._host[0])


class _CudaArray:
    """``host`` described by the CUDA array interface, which ``torch.as_tensor`` wraps without
    a copy; it holds ``host``, so the view keeps the memory alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(host.shape),
            "typestr": "<f4",
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def _mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The pinned fp32 ``host`` as a tensor on CUDA ``device`` over the same memory, or ``None``
    where none can be had (not CUDA, ROCm, or torch would have copied it: a different pointer
    or device, for instance memory registered against another device)."""
    if device.type != "cuda" or torch.version.hip is not None or not host.is_pinned():
        return None
    if host.dtype != torch.float32:
        raise AssertionError(f"expected an fp32 host buffer, got {host.dtype}")
    try:
        view = torch.as_tensor(_CudaArray(host), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if view.data_ptr() != host.data_ptr() or view.device != torch.device("cuda", index):
        return None
    return view
