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

import warnings
from typing import TYPE_CHECKING

import torch

from offload import HostFlag

if TYPE_CHECKING:
    from ._setup import Nonfinite

__all__ = ["SkipCount"]


class SkipCount:
    """How many steps were skipped for inf/NaN grads, including one whose verdict is still on its
    way."""

    num_skipped: int  # verdicts read so far that skipped their step
    _verdict: HostFlag  # the last step's verdict, on its way to the host
    _unread: bool  # _verdict holds a verdict not counted yet

    def __init__(self, device: torch.device) -> None:
        self.num_skipped = 0
        self._verdict = HostFlag(device)
        self._unread = False

    def decide(
        self, flag: torch.Tensor, nonfinite: Nonfinite, *, on_device: bool
    ) -> tuple[bool, torch.Tensor | None]:
        """Whether the step of ``flag`` (one element, fp32, on the device; nonzero: infs or NaNs)
        is skipped, as (known now on the host: skip, the flag for the step's kernels to read
        instead). With ``nonfinite="skip"`` and kernels that read the flag (``on_device``), the
        host starts reading it as the current stream will hold it, without waiting for it."""
        if nonfinite == "skip" and on_device:
            if self._unread:
                raise AssertionError("expected the previous step's verdict to be read first")
            self._verdict.send(flag)
            self._unread = True
            return False, flag
        if not bool(flag):
            return False, None
        if nonfinite == "raise":
            raise RuntimeError(
                "the grads hold an inf or a NaN (on some rank); the step was not taken and the "
                "optimizer state is unchanged. Use nonfinite='skip' to skip such steps"
            )
        self.num_skipped += 1
        _warn_skipped(self.num_skipped, stacklevel=6)  # step()'s caller, through torch.no_grad
        return True, None

    def read(self, *, block: bool) -> None:
        """Counts the verdict in flight, if any and (unless ``block``) if it has arrived, and
        warns if it skipped its step."""
        if not self._unread or (not block and not self._verdict.arrived()):
            return
        self._unread = False
        if self._verdict.read() == 0:
            return
        self.num_skipped += 1
        _warn_skipped(self.num_skipped, stacklevel=5)  # step()'s caller, through torch.no_grad


def _warn_skipped(num_skipped: int, *, stacklevel: int) -> None:
    warnings.warn(
        f"zero-shard skipped a step: the grads hold an inf or a NaN ({num_skipped} step(s) "
        "skipped so far); state and params are unchanged",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
