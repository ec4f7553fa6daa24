"""End to end: ``examples/train_gpt.py`` on GPUs, at several offload fractions and sizes.

Each configuration is one ``torchrun --standalone`` run of the example (a fresh process, so peak
memory is its own), whose JSON log gives the iteration time (mean over the steps after the
first), the forward / backward / step split, tokens/s and the peak GPU memory. Beside them, the
CPU AdamW floor for the model's parameter count: ``torch.optim.AdamW(fused=True)`` on that many
fp32 elements on the host, the least a full-offload step can cost. ``targets`` in the results
holds the project's targets for the rows run (``SPEED_TARGETS``): fraction 1.0's iteration <=
1.10 x its backward + the floor; fraction 0's iteration and peak <= plain AdamW's; fraction
1.0's peak <= Megatron-Core HDO's.

``speed --megatron-fractions 0.5,1`` adds Megatron-Core's HybridDeviceOptimizer to the rows: the
same example, loop, model (bf16 params) and flags with ``--optimizer megatron-hdo`` (one GPU; see
``examples/megatron_hdo.py``). When megatron-core does not import, or the device is not CUDA,
those rows are recorded as ``{"skipped": reason}``. The peer travels as a wheel
(docs/benchmarks/README.md): ``PYTHONPATH=/tmp/site:$PWD`` reaches the example's processes too.

``peers`` runs zero-shard at full offload against the offload peers in the same loop, for
``--repeats`` rounds of fresh runs that alternate between the systems: torchao's
CPUOffloadOptimizer (fp32 params, bf16 autocast; one GPU) and FSDP2's CPUOffloadPolicy (fp32
params cast to bf16 per unit), both ``examples/offload_peers.py``, and zero-shard stepping that
FSDP2 model's host params (``--fsdp2-cpu-offload``), then plain AdamW once (unless
``--no-plain``), then the CPU AdamW floor. Per system: the median iteration, its spread (slowest /
median), the peak GPU memory and whether its step honours the clip (``--clip`` 1.0 for all; the
example's log says why not); the ratios zero-shard / torchao and zero-shard / FSDP2 of the
medians against the project's targets (<= 0.9 and <= 0.35). A peer that cannot run here (torchao
does not import, not CUDA, more than one rank) is recorded as ``{"skipped": reason}``. Flags after
``--`` go to zero-shard's runs only.

Run from the repository root on a GPU machine (each part writes ``results.json`` under ``--out``
after every run, so a cut-off run keeps what it measured)::

    python benchmarks/e2e_gpt.py speed --preset 1b --out $OUT/e2e        # fractions, plain AdamW
    python benchmarks/e2e_gpt.py speed --preset 1b --megatron-fractions 0.5,1 --out $OUT/e2e_mcore
    python benchmarks/e2e_gpt.py speed --preset 1b --nproc 2 --fractions 0.5 --out $OUT/e2e2
    python benchmarks/e2e_gpt.py largest --out $OUT/largest   # biggest preset per fraction
    python benchmarks/e2e_gpt.py converge --preset small --steps 300 --out $OUT/converge
    PYTHONPATH=/tmp/site:$PWD python benchmarks/e2e_gpt.py peers --preset 1b --out $OUT/peers
    python benchmarks/e2e_gpt.py overhead --nproc 2 --steps 20 --repeats 3 --out $OUT/overhead2
    python benchmarks/e2e_gpt.py speed --device cpu --preset tiny --steps 4 --out runs/e2e  # smoke
    python benchmarks/e2e_gpt.py peers --device cpu --preset tiny --steps 3 --repeats 1 --out runs/p

``overhead`` measures zero-shard's fixed cost per step where it shows, at small models: for
each of ``--presets`` (default small, medium and 1b), ``--repeats`` rounds of fresh runs that
alternate the reference (plain AdamW at ``--nproc 1``; DDP + AdamW at more, as the example wraps
it) and zero-shard at each of ``--fractions`` (default 0 and 0.5); per preset the median
iteration and step of each, the spread (slowest / median) and zero-shard's ratio to the
reference (of the medians, and the least and most of the rounds' ratios).

``converge`` trains zero-shard (fraction 0.5) and plain AdamW (fp32 params, bf16 autocast) from
the same seed and plots both loss curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import describe_run, median_ms, package_version, split_at_dashes, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import PRESETS  # noqa: E402
from megatron_hdo import import_hybrid_device_optimizer  # noqa: E402
from offload_peers import import_torchao_offload  # noqa: E402
from reporting import PHASES, import_pyplot  # noqa: E402


def run_example(
    name: str, flags: list[str], args: argparse.Namespace, *, nproc: int | None = None
) -> dict[str, Any]:
    """One run of the example; its log's summary and config, or why it failed."""
    out = args.out / name
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc or args.nproc}", str(ROOT / "examples" / "train_gpt.py"),
        "--device", args.device, "--quiet", "--out", str(out), *flags,
    ]  # fmt: skip
    # The caller's PYTHONPATH stays behind the root: it may carry peers installed with --target.
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    record: dict[str, Any] = {"name": name, "flags": flags, "nproc": nproc or args.nproc}
    record["seconds"] = time.perf_counter() - started
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-8000:]  # torchrun's report is the last ~2000
        record["error"] = "out of memory" if "OutOfMemoryError" in tail else tail
        print(f"{name}: failed ({record['error'][-300:]})", flush=True)
        return record
    log = json.loads((out / "log.json").read_text())
    record.update(summary=log["summary"], config=log["config"])
    summary = log["summary"]
    print(
        f"{name}: iteration {summary['iteration_ms']:.1f} ms, forward {summary['forward_ms']:.1f}"
        f", backward {summary['backward_ms']:.1f}, step {summary['step_ms']:.1f}, "
        f"{summary['tokens_per_s']:,.0f} tok/s, peak {summary['memory']['peak_bytes'] / 2**30:.1f}"
        " GiB",
        flush=True,
    )
    return record


