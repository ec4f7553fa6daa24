"""Data-parallel zero-shard on several GPUs: collectives, one step, and a transformer iteration.

Run with one process per GPU (NCCL), from the repository root::

    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/zero_step.py \\
        --out $OUT/zero_step

Check it without a GPU (CPU + gloo, tiny sizes)::

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/zero_step.py --smoke --out runs/smoke

Three parts, each timed with CUDA events after a barrier; medians over ``--iters`` after
warm-ups. Rank 0 prints tables and writes ``results.json`` to ``--out``.

- ``collectives``: ``reduce_scatter`` and ``all_gather`` of bf16 buffers from 4 MiB to 1 GiB
  (the full, unsharded size), as NCCL bus bandwidth: ``size * (world - 1) / world / time``.
  The reference for 2 x H200, NCCL's own figure measured on 2026-11-22 (1 GiB in 2.0 ms each
  way), is 268 GB/s of bus bandwidth (``*_vs_design`` in the results; docs/benchmarks/zero_step.md).
- ``step``: ``--num-tensors`` fp32 params of 4096 x 4096 (64: 1.07B) with given grads; one timed
  step is everything from the grads on each rank to the updated params on every rank:
  ``ddp_fused_adamw`` (all-reduce the grads in 64 MiB chunks, as DDP's buckets, then
  ``torch.optim.AdamW(fused=True)`` on every param on every rank), ``torch_zero1``
  (the same all-reduce, then ``torch.distributed.optim.ZeroRedundancyOptimizer`` with fused AdamW:
  each rank steps its whole params, then broadcasts them), and ``zero_shard`` stage 2 (the
  reduce-scatter of the grads, the step of this rank's rows, the all-gather; grads assigned before
  each step, so the reduce-scatter runs inside ``step()`` instead of during a backward) and stage
  1, for each of ``--buckets-mb``. fp32 everywhere so that every system does the same arithmetic.
- ``iteration``: the GPT of ``examples/train_gpt.py`` (``--layers`` x ``--width``, bf16, 1024
  tokens a sequence, ``--batch`` sequences per rank) trained with zero-shard stage 2 and AdamW,
  with ``overlap_param_gather`` on and off, for each of ``--buckets-mb``: ``--iters`` iterations
  back to back with no host synchronization between them (as in training), each split into
  forward, backward and step by events on the current stream (and by host clock, ``host_*``).
  With overlap, the all-gathers run during the next forward. ``--profile`` writes the top ops
  of 3 profiled iterations (overlap on, the last bucket size) to ``profile.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    Clock,
    describe_run,
    free_memory,
    init_distributed,
    peak_memory,
    reset_peak_memory,
    write_json,
)

import zero_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

DESIGN_BUS_GBPS = (1 << 30) / 2 / 2.0e-3 / 1e9  # 1 GiB in 2.0 ms on 2 ranks: 268 GB/s


def timed(
    function: Callable[[], None],
    clock: Clock,
    iters: int,
    warmup: int = 3,
    setup: Callable[[], None] | None = None,
) -> float:
    """Median milliseconds of ``function`` (after a barrier each time)."""
    times = []
    for index in range(warmup + iters):
        if setup is not None:
            setup()
        dist.barrier()
        clock.synchronize()
        start = clock.mark()
        function()
        end = clock.mark()
        clock.synchronize()
        if index >= warmup:
            times.append(clock.ms(start, end))
    return statistics.median(times)


def bench_collectives(
    device: torch.device, iters: int, sizes_mib: list[int]
) -> list[dict[str, Any]]:
    world, rows, clock = dist.get_world_size(), [], Clock(device)
    for size_mib in sizes_mib:
        numel = (size_mib << 20) // 2
        full = torch.randn(numel, device=device, dtype=torch.bfloat16)
        shard = torch.empty(numel // world, device=device, dtype=torch.bfloat16)
        row = {"size_mib": size_mib}
        for name, run in (
            ("reduce_scatter", lambda s=shard, f=full: dist.reduce_scatter_tensor(s, f)),
            ("all_gather", lambda s=shard, f=full: dist.all_gather_into_tensor(f, s)),
        ):
            ms = timed(run, clock, iters)
            bus = (size_mib << 20) * (world - 1) / world / (ms * 1e-3) / 1e9
            row[f"{name}_ms"] = ms
            row[f"{name}_bus_gbps"] = bus
            row[f"{name}_vs_design"] = bus / DESIGN_BUS_GBPS
        rows.append(row)
    return rows


def _all_reduce_chunks(flat: torch.Tensor, chunk_numel: int) -> None:
    for start in range(0, flat.numel(), chunk_numel):
        dist.all_reduce(flat[start : start + chunk_numel], op=dist.ReduceOp.AVG)


def bench_step(
    device: torch.device, num_tensors: int, dim: int, iters: int, buckets_mb: list[float]
) -> list[dict[str, Any]]:
    rows, clock = [], Clock(device)
    numel = num_tensors * dim * dim
    gen = torch.Generator(device).manual_seed(dist.get_rank())
    grad_flat = torch.randn(numel, device=device, generator=gen) * 1e-3
    grads = list(grad_flat.view(num_tensors, dim, dim).unbind())

    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [
            torch.nn.Parameter(torch.randn(dim, dim, device=device)) for _ in range(num_tensors)
        ]

    def measure(
        name: str, build: Callable[[], tuple[Callable[[], None], Callable[[], None]]]
    ) -> None:
        free_memory(device)
        base = reset_peak_memory(device)
        run, setup = build()
        ms = timed(run, clock, iters, setup=setup)
        peak = peak_memory(device) - base
        rows.append({"system": name, "step_ms": ms, "peak_gib": peak / 2**30})
        if dist.get_rank() == 0:
            print(f"  {name}: {ms:.1f} ms, peak {peak / 2**30:.2f} GiB", flush=True)

    def ddp() -> tuple[Callable[[], None], Callable[[], None]]:
        ps = params()
        flat = grad_flat.clone()
        for p, g in zip(ps, flat.view(num_tensors, dim, dim).unbind(), strict=True):
            p.grad = g
        opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")

        def run() -> None:
            _all_reduce_chunks(flat, 32 << 20)
            opt.step()

        return run, lambda: flat.copy_(grad_flat)

    def zero1() -> tuple[Callable[[], None], Callable[[], None]]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ps = params()
        flat = grad_flat.clone()
        for p, g in zip(ps, flat.view(num_tensors, dim, dim).unbind(), strict=True):
            p.grad = g
        opt = ZeroRedundancyOptimizer(
            ps,
            optimizer_class=torch.optim.AdamW,
            lr=1e-4,
            weight_decay=0.1,
            fused=device.type == "cuda",
        )

        def run() -> None:
            _all_reduce_chunks(flat, 32 << 20)
            opt.step()

        return run, lambda: flat.copy_(grad_flat)

    def ours(
        stage: int, bucket_mb: float
    ) -> Callable[[], tuple[Callable[[], None], Callable[[], None]]]:
        def build() -> tuple[Callable[[], None], Callable[[], None]]:
            model = torch.nn.ParameterList(params())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
            opt = zero_shard.wrap(
                opt, model, stage=stage, overlap_param_gather=False, bucket_mb=bucket_mb
            )

            def setup() -> None:
                opt.zero_grad()
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.grad = g

            return opt.step, setup

        return build

    measure("ddp_fused_adamw", ddp)
    measure("torch_zero1", zero1)
    for bucket_mb in buckets_mb:
        measure(f"zero_shard_stage2_bucket{bucket_mb:g}", ours(2, bucket_mb))
    measure(f"zero_shard_stage1_bucket{buckets_mb[-1]:g}", ours(1, buckets_mb[-1]))
    return rows


def _train_iterations(
    model: torch.nn.Module,
    opt: zero_shard.ZeroShardOptimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    clock: Clock,
    count: int,
) -> tuple[list[Any], list[list[float]]]:
    """``count`` iterations back to back, no host synchronization between them. Returns the
    clock's marks at each forward's start, forward's end, backward's end and step's end, and one
    after the last (read them after a synchronize); and per iteration the host times of its
    first four marks."""
    device_marks, host = [], []
    for _ in range(count):
        marks = [time.perf_counter()]
        device_marks.append(clock.mark())
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))
        device_marks.append(clock.mark())
        marks.append(time.perf_counter())
        loss.backward()
        device_marks.append(clock.mark())
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        device_marks.append(clock.mark())
        marks.append(time.perf_counter())
        host.append(marks)
    device_marks.append(clock.mark())
    return device_marks, host


def bench_iteration(
    device: torch.device,
    layers: int,
    width: int,
    batch: int,
    seq_len: int,
    iters: int,
    buckets_mb: list[float],
    profile_dir: Path | None,
    gathers: list[str],
) -> list[dict[str, Any]]:
    from gpt import GPT, GPTConfig

    rows, clock = [], Clock(device)
    config = GPTConfig(layers, num_heads=max(width // 128, 1), d_model=width, seq_len=seq_len)
    gen = torch.Generator(device).manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (batch, seq_len + 1), device=device, generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    configs = [(g, b, o) for g in gathers for b in buckets_mb for o in (True, False)]
    for gather, bucket_mb, overlap in configs:
        free_memory(device)
        reset_peak_memory(device)
        torch.manual_seed(0)
        model = GPT(config).to(device, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        opt = zero_shard.wrap(
            opt, model, overlap_param_gather=overlap, bucket_mb=bucket_mb,
            all_gather=_experiment_gather(gather),
        )  # fmt: skip
        _train_iterations(model, opt, inputs, targets, clock, 3)  # warm-up
        dist.barrier()
        clock.synchronize()
        marks, host = _train_iterations(model, opt, inputs, targets, clock, iters)
        clock.synchronize()
        phases = {
            "forward": [clock.ms(marks[4 * i], marks[4 * i + 1]) for i in range(iters)],
            "backward": [clock.ms(marks[4 * i + 1], marks[4 * i + 2]) for i in range(iters)],
            "step": [clock.ms(marks[4 * i + 2], marks[4 * i + 3]) for i in range(iters)],
            "iter": [clock.ms(marks[4 * i], marks[4 * i + 4]) for i in range(iters)],
        }
        row = {
            "gather": gather,
            "nccl_proto": os.environ.get("NCCL_PROTO", "default"),
            "bucket_mb": bucket_mb,
            "overlap_param_gather": overlap,
            "num_params": sum(p.numel() for p in model.parameters()),
            "num_buckets": len(opt.kind.buckets),
        }
        row.update({f"{name}_ms": statistics.median(v) for name, v in phases.items()})
        for name, (a, b) in (("forward", (0, 1)), ("backward", (1, 2)), ("step", (2, 3))):
            row[f"host_{name}_ms"] = statistics.median((m[b] - m[a]) * 1e3 for m in host)
        if opt.num_skipped_steps:
            raise RuntimeError(f"{opt.num_skipped_steps} steps skipped as non-finite")
        row["peak_gib"] = peak_memory(device) / 2**30
        row["tokens_per_s_per_gpu"] = batch * seq_len / (row["iter_ms"] * 1e-3)
        rows.append(row)
        if dist.get_rank() == 0:
            print(f"  {row}", flush=True)
        if profile_dir is not None and overlap and bucket_mb == buckets_mb[-1]:
            _profile(model, opt, inputs, targets, clock, profile_dir / gather)
        opt.finish_param_sync()
        del model, opt
    return rows


def _experiment_gather(kind: str) -> Any:
    """``wrap``'s ``all_gather``: zero-shard's own (``nccl``: None), or the copy-engine all-gather
    of ``_ce_gather`` (``ce``)."""
    if kind == "nccl":
        return None
    from _ce_gather import CopyEngineGather

    return CopyEngineGather(dist.group.WORLD)


def _profile(
    model: torch.nn.Module,
    opt: zero_shard.ZeroShardOptimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    clock: Clock,
    out: Path,
) -> None:
    """Rank 0's profile of 3 iterations: the top ops by device time, by host time and by host
    time of their own (where the runtime's calls show: allocations, synchronizations), as text."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = clock.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        _train_iterations(model, opt, inputs, targets, clock, 3)
        clock.synchronize()
    if dist.get_rank() == 0:
        averages = prof.key_averages()
        device_key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
        text = "\n\n".join(
            [
                averages.table(sort_by=device_key, row_limit=30),
                averages.table(sort_by="cpu_time_total", row_limit=30),
                averages.table(sort_by="self_cpu_time_total", row_limit=30),
            ]
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.txt").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tensors", type=int, default=64, help="4096x4096 fp32 params")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="sequences of 1024 per rank")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--parts", default="collectives,step,iteration")
    parser.add_argument("--buckets-mb", default="64,256", help="zero-shard bucket sizes to run")
    parser.add_argument("--profile", action="store_true", help="write profile.txt to --out")
    parser.add_argument(
        "--gathers", default="nccl", help="param gathers to run: nccl, ce (copy engines; CUDA)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny sizes")
    parser.add_argument("--out", type=Path, default=Path("runs/zero_step"))
    args = parser.parse_args()
    sizes_mib, dim, seq_len = [4, 25, 64, 256, 1024], 4096, 1024
    if args.smoke:
        sizes_mib, dim, seq_len = [1], 64, 32
        args.layers, args.width, args.batch, args.iters = 2, 128, 2, 2
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    device = init_distributed("cpu" if args.smoke else "cuda")
    results: dict[str, Any] = {
        **describe_run(device),
        "world_size": dist.get_world_size(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    parts = args.parts.split(",")
    buckets_mb = [float(b) for b in args.buckets_mb.split(",")]
    if "collectives" in parts:
        results["collectives"] = bench_collectives(device, args.iters, sizes_mib)
    if "step" in parts:
        results["step"] = bench_step(device, args.num_tensors, dim, args.iters, buckets_mb)
    if "iteration" in parts:
        results["iteration"] = bench_iteration(
            device,
            args.layers,
            args.width,
            args.batch,
            seq_len,
            args.iters,
            buckets_mb,
            args.out if args.profile else None,
            args.gathers.split(","),
        )
    if dist.get_rank() == 0:
        write_json(args.out / "results.json", results)
        print(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
