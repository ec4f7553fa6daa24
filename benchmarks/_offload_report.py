"""offload_step.py's results: the record of one system, the targets, the table, the plot, the JSON.

The runners in offload_step.py return a :class:`Result` per system; everything here reads them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import write_json

GIB = 1 << 30
TARGET_FULL_VS_CPU = 1.15
TARGET_HALF_VS_FULL = 0.6
TARGET_NONE_VS_GPU = 1.1


@dataclass
class Result:
    """One system's measurements (times in ms, medians over the timed iterations)."""

    system: str
    fraction: float | None = None
    iter_ms: float | None = None
    step_ms: float | None = None
    iter_samples_ms: list[float] = field(default_factory=list)
    step_samples_ms: list[float] = field(default_factory=list)
    gpu_peak_bytes: int | None = None
    host_rss_bytes: int | None = None  # while the system is alive, after its timed iterations
    host_rss_delta_bytes: int | None = None  # of host_rss_bytes: over the RSS before it was built
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    error: str | None = None


def to_gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / GIB


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def find(results: list[Result], system: str, fraction: float | None = None) -> Result | None:
    for result in results:
        if result.system == system and result.step_ms is not None:
            if fraction is None or result.fraction == fraction:
                return result
    return None


def check_targets(results: list[Result]) -> list[dict[str, Any]]:
    """The project's three step-time targets, each with its ratio and verdict."""
    cpu, gpu = find(results, "cpu_fused_adamw"), find(results, "gpu_fused_adamw")
    full, half = find(results, "zero_shard", 1.0), find(results, "zero_shard", 0.5)
    none = find(results, "zero_shard", 0.0)
    checks = [
        ("fraction 1.0 step <= 1.15 x cpu_fused_adamw", full, cpu, TARGET_FULL_VS_CPU),
        ("fraction 0.5 step <= 0.6 x own fraction 1.0", half, full, TARGET_HALF_VS_FULL),
        ("fraction 0 step <= 1.1 x gpu_fused_adamw", none, gpu, TARGET_NONE_VS_GPU),
    ]
    targets = []
    for name, measured, reference, limit in checks:
        ratio = None
        if measured is not None and reference is not None and reference.step_ms > 0:
            ratio = measured.step_ms / reference.step_ms
        verdict = "n/a" if ratio is None else ("PASS" if ratio <= limit else "FAIL")
        targets.append({"target": name, "limit": limit, "ratio": ratio, "verdict": verdict})
    return targets


def ratio_to_cpu_floor(result: Result, cpu: Result | None) -> float | None:
    if cpu is None or result.step_ms is None or not result.fraction:
        return None
    if result.system in ("pinned_copies", "gpu_fused_adamw"):
        return None
    return result.step_ms / (cpu.step_ms * result.fraction)


HEADER = ("system", "fraction", "iter ms", "step ms", "GPU peak GiB", "RSS GiB", "vs CPU floor x f")
WIDTHS = (18, 8, 9, 9, 12, 8, 16)


def table_rows(results: list[Result]) -> list[tuple[list[str], str]]:
    """(cells, note) per row; a skipped or failed system has no numbers, only a note."""
    cpu = find(results, "cpu_fused_adamw")
    rows = []
    for result in results:
        fraction = "-" if result.fraction is None else f"{result.fraction:g}"
        if result.skipped or result.error:
            note = f"skipped: {result.skipped}" if result.skipped else f"error: {result.error}"
            rows.append(([result.system, fraction], note[:100]))
            continue
        cells = [
            result.system,
            fraction,
            fmt(result.iter_ms),
            fmt(result.step_ms),
            fmt(to_gib(result.gpu_peak_bytes), 2),
            fmt(to_gib(result.host_rss_bytes), 2),
            fmt(ratio_to_cpu_floor(result, cpu), 2),
        ]
        note = "step = d2h + h2d at once" if result.system == "pinned_copies" else ""
        rows.append((cells, note))
        if result.system == "pinned_copies":
            for mode in ("d2h", "h2d"):
                ms = fmt(result.extra[f"{mode}_ms"])
                rows.append(
                    (
                        [f"  {mode} alone", "-", "-", ms, "-", "-", "-"],
                        f"{result.extra[f'{mode}_gb_per_s']:.1f} GB/s",
                    )
                )
    return rows


