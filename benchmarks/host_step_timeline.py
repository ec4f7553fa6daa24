"""Where a full-offload iteration goes: ``examples/train_gpt.py`` with the host step's chunks timed.

Runs the example in this process (under ``torchrun`` for one rank, as the example runs) with the
host pipeline's worker functions wrapped to note, per chunk, when the worker took it, when its
kernel started and ended, and how many pieces it stepped; the example's phase events are mapped
onto the host clock (a device event recorded when each step starts, with the device idle after
the last step's synchronize). Then, per step, the iteration (end of backward to end of the next
backward) split into:

- ``lag``: end of backward -> the first chunk's kernel (clip, ``step()``'s host code, the first
  chunk's D2H); ``lag_host`` until the host began the host step (negative where it began before
  the device finished backward) and ``lag_worker`` from then (or from the end of backward, if
  later) to the first kernel;
- ``kernels`` and ``gaps``: the CPU step's wall time, as kernel time and the worker's waits
  between kernels (for a chunk's grads to land, for the GIL);
- ``tail``: the last kernel -> the end of the next step's first forward (its last H2D, the
  forward of the units that waited for it).

With ``--floor-every K`` the floor is also sampled *between* training steps: before each step
whose index (from 0) is a multiple of K, from index 2 on, once the worker and the copier are
done with the step in flight and the device is idle, torch's fused CPU AdamW steps fresh fp32
tensors of as many elements as the host step, with all the host's cores
(``interleaved_floor_ms``). The rows a sample disturbs are left out (``steady``: the row holding
it, and for a delayed update also the next, whose wait for the CPU step the sample took); each
other row is set against the samples just before and after it (``interleaved``): its ``ratio``
is iteration / (backward + floor) for the exact step and iteration / max(forward + backward,
floor) for a delayed update (``-- --delayed-update``), the project's bounds (targets 1.10 and
1.15; docs/benchmarks/host_step_timeline.md).
The host's memory speed moves by up to 1.7x within seconds on the GPU machines' hosts, so a floor
measured after the run (as ``e2e_gpt.py`` does) can be off by as much; samples seconds apart from
the step they bound are the fair measure.

After the run, interleaved, the kernel steps the same chunks again alone (``isolated_kernel_ms``:
the kernel's own floor in this process; more steps of the live optimizer, whose state is
then of no further use), torch's fused CPU AdamW steps the same main weights and state
(``torch_on_run_memory_ms``), copies of them (``torch_on_copies_ms``) and as many fresh fp32
elements (``torch_floor_ms``); then ``memory_map`` times the host's memory over the run's pages
against fresh ones, region by region. The report also names the host's CPU model, usable cores
and NUMA nodes (``host``). The wrapped functions are private (``optimizers._host_part``): this is a
diagnosis tool for the host pipeline, not an API. Results go to ``--out``/timeline.json and are
printed; flags after ``--`` go to the example (``-- --delayed-update``)::

    torchrun --standalone --nproc-per-node 1 benchmarks/host_step_timeline.py --out $OUT/tl \\
        -- --device cuda --preset 1b --offload-fraction 1 --steps 12
    torchrun --standalone --nproc-per-node 1 benchmarks/host_step_timeline.py --floor-every 2 \\
        --out $OUT/tl -- --device cuda --preset 1b --offload-fraction 1 --steps 16
    torchrun --standalone --nproc-per-node 1 benchmarks/host_step_timeline.py --floor-every 3 \\
        --out $OUT/tl -- --device cuda --preset 1b --offload-fraction 1 --steps 20 --delayed-update
    python benchmarks/host_step_timeline.py --out runs/tl -- --device cpu --preset tiny --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
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
from _common import split_at_dashes  # noqa: E402

import optimizers._host_part as host_part  # noqa: E402
from optimizers._cpu_kernel import KernelPiece  # noqa: E402

now = time.perf_counter


@dataclasses.dataclass
class ChunkTiming:
    """Host times of one chunk's turn on the worker (``time.perf_counter`` seconds)."""

    pieces: int  # the pieces it stepped (params with a grad)
    taken: float  # the worker took the chunk
    chunks: int = 1  # the chunks its kernel call stepped: itself and those merged after it
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
        self.floor: FloorSampler | None = None  # --floor-every: samples between steps
        self._timing_of: dict[int, ChunkTiming] = {}  # id(job) -> its timing, while it runs

    def install(self) -> None:
        run_job, step_chunk, start = (
            host_part._run_job,
            host_part._step_chunk,
            host_part.HostPart.start,
        )
        recorder = self

        def timed_run_job(step: Any, position: int, job: Any, *args: Any) -> bool:
            timing = ChunkTiming(pieces=len(job.active), taken=now())
            recorder.chunks.append(timing)
            recorder._timing_of[id(job)] = timing
            try:
                return run_job(step, position, job, *args)
            finally:
                del recorder._timing_of[id(job)]

        def timed_step_chunk(job: Any, *args: Any) -> None:
            timing = recorder._timing_of[id(job)]
            followers = args[2] if len(args) > 2 else ()  # merged into its kernel call
            timing.chunks += len(followers)
            timing.pieces += sum(len(follower.active) for follower in followers)
            timing.kernel_start = now()
            step_chunk(job, *args)
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
                if recorder.floor is not None:  # before t0: in the last row, not this step
                    recorder.floor.maybe_sample(len(recorder.steps), recorder.parts)
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
            "forward_ms": 1e3 * _phase_seconds(after, "forward"),  # the next step's: in the row
            "backward_ms": 1e3 * _phase_seconds(after, "backward"),
            "lag_ms": 1e3 * (first - backward_end),
            # of which until the host began the step (HostPart.start; negative: before the
            # device finished backward), then until the first chunk's kernel (the worker)
            "lag_host_ms": 1e3 * (began[-1] - backward_end),
            "lag_worker_ms": 1e3 * (first - max(began[-1], backward_end)),
            "cpu_wall_ms": 1e3 * (last - first),
            "kernels_ms": 1e3 * kernels,
            "gaps_ms": 1e3 * (last - first - kernels),
            "tail_ms": 1e3 * (next_forward_end - last),
            "num_chunks": sum(c.chunks for c in mine),
            "num_calls": len(mine),  # kernel calls (chunks merged into one: one call)
            "most_pieces": most.pieces,
            "most_pieces_kernel_ms": 1e3 * (most.kernel_end - most.kernel_start),
        })  # fmt: skip
    return rows


