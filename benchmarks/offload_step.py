"""Times one optimizer step with CPU offload: zero-shard at several fractions, floors and peers.

Every system runs in one process, one after the other, on the same workload: ``--num-tensors``
bf16 params of ``--dim`` x ``--dim`` on the accelerator (default 32 x 4096 x 4096 = 537M params;
``--sizes 88`` also runs 88 tensors, ~1.48B). A timed iteration is ``zero_grad(set_to_none=True)``
+ a backward through one tiny matmul per param (``((x @ p) * y).sum()`` with x, y of shape
(8, dim): dense rank-8 grads made by autograd, so grad hooks fire) + ``opt.step()``. CUDA events
time the whole iteration and the step alone (event before ``step()``, event after it, so the step
time includes the copies back that the next forward would wait for); the device is synchronized
after each iteration; 2 warm-up iterations, then the median of ``--iters`` (default 5).

Run it from the repository root on a GPU machine (estimated 2-3 minutes for the default workload
on an H100 with 16 cores, not yet measured; an extra ``--sizes 88`` workload adds about 3x that)::

    python benchmarks/offload_step.py --out $OUT/bench
    python benchmarks/offload_step.py --device cpu --quick --out runs/smoke   # smoke test, CPU

It writes ``results.json`` (after every system, so a cut-off run keeps what it measured) and
``offload_step.png`` (if matplotlib imports) to ``--out``, then prints the target checks and a
table, last.

Rows (``step ms`` is what the targets use; ``iter ms`` adds zero_grad and the backward):

- ``zero_shard``: ``HybridDeviceOptimizer(params, torch.optim.AdamW,
  policy=OffloadPolicy(fraction=f, num_threads=--threads), lr=1e-4, weight_decay=0.1)``, one row
  per fraction in ``--fractions`` (default 0, 0.25, 0.5, 0.75, 1).
- ``gpu_fused_adamw`` (floor for fraction 0): the least a mixed-precision step on the GPU does,
  on the same bf16 params and grads: cast the bf16 grads into fp32 grads (one
  ``torch._foreach_copy_``), ``torch.optim.AdamW(fused=True)`` on fp32 main copies, cast the fp32
  main weights back into the bf16 params. ``adamw_only_ms`` in the JSON is the AdamW kernel alone.
- ``cpu_fused_adamw`` (floor for the CPU's share): ``torch.optim.AdamW(fused=True)`` on CPU fp32
  params of the same element count with fp32 grads, ``torch.set_num_threads(--threads)``; only
  ``step()`` is timed (``time.perf_counter``). No copies and no casts: the CPU's best case.
- ``pinned_copies``: every bf16 grad device-to-host into one pinned buffer, pinned host-to-device
  into the params, and both at once on two streams (the copy floor of full offload); its
  ``step ms`` is both at once, and each direction alone is printed below it with its GB/s.
- ``torchao_bf16`` / ``torchao_fp32``: ``torchao.optim.CPUOffloadOptimizer(params,
  torch.optim.AdamW, fused=True, offload_gradients=False)`` on bf16 params (bf16 weights and state
  on the CPU: less work, less precision) and on fp32 params (fp32 grads: twice the copy bytes).
  Its grads leave during backward (grad hooks), so compare ``iter ms``, not ``step ms``.
- ``megatron_hdo``: Megatron-Core's ``HybridDeviceOptimizer`` (per-param CPU optimizers on the
  main thread, fused torch AdamW on both devices, ``param_update_in_fp32=True``) at
  ``--peer-fractions``. Peers that do not import are recorded as ``{"skipped": reason}``.

``vs CPU floor x f`` is step ms / (cpu_fused_adamw step ms x fraction): 1.0 means the offloaded
share costs exactly a bare CPU AdamW over it. The project's targets, checked and printed:

- fraction 1.0 step <= 1.15 x the cpu_fused_adamw step;
- fraction 0.5 step <= 0.6 x zero-shard's own fraction-1.0 step;
- fraction 0 step <= 1.1 x the gpu_fused_adamw step.

``--device cpu`` runs zero-shard (the "accelerator" is then the CPU itself) and the CPU floor;
the CUDA-only systems are recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from offload import usable_cores
from optimizers import HybridDeviceOptimizer, OffloadPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from megatron_hdo import build_hybrid_device_optimizer

GIB = 1 << 30
BATCH = 8  # rows of the tiny matmul per param: dense rank-8 grads
LR = 1e-4
WEIGHT_DECAY = 0.1
TARGET_FULL_VS_CPU = 1.15
TARGET_HALF_VS_FULL = 0.6
TARGET_NONE_VS_GPU = 1.1


class Skip(Exception):
    """A system that cannot run here; recorded as ``{"skipped": reason}``."""


@dataclass(frozen=True)
class Workload:
    """The params every system steps: ``num_tensors`` of ``dim`` x ``dim``."""

    num_tensors: int
    dim: int

    @property
    def numel(self) -> int:
        return self.num_tensors * self.dim * self.dim


@dataclass(frozen=True)
class Settings:
    """What is the same for every system of a run."""

    device: torch.device
    warmup: int
    iters: int
    threads: int
    fractions: tuple[float, ...]
    peer_fractions: tuple[float, ...]


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


class Model(NamedTuple):
    """Params on the device and the inputs of their tiny matmuls."""

    params: list[torch.Tensor]  # num_tensors x (dim, dim), requires_grad
    x: torch.Tensor  # (BATCH, dim)
    y: torch.Tensor  # (BATCH, dim)


# ---------------------------------------------------------------------------------------------
# Measuring


class Clock:
    """Timestamps in stream order: CUDA events on a GPU, ``time.perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events = device.type != "cpu"

    def mark(self) -> Any:
        if not self._events:
            return time.perf_counter()
        module = torch.get_device_module(self.device)
        event = module.Event(enable_timing=True)
        event.record(module.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        if self._events:
            torch.get_device_module(self.device).synchronize(self.device)

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``; call after :meth:`synchronize`."""
        return start.elapsed_time(end) if self._events else (end - start) * 1e3


class Timing(NamedTuple):
    iter_samples_ms: list[float]  # empty when only the step is timed
    step_samples_ms: list[float]


def time_iterations(
    step: Callable[[], Any],
    prepare: Callable[[], None] | None,
    clock: Clock,
    settings: Settings,
) -> Timing:
    """Runs ``prepare`` (zero_grad + backward) and ``step`` warmup + iters times, timing each."""
    iter_samples, step_samples = [], []
    for index in range(settings.warmup + settings.iters):
        start = clock.mark()
        if prepare is not None:
            prepare()
        before_step = clock.mark()
        step()
        end = clock.mark()
        clock.synchronize()
        if index >= settings.warmup:
            if prepare is not None:
                iter_samples.append(clock.ms(start, end))
            step_samples.append(clock.ms(before_step, end))
    return Timing(iter_samples, step_samples)


def host_rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # Pinned blocks freed by the last system stay in torch's caching host allocator (and in
        # RSS) until emptied; the private hook exists in CUDA builds of torch >= 2.5.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def median_or_none(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def make_result(
    system: str,
    fraction: float | None,
    timing: Timing,
    device: torch.device,
    extra: dict[str, Any] | None = None,
) -> Result:
    """Medians and memory, measured now (call it while the system is still alive)."""
    return Result(
        system=system,
        fraction=fraction,
        iter_ms=median_or_none(timing.iter_samples_ms),
        step_ms=median_or_none(timing.step_samples_ms),
        iter_samples_ms=timing.iter_samples_ms,
        step_samples_ms=timing.step_samples_ms,
        gpu_peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        host_rss_bytes=host_rss_bytes(),
        extra=extra or {},
    )


def run_guarded(
    system: str, fraction: float | None, run: Callable[[], Result], device: torch.device
) -> Result:
    """Runs one system with memory freed before and after; a failure is recorded, not raised."""
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = host_rss_bytes()
    started = time.perf_counter()
    try:
        result = run()
        if result.host_rss_bytes is not None and rss_before is not None:
            result.host_rss_delta_bytes = result.host_rss_bytes - rss_before
    except Skip as skip:
        result = Result(system, fraction, skipped=str(skip))
    except Exception as err:
        traceback.print_exc()
        result = Result(system, fraction, error=f"{type(err).__name__}: {err}")
    free_memory(device)
    label = system if fraction is None else f"{system} f={fraction:g}"
    status = result.skipped or result.error or f"step {fmt(result.step_ms)} ms"
    print(f"  {label:<28} {time.perf_counter() - started:6.1f} s  {status}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------
# The workload


def make_model(workload: Workload, device: torch.device, dtype: torch.dtype) -> Model:
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (workload.dim, workload.dim)
    params = [
        torch.randn(shape, generator=generator, device=device, dtype=dtype)
        .mul_(0.02)
        .requires_grad_()
        for _ in range(workload.num_tensors)
    ]
    inputs = (BATCH, workload.dim)
    x = torch.randn(inputs, generator=generator, device=device, dtype=dtype)
    y = torch.randn(inputs, generator=generator, device=device, dtype=dtype)
    return Model(params, x, y)


def backward(model: Model) -> None:
    """Autograd fills every ``p.grad`` with x^T @ y (dense), so post-accumulate hooks fire."""
    loss = sum(((model.x @ p) * model.y).float().sum() for p in model.params)
    loss.backward()


def prepare_with(model: Model, zero_grad: Callable[[], None]) -> Callable[[], None]:
    def prepare() -> None:
        zero_grad()
        backward(model)

    return prepare


def zero_model_grads(model: Model) -> None:
    for param in model.params:
        param.grad = None


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise Skip(f"needs a CUDA device (running on {device.type})")


# ---------------------------------------------------------------------------------------------
# Systems


def run_zero_shard(
    workload: Workload, fraction: float, settings: Settings, variant: str = ""
) -> Result:
    """zero-shard with its defaults, or a variant: "torch_kernel" (torch's fused CPU AdamW and
    separate casts) or "hooks" (grads sent D2H from backward hooks rather than at step())."""
    device = settings.device
    model = make_model(workload, device, torch.bfloat16)
    overrides = {
        "": {},
        "torch_kernel": {"cpu_kernel": "torch"},
        "hooks": {"d2h_during_backward": True},
    }[variant]
    policy = OffloadPolicy(fraction=fraction, num_threads=settings.threads, **overrides)
    opt = HybridDeviceOptimizer(
        model.params, torch.optim.AdamW, policy=policy, lr=LR, weight_decay=WEIGHT_DECAY
    )
    timing = time_iterations(
        opt.step,
        prepare_with(model, functools.partial(opt.zero_grad, set_to_none=True)),
        Clock(device),
        settings,
    )
    extra = {
        "memory_report": dataclasses.asdict(opt.memory_report()),
        "policy": dataclasses.asdict(policy),
    }
    name = f"zero_shard_{variant}" if variant else "zero_shard"
    return make_result(name, fraction, timing, device, extra)


def run_gpu_floor(workload: Workload, settings: Settings) -> Result:
    """bf16 grads -> fp32 grads, fused AdamW on fp32 mains, fp32 mains -> bf16 params."""
    device = settings.device
    require_cuda(device)
    model = make_model(workload, device, torch.bfloat16)
    mains = [p.detach().float() for p in model.params]
    for main in mains:
        main.grad = torch.zeros_like(main)
    opt = torch.optim.AdamW(mains, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    clock = Clock(device)
    adamw_marks: list[tuple[Any, Any]] = []

    @torch.no_grad()
    def step() -> None:
        torch._foreach_copy_([m.grad for m in mains], [p.grad for p in model.params])
        start = clock.mark()
        opt.step()
        adamw_marks.append((start, clock.mark()))
        torch._foreach_copy_([p.detach() for p in model.params], mains)

    timing = time_iterations(
        step, prepare_with(model, lambda: zero_model_grads(model)), clock, settings
    )
    adamw = [clock.ms(a, b) for a, b in adamw_marks[settings.warmup :]]
    extra = {"adamw_only_ms": statistics.median(adamw), "adamw_only_samples_ms": adamw}
    return make_result("gpu_fused_adamw", 0.0, timing, device, extra)


def run_cpu_floor(workload: Workload, settings: Settings) -> Result:
    torch.set_num_threads(settings.threads)
    # Random values, drawn once and cloned: torch's CPU RNG is serial (seconds for 1B values), and
    # AdamW's speed does not depend on the values.
    shape = (workload.dim, workload.dim)
    param_values = torch.empty(shape).uniform_(-0.02, 0.02)
    grad_values = torch.empty(shape).uniform_(-1e-3, 1e-3)
    params = [param_values.clone() for _ in range(workload.num_tensors)]
    for param in params:
        param.grad = grad_values.clone()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    cpu = torch.device("cpu")
    timing = time_iterations(opt.step, None, Clock(cpu), settings)
    return make_result("cpu_fused_adamw", 1.0, timing, cpu, {"threads": torch.get_num_threads()})


def time_copies(
    directions: list[tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]], clock: Clock
) -> float:
    """Copies (dst, src) pairs, each list on its stream, all at once; ms until all finished."""
    current = torch.cuda.current_stream()
    start = clock.mark()
    # Every stream waits for the start event before any copy is queued, and the current stream
    # waits for the streams only after all are queued: the directions run at the same time.
    for stream, _ in directions:
        stream.wait_stream(current)
    for stream, pairs in directions:
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
    for stream, _ in directions:
        current.wait_stream(stream)
    end = clock.mark()
    clock.synchronize()
    return clock.ms(start, end)


def run_pinned_copies(workload: Workload, settings: Settings) -> Result:
    device = settings.device
    require_cuda(device)
    model = make_model(workload, device, torch.bfloat16)
    backward(model)
    grads = [p.grad.view(-1) for p in model.params]
    params = [p.detach().view(-1) for p in model.params]
    # Two buffers, so the D2H and H2D of "both" never touch the same host bytes.
    host_in = torch.empty(workload.numel, dtype=torch.bfloat16, pin_memory=True)
    host_out = torch.empty(workload.numel, dtype=torch.bfloat16, pin_memory=True)
    sizes = [g.numel() for g in grads]
    d2h = list(zip(host_in.split(sizes), grads, strict=True))
    h2d = list(zip(params, host_out.split(sizes), strict=True))
    d2h_stream, h2d_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    clock = Clock(device)
    modes = {
        "d2h": [(d2h_stream, d2h)],
        "h2d": [(h2d_stream, h2d)],
        "both": [(d2h_stream, d2h), (h2d_stream, h2d)],
    }
    samples: dict[str, list[float]] = {}
    for mode, directions in modes.items():
        runs = [time_copies(directions, clock) for _ in range(settings.warmup + settings.iters)]
        samples[mode] = runs[settings.warmup :]
    num_bytes = workload.numel * 2
    extra: dict[str, Any] = {"bytes_each_way": num_bytes, "pinned": host_in.is_pinned()}
    for mode, runs in samples.items():
        median = statistics.median(runs)
        extra[f"{mode}_ms"] = median
        extra[f"{mode}_samples_ms"] = runs
        extra[f"{mode}_gb_per_s"] = num_bytes / median / 1e6
    return make_result("pinned_copies", None, Timing([], samples["both"]), device, extra)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_torchao_offload() -> type:
    reasons = []
    for module_name in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            return importlib.import_module(module_name).CPUOffloadOptimizer
        except Exception as err:
            reasons.append(f"{module_name}: {type(err).__name__}: {err}")
    raise Skip(f"torchao CPUOffloadOptimizer does not import ({'; '.join(reasons)})")


def run_torchao(workload: Workload, dtype: torch.dtype, settings: Settings) -> Result:
    device = settings.device
    require_cuda(device)
    cpu_offload_cls = import_torchao_offload()
    model = make_model(workload, device, dtype)
    opt = cpu_offload_cls(
        model.params,
        torch.optim.AdamW,
        fused=True,
        offload_gradients=False,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
    )
    prepare = prepare_with(model, functools.partial(opt.zero_grad, set_to_none=True))
    timing = time_iterations(opt.step, prepare, Clock(device), settings)
    name = "torchao_bf16" if dtype == torch.bfloat16 else "torchao_fp32"
    extra = {"param_dtype": str(dtype), "version": package_version("torchao")}
    return make_result(name, 1.0, timing, device, extra)


def run_megatron(workload: Workload, fraction: float, settings: Settings) -> Result:
    device = settings.device
    require_cuda(device)
    model = make_model(workload, device, torch.bfloat16)
    try:
        opt = build_hybrid_device_optimizer(
            [{"params": model.params, "weight_decay": WEIGHT_DECAY}],
            offload_fraction=fraction,
            lr=LR,
            betas=(0.9, 0.999),  # AdamW's default, as every other system here
        )
    except ImportError as err:
        raise Skip(str(err)) from err
    prepare = prepare_with(model, functools.partial(opt.zero_grad, set_to_none=True))
    timing = time_iterations(opt.step, prepare, Clock(device), settings)
    extra = {"version": package_version("megatron-core")}
    return make_result("megatron_hdo", fraction, timing, device, extra)


def run_workload(
    workload: Workload, settings: Settings, results: list[Result], save: Callable[[], None]
) -> None:
    """Every system on ``workload``, appended to ``results``; ``save`` is called after each."""
    runs: list[tuple[str, float | None, Callable[[], Result]]] = [
        ("cpu_fused_adamw", 1.0, functools.partial(run_cpu_floor, workload, settings)),
        ("gpu_fused_adamw", 0.0, functools.partial(run_gpu_floor, workload, settings)),
        ("pinned_copies", None, functools.partial(run_pinned_copies, workload, settings)),
    ]
    for fraction in settings.fractions:
        run = functools.partial(run_zero_shard, workload, fraction, settings)
        runs.append(("zero_shard", fraction, run))
    # At 1.0, each of the step's two mechanisms turned off in the same run, to show its share.
    for variant in ("torch_kernel", "hooks"):
        run = functools.partial(run_zero_shard, workload, 1.0, settings, variant)
        runs.append((f"zero_shard_{variant}", 1.0, run))
    for dtype, name in ((torch.bfloat16, "torchao_bf16"), (torch.float32, "torchao_fp32")):
        runs.append((name, 1.0, functools.partial(run_torchao, workload, dtype, settings)))
    for fraction in settings.peer_fractions:
        run = functools.partial(run_megatron, workload, fraction, settings)
        runs.append(("megatron_hdo", fraction, run))
    for system, fraction, run in runs:
        results.append(run_guarded(system, fraction, run, settings.device))
        save()


# ---------------------------------------------------------------------------------------------
# Reporting


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


def print_report(workload: Workload, results: list[Result], targets: list[dict[str, Any]]) -> None:
    print(
        f"\nworkload: {workload.num_tensors} x {workload.dim}x{workload.dim} bf16 = "
        f"{workload.numel / 1e6:.0f}M params"
    )
    for target in targets:
        ratio = fmt(target["ratio"], 2)
        print(f"  target: {target['target']:<46} ratio {ratio:>5}  {target['verdict']}")
    print(format_row(list(HEADER), ""))
    for cells, note in table_rows(results):
        print(format_row(cells, note))


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


# ---------------------------------------------------------------------------------------------
# Main


def parse_floats(text: str) -> tuple[float, ...]:
    return tuple(float(item) for item in text.split(",") if item.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(",") if item.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--num-tensors", type=int, default=32, help="params per workload (default 32)"
    )
    parser.add_argument(
        "--dim", type=int, default=4096, help="each param is dim x dim (default 4096)"
    )
    parser.add_argument(
        "--sizes",
        default="",
        help="more workloads, as comma-separated --num-tensors values (e.g. 88)",
    )
    parser.add_argument(
        "--fractions", default="0,0.25,0.5,0.75,1", help="zero-shard offload fractions"
    )
    parser.add_argument("--peer-fractions", default="0.5,1", help="Megatron HDO offload fractions")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed iterations first (default 2)"
    )
    parser.add_argument(
        "--threads", type=int, default=usable_cores(), help="CPU threads (default: usable cores)"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", default="runs/offload_step", help="output folder")
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 x 1024x1024, 2 iters")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_tensors, args.dim, args.iters = 4, 1024, 2
    return args


def describe_environment(device: torch.device, threads: int) -> dict[str, Any]:
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine()
    return {
        "benchmark": "offload_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": device_name,
        "host": platform.node(),
        "usable_cores": usable_cores(),
        "threads": threads,
    }


def save_report(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """Writes results.json from ``report`` (whose workloads hold Result objects); returns it."""
    workloads = [
        {**entry, "results": [dataclasses.asdict(result) for result in entry["results"]]}
        for entry in report["workloads"]
    ]
    payload = {**report, "workloads": workloads}
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a GPU; use --device cpu --quick on a CPU machine")
        device = torch.device("cuda", torch.cuda.current_device())
    settings = Settings(
        device=device,
        warmup=args.warmup,
        iters=args.iters,
        threads=args.threads,
        fractions=parse_floats(args.fractions),
        peer_fractions=parse_floats(args.peer_fractions),
    )
    torch.set_num_threads(args.threads)  # the main thread's CPU work (torchao, Megatron) too
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = describe_environment(device, args.threads)
    report["settings"] = {
        **{k: v for k, v in dataclasses.asdict(settings).items() if k != "device"},
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "batch": BATCH,
    }
    report["workloads"] = []
    workloads = [Workload(n, args.dim) for n in (args.num_tensors, *parse_ints(args.sizes))]
    for workload in workloads:
        print(
            f"workload {workload.num_tensors} x {workload.dim}x{workload.dim} "
            f"({workload.numel / 1e6:.0f}M params)",
            flush=True,
        )
        results: list[Result] = []
        entry = {
            "num_tensors": workload.num_tensors,
            "dim": workload.dim,
            "dtype": "bfloat16",
            "num_params": workload.numel,
            "results": results,
        }
        report["workloads"].append(entry)
        run_workload(workload, settings, results, functools.partial(save_report, report, out))
        entry["targets"] = check_targets(results)
    payload = save_report(report, out)
    why_no_plot = plot(payload, out / "offload_step.png")
    wrote = "no plot: " + why_no_plot if why_no_plot else f"wrote {out / 'offload_step.png'}"
    print(f"\nwrote {out / 'results.json'}; {wrote}")
    for workload, entry in zip(workloads, report["workloads"], strict=True):
        print_report(workload, entry["results"], entry["targets"])


if __name__ == "__main__":
    main()
