"""Where a full-offload iteration goes: ``examples/train_gpt.py`` with the host step's chunks timed.

Runs the example in this process (under ``torchrun`` for one rank, as the example runs) with the
host pipeline's worker functions wrapped to note, per chunk, when the worker took it, when its
kernel started and ended, and how many pieces it stepped; the example's phase events are mapped
onto the host clock (a device event recorded when each step starts, with the device idle after
the last step's synchronize). Then, per step, the iteration (end of backward to end of the next
backward) split into:

- ``lag``: end of backward -> the first chunk's kernel (clip, ``step()``'s host code, the first
  chunk's D2H);
- ``kernels`` and ``gaps``: the CPU step's wall time, as kernel time and the worker's waits
  between kernels (for a chunk's grads to land, for the GIL);
- ``tail``: the last kernel -> the end of the next step's first forward (its last H2D, the
  forward of the units that waited for it).

After the run, interleaved, the kernel steps the same chunks again alone (``isolated_kernel_ms``:
the kernel's own floor in this process; more steps of the live optimizer, whose state is
then of no further use), torch's fused CPU AdamW steps the same main weights and state
(``torch_on_run_memory_ms``) and as many fresh fp32 elements (``torch_floor_ms``). The
report also names the host's CPU model, usable cores and NUMA nodes (``host``). The wrapped functions are private (``optimizers._host_part``): this is a
diagnosis tool for the host pipeline, not an API. Results go to ``--out``/timeline.json and are
printed; flags after ``--`` go to the example (``-- --delayed-update``)::

    torchrun --standalone --nproc-per-node 1 benchmarks/host_step_timeline.py --out $OUT/tl \\
        -- --device cuda --preset 1b --offload-fraction 1 --steps 12
    python benchmarks/host_step_timeline.py --out runs/tl -- --device cpu --preset tiny --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import reporting  # noqa: E402
import torch  # noqa: E402
import train_gpt  # noqa: E402

import optimizers._host_part as host_part  # noqa: E402
from optimizers._cpu_kernel import KernelPiece  # noqa: E402

now = time.perf_counter


@dataclasses.dataclass
class ChunkTiming:
    """Host times of one chunk's turn on the worker (``time.perf_counter`` seconds)."""

    pieces: int  # the pieces it stepped (params with a grad)
    taken: float  # the worker took the chunk
    kernel_start: float | None = None  # None: the chunk was not stepped (skipped or failed)
    kernel_end: float | None = None


@dataclasses.dataclass
class StepMarks:
    """One training step's start and its phases, on the host clock."""

    start: float
    phases: list[tuple[str, float, float]]  # (phase, start, end) as PhaseTimer marked them


class Recorder:
    """Host times of the host step's chunks and of the example's phases."""

    def __init__(self) -> None:
        self.chunks: list[ChunkTiming] = []
        self.starts: list[float] = []  # when each HostPart.start began
        self.steps: list[StepMarks] = []
        self.parts: list[host_part.HostPart] = []
        self._timing_of: dict[int, ChunkTiming] = {}  # id(job) -> its timing, while it runs

    def install(self) -> None:
        run_job, step_chunk, start = (
            host_part._run_job,
            host_part._step_chunk,
            host_part.HostPart.start,
        )
        recorder = self

        def timed_run_job(step: Any, job: Any, *args: Any) -> bool:
            timing = ChunkTiming(pieces=len(job.active), taken=now())
            recorder.chunks.append(timing)
            recorder._timing_of[id(job)] = timing
            try:
                return run_job(step, job, *args)
            finally:
                del recorder._timing_of[id(job)]

        def timed_step_chunk(job: Any, grad_scale: float | None) -> None:
            timing = recorder._timing_of[id(job)]
            timing.kernel_start = now()
            step_chunk(job, grad_scale)
            timing.kernel_end = now()

        def timed_start(part: host_part.HostPart, *args: Any, **kwargs: Any) -> Any:
            if part not in recorder.parts:
                recorder.parts.append(part)
            recorder.starts.append(now())
            return start(part, *args, **kwargs)

        host_part._run_job, host_part._step_chunk = timed_run_job, timed_step_chunk
        host_part.HostPart.start = timed_start
        train_gpt.PhaseTimer = self._timer_class()

    def _timer_class(self) -> type:
        recorder = self

        class Timer(reporting.PhaseTimer):
            def start_step(self) -> None:
                super().start_step()
                self.t0 = now()
                if self._module is not None:  # the device is idle: the last step synchronized
                    self.reference = self._module.Event(enable_timing=True)
                    self.reference.record()

            def finish_step(self) -> dict[str, float]:
                split = super().finish_step()
                host: Callable[[Any], float] = (
                    (lambda mark: mark)
                    if self._module is None
                    else (lambda event: self.t0 + self.reference.elapsed_time(event) / 1e3)
                )
                phases = [(phase, host(start), host(end)) for phase, start, end in self._marks]
                recorder.steps.append(StepMarks(self.t0, phases))
                return split

        return Timer


