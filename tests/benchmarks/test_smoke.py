"""The benchmarks' CPU smoke modes still run and write the results.json keys the docs read.

Each script runs as a user runs it (a subprocess from the repository root), at its smallest size.
The GPU runs themselves are recorded in docs/benchmarks/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_gpt  # noqa: E402
import offload_peers  # noqa: E402  (on the path through e2e_gpt)
import peak_blocks  # noqa: E402
from _common import Clock, median_ms  # noqa: E402


def run_script(script: str, *flags: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, str(ROOT / "benchmarks" / script), *flags]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_clock_on_the_cpu_is_the_host_clock() -> None:
    clock = Clock(torch.device("cpu"))
    start = clock.mark()
    end = clock.mark()
    clock.synchronize()
    assert 0.0 <= clock.ms(start, end) < 1e3
    assert median_ms(lambda: None, 3) >= 0.0


def test_offload_step_quick(tmp_path: Path) -> None:
    run_script("offload_step.py", "--device", "cpu", "--quick", "--fractions", "0.5,1",
               "--out", str(tmp_path))  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    (workload,) = report["workloads"]
    rows = {(r["system"], r["fraction"]): r for r in workload["results"]}
    for key in (("cpu_fused_adamw", 1.0), ("zero_shard", 0.5), ("zero_shard", 1.0),
                ("zero_shard_torch_kernel", 1.0)):  # fmt: skip
        assert rows[key]["error"] is None and rows[key]["step_ms"] > 0, rows[key]
    assert rows[("gpu_fused_adamw", 0.0)]["skipped"]  # CUDA only
    assert [t["verdict"] for t in workload["targets"]][2] == "n/a"  # no GPU floor here


def test_host_step_timeline_smoke(tmp_path: Path) -> None:
    run_script("host_step_timeline.py", "--out", str(tmp_path), "--map-region-mib", "1", "--",
               "--device", "cpu", "--preset", "tiny", "--steps", "4", "--offload-fraction", "1")  # fmt: skip
    report = json.loads((tmp_path / "timeline.json").read_text())
    assert report["steps"], report  # steps 1 and 2 of 4: each between two others
    for row in report["steps"]:
        assert row["num_chunks"] >= 1 and row["kernels_ms"] > 0, row
        assert row["cpu_wall_ms"] >= row["kernels_ms"] > 0, row
    assert len(report["isolated_kernel_ms"]) == 3 and min(report["torch_floor_ms"]) > 0
    assert min(report["torch_on_run_memory_ms"]) > 0 and min(report["torch_on_copies_ms"]) > 0
    gbps = report["memory_map"]["gbps"]  # 3 passes over the run's 1 MiB regions, then as many fresh
    assert len(gbps["run"]) == len(gbps["fresh"]) == 3 and gbps["run"][0], gbps
    assert all(len(p) == len(gbps["run"][0]) and min(p) > 0 for p in gbps["run"] + gbps["fresh"])


def test_host_step_timeline_samples_the_floor_between_steps(tmp_path: Path) -> None:
    run_script("host_step_timeline.py", "--floor-every", "2", "--out", str(tmp_path), "--",
               "--device", "cpu", "--preset", "tiny", "--steps", "6", "--offload-fraction", "1")  # fmt: skip
    report = json.loads((tmp_path / "timeline.json").read_text())
    assert [j for j, _ in report["interleaved_floor_ms"]] == [2, 4]  # before steps 2 and 4
    # (the sampler's tensors and state were built before step 1, in row 0, not a sample)
    assert min(ms for _, ms in report["interleaved_floor_ms"]) > 0
    interleaved = report["interleaved"]
    assert [row["step"] for row in interleaved["rows"]] == [2, 4]  # rows 1 and 3 hold a sample
    assert interleaved["target"] == 1.10 and interleaved["ratio_median"] > 0
    assert len(report["torch_floor_ms"]) == 3  # after the run, on the sampler's tensors


def test_interleaved_rows_pair_each_row_with_the_samples_around_it() -> None:
    from host_step_timeline import interleaved_rows

    rows = [{"step": k, "iteration_ms": 300.0 + k, "forward_ms": 30.0, "backward_ms": 60.0}
            for k in range(1, 7)]  # fmt: skip
    samples = [(2, 200.0), (4, 240.0), (6, 100.0)]  # in rows 1, 3 and 5
    exact = interleaved_rows(rows, samples, delayed=False)
    assert [row["step"] for row in exact["rows"]] == [2, 4, 6]
    assert [row["floor_ms"] for row in exact["rows"]] == [[200.0, 240.0], [240.0, 100.0], [100.0]]
    assert [row["bound_ms"] for row in exact["rows"]] == [280.0, 230.0, 160.0]
    assert exact["ratio_median"] == pytest.approx(304.0 / 230.0)
    assert exact["ratio_max"] == pytest.approx(306.0 / 160.0)
    # A delayed update's row after a sample is not steady either (the sample waited for its
    # CPU step), nor row 1 (the example settles the first step).
    delayed = interleaved_rows(rows, [(3, 200.0), (6, 100.0)], delayed=True)
    assert [row["step"] for row in delayed["rows"]] == [4]  # rows 1, 2, 3, 5 and 6 are not
    assert delayed["rows"][0]["floor_ms"] == [200.0, 100.0]
    assert delayed["rows"][0]["bound_ms"] == 150.0  # max(fwd + bwd = 90, floor 150)
    assert delayed["target"] == 1.15
    late = interleaved_rows(rows, [(2, 50.0), (5, 60.0)], delayed=True)
    assert [row["step"] for row in late["rows"]] == [3, 6]
    assert [row["bound_ms"] for row in late["rows"]] == [90.0, 90.0]  # fwd + bwd above floor
    assert interleaved_rows(rows, [], delayed=False)["ratio_median"] is None


def test_checkpoint_save_smoke(tmp_path: Path) -> None:
    run_script("checkpoint_save.py", "--smoke", "--reps", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "results.json").read_text())
    assert {"date", "device", "world_size", "torch", "args", "params", "disk"} <= report.keys()
    for name in ("save", "async_save", "load", "state_dict"):
        assert "seconds_median" in report["results"][name], report["results"][name]


def test_zero_step_smoke(tmp_path: Path) -> None:
    run_script("zero_step.py", "--smoke", "--buckets-mb", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "results.json").read_text())
    assert {"date", "device", "world_size", "torch", "args"} <= report.keys()
    assert [row["size_mib"] for row in report["collectives"]] == [1]
    assert {row["system"] for row in report["step"]} == {
        "ddp_fused_adamw", "torch_zero1", "zero_shard_stage2_bucket1", "zero_shard_stage1_bucket1"
    }  # fmt: skip
    assert [(r["overlap_param_gather"], r["num_buckets"] > 0) for r in report["iteration"]] == [
        (True, True),
        (False, True),
    ]


def test_e2e_peers_smoke(tmp_path: Path) -> None:
    """zero-shard at fraction 1, FSDP2's CPUOffloadPolicy and zero-shard on that FSDP2 model
    (gloo, one process) run in the same call; torchao's CPUOffloadOptimizer is recorded as
    skipped (CUDA only)."""
    run_script("e2e_gpt.py", "peers", "--device", "cpu", "--preset", "tiny", "--steps", "3",
               "--repeats", "1", "--no-plain", "--out", str(tmp_path))  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    systems = report["systems"]
    ran = ["zero_shard_f1", "fsdp2_offload", "zero_shard_on_fsdp2_offload"]
    assert list(systems) == [ran[0], "torchao_offload", *ran[1:]]
    assert systems["torchao_offload"] == {"skipped": e2e_gpt.torchao_unavailable("cpu", 1)}
    assert [(run["system"], run["round"]) for run in report["runs"]] == [(n, 0) for n in ran]
    for name in ran:
        system = systems[name]
        assert system["failed"] == [] and len(system["iteration_ms"]) == 1, system
        assert system["median_ms"] > 0 and system["spread"] == 1.0
        assert system["peak_bytes"] > 0 and system["honours_clipping"] is True
    ratios = report["ratios"]
    assert ratios["zero_shard_over_torchao_offload"] == {"ratio": None, "target": 0.9, "met": None}
    fsdp2 = ratios["zero_shard_over_fsdp2_offload"]
    want = systems["zero_shard_f1"]["median_ms"] / systems["fsdp2_offload"]["median_ms"]
    assert fsdp2["ratio"] == pytest.approx(want) and fsdp2["met"] == (want <= 0.35)
    assert report["cpu_adamw_floor_ms"] > 0


def test_e2e_overhead_smoke(tmp_path: Path) -> None:
    """The reference (plain AdamW at one rank) and zero-shard alternate per preset; the ratios
    are zero-shard's medians over the reference's, and the rounds' own."""
    run_script("e2e_gpt.py", "overhead", "--device", "cpu", "--presets", "tiny", "--steps", "3",
               "--repeats", "1", "--fractions", "0", "--out", str(tmp_path))  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    names = [(run["system"], run["preset"], run["round"]) for run in report["runs"]]
    assert names == [("reference", "tiny", 0), ("zero_shard_f0", "tiny", 0)]
    assert report["reference"] == "plain AdamW"
    systems = report["presets"]["tiny"]["systems"]
    ours, reference = systems["zero_shard_f0"], systems["reference"]
    assert reference["median_ms"] > 0 and reference["spread"] == 1.0 and ours["step_ms"] > 0
    ratio = report["presets"]["tiny"]["ratios"]["zero_shard_f0"]
    assert ratio["of_medians"] == pytest.approx(ours["median_ms"] / reference["median_ms"])
    assert ratio["least"] == ratio["most"] == pytest.approx(ratio["of_medians"])


