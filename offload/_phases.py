"""Profiler labels for the phases of a step, free when no profiler runs."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["phase"]


def phase(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler runs, else nothing.

    Entering and leaving a label are torch ops, and every torch op releases the GIL. On the host
    step's worker and copier threads each release can mean waiting for the thread that queues
    the model's forward meanwhile: a chunk's labels cost more there than its bookkeeping.
    """
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()
