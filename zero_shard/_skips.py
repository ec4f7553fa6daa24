"""Steps skipped for non-finite grads, counted without making the host wait for the verdict.

[Note: skip on the device]
The verdict of a step (an inf or NaN in some rank's grads, after an all-reduce) is a flag on the
accelerator, final only once backward and the reductions are done there. Reading it on the host
at ``step()`` would stall the host until then, so that it could queue nothing of the next
forward while the accelerator finishes backward. Instead the step hands the flag to the kernels:
torch's fused optimizers read it on the device (``found_inf``) and the CPU worker reads a copy
of it before its first chunk. The host reads its own copy later, to count and warn: the copy
goes into a pinned scalar behind an event, read at the next ``step()`` (long done by then) or
when ``num_skipped_steps`` is asked for, or at once where the device is the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SkipCount"]


class SkipCount:
    """How many steps were skipped, including one whose verdict is still on its way."""

    num_skipped: int  # verdicts read so far that skipped their step
    _host_flag: torch.Tensor  # 1 element, fp32; pinned on an accelerator
    _event: Any  # after the copy into _host_flag; None on CPU (the copy was synchronous)
    _unread: bool  # _host_flag holds a verdict not counted yet

    def __init__(self, device: torch.device) -> None:
        self.num_skipped = 0
        self._host_flag = torch.zeros(1, pin_memory=device.type != "cpu")
        self._event = None
        self._unread = False

    def add(self) -> int:
        """Counts a step skipped with its verdict known on the host; returns the new count."""
        self.num_skipped += 1
        return self.num_skipped

    def note(self, flag: torch.Tensor) -> None:
        """Starts reading ``flag`` (one element, fp32, on the device; nonzero: the step was
        skipped) as the current stream will hold it. The previous verdict must be read first."""
        if self._unread:
            raise AssertionError("expected the previous step's verdict to be read first")
        self._host_flag.copy_(flag.detach().reshape(1), non_blocking=True)
        self._event = None
        if flag.device.type != "cpu":
            module = torch.get_device_module(flag.device)
            self._event = module.Event()
            self._event.record(module.current_stream(flag.device))
        self._unread = True

    def read(self, *, block: bool) -> bool:
        """Counts the verdict in flight, if any and (unless ``block``) if it has arrived;
        returns whether it skipped its step."""
        if not self._unread or (not block and self._event is not None and not self._event.query()):
            return False
        if self._event is not None:
            self._event.synchronize()
        self._unread, self._event = False, None
        if self._host_flag[0] == 0:
            return False
        self.num_skipped += 1
        return True