def format_row(cells: list[str], note: str) -> str:
    padded = [
        cell.ljust(width) if index == 0 else cell.rjust(width)
        for index, (cell, width) in enumerate(zip(cells, WIDTHS, strict=False))
    ]
    return "  " + " ".join([*padded, note]).rstrip()


def print_report(entry: dict[str, Any]) -> None:
    """The targets and the table of one workload's entry in the report."""
    print(
        f"\nworkload: {entry['num_tensors']} x {entry['dim']}x{entry['dim']} bf16 = "
        f"{entry['num_params'] / 1e6:.0f}M params"
    )
    for target in entry["targets"]:
        ratio = fmt(target["ratio"], 2)
        print(f"  target: {target['target']:<46} ratio {ratio:>5}  {target['verdict']}")
    print(format_row(list(HEADER), ""))
    for cells, note in table_rows(entry["results"]):
        print(format_row(cells, note))


def save_report(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """Writes results.json from ``report`` (whose workloads hold Result objects); returns it."""
    workloads = [
        {**entry, "results": [dataclasses.asdict(result) for result in entry["results"]]}
        for entry in report["workloads"]
    ]
    payload = {**report, "workloads": workloads}
    write_json(out / "results.json", payload)
    return payload


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Step ms vs offload fraction per workload; returns why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:
        return f"matplotlib does not import: {err}"
    workloads = report["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 5), squeeze=False)
    for ax, entry in zip(axes[0], workloads, strict=True):
        results = [r for r in entry["results"] if r["step_ms"] is not None]
        by_system: dict[str, list[dict[str, Any]]] = {}
        for result in results:
            by_system.setdefault(result["system"], []).append(result)
        plot_workload(ax, by_system)
        ax.set_title(
            f"{entry['num_tensors']} x {entry['dim']}^2 bf16 ({entry['num_params'] / 1e6:.0f}M)"
        )
    fig.suptitle(f"offload_step on {report['device_name']}, {report['threads']} CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def plot_workload(ax: Any, by_system: dict[str, list[dict[str, Any]]]) -> None:
    zero = sorted(by_system.get("zero_shard", []), key=lambda r: r["fraction"])
    fractions = [r["fraction"] for r in zero]
    ax.plot(fractions, [r["step_ms"] for r in zero], "o-", color="C0", label="zero-shard step")
    ax.plot(
        fractions,
        [r["iter_ms"] for r in zero],
        "o--",
        color="C0",
        alpha=0.5,
        label="zero-shard iteration",
    )
    floors = {"cpu_fused_adamw": "C1", "gpu_fused_adamw": "C2", "pinned_copies": "C7"}
    for system, color in floors.items():
        for result in by_system.get(system, []):
            ax.axhline(result["step_ms"], color=color, linestyle=":", label=f"{system} floor")
    for result in by_system.get("cpu_fused_adamw", []):
        ax.plot([0, 1], [0, result["step_ms"]], color="C1", alpha=0.4, label="CPU floor x fraction")
    peers = (("torchao_bf16", "s", "C3"), ("torchao_fp32", "D", "C4"), ("megatron_hdo", "^", "C5"))
    for system, marker, color in peers:
        points = sorted(by_system.get(system, []), key=lambda r: r["fraction"])
        fractions = [r["fraction"] for r in points]
        if points:
            steps = [r["step_ms"] for r in points]
            ax.plot(fractions, steps, marker, color=color, label=f"{system} step")
            iters = [math.nan if r["iter_ms"] is None else r["iter_ms"] for r in points]
            label = f"{system} iteration"
            ax.plot(fractions, iters, marker, color=color, fillstyle="none", label=label)
    ax.set_xlabel("offload fraction")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