def cpu_adamw_floor_ms(num_params: int, reps: int = 3) -> float:
    """Median ms of one fused CPU AdamW step over ``num_params`` fp32 elements (all cores)."""
    torch.set_num_threads(os.cpu_count() or 1)
    param = torch.zeros(num_params, dtype=torch.float32)
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    return median_ms(opt.step, reps)  # the untimed first step creates the state


def save(report: dict[str, Any], args: argparse.Namespace) -> None:
    write_json(args.out / "results.json", report)


def speed(args: argparse.Namespace, report: dict[str, Any]) -> None:
    common = ["--preset", args.preset, "--steps", str(args.steps), "--eval-every", "0"]
    common += args.extra
    for fraction in args.fractions:
        name = f"zero_shard_f{fraction:g}_x{args.nproc}"
        flags = [*common, "--offload-fraction", str(fraction)]
        report["runs"].append(run_example(name, flags, args))
        save(report, args)
    unavailable = megatron_unavailable(args.device) if args.megatron_fractions else None
    if args.megatron_fractions and unavailable is None:
        report["megatron_core"] = package_version("megatron-core")
    for fraction in args.megatron_fractions:
        name = f"megatron_hdo_f{fraction:g}_x1"
        if unavailable is None:
            flags = [*common, "--optimizer", "megatron-hdo", "--offload-fraction", str(fraction)]
            report["runs"].append(run_example(name, flags, args))
        else:
            report["runs"].append({"name": name, "skipped": unavailable})
            print(f"{name}: skipped ({unavailable})", flush=True)
        save(report, args)
    if args.plain:
        report["runs"].append(run_example(f"plain_adamw_x{args.nproc}", [*common, "--optimizer",
                                          "adamw"], args))  # fmt: skip
    num_params = PRESETS[args.preset].model.num_params()
    report["cpu_adamw_floor_ms"] = cpu_adamw_floor_ms(num_params // args.nproc)
    report["targets"] = speed_targets(report)
    save(report, args)
    print_table(report)


def megatron_unavailable(device: str) -> str | None:
    """Why ``train_gpt.py --optimizer megatron-hdo`` cannot run here, or None if it can."""
    if torch.device(device).type != "cuda":
        return f"Megatron-Core's HybridDeviceOptimizer needs CUDA, not --device {device}"
    try:
        import_hybrid_device_optimizer()
    except ImportError as err:
        return str(err)
    return None


def print_table(report: dict[str, Any]) -> None:
    """The speed rows as a markdown table, as in docs/benchmarks/e2e.md (memory in GiB)."""
    print("| run | iteration ms | forward | backward | step | tokens/s | peak | host RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for run in report["runs"]:
        if "summary" not in run:
            print(f"| {run['name']} | {run.get('skipped', 'failed')} | | | | | | |")
            continue
        summary, memory = run["summary"], run["summary"]["memory"]
        cells = [f"{summary[f'{key}_ms']:.1f}" for key in ("iteration", *PHASES)]
        cells.append(f"{summary['tokens_per_s']:,.0f}")
        cells += [f"{memory[key] / 2**30:.1f}" for key in ("peak_bytes", "host_rss_bytes")]
        print(f"| {run['name']} | {' | '.join(cells)} |")
    if "cpu_adamw_floor_ms" in report:
        print(f"| CPU AdamW floor | | | | {report['cpu_adamw_floor_ms']:.1f} | | | |")


# The project's targets in one speed run (docs/benchmarks/e2e.md): (the run measured, the run
# it is held against, what is compared, the largest ratio allowed).
SPEED_TARGETS = {
    "fraction_1_exact": ("zero_shard_f1", None, "iteration_ms", 1.10),
    "fraction_0_iteration": ("zero_shard_f0", "plain_adamw", "iteration_ms", 1.0),
    "fraction_0_peak": ("zero_shard_f0", "plain_adamw", "peak_bytes", 1.0),
    "fraction_1_peak": ("zero_shard_f1", "megatron_hdo_f1", "peak_bytes", 1.0),
}


def speed_targets(report: dict[str, Any]) -> dict[str, Any]:
    """The project's targets for the rows this run has: fraction 1's iteration against the bound
    of an exact step (its own backward + the CPU AdamW floor, sampled once in this process: the
    floors ``host_step_timeline.py`` samples between the steps are the finer measure), and
    fraction 0's iteration and peak against plain AdamW's, fraction 1's peak against Megatron-Core
    HDO's at fraction 1. Each: the two values, their ratio, the largest ratio allowed, met."""
    runs = {
        run["name"].split("_x")[0]: run["summary"] for run in report["runs"] if "summary" in run
    }

    def value(summary: dict[str, Any], key: str) -> float:
        return summary["memory"][key] if key == "peak_bytes" else summary[key]

    targets = {}
    for name, (measured, against, key, limit) in SPEED_TARGETS.items():
        if measured not in runs or (against is not None and against not in runs):
            continue
        got = value(runs[measured], key)
        if against is None:  # the exact bound
            bound = runs[measured]["backward_ms"] + report["cpu_adamw_floor_ms"]
        else:
            bound = value(runs[against], key)
        ratio = got / bound
        targets[name] = {
            "value": got, "against": against or "backward_ms + cpu_adamw_floor_ms",
            "bound": bound, "ratio": ratio, "limit": limit, "met": ratio <= limit,
        }  # fmt: skip
    return targets


# The project's targets: zero-shard's median iteration at full offload over each peer's, at most.
PEER_TARGETS = {"torchao_offload": 0.9, "fsdp2_offload": 0.35}


def peers(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Rounds of fresh runs alternating zero-shard (fraction 1) and the offload peers, then the
    medians, spreads and ratios (module docstring)."""
    common = ["--preset", args.preset, "--steps", str(args.steps), "--eval-every", "0"]
    systems = {
        "zero_shard_f1": [*common, "--offload-fraction", "1", *args.extra],
        "torchao_offload": [*common, "--optimizer", "torchao-offload"],
        "fsdp2_offload": [*common, "--optimizer", "fsdp2-offload"],
        # zero-shard stepping FSDP2's host params (FSDP2's GPU memory, below the params).
        "zero_shard_on_fsdp2_offload": [
            *common,
            "--offload-fraction",
            "1",
            "--fsdp2-cpu-offload",
            *args.extra,
        ],
    }
    if args.systems is not None:
        unknown = sorted(set(args.systems) - set(systems))
        if unknown:
            raise SystemExit(f"--systems: unknown {unknown}; choose from {sorted(systems)}")
        systems = {name: flags for name, flags in systems.items() if name in args.systems}
    skipped = {}
    if "torchao_offload" in systems:
        skipped["torchao_offload"] = torchao_unavailable(args.device, args.nproc)
    report["torchao"] = package_version("torchao")
    report["systems"] = {name: {"skipped": why} for name, why in skipped.items() if why}
    for name, why in report["systems"].items():
        print(f"{name}: skipped ({why['skipped']})", flush=True)
    for index in range(args.repeats):
        for name, flags in systems.items():
            if skipped.get(name) is None:
                run = run_example(f"{name}_r{index}_x{args.nproc}", flags, args)
                report["runs"].append({**run, "system": name, "round": index})
                save(report, args)
    if args.plain:
        run = run_example(f"plain_adamw_x{args.nproc}", [*common, "--optimizer", "adamw"], args)
        report["runs"].append({**run, "system": "plain_adamw", "round": 0})
    num_params = PRESETS[args.preset].model.num_params()
    report["cpu_adamw_floor_ms"] = cpu_adamw_floor_ms(num_params // args.nproc)
    summaries = {}
    for name in (*systems, "plain_adamw"):
        runs = [run for run in report["runs"] if run["system"] == name]
        if skipped.get(name) is not None:
            summaries[name] = {"skipped": skipped[name]}
        elif runs:
            summaries[name] = summarize_system(runs)
    report["systems"] = summaries
    report["ratios"] = peer_ratios(report["systems"])
    save(report, args)
    print_peers_table(report)


def torchao_unavailable(device: str, nproc: int) -> str | None:
    """Why ``train_gpt.py --optimizer torchao-offload`` cannot run here, or None if it can."""
    if torch.device(device).type != "cuda":
        return f"torchao's CPUOffloadOptimizer needs CUDA, not --device {device}"
    if nproc != 1:
        return f"torchao's CPUOffloadOptimizer runs on one GPU, not --nproc {nproc}"
    try:
        import_torchao_offload()
    except ImportError as err:
        return str(err)
    return None


def summarize_system(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs: the median iteration and its spread, memory, clipping."""
    done = [run["summary"] for run in runs if "summary" in run]
    failed = [run["name"] for run in runs if "summary" not in run]
    if not done:
        return {"failed": failed, "error": runs[-1].get("error", "")[-300:]}
    times = [summary["iteration_ms"] for summary in done]
    median = statistics.median(times)
    return {
        "iteration_ms": times,
        "median_ms": median,
        "spread": max(times) / median,  # the slowest run over the median
        "peak_bytes": max(summary["memory"]["peak_bytes"] for summary in done),
        "host_rss_steady_bytes": max(s["memory"]["host_rss_steady_bytes"] for s in done),
        "honours_clipping": done[0]["clipping"]["honoured"],
        "clipping": done[0]["clipping"]["how"],
        "failed": failed,
    }


def peer_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """zero-shard's median over each peer's, against ``PEER_TARGETS``; None where one is
    missing."""
    ours = systems.get("zero_shard_f1", {}).get("median_ms")
    ratios: dict[str, Any] = {}
    for peer, target in PEER_TARGETS.items():
        theirs = systems.get(peer, {}).get("median_ms")
        ratio = ours / theirs if ours is not None and theirs is not None else None
        met = None if ratio is None else ratio <= target
        ratios[f"zero_shard_over_{peer}"] = {"ratio": ratio, "target": target, "met": met}
    return ratios


def print_peers_table(report: dict[str, Any]) -> None:
    """The per-system medians as a markdown table (memory in GiB), then the ratios."""
    print("| system | runs: iteration ms | median ms | spread | peak GiB | honours clip |")
    print("|---|---|---|---|---|---|")
    for name, system in report["systems"].items():
        if "median_ms" not in system:
            why = system.get("skipped") or f"failed: {system.get('error', '')[-120:]}"
            print(f"| {name} | {why} | | | | |")
            continue
        times = ", ".join(f"{ms:.1f}" for ms in system["iteration_ms"])
        print(
            f"| {name} | {times} | {system['median_ms']:.1f} | {system['spread']:.2f} | "
            f"{system['peak_bytes'] / 2**30:.1f} | {'yes' if system['honours_clipping'] else 'no'} |"
        )
    print(f"| CPU AdamW floor | | {report['cpu_adamw_floor_ms']:.1f} | | | |")
    for name, ratio in report["ratios"].items():
        value = "n/a" if ratio["ratio"] is None else f"{ratio['ratio']:.2f}"
        print(f"{name}: {value} (target <= {ratio['target']}, met: {ratio['met']})")


def overhead(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """zero-shard's iteration over the reference's at each of ``--presets``: ``--repeats`` rounds
    of fresh runs, alternating the reference (plain AdamW at one rank; the example wraps it in
    DDP at more) and zero-shard at each of ``--fractions``; per preset and system the median
    iteration and step and the spread (slowest / median), and zero-shard's ratios to the
    reference: of the medians, and the least and most of the rounds' ratios."""
    presets = args.presets.split(",")
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown:
        raise SystemExit(f"--presets: unknown {unknown}; choose from {list(PRESETS)}")
    systems = {"reference": ["--optimizer", "adamw"]}
    for fraction in args.fractions:
        systems[f"zero_shard_f{fraction:g}"] = ["--offload-fraction", str(fraction), *args.extra]
    for index in range(args.repeats):
        for preset in presets:
            common = ["--preset", preset, "--steps", str(args.steps), "--eval-every", "0"]
            for name, flags in systems.items():
                run = run_example(f"{name}_{preset}_r{index}_x{args.nproc}", common + flags, args)
                report["runs"].append({**run, "system": name, "preset": preset, "round": index})
                save(report, args)
    report["reference"] = "plain AdamW" if args.nproc == 1 else "DDP + AdamW"
    report["presets"] = {preset: summarize_overhead(report["runs"], preset) for preset in presets}
    save(report, args)
    print_overhead_table(report)


def summarize_overhead(runs: list[dict[str, Any]], preset: str) -> dict[str, Any]:
    """One preset's runs: per system the medians and spread; per zero-shard system its ratios
    to the reference (None where a run is missing)."""
    done = [run for run in runs if run["preset"] == preset and "summary" in run]
    systems: dict[str, Any] = {}
    for name in dict.fromkeys(run["system"] for run in runs):
        mine = [run["summary"] for run in done if run["system"] == name]
        if not mine:
            systems[name] = {"failed": [run["name"] for run in runs if run["preset"] == preset
                                        and run["system"] == name]}  # fmt: skip
            continue
        times = [summary["iteration_ms"] for summary in mine]
        median = statistics.median(times)
        systems[name] = {
            "iteration_ms": times, "median_ms": median, "spread": max(times) / median,
            "step_ms": statistics.median(summary["step_ms"] for summary in mine),
        }  # fmt: skip
    reference = systems.get("reference", {})
    by_round = {(run["system"], run["round"]): run["summary"]["iteration_ms"] for run in done}
    ratios: dict[str, Any] = {}
    for name, system in systems.items():
        if name == "reference":
            continue
        if "median_ms" not in system or "median_ms" not in reference:
            ratios[name] = None
            continue
        paired = [
            ms / by_round["reference", number]
            for (system_name, number), ms in by_round.items()
            if system_name == name and ("reference", number) in by_round
        ]
        ratios[name] = {
            "of_medians": system["median_ms"] / reference["median_ms"],
            "rounds": paired, "least": min(paired), "most": max(paired),
        }  # fmt: skip
    return {"systems": systems, "ratios": ratios}


def print_overhead_table(report: dict[str, Any]) -> None:
    """The overhead rows as a markdown table: per preset and system, the medians, the spread and
    the ratio to the reference (the rounds' least and most in brackets)."""
    print(f"| preset | system | iteration ms | step ms | spread | over {report['reference']} |")
    print("|---|---|---|---|---|---|")
    for preset, result in report["presets"].items():
        for name, system in result["systems"].items():
            if "median_ms" not in system:
                print(f"| {preset} | {name} | failed | | | |")
                continue
            ratio = result["ratios"].get(name)
            shown = "" if ratio is None else (
                f"{ratio['of_medians']:.3f} ({ratio['least']:.3f}-{ratio['most']:.3f})"
            )  # fmt: skip
            print(
                f"| {preset} | {name} | {system['median_ms']:.1f} | {system['step_ms']:.1f} | "
                f"{system['spread']:.2f} | {shown} |"
            )


def largest(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """For each of ``--fractions`` (default 0 and 1), the presets in ascending size until one
    fails (activation checkpointing on, micro-batches of one sequence per rank, a few steps)."""
    for fraction in args.fractions:
        for preset in args.candidates.split(","):
            flags = ["--preset", preset, "--steps", str(args.steps), "--eval-every", "0",
                     "--offload-fraction", str(fraction), "--checkpoint-activations",
                     "--micro-batches", str(PRESETS[preset].batch_size // args.nproc)]  # fmt: skip
            run = run_example(f"largest_f{fraction:g}_{preset}", flags, args)
            run["num_params"] = PRESETS[preset].model.num_params()
            report["runs"].append(run)
            save(report, args)
            if "error" in run:
                break


def converge(args: argparse.Namespace, report: dict[str, Any]) -> None:
    common = ["--preset", args.preset, "--steps", str(args.steps), *args.extra]
    for name, flags in (("zero_shard_f0.5", ["--offload-fraction", "0.5"]),
                        ("plain_adamw", ["--optimizer", "adamw"])):  # fmt: skip
        report["runs"].append(run_example(name, [*common, *flags], args))
        save(report, args)
    logs = {run["name"]: json.loads((args.out / run["name"] / "log.json").read_text())
            for run in report["runs"] if "summary" in run}  # fmt: skip
    if len(logs) == 2:
        final = {name: log["summary"]["last_loss"] for name, log in logs.items()}
        report["final_loss_ratio"] = final["zero_shard_f0.5"] / final["plain_adamw"]
        report["final_val_ratio"] = (
            logs["zero_shard_f0.5"]["summary"]["val_loss_end"]
            / logs["plain_adamw"]["summary"]["val_loss_end"]
        )
        plot_curves(logs, args.out / "converge.png")
    save(report, args)


def plot_curves(logs: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        plt = import_pyplot()
    except ImportError as err:
        print(err)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, log in logs.items():
        steps = [record["step"] for record in log["steps"]]
        ax.plot(steps, [record["loss"] for record in log["steps"]], lw=0.8, label=f"{name} train")
        val = sorted((int(step), loss) for step, loss in log["val_losses"].items())
        ax.plot(*zip(*val, strict=True), "o-", label=f"{name} validation")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="zero-shard vs plain AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["speed", "largest", "converge", "peers", "overhead"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="1b", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (GPUs)")
    parser.add_argument("--fractions", help="speed: default 0,0.5,1; largest: 0,1; overhead: 0,0.5")
    parser.add_argument("--presets", default="small,medium,1b", help="overhead: presets to run")
    parser.add_argument("--megatron-fractions", default="", help="speed: Megatron-Core "
                        "HybridDeviceOptimizer rows at these fractions (one GPU), e.g. 0.5,1")  # fmt: skip
    parser.add_argument("--candidates", default="1b,3b,5b,7b,9b,10b",
                        help="largest: presets to try, in ascending size")  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=3, help="peers, overhead: rounds of fresh runs"
    )
    parser.add_argument(
        "--systems",
        type=lambda text: text.split(","),
        help="peers: a comma-separated subset of zero_shard_f1, torchao_offload, "
        "fsdp2_offload, zero_shard_on_fsdp2_offload (default all)",
    )
    parser.add_argument("--no-plain", dest="plain", action="store_false")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("runs/e2e_gpt"))
    parser.epilog = (
        "Flags after a lone -- go to train_gpt.py as they are (e.g. -- --threads 12); in peers, "
        "to zero-shard's runs only."
    )
    own, extra = split_at_dashes(sys.argv[1:])
    args = parser.parse_args(own)
    args.extra = extra
    fractions = args.fractions or {"largest": "0,1", "overhead": "0,0.5"}.get(args.part, "0,0.5,1")
    args.fractions = [float(f) for f in fractions.split(",")]
    args.megatron_fractions = [float(f) for f in args.megatron_fractions.split(",") if f]
    if args.megatron_fractions and args.nproc != 1:
        parser.error("--megatron-fractions runs on one GPU: leave --nproc at 1")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    # The GPUs the example's processes see; this process only times the CPU floor.
    visible = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {
        "part": args.part,
        **describe_run(visible),
        "cpu_count": os.cpu_count(),
        "runs": [],
    }
    parts = {
        "speed": speed, "largest": largest, "converge": converge, "peers": peers,
        "overhead": overhead,
    }  # fmt: skip
    parts[args.part](args, report)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