def _phase_seconds(step: StepMarks, name: str) -> float:
    return sum(end - start for phase, start, end in step.phases if phase == name)


class FloorSampler:
    """torch's fused CPU AdamW over fresh fp32 tensors as large as the host step (all the host's
    cores), timed before each training step whose index is a multiple of ``every`` (from 2 on),
    with the host step quiet: the CPU AdamW floor at the moment of the steps around it."""

    def __init__(self, every: int, num_threads: int) -> None:
        self.every = every
        self.num_threads = num_threads
        self.samples: list[tuple[int, float]] = []  # (the step it preceded, ms)
        self._step: Callable[[], None] | None = None  # built at the first sample

    def maybe_sample(self, step_index: int, parts: list[host_part.HostPart]) -> None:
        """Before step ``step_index``: builds the tensors and state before the second step (in
        the first row, which no report holds), then samples before every ``every``-th."""
        if not parts or not (step_index == 1 or (step_index >= 2 and step_index % self.every == 0)):
            return
        _wait_until_quiet(parts)
        before = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            if self._step is None:  # its first step (state, page faults) is not a sample
                numel = sum(chunk.main.numel() for part in parts for chunk in part.chunks)
                self._step = _torch_over([torch.randn(numel)], None)
            if step_index >= 2:
                start = now()
                self._step()
                self.samples.append((step_index, 1e3 * (now() - start)))
        finally:
            torch.set_num_threads(before)

    def run_once(self) -> float:
        """One more timed step, for the floors after the run (``isolated_ms``)."""
        if self._step is None:
            raise AssertionError("expected a sample taken during the run")
        start = now()
        self._step()
        return 1e3 * (now() - start)


def _wait_until_quiet(parts: list[host_part.HostPart]) -> None:
    """Waits until the worker stepped every chunk in flight and the copier queued their copies,
    then until the device ran them: nothing of the host step runs during a floor sample. Nothing
    is completed, so the step then goes on as it would have (a delayed update keeps its lag)."""
    for part in parts:
        pending = part.pending
        if pending is not None:
            pending.wait_worker()
        copier = getattr(part.staging, "_copier", None)  # bounded staging's
        if copier is not None:  # runs in order: a no-op is done after the last copy
            copier.submit(int).result()
        if part.engine.device.type != "cpu":
            torch.get_device_module(part.engine.device).synchronize()


def steady(k: int, sampled: set[int], *, delayed: bool) -> bool:
    """Whether row ``k`` (from the end of backward k to that of k + 1) ran as in a run with no
    samples. A sample before step j lies in row j - 1. A delayed update's row also starts by
    waiting for the CPU step launched in the row before, which a sample before step k (or the
    example's settled first step, for row 1) has already waited for."""
    if k + 1 in sampled:
        return False
    return not delayed or (k >= 2 and k not in sampled)


