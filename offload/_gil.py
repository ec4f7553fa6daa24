"""The interpreter's GIL switch interval, shortened while work on helper threads is in flight.

[Note: GIL switch interval]
A thread that released the GIL for a long C call (the host step's worker, for each chunk's CPU
kernel) must take it back when the call returns. If another thread is running Python then (the
main thread queuing the next forward, a copier building a chunk's copies), CPython hands the GIL
over only once the waiting thread has waited for the switch interval (``sys.setswitchinterval``,
5 ms by default) or the running thread blocks. So each chunk may wait up to the interval after
its kernel, and a step of 64 chunks up to 64 times: a shorter interval while the host step is in
flight bounds that wait by the interval instead (docs/benchmarks/e2e.md compares the two). The
cost: threads that run Python at the same time hand the GIL over more often (each hand-off
is a few microseconds).

The interval belongs to the interpreter, so holds are counted: the first shortens it (never
lengthens it), the last puts back the value it found, unless something else changed the interval
in between (that value is then left alone).
"""

from __future__ import annotations

import math
import sys
import threading

__all__ = ["SwitchInterval", "check_switch_interval", "switch_interval"]


def check_switch_interval(seconds: float | None) -> None:
    """Raises ``ValueError`` unless ``seconds`` is ``None`` or a positive finite number."""
    if seconds is None:
        return
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise ValueError(
            f"gil_switch_interval must be a positive number of seconds or None (leave the "
            f"interpreter's interval alone), got {seconds!r}"
        )


class SwitchInterval:
    """Counted holds on a shorter GIL switch interval; see [Note: GIL switch interval]."""

    _lock: threading.Lock  # holds and releases may come from different threads
    _num_holds: int
    _found: float | None  # the interval before the first hold; None: no hold
    _set: float | None  # the interval the holds set; None: they did not change it

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_holds = 0
        self._found = self._set = None

    @property
    def num_holds(self) -> int:
        return self._num_holds

    def hold(self, seconds: float) -> None:
        """Shortens the interval to ``seconds`` if it is longer, until the matching
        :meth:`release`."""
        check_switch_interval(seconds)
        with self._lock:
            current = sys.getswitchinterval()
            if self._num_holds == 0:
                self._found, self._set = current, None
            if seconds < current:
                sys.setswitchinterval(seconds)
                self._set = sys.getswitchinterval()  # as the interpreter rounded it
            self._num_holds += 1

    def release(self) -> None:
        """Ends one hold; the last puts back the interval found by the first, unless the
        interval is no longer the one the holds set."""
        with self._lock:
            if self._num_holds == 0:
                raise AssertionError("expected a hold on the switch interval to release")
            self._num_holds -= 1
            if self._num_holds:
                return
            if self._set is not None and sys.getswitchinterval() == self._set:
                sys.setswitchinterval(self._found)
            self._found = self._set = None


# One per process: the interval is the interpreter's.
switch_interval = SwitchInterval()
