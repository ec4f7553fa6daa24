"""Soak: the README's main job for 2000 steps on the CPU, stopped and resumed from its checkpoint
every 100 steps, each 100-step segment in fresh processes at a world size (1-3) and an offload
fraction (0-1) drawn from a seeded generator. It must follow the same job run without a stop
(one rank) and plain torch AdamW, skip no step, and not grow its host RSS.

What "no drift" can mean over 2000 steps: rounding differences (grads averaged over another
number of ranks, the CPU kernel instead of torch's on another share of the elements) grow about
tenfold every 100 steps here, until, from step ~500 on, two correct runs differ per step by as much
as the loss's own noise (measured: the uninterrupted run against plain AdamW, up to 3% per step,
and its final weights 33% apart from those of the same run on two ranks). So the per-step
comparison is tight only while the differences are small (the first 300 steps); after that the
checks are on what does not depend on the trajectory's details: the mean loss of every 100
steps, the final validation loss, and a distance of the final weights no larger than that
between two uninterrupted correct runs. A resume that loses or misplaces state shows up in all
of them.

Marked slow (13-16 minutes on 2 cores), so outside the default run; the run and its figures
are recorded in docs/reliability.md::

    python -m pytest -m slow tests/examples/test_soak.py -s
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * 3600)]

ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 2000
SEGMENT_STEPS = 100
# The first seed from 2026 on whose plan has each world size at least four times and both ends
# of the fraction (drawn: 6 segments on 1 rank, 8 on 2, 6 on 3; fraction 0 five times, 1 three).
PLAN_SEED = 2027
# Batch 12 divides over 1, 2 and 3 ranks.
FLAGS = ["--device", "cpu", "--preset", "tiny", "--quiet", "--seed", "3", "--batch-size", "12",
         "--steps", str(NUM_STEPS)]  # fmt: skip
REFERENCE_FRACTION = 0.5

# The figures measured are of the plan of PLAN_SEED; those of the uninterrupted runs do not
# depend on it (a pilot with another plan measured alike).
# Per-step loss against the uninterrupted run while rounding differences are still small
# (measured: 5.7e-5 at most; plain AdamW against the uninterrupted run 5.3e-4, the two-rank run
# 2.2e-4; the tests of short runs assert 1e-3 for two ranks against one).
EARLY_STEPS = 300
EARLY_LOSS_RTOL = 1e-3
# Over the whole run, per step: a resume that blows the loss up (measured: 2.3%; plain AdamW
# against the uninterrupted run 3.1%, the two-rank run 4.1%).
LOSS_RTOL = 0.1
# Mean loss of each 100-step window (measured: 1.35e-3 against the uninterrupted run and against
# plain AdamW; the uninterrupted run against plain AdamW 1.5e-3, the two-rank run 1.7e-3).
WINDOW_LOSS_RTOL = 5e-3
# Final validation loss (measured: 3.9e-3 against the uninterrupted run, 1.4e-3 against plain
# AdamW; the two-rank run against the one-rank run 8.6e-3).
VAL_LOSS_RTOL = 2e-2
# The final weights' distance from the uninterrupted one-rank run's, as a multiple of the
# distance between that run and the same run on two ranks (measured: 0.26 and 0.33).
WEIGHTS_DISTANCE_FACTOR = 2.0
# Host RSS after warm-up. A leak only grows it, so each check bounds growth alone, with a margin
# above what correct runs show. glibc gives threads malloc arenas of their own, and how much of
# them stays resident varies from run to run: four identical 100-step runs held 456-487 MiB
# (median after warm-up), 7% apart; with one arena, 432-442 MiB. So the training processes get
# one arena, unless the environment sets MALLOC_ARENA_MAX itself.
MALLOC_ARENA_MAX = "1"
# Each segment (fresh processes) against the first segment of its world size. Identical
# processes differ by up to 7% either way (above; and one run of this soak on a loaded machine
# had a segment 6.8% below the first of its world size), so a segment may sit 7% above the
# first with no leak: the bound is 10%. A fresh process leaks little in 100 steps; what this
# catches is memory that grows with what the checkpoints carry over.
SEGMENT_RSS_GROWTH = 0.10
# The uninterrupted runs, one process each: the last 100 steps against steps 901-1000. A leak
# grows with the steps, while the first half holds the heap's settling, in jumps of a few MiB at
# steps that differ from run to run (measured in three runs: +1% to +6% from the first 100 steps
# to step 1000, on one rank, on two, and with plain AdamW alike; then +0.1% to +2.6% over the
# last 1000; the bound is about twice that). A leak of more than ~20 KB a step fails it.
UNINTERRUPTED_RSS_GROWTH = 0.05
RSS_WARMUP_STEPS = 10  # as examples/train_gpt.py's: a process's first steps are not counted


@dataclass(frozen=True)
class Segment:
    index: int
    last_step: int  # it trains steps last_step - SEGMENT_STEPS + 1 to last_step
    world_size: int
    fraction: float


@dataclass
class Soak:
    plan: list[Segment]
    segment_logs: list[dict]  # each segment's log.json; the steps carry over the checkpoints
    reference_log: dict  # uninterrupted, one rank, fraction REFERENCE_FRACTION
    two_ranks_log: dict  # the same on two ranks
    adamw_log: dict  # uninterrupted, one rank, plain torch AdamW
    segmented: dict  # the final checkpoints, as torch.save dicts
    reference: dict
    two_ranks: dict
    minutes: float


def draw_plan(seed: int) -> list[Segment]:
    """World sizes 1-3 uniformly; fractions uniform in [0, 1], but the two ends (nothing on
    the CPU, nothing on the accelerator) a quarter of the time each."""
    rng = random.Random(seed)
    plan = []
    for index, last_step in enumerate(range(SEGMENT_STEPS, NUM_STEPS + 1, SEGMENT_STEPS)):
        world_size = rng.randint(1, 3)
        fraction = rng.choice([0.0, 1.0, round(rng.random(), 3), round(rng.random(), 3)])
        plan.append(Segment(index, last_step, world_size, fraction))
    return plan


def launch(world_size: int, out: Path, *flags: str) -> dict:
    """Runs examples/train_gpt.py in fresh processes (plain python for one rank, torchrun for
    more); returns its JSON log."""
    script = str(ROOT / "examples" / "train_gpt.py")
    if world_size == 1:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world_size}", script]  # fmt: skip
    command += [*FLAGS, "--out", str(out), *flags]
    env = {"MALLOC_ARENA_MAX": MALLOC_ARENA_MAX, **os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads((out / "log.json").read_text())


def final_checkpoint(folder: Path) -> dict:
    dcp_to_torch_save(folder / "latest", folder / "full.pt")
    return torch.load(folder / "full.pt", weights_only=False)


def run_soak(tmp_path: Path) -> Soak:
    """The segmented run, then the uninterrupted runs (these save every 100 steps too, so that
    their RSS covers 20 saves in one process)."""
    started = time.perf_counter()
    plan = draw_plan(PLAN_SEED)
    segment_logs = []
    for segment in plan:
        flags = ["--offload-fraction", str(segment.fraction),
                 "--checkpoint-dir", str(tmp_path / "segmented"), "--resume",
                 "--stop-after", str(segment.last_step)]  # fmt: skip
        out = tmp_path / f"segment_{segment.index:02d}"
        segment_logs.append(launch(segment.world_size, out, *flags))
    uninterrupted = {}
    for name, world_size in (("reference", 1), ("two_ranks", 2)):
        flags = ["--offload-fraction", str(REFERENCE_FRACTION),
                 "--checkpoint-dir", str(tmp_path / f"{name}_ckpt"),
                 "--checkpoint-every", str(SEGMENT_STEPS)]  # fmt: skip
        uninterrupted[name] = launch(world_size, tmp_path / name, *flags)
    adamw_log = launch(1, tmp_path / "adamw", "--optimizer", "adamw")
    return Soak(
        plan=plan,
        segment_logs=segment_logs,
        reference_log=uninterrupted["reference"],
        two_ranks_log=uninterrupted["two_ranks"],
        adamw_log=adamw_log,
        segmented=final_checkpoint(tmp_path / "segmented"),
        reference=final_checkpoint(tmp_path / "reference_ckpt"),
        two_ranks=final_checkpoint(tmp_path / "two_ranks_ckpt"),
        minutes=(time.perf_counter() - started) / 60,
    )


# ---------------------------------------------------------------------------------------------
# Figures


def losses(log: dict) -> list[float]:
    return [record["loss"] for record in log["steps"]]


def relative_gaps(got: list[float], want: list[float]) -> list[float]:
    return [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]


def window_means(values: list[float]) -> list[float]:
    starts = range(0, len(values), SEGMENT_STEPS)
    return [statistics.fmean(values[i : i + SEGMENT_STEPS]) for i in starts]


def weights(checkpoint: dict) -> list[torch.Tensor]:
    return [checkpoint["model"][fqn] for fqn in sorted(checkpoint["model"])]


def relative_distance(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """||got - want|| / ||want||, over all the tensors as one vector, in float64."""
    pairs = list(zip(got, want, strict=True))
    diff = sum(float((g.double() - w.double()).square().sum()) for g, w in pairs)
    return math.sqrt(diff / sum(float(w.double().square().sum()) for w in want))


def loss_figures(got: dict, want: dict) -> dict[str, float]:
    gaps = relative_gaps(losses(got), losses(want))
    return {
        "early_max": max(gaps[:EARLY_STEPS]),
        "max": max(gaps),
        "max_at_step": gaps.index(max(gaps)) + 1,
        # the first step of each segment but the first: a resume that lost state jumps there
        "first_after_resume_max": max(gaps[SEGMENT_STEPS::SEGMENT_STEPS]),
        "window_mean_max": max(
            relative_gaps(window_means(losses(got)), window_means(losses(want)))
        ),
        "val_loss_end": relative_gaps(
            [got["summary"]["val_loss_end"]], [want["summary"]["val_loss_end"]]
        )[0],
    }


def segment_rows(soak: Soak) -> list[dict]:
    """Per segment: its plan, ms per step (median of its steps), steps skipped, and host RSS
    (max over its ranks): the median and the max over its steps after warm-up, and at its end
    (after its checkpoint)."""
    all_steps = soak.segment_logs[-1]["steps"]
    rows = []
    for segment, log in zip(soak.plan, soak.segment_logs, strict=True):
        own = all_steps[segment.last_step - SEGMENT_STEPS : segment.last_step]
        memory = log["summary"]["memory"]
        rows.append({
            "segment": segment.index,
            "steps": f"{own[0]['step']}-{own[-1]['step']}",
            "world_size": segment.world_size,
            "fraction": segment.fraction,
            "step_ms": statistics.median(record["wall_ms"] for record in own),
            "skipped": sum(not math.isfinite(record["grad_norm"]) for record in own),
            "rss_steady": memory["host_rss_steady_bytes"],
            "rss_max": memory["host_rss_max_bytes"],
            "rss_end": memory["host_rss_bytes"],
        })  # fmt: skip
    return rows


def against_first_of_world_size(rows: list[dict], key: str) -> list[float]:
    """Each row's ``key`` relative to the first row of its world size, minus 1."""
    first: dict[int, int] = {}
    return [row[key] / first.setdefault(row["world_size"], row[key]) - 1.0 for row in rows]


