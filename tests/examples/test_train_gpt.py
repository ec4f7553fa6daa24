"""The README's main job, shortened: zero-shard follows plain AdamW's loss curve, trains the same
on two ranks as on one, and resumes from its checkpoints exactly (after a crash too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_gpt  # noqa: E402

COMMON = ["--device", "cpu", "--preset", "tiny", "--quiet", "--seed", "3"]
NUM_STEPS = 30
# Per-step loss tolerance against plain AdamW, one process, fp32. zero-shard's AdamW arithmetic
# equals torch's fused AdamW (tests/optimizers); what differs is the order of the sums in the
# global grad norm (clipping), a few ulps per step that training amplifies slowly: measured
# up to ~2e-6 relative over these 30 steps, asserted at 1e-4.
LOSS_RTOL = 1e-4
# Two ranks against one: the grads are averaged over ranks in another order (~1e-7 relative per
# step, measured ~1e-5 after 30 steps).
RANKS_RTOL = 1e-3
EXACT = {"atol": 0.0, "rtol": 0.0}
# Weights and Adam state after 20 steps at one rank against two, from the same checkpoint: the
# rounding differences of the grad averages pass through Adam's m / sqrt(v), which turns them
# into differences of up to lr (3e-3) per step in elements whose grads are near zero. Measured:
# 3e-5 at most.
ONE_RANK_TOL = {"atol": 3e-4, "rtol": 1e-3}


def run_in_process(tmp_path: Path, *flags: str) -> dict:
    return train_gpt.main([*COMMON, "--steps", str(NUM_STEPS), "--out", str(tmp_path), *flags])


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("curves")
    runs = {"adamw": run_in_process(out / "adamw", "--optimizer", "adamw")}
    for fraction in ("0", "0.5", "1"):
        runs[fraction] = run_in_process(out / fraction, "--offload-fraction", fraction)
    return runs


def losses(run: dict) -> list[float]:
    return [record["loss"] for record in run["steps"]]


def test_loss_goes_down(curves: dict[str, dict]) -> None:
    for run in curves.values():
        summary = run["summary"]
        assert summary["last_loss"] < summary["first_loss"] - 1.0
        assert summary["val_loss_end"] < summary["val_loss_start"] - 1.0


@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
def test_follows_plain_adamw(curves: dict[str, dict], fraction: str) -> None:
    reference = losses(curves["adamw"])
    assert len(reference) == NUM_STEPS
    for step, (got, want) in enumerate(zip(losses(curves[fraction]), reference, strict=True)):
        assert got == pytest.approx(want, rel=LOSS_RTOL), f"step {step + 1}, fraction {fraction}"


def test_writes_log_and_plot(curves: dict[str, dict], tmp_path: Path) -> None:
    run = run_in_process(tmp_path, "--steps", "3", "--micro-batches", "2")
    log = json.loads((tmp_path / "log.json").read_text())
    assert [record["step"] for record in log["steps"]] == [1, 2, 3]
    assert log["summary"] == run["summary"]
    for phase in ("forward", "backward", "step", "other"):
        assert all(record[f"{phase}_ms"] >= 0 for record in log["steps"])
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def torchrun(
    tmp_path: Path, *flags: str, restarts: int = 0, check: bool = True
) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node=2", f"--max-restarts={restarts}",
        str(EXAMPLES / "train_gpt.py"), *COMMON, "--out", str(tmp_path / "out"), *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def final_checkpoint(folder: Path) -> dict:
    dcp_to_torch_save(folder / "latest", folder / "full.pt")
    return torch.load(folder / "full.pt", weights_only=False)


def test_two_ranks_crash_and_resume(curves: dict[str, dict], tmp_path: Path) -> None:
    """Two ranks train like one; a rank killed at step 17 restarts (torchrun) from the step-10
    checkpoint and ends bit-identical to the uninterrupted run; the same crash without a restart,
    resumed by one process, ends within rounding of it."""
    flags = ["--steps", str(NUM_STEPS), "--checkpoint-every", "10", "--resume"]
    torchrun(tmp_path / "straight", *flags, "--checkpoint-dir", str(tmp_path / "straight"))
    log = json.loads((tmp_path / "straight" / "out" / "log.json").read_text())
    assert log["config"]["world_size"] == 2
    for step, (got, want) in enumerate(zip(losses(log), losses(curves["0.5"]), strict=True)):
        assert got == pytest.approx(want, rel=RANKS_RTOL), f"step {step + 1}"

    crash = ["--simulate-crash", "17"]
    torchrun(tmp_path, *flags, *crash, "--checkpoint-dir", str(tmp_path / "restarted"), restarts=1)
    crashed = torchrun(
        tmp_path, *flags, *crash, "--checkpoint-dir", str(tmp_path / "resumed"), check=False
    )
    assert crashed.returncode != 0 and "simulated crash at step 17" in crashed.stderr
    train_gpt.main([*COMMON, *flags, "--checkpoint-dir", str(tmp_path / "resumed"),
                    "--out", str(tmp_path / "resumed_out")])  # fmt: skip

    straight = final_checkpoint(tmp_path / "straight")
    for name, tol in (("restarted", EXACT), ("resumed", ONE_RANK_TOL)):
        other = final_checkpoint(tmp_path / name)
        for key, want in straight["model"].items():
            torch.testing.assert_close(other["model"][key], want, **tol, msg=f"{name}: {key}")
        for fqn, state in straight["optim"]["state"].items():
            torch.testing.assert_close(other["optim"]["state"][fqn], state, **tol,
                                       msg=f"{name}: {fqn}")  # fmt: skip


def test_stop_after_and_resume_equals_the_straight_run(
    curves: dict[str, dict], tmp_path: Path
) -> None:
    """``--stop-after`` ends a run early, checkpointed, on the schedule of ``--steps``; the
    resumed run's losses are the uninterrupted run's, bit for bit."""
    flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
    first = run_in_process(tmp_path / "first", *flags, "--stop-after", "10")
    assert [record["step"] for record in first["steps"]] == list(range(1, 11))
    resumed = run_in_process(tmp_path / "resumed", *flags)
    assert losses(resumed) == losses(curves["0.5"])
    # Its times are its own steps' after its first (step 11), not the first run's.
    own = [record["wall_ms"] for record in resumed["steps"] if record["step"] > 11]
    assert resumed["summary"]["iteration_ms"] == pytest.approx(sum(own) / len(own))
    with pytest.raises(SystemExit):
        run_in_process(tmp_path / "bad", "--stop-after", str(NUM_STEPS + 1))


def test_tensor_parallel_plans_follow_one_rank_and_resume_across_layouts(
    curves: dict[str, dict], tmp_path: Path
) -> None:
    """``--tp 2`` on two ranks (tensor parallel, dp 1 x tp 2) follows one process's curve in
    both of ``gpt.parallelize``'s plans: torch's sequence-parallel one for steps 1-10, the
    default one (``ColumnParallelLinear`` / ``RowParallelLinear`` on local tensors, everything
    else plain and replicated over tp) resumed from its checkpoint for steps 11-20, and one
    process without tensor parallelism resumed from that for the rest."""
    flags = ["--steps", str(NUM_STEPS), "--checkpoint-dir", str(tmp_path / "ckpt")]
    torchrun(tmp_path / "sp", *flags, "--tp", "2", "--sequence-parallel", "--stop-after", "10")
    torchrun(tmp_path / "plain", *flags, "--tp", "2", "--resume", "--stop-after", "20")
    runs = {}
    for name in ("sp", "plain"):
        runs[name] = json.loads((tmp_path / name / "out" / "log.json").read_text())
        assert runs[name]["config"]["tp"] == 2
    assert runs["sp"]["config"]["sequence_parallel"]
    assert not runs["plain"]["config"]["sequence_parallel"]
    runs["resumed"] = train_gpt.main(
        [*COMMON, *flags, "--resume", "--out", str(tmp_path / "resumed")]
    )
    # A resumed run's log holds the steps before its checkpoint too.
    reference = losses(curves["0.5"])
    for name, last in (("sp", 10), ("plain", 20), ("resumed", NUM_STEPS)):
        assert [record["step"] for record in runs[name]["steps"]] == list(range(1, last + 1))
        pairs = zip(losses(runs[name]), reference[:last], strict=True)
        for step, (got, want) in enumerate(pairs, start=1):
            assert got == pytest.approx(want, rel=RANKS_RTOL), f"{name}, step {step}"


def test_bf16_accumulation_and_async_checkpoint(tmp_path: Path) -> None:
    """bf16 params with two micro-batches per rank, checkpoints written in the background, and
    a resume at another world size that refuses another run's checkpoint."""
    flags = ["--steps", "4", "--dtype", "bf16", "--micro-batches", "2", "--async-checkpoint"]
    folder = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    torchrun(tmp_path, *flags, *folder)
    assert (tmp_path / "ckpt" / "latest" / ".zero_shard_complete").exists()
    with pytest.raises(ValueError, match="is of another run"):
        train_gpt.main([*COMMON, *flags, *folder, "--resume", "--seed", "4",
                        "--out", str(tmp_path / "other")])  # fmt: skip


