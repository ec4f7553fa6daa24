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

import torch

from offload import HostFlag

__all__ = ["SkipCount"]


class SkipCount:
    """How many steps were skipped, including one whose verdict is still on its way."""

    num_skipped: int  # verdicts read so far that skipped their step
    _verdict: HostFlag  # the last step's verdict, on its way to the host
    _unread: bool  # _verdict holds a verdict not counted yet

    def __init__(self, device: torch.device) -> None:
        self.num_skipped = 0
        self._verdict = HostFlag(device)
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
        self._verdict.send(flag)
        self._unread = True

    def read(self, *, block: bool) -> bool:
        """Counts the verdict in flight, if any and (unless ``block``) if it has arrived;
        returns whether it skipped its step."""
        if not self._unread or (not block and not self._verdict.arrived()):
            return False
        self._unread = False
        if self._verdict.read() == 0:
            return False
        self.num_skipped += 1
        return True