def test_overhead_summary_pairs_each_round_with_its_reference() -> None:
    def run(system: str, round_: int, ms: float | None) -> dict:
        record = {"name": f"{system}_small_r{round_}_x2", "system": system, "preset": "small"}
        record["round"] = round_
        return record if ms is None else {**record, "summary": {"iteration_ms": ms,
                                                                 "step_ms": ms / 10}}  # fmt: skip

    runs = [run("reference", 0, 10.0), run("zero_shard_f0", 0, 12.0),
            run("reference", 1, 20.0), run("zero_shard_f0", 1, 22.0),
            run("zero_shard_f0.5", 0, None)]  # fmt: skip
    result = e2e_gpt.summarize_overhead(runs, "small")
    ratio = result["ratios"]["zero_shard_f0"]
    assert ratio["rounds"] == [1.2, 1.1] and (ratio["least"], ratio["most"]) == (1.1, 1.2)
    assert ratio["of_medians"] == pytest.approx(17.0 / 15.0)
    assert result["systems"]["zero_shard_f0.5"] == {"failed": ["zero_shard_f0.5_small_r0_x2"]}
    assert result["ratios"]["zero_shard_f0.5"] is None


def test_torchao_skip_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "needs CUDA, not --device cpu" in e2e_gpt.torchao_unavailable("cpu", 1)
    assert "one GPU, not --nproc 2" in e2e_gpt.torchao_unavailable("cuda", 2)
    offload_peers.import_torchao_offload.cache_clear()
    monkeypatch.setattr(offload_peers, "TORCHAO_MODULES", ("no_such_module_for_zero_shard",))
    try:
        assert "does not import" in e2e_gpt.torchao_unavailable("cuda", 1)
    finally:
        offload_peers.import_torchao_offload.cache_clear()