def test_compiled_blocks_follow_the_eager_run(tmp_path: Path) -> None:
    """``--compile`` (each block compiled; ``aot_eager``, which runs the same aten ops as eager,
    so the CPU needs no C++ compiler) trains along the eager run, at fraction 0.5 with the
    gathers overlapping the forward."""
    flags = [*COMMON, "--steps", "6", "--offload-fraction", "0.5"]
    eager = train_gpt.main([*flags, "--out", str(tmp_path / "eager")])
    counters.clear()
    compiled = train_gpt.main([*flags, "--compile", "aot_eager", "--out", str(tmp_path / "comp")])
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    for step, (got, want) in enumerate(zip(losses(compiled), losses(eager), strict=True)):
        assert got == pytest.approx(want, rel=LOSS_RTOL), f"step {step + 1}"


def test_fp32_params_follow_plain_adamw_under_bf16_autocast(tmp_path: Path) -> None:
    """``--fp32-params``: zero-shard on plain AdamW's recipe (fp32 params, bf16 autocast) follows
    its curve. bf16 autocast rounds each matmul's inputs, which turns the ulps between the two
    AdamWs into ~4e-4 relative by step 8 (measured), asserted at 2e-3."""
    flags = [*COMMON, "--steps", "10", "--dtype", "bf16"]
    plain = train_gpt.main([*flags, "--optimizer", "adamw", "--out", str(tmp_path / "plain")])
    ours = train_gpt.main([*flags, "--fp32-params", "--out", str(tmp_path / "ours")])
    assert ours["config"]["fp32_params"]
    for step, (got, want) in enumerate(zip(losses(ours), losses(plain), strict=True)):
        assert got == pytest.approx(want, rel=2e-3), f"step {step + 1}"


