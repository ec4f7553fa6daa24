"""Profiler labels: present under a profiler, nothing (no torch op) without one."""

from __future__ import annotations

import contextlib

import torch

from offload import phase


def test_a_phase_is_a_profiler_label_only_under_a_profiler() -> None:
    assert isinstance(phase("zero_shard::probe"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("zero_shard::probe"):
            torch.ones(3).sum()
    assert any(event.name == "zero_shard::probe" for event in prof.events())