def rss_windows(log: dict) -> list[float]:
    """An uninterrupted run's host RSS (rank 0's), the median of every 100 steps, the first
    100 without warm-up."""
    rss = [record["host_rss_bytes"] for record in log["steps"]]
    return [
        statistics.median(rss[max(i, RSS_WARMUP_STEPS) : i + SEGMENT_STEPS])
        for i in range(0, len(rss), SEGMENT_STEPS)
    ]


def print_report(soak: Soak) -> None:
    mib = 2**20
    rows = segment_rows(soak)
    steady = against_first_of_world_size(rows, "rss_steady")
    peak = against_first_of_world_size(rows, "rss_max")
    print(f"\nsoak: {NUM_STEPS} steps in {len(rows)} segments + 3 uninterrupted runs: "
          f"{soak.minutes:.1f} min")  # fmt: skip
    print("segment  steps      ranks fraction  ms/step skipped  host RSS MiB: median  max    "
          "end   median / max against the first of its world size")  # fmt: skip
    for row, s, p in zip(rows, steady, peak, strict=True):
        print(f"{row['segment']:>7}  {row['steps']:>9}  {row['world_size']:>5} "
              f"{row['fraction']:>8.3f}  {row['step_ms']:>7.1f} {row['skipped']:>7}  "
              f"{row['rss_steady'] / mib:>19.1f} {row['rss_max'] / mib:>6.1f} "
              f"{row['rss_end'] / mib:>6.1f}   {s:+.2%} / {p:+.2%}")  # fmt: skip
    for name in ("reference_log", "two_ranks_log", "adamw_log"):
        windows = " ".join(f"{w / mib:.1f}" for w in rss_windows(getattr(soak, name)))
        print(f"{name}: rank 0's host RSS MiB, median of every 100 steps: {windows}")
    comparisons = {
        "segmented vs uninterrupted": (soak.segment_logs[-1], soak.reference_log),
        "segmented vs plain AdamW": (soak.segment_logs[-1], soak.adamw_log),
        "uninterrupted vs plain AdamW": (soak.reference_log, soak.adamw_log),
        "two ranks vs one, uninterrupted": (soak.two_ranks_log, soak.reference_log),
    }
    for label, (got, want) in comparisons.items():
        figures = loss_figures(got, want)
        print(f"loss, {label}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()))
    print(
        "final weights, relative L2 distance from the uninterrupted run's: segmented "
        f"{relative_distance(weights(soak.segmented), weights(soak.reference)):.3g}, two ranks "
        f"{relative_distance(weights(soak.two_ranks), weights(soak.reference)):.3g}"
    )


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Soak:
    result = run_soak(tmp_path_factory.mktemp("soak"))
    print_report(result)
    return result


def test_the_plan_covers_every_world_size_and_both_ends_of_the_fraction() -> None:
    plan = draw_plan(PLAN_SEED)
    assert {segment.world_size for segment in plan} == {1, 2, 3}
    assert {0.0, 1.0} <= {segment.fraction for segment in plan}
    assert any(0.0 < segment.fraction < 1.0 for segment in plan)


def test_every_step_is_taken_once_and_none_is_skipped(soak: Soak) -> None:
    for log in (soak.segment_logs[-1], soak.reference_log, soak.two_ranks_log, soak.adamw_log):
        assert [record["step"] for record in log["steps"]] == list(range(1, NUM_STEPS + 1))
        assert log["summary"]["num_skipped"] == 0
    for segment, log in zip(soak.plan, soak.segment_logs, strict=True):
        assert log["config"]["world_size"] == segment.world_size
        assert log["config"]["offload_fraction"] == segment.fraction
        assert log["steps"][-1]["step"] == segment.last_step


def test_follows_the_uninterrupted_run(soak: Soak) -> None:
    figures = loss_figures(soak.segment_logs[-1], soak.reference_log)
    assert figures["early_max"] <= EARLY_LOSS_RTOL, figures
    assert figures["max"] <= LOSS_RTOL, figures
    assert figures["window_mean_max"] <= WINDOW_LOSS_RTOL, figures
    assert figures["val_loss_end"] <= VAL_LOSS_RTOL, figures
    segmented = relative_distance(weights(soak.segmented), weights(soak.reference))
    two_ranks = relative_distance(weights(soak.two_ranks), weights(soak.reference))
    assert segmented <= WEIGHTS_DISTANCE_FACTOR * two_ranks, (segmented, two_ranks)


def test_follows_plain_adamw(soak: Soak) -> None:
    figures = loss_figures(soak.segment_logs[-1], soak.adamw_log)
    assert figures["window_mean_max"] <= WINDOW_LOSS_RTOL, figures
    assert figures["val_loss_end"] <= VAL_LOSS_RTOL, figures


def test_host_rss_does_not_grow(soak: Soak) -> None:
    rows = segment_rows(soak)
    for key in ("rss_steady", "rss_max"):
        for row, growth in zip(rows, against_first_of_world_size(rows, key), strict=True):
            assert growth <= SEGMENT_RSS_GROWTH, (key, f"{growth:+.2%}", row)  # less is no leak
    for log in (soak.reference_log, soak.two_ranks_log):
        windows = rss_windows(log)
        middle = windows[len(windows) // 2 - 1]
        assert windows[-1] <= (1 + UNINTERRUPTED_RSS_GROWTH) * middle, windows
