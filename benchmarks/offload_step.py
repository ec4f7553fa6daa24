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
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from _common import (
    Clock,
    device_name,
    free_memory,
    package_version,
    peak_memory,
    reset_peak_memory,
)
from _offload_report import Result, check_targets, fmt, plot, print_report, save_report

from offload import usable_cores
from optimizers import HybridDeviceOptimizer, OffloadPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from megatron_hdo import build_hybrid_device_optimizer
from offload_peers import import_torchao_offload

BATCH = 8  # rows of the tiny matmul per param: dense rank-8 grads
LR = 1e-4
WEIGHT_DECAY = 0.1


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


class Model(NamedTuple):
    """Params on the device and the inputs of their tiny matmuls."""

    params: list[torch.Tensor]  # num_tensors x (dim, dim), requires_grad
    x: torch.Tensor  # (BATCH, dim)
    y: torch.Tensor  # (BATCH, dim)


# ---------------------------------------------------------------------------------------------
# Measuring


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
        gpu_peak_bytes=peak_memory(device) if device.type == "cuda" else None,
        host_rss_bytes=host_rss_bytes(),
        extra=extra or {},
    )


def run_guarded(
    system: str, fraction: float | None, run: Callable[[], Result], device: torch.device
) -> Result:
    """Runs one system with memory freed before and after; a failure is recorded, not raised."""
    free_memory(device)
    reset_peak_memory(device)
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
    workload: Workload, fraction: float, settings: Settings, *, torch_kernel: bool = False
) -> Result:
    """zero-shard with its defaults, or with ``torch_kernel`` torch's fused CPU AdamW and
    separate casts instead of the single-pass kernel."""
    device = settings.device
    model = make_model(workload, device, torch.bfloat16)
    policy = OffloadPolicy(
        fraction=fraction,
        num_threads=settings.threads,
        cpu_kernel="torch" if torch_kernel else "auto",
    )
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
    name = "zero_shard_torch_kernel" if torch_kernel else "zero_shard"
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


def run_torchao(workload: Workload, dtype: torch.dtype, settings: Settings) -> Result:
    device = settings.device
    require_cuda(device)
    try:
        cpu_offload_cls = import_torchao_offload()
    except ImportError as err:
        raise Skip(str(err)) from err
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
    # At 1.0, the single-pass kernel turned off in the same run, to show its share.
    run = functools.partial(run_zero_shard, workload, 1.0, settings, torch_kernel=True)
    runs.append(("zero_shard_torch_kernel", 1.0, run))
    for dtype, name in ((torch.bfloat16, "torchao_bf16"), (torch.float32, "torchao_fp32")):
        runs.append((name, 1.0, functools.partial(run_torchao, workload, dtype, settings)))
    for fraction in settings.peer_fractions:
        run = functools.partial(run_megatron, workload, fraction, settings)
        runs.append(("megatron_hdo", fraction, run))
    for system, fraction, run in runs:
        results.append(run_guarded(system, fraction, run, settings.device))
        save()


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
    return {
        "benchmark": "offload_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": device_name(device),
        "host": platform.node(),
        "usable_cores": usable_cores(),
        "threads": threads,
    }


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
    for entry in report["workloads"]:
        print_report(entry)


if __name__ == "__main__":
    main()