def interleaved_rows(
    rows: list[dict[str, float]], samples: list[tuple[int, float]], *, delayed: bool
) -> dict[str, Any]:
    """The steady rows, each against the last sample before it and the first after it."""
    floor_before = dict(samples)
    bound_name = "max(forward + backward, floor)" if delayed else "backward + floor"
    kept = []
    for row in rows:
        k = row["step"]
        if not steady(k, set(floor_before), delayed=delayed):
            continue
        before = [j for j in floor_before if j <= k]
        after = [j for j in floor_before if j >= k + 2]
        around = [floor_before[j] for j in (max(before, default=None), min(after, default=None))
                  if j is not None]  # fmt: skip
        if not around:
            continue
        floor = sum(around) / len(around)
        if delayed:
            bound = max(row["forward_ms"] + row["backward_ms"], floor)
        else:
            bound = row["backward_ms"] + floor
        kept.append({"step": k, "iteration_ms": row["iteration_ms"], "floor_ms": around,
                     "bound_ms": bound, "ratio": row["iteration_ms"] / bound})  # fmt: skip
    ratios = [row["ratio"] for row in kept]
    return {
        "bound": f"iteration / ({bound_name})",
        "target": 1.15 if delayed else 1.10,  # the project's targets
        "rows": kept,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_max": max(ratios, default=None),
    }


