"""How many CPU threads one rank's CPU optimizer may use."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ._host_memory import local_world_size

__all__ = ["ThreadBudget", "intra_op_threads", "resolve_thread_budget", "usable_cores"]

logger = logging.getLogger("zero_shard")
_torchrun_warned = False


@dataclass(frozen=True)
class ThreadBudget:
    """The CPU thread count for one rank's CPU optimizer, and where it came from.

    Attributes:
        num_threads: the thread count.
        source: where it came from: ``"argument"``, ``"OMP_NUM_THREADS"``, or ``"cores / local
            ranks"`` (``"cores / local ranks - N"`` where ``N`` cores are kept free).
    """

    num_threads: int
    source: str  # "argument", "OMP_NUM_THREADS", or "cores / local ranks"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return max(os.cpu_count() or 1, 1)


def resolve_thread_budget(requested: int | None = None, *, keep_free: int = 0) -> ThreadBudget:
    """Chooses the CPU optimizer's thread count for this rank, logs it and returns it.

    Order: ``requested`` if given; else ``OMP_NUM_THREADS`` if the user set it (torchrun's own
    ``OMP_NUM_THREADS=1`` does not count: it would leave the CPU optimizer on one core); else the
    usable cores divided by the ranks on this host (``LOCAL_WORLD_SIZE``), less ``keep_free``, at
    least 1.

    Args:
        requested: an explicit thread count, or ``None`` to choose one.
        keep_free: cores of this rank's share left to other threads when the count is chosen
            here: those that queue the model's forward and backward, where the CPU step runs
            at the same time (a delayed update).
    """
    global _torchrun_warned
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_threads must be a positive integer or None, got {requested!r}")
        budget = ThreadBudget(requested, "argument")
    else:
        omp = os.environ.get("OMP_NUM_THREADS", "")
        from_torchrun = omp == "1" and "TORCHELASTIC_RUN_ID" in os.environ
        if omp.isdigit() and int(omp) >= 1 and not from_torchrun:
            budget = ThreadBudget(int(omp), "OMP_NUM_THREADS")
        else:
            share = usable_cores() // local_world_size()
            source = "cores / local ranks" + (f" - {keep_free}" if keep_free else "")
            budget = ThreadBudget(max(share - keep_free, 1), source)
            if from_torchrun and budget.num_threads != 1 and not _torchrun_warned:
                _torchrun_warned = True
                warnings.warn(
                    f"torchrun set OMP_NUM_THREADS=1; zero-shard's CPU optimizer uses "
                    f"{budget.num_threads} threads on this rank instead ({usable_cores()} usable "
                    f"cores / {local_world_size()} local ranks"
                    f"{f', {keep_free} kept free' if keep_free else ''}). Pass num_threads to "
                    "choose.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    logger.info(
        "zero-shard: CPU optimizer threads per rank = %d (%s)", budget.num_threads, budget.source
    )
    return budget


@contextlib.contextmanager
def intra_op_threads(num_threads: int | None) -> Iterator[None]:
    """Runs the block's torch CPU kernels on ``num_threads`` intra-op threads, then restores the
    count there was (torchrun's one, say, for the rest of the loop). ``None`` leaves the count as
    it is. torch's count is the process's, not the calling thread's: CPU kernels that other
    threads run meanwhile get it too."""
    before = torch.get_num_threads()
    if num_threads is None or num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