def test_speed_targets_are_those_of_the_rows_run() -> None:
    def run(name: str, iteration_ms: float, backward_ms: float, peak: int) -> dict:
        summary = {"iteration_ms": iteration_ms, "backward_ms": backward_ms}
        return {"name": f"{name}_x1", "summary": {**summary, "memory": {"peak_bytes": peak}}}

    report = {
        "cpu_adamw_floor_ms": 200.0,
        "runs": [
            run("zero_shard_f0", 110.0, 60.0, 23 << 30),
            run("zero_shard_f1", 290.0, 70.0, (12 << 30) + 512),
            run("megatron_hdo_f1", 950.0, 60.0, 12 << 30),
            {"name": "plain_adamw_x1", "error": "out of memory"},  # failed: its targets go
        ],
    }
    targets = e2e_gpt.speed_targets(report)
    assert set(targets) == {"fraction_1_exact", "fraction_1_peak"}
    exact = targets["fraction_1_exact"]
    assert exact["bound"] == 270.0 and exact["ratio"] == pytest.approx(290 / 270)
    assert exact["met"] is True  # 1.074 <= 1.10
    peak = targets["fraction_1_peak"]
    assert peak["ratio"] > 1.0 and peak["met"] is False  # 512 bytes above HDO's: missed


def test_peak_blocks_replays_from_the_mark_and_groups_what_is_alive_at_the_peak() -> None:
    def frame(path: Path, line: int) -> dict:
        return {"filename": str(path), "line": line, "name": "f"}

    ours = [frame(Path("/usr/lib/torch/nn/module.py"), 1), frame(ROOT / "zero_shard" / "x.py", 7)]
    theirs = [frame(Path("/site/torch/optim/adamw.py"), 3), frame(Path("/site/mcore/o.py"), 9)]

    def alloc(addr: int, size: int, frames: list) -> dict:
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    def free(addr: int) -> dict:
        return {"action": "free_completed", "addr": addr}

    trace = [
        alloc(1, 10 << 20, []), free(1),  # the init's peak, before the mark: not counted
        alloc(2, 48, ours), alloc(3, 48, ours), alloc(4, 2 << 20, theirs),
        alloc(5, peak_blocks.MARK_BYTES, []), free(5),  # the example's reset
        alloc(6, 3 << 20, theirs), free(6), free(3),
        alloc(7, 1 << 20, theirs),  # 48 + 2 MiB + 1 MiB: below the peak
        {"action": "free_requested", "addr": 7}, free(7),
    ]  # fmt: skip
    peak, alive = peak_blocks.replay_peak(trace)
    assert peak == 48 + 48 + (2 << 20) + (3 << 20)  # at 6's alloc, before 3 and 6 were freed
    assert sorted(block["addr"] for block in alive) == [2, 3, 4, 6]
    rows = peak_blocks.group_blocks(alive)
    assert rows == [
        {"where": "mcore/o.py:9 f", "size": None, "count": 2, "bytes": 5 << 20},
        {"where": "zero_shard/x.py:7 f", "size": 48, "count": 2, "bytes": 96},
    ]