@torch.no_grad()
def _kernel_over_chunks(parts: list[host_part.HostPart]) -> Callable[[], None]:
    """The kernel over every chunk again, one call per chunk as in the run (staging holds the
    last step's weights: finite values)."""
    calls = []
    for part in parts:
        for position, chunk in enumerate(part.chunks):
            if chunk.kernel is None:
                continue
            staging = part.staging.view(part.staging.slot(position, chunk), chunk.spec)
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
    parts: list[host_part.HostPart],
    num_threads: int,
    repeat: int = 3,
    floor: FloorSampler | None = None,
) -> dict[str, list[float]]:
    """After the run, interleaved: the kernel over the run's chunks (``isolated_kernel_ms``: its
    own floor in this process), torch's fused AdamW over the same main weights and state
    (``torch_on_run_memory_ms``), over copies of them made now (``torch_on_copies_ms``: the same
    tensors, fresh pages) and over fresh tensors of as many elements (``torch_floor_ms``: one
    tensor). torch over the run's tensors has been 5-80% slower than over one fresh tensor; the
    copies tell the pages (the run's memory) from the layout (many tensors, some small).
    Measured interleaved because the host's memory speed moves: on one H100 host the same kernel
    over the same chunks took 343.7 and then 201.0 ms seconds apart. Each repeat steps the live
    optimizer's state twice more (kernel and torch): it is of no further use. The fresh tensors
    sit beside the run's, with the copies about three times the run's host memory (fine at 1B); with
    ``floor`` (a sampler that ran during the run) its tensors are the fresh ones."""
    pieces = [p for part in parts for chunk in part.chunks if chunk.kernel is not None
              for _, p in chunk.pieces]  # fmt: skip
    if floor is None or not floor.samples:
        fresh_floor = _torch_over([torch.randn(piece.main.numel()) for piece in pieces], None)
    else:
        fresh_floor = floor.run_once
    copies = [(p.main.clone(), {k: v.clone() for k, v in p.state.items()}) for p in pieces]
    runs = {
        "isolated_kernel_ms": _kernel_over_chunks(parts),
        "torch_on_run_memory_ms": _torch_over([p.main for p in pieces], [p.state for p in pieces]),
        "torch_on_copies_ms": _torch_over([m for m, _ in copies], [s for _, s in copies]),
        "torch_floor_ms": fresh_floor,
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


@torch.no_grad()
def memory_map(
    parts: list[host_part.HostPart],
    num_threads: int,
    region_bytes: int = 256 << 20,
    passes: int = 3,
) -> dict[str, Any]:
    """The host's memory speed over the run's own pages against fresh pages: an in-place
    ``mul_(1.0)`` (each element read and written, values unchanged) timed over each
    ``region_bytes`` of the run's main weights and of its largest moments, then over as many
    fresh bytes, ``passes`` times in turn, all the host's cores. GB/s per region and pass (read
    + write bytes / time): slow regions that stay slow would mean the run's pages themselves are
    slower (where the host placed them), a spread that moves from pass to pass the host's
    moment."""
    numel = region_bytes // 4
    run_tensors = [flat for part in parts for flat in part._main_flats]
    run_tensors += [p.state[name] for part in parts for chunk in part.chunks
                    if chunk.kernel is not None for _, p in chunk.pieces
                    if p.main.numel() >= numel for name in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    run = [t.view(-1)[i : i + numel] for t in run_tensors
           for i in range(0, t.numel() - numel + 1, numel)]  # fmt: skip
    fresh = [torch.ones(numel) for _ in run]
    gbps: dict[str, list[list[float]]] = {"run": [], "fresh": []}
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for _ in range(passes):
            for name, regions in (("run", run), ("fresh", fresh)):
                speeds = []
                for region in regions:
                    start = now()
                    region.mul_(1.0)
                    speeds.append(2 * region_bytes / (now() - start) / 1e9)
                gbps[name].append(speeds)
    finally:
        torch.set_num_threads(before)
    return {"region_bytes": region_bytes, "gbps": gbps}


def describe_host() -> dict[str, Any]:
    """The host's CPU model, usable cores and NUMA nodes: the kernel's speed against torch's
    floor has differed between machines of the same kind."""
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
    own, example = split_at_dashes(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/host_step_timeline"))
    parser.add_argument("--floor-every", type=int, default=0, metavar="K",
                        help="sample the CPU AdamW floor before every K-th step (K >= 2; 0: not "
                        "during the run)")  # fmt: skip
    parser.add_argument("--map-region-mib", type=int, default=256, metavar="MIB",
                        help="the memory map's region size (default 256)")  # fmt: skip
    args = parser.parse_args(own)
    if args.floor_every == 1 or args.floor_every < 0:
        parser.error(f"--floor-every must be 0 or at least 2, got {args.floor_every}: a row "
                     "holding a sample is left out, so every step cannot have one")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder()
    if args.floor_every:
        recorder.floor = FloorSampler(args.floor_every, len(os.sched_getaffinity(0)))
    recorder.install()
    log = train_gpt.main([*example, "--quiet", "--eval-every", "0", "--out", str(args.out / "run")])
    threads = [part.threads.num_threads for part in recorder.parts if part.threads is not None]
    rows = split_steps(recorder)
    report: dict[str, Any] = {
        "example_flags": example,
        # With --floor-every, the log's mean leaves out the waits before the samples (they lie
        # between its steps): read the rows instead.
        "iteration_ms": log["summary"]["iteration_ms"],
        "threads": threads,
        "steps": rows,
    }
    if recorder.floor is not None:
        report["interleaved_floor_ms"] = recorder.floor.samples
        report["interleaved"] = interleaved_rows(
            rows, recorder.floor.samples, delayed="--delayed-update" in example
        )
    threads_after = max(threads, default=os.cpu_count() or 1)
    report.update(isolated_ms(recorder.parts, threads_after, floor=recorder.floor))
    report["memory_map"] = memory_map(recorder.parts, threads_after, args.map_region_mib << 20)
    report["host"] = describe_host()
    recorder.parts.clear()
    gc.collect()
    (args.out / "timeline.json").write_text(json.dumps(report, indent=1))
    for row in report["steps"]:
        print(" | ".join(f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}"
                         for key, value in row.items()))  # fmt: skip
    for key in ("isolated_kernel_ms", "torch_on_run_memory_ms", "torch_on_copies_ms",
                "torch_floor_ms"):  # fmt: skip
        print(f"{key}: {', '.join(f'{ms:.1f}' for ms in report[key])}")
    for name, passes in report["memory_map"]["gbps"].items():
        spans = [f"{statistics.median(p):.0f} ({min(p):.0f}-{max(p):.0f})" for p in passes if p]
        print(f"memory map, {name} pages, GB/s per pass, median (min-max): {', '.join(spans)}")
    if "interleaved" in report:
        interleaved = report["interleaved"]
        samples = ", ".join(f"{ms:.1f} (step {j})" for j, ms in report["interleaved_floor_ms"])
        print(f"interleaved floor samples, ms (before step): {samples}")
        for row in interleaved["rows"]:
            floors = ", ".join(f"{ms:.1f}" for ms in row["floor_ms"])
            print(f"step {row['step']}: iteration {row['iteration_ms']:.1f}, floor {floors}, "
                  f"bound {row['bound_ms']:.1f}, ratio {row['ratio']:.3f}")  # fmt: skip
        print(f"{interleaved['bound']}: median {interleaved['ratio_median']}, max "
              f"{interleaved['ratio_max']} (target {interleaved['target']})")  # fmt: skip
    print(f"host: {report['host']}")


if __name__ == "__main__":
    main()