def test_speculative_cpu_steps_give_the_run_without_them(
    curves: dict[str, dict], tmp_path: Path
) -> None:
    """--speculative on (and auto) at fraction 1 with a buffer per chunk: the losses of the run
    without it (off, the default), to the bit, and the summary counts the speculated steps that
    stood and those redone (a clip at 1.0 scales the grads of the first steps; at 100 none)."""
    # Buckets and chunks small enough that most chunks lie within buckets reduced before the
    # last (whose grads are copied to the host as backward goes on).
    flags = ("--offload-fraction", "1", "--host-staging", "per_chunk", "--chunk-numel", "4096",
             "--bucket-mb", "0.25", "--steps", "10", "--eval-every", "5")  # fmt: skip
    for clip, outcome, mode in (("1.0", "redone", "on"), ("100", "stood", "auto")):
        plain = run_in_process(tmp_path / f"plain{clip}", *flags, "--clip", clip)
        assert "speculation" not in plain["summary"]
        speculative = run_in_process(tmp_path / f"spec{clip}", *flags, "--clip", clip,
                                     "--speculative", mode)  # fmt: skip
        assert losses(speculative) == losses(plain)
        counts = speculative["summary"]["speculation"]  # (those the step found started)
        assert counts[outcome] > 0, (clip, counts)