def split_steps(recorder: Recorder) -> list[dict[str, float]]:
    """Per step (after the first, before the last): the iteration and its parts, in ms."""
    rows = []
    stepped = sorted(
        (c for c in recorder.chunks if c.kernel_end is not None), key=lambda c: c.taken
    )
    for k in range(1, len(recorder.steps) - 1):
        this, after = recorder.steps[k], recorder.steps[k + 1]
        began = [t for t in recorder.starts if this.start <= t < after.start]
        if not began:
            continue
        later = [t for t in recorder.starts if t > began[-1]]
        until = later[0] if later else float("inf")
        mine = [c for c in stepped if began[-1] <= c.taken < until]
        if not mine:
            continue
        backward_end = [end for phase, _, end in this.phases if phase == "backward"][-1]
        next_backward_end = [end for phase, _, end in after.phases if phase == "backward"][-1]
        next_forward_end = next(end for phase, _, end in after.phases if phase == "forward")
        first = min(c.kernel_start for c in mine)
        last = max(c.kernel_end for c in mine)
        kernels = sum(c.kernel_end - c.kernel_start for c in mine)
        most = max(mine, key=lambda c: c.pieces)  # the chunk of the most (small) params
        rows.append({
            "step": k,
            "iteration_ms": 1e3 * (next_backward_end - backward_end),
            "lag_ms": 1e3 * (first - backward_end),
            "cpu_wall_ms": 1e3 * (last - first),
            "kernels_ms": 1e3 * kernels,
            "gaps_ms": 1e3 * (last - first - kernels),
            "tail_ms": 1e3 * (next_forward_end - last),
            "num_chunks": len(mine),
            "most_pieces": most.pieces,
            "most_pieces_kernel_ms": 1e3 * (most.kernel_end - most.kernel_start),
        })  # fmt: skip
    return rows


@torch.no_grad()
def _kernel_over_chunks(parts: list[host_part.HostPart]) -> Callable[[], None]:
    """The kernel over every chunk again, one call per chunk as in the run (staging holds the
    last step's weights: finite values)."""
    calls = []
    for part in parts:
        for position, chunk in enumerate(part.chunks):
            if chunk.kernel is None:
                continue
            staging = part.staging(position % part.num_slots, chunk.spec)
            pieces = [
                KernelPiece(piece.main, staging[piece.offset : piece.offset + piece.spec.numel],
                            piece.state)
                for _, piece in chunk.pieces
            ]  # fmt: skip
            calls.append((chunk.kernel, pieces, chunk.optimizer.param_groups[0]))

    def run() -> None:
        for kernel, pieces, group in calls:
            kernel.step(pieces, group)

    return run


def _torch_over(
    mains: list[torch.Tensor], states: list[dict[str, Any]] | None
) -> Callable[[], None]:
    """torch's fused CPU AdamW over ``mains`` with fresh fp32 grads, on ``states`` (the run's
    state, shared) or on state of its own (``None``: created by a first step)."""
    params = [torch.nn.Parameter(main, requires_grad=True) for main in mains]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    if states is None:
        optimizer.step()
    else:
        for param, state in zip(params, states, strict=True):
            optimizer.state[param] = state
    return optimizer.step


def isolated_ms(
    parts: list[host_part.HostPart], num_threads: int, repeat: int = 3
) -> dict[str, list[float]]:
    """After the run, interleaved: the kernel over the run's chunks (``isolated_kernel_ms``: its
    own floor in this process), torch's fused AdamW over the same main weights and state
    (``torch_on_run_memory_ms``) and over fresh tensors of as many elements (``torch_floor_ms``).
    Measured interleaved because the host's memory speed moves: on one H100 host the same kernel
    over the same chunks took 343.7 and then 201.0 ms seconds apart. Each repeat steps the live
    optimizer's state twice more (kernel and torch): it is of no further use. The fresh tensors
    sit beside the run's, so this needs about twice the run's host memory (fine at 1B)."""
    pieces = [p for part in parts for chunk in part.chunks if chunk.kernel is not None
              for _, p in chunk.pieces]  # fmt: skip
    fresh = [torch.randn(piece.main.numel()) for piece in pieces]
    runs = {
        "isolated_kernel_ms": _kernel_over_chunks(parts),
        "torch_on_run_memory_ms": _torch_over([p.main for p in pieces], [p.state for p in pieces]),
        "torch_floor_ms": _torch_over(fresh, None),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for _ in range(repeat):
            for name, run in runs.items():
                start = now()
                run()
                times[name].append(1e3 * (now() - start))
    finally:
        torch.set_num_threads(before)
    return times


def describe_host() -> dict[str, Any]:
    """The host's CPU model, usable cores and NUMA nodes: the kernel's speed against torch's
    floor has differed between leases of the same machine kind."""
    models: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    models.add(line.split(":", 1)[1].strip())
    except OSError:
        pass
    nodes = sorted(path.name for path in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {
        "cpu_models": sorted(models),
        "usable_cores": len(os.sched_getaffinity(0)),
        "numa_nodes": nodes,
    }


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/host_step_timeline"))
    args = parser.parse_args(argv[:split])
    example = argv[split + 1 :]
    args.out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder()
    recorder.install()
    log = train_gpt.main([*example, "--quiet", "--eval-every", "0", "--out", str(args.out / "run")])
    threads = [part.threads.num_threads for part in recorder.parts if part.threads is not None]
    report: dict[str, Any] = {
        "example_flags": example,
        "iteration_ms": log["summary"]["iteration_ms"],
        "threads": threads,
        "steps": split_steps(recorder),
        **isolated_ms(recorder.parts, max(threads, default=os.cpu_count() or 1)),
        "host": describe_host(),
    }
    recorder.parts.clear()
    gc.collect()
    (args.out / "timeline.json").write_text(json.dumps(report, indent=1))
    for row in report["steps"]:
        print(" | ".join(f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}"
                         for key, value in row.items()))  # fmt: skip
    for key in ("isolated_kernel_ms", "torch_on_run_memory_ms", "torch_floor_ms"):
        print(f"{key}: {', '.join(f'{ms:.1f}' for ms in report[key])}")
    print(f"host: {report['host']}")


if __name__ == "__main__":
    main()
