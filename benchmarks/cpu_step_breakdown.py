"""Where a full-offload step spends its CPU time: the casts around the CPU AdamW, per chunk.

Times, on this host's CPU with the zero-shard thread budget, for ``--numel`` elements cut into
chunks of ``--chunk-numel``: the bf16 -> fp32 grad cast, torch's fused AdamW, the fp32 -> bf16
weight cast, the three back to back (HybridDeviceOptimizer with ``cpu_kernel="torch"``), and
zero-shard's single-pass kernel that does all three in one pass (``cpu_kernel="fused"``). Then a
``torch.profiler`` summary of one HybridDeviceOptimizer step at fraction 1 on CUDA, if present.

    python benchmarks/cpu_step_breakdown.py --out $OUT/breakdown.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _common import median_ms, write_json

from offload import resolve_thread_budget
from optimizers._cpu_kernel import CpuAdamKernel, KernelPiece, load_cpu_adam


def cpu_breakdown(numel: int, chunk_numel: int, repeat: int) -> dict[str, float]:
    num_chunks = max(numel // chunk_numel, 1)
    staging = [torch.randn(chunk_numel).to(torch.bfloat16) for _ in range(num_chunks)]
    grads = [torch.empty(chunk_numel) for _ in range(num_chunks)]
    mains = [torch.randn(chunk_numel) for _ in range(num_chunks)]
    for main, grad in zip(mains, grads, strict=True):
        main.grad = grad
    optimizers = [torch.optim.AdamW([m], lr=1e-4, fused=True) for m in mains]
    for grad, stage in zip(grads, staging, strict=True):
        grad.copy_(stage)

    def cast_in() -> None:
        for grad, stage in zip(grads, staging, strict=True):
            grad.copy_(stage)

    def adamw() -> None:
        for optimizer in optimizers:
            optimizer.step()

    def cast_out() -> None:
        for stage, main in zip(staging, mains, strict=True):
            stage.copy_(main)

    def pipeline() -> None:
        for optimizer, grad, stage, main in zip(optimizers, grads, staging, mains, strict=True):
            grad.copy_(stage)
            optimizer.step()
            stage.copy_(main)

    one = torch.optim.AdamW(mains, lr=1e-4, fused=True)
    kernel_ms = None
    library = load_cpu_adam()
    if library is not None:
        kernel = CpuAdamKernel(library, torch.optim.AdamW, torch.get_num_threads())
        states = [
            {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(m),
                "exp_avg_sq": torch.zeros_like(m),
            }
            for m in mains
        ]
        group = one.param_groups[0]

        def fused_kernel() -> None:
            for main, stage, state in zip(mains, staging, states, strict=True):
                kernel.step([KernelPiece(main, stage, state)], group)

        kernel_ms = median_ms(fused_kernel, repeat)
    return {
        "single_pass_kernel_ms": kernel_ms,
        "num_chunks": num_chunks,
        "cast_in_ms": median_ms(cast_in, repeat),
        "adamw_per_chunk_ms": median_ms(adamw, repeat),
        "adamw_one_call_ms": median_ms(one.step, repeat),
        "cast_out_ms": median_ms(cast_out, repeat),
        "cast_adamw_cast_ms": median_ms(pipeline, repeat),
    }


def profile_step(numel_per_tensor: int, num_tensors: int) -> list[tuple[str, float, int]]:
    from optimizers import HybridDeviceOptimizer

    params = [
        torch.nn.Parameter(torch.randn(numel_per_tensor, device="cuda", dtype=torch.bfloat16))
        for _ in range(num_tensors)
    ]
    opt = HybridDeviceOptimizer(params, offload_fraction=1.0, lr=1e-4)
    for param in params:
        param.grad = torch.randn_like(param)
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if (
            event.key.startswith("zero_shard::")
            or event.key.startswith("aten::copy_")
            or "adam" in event.key
        ):
            rows.append((event.key, event.cpu_time_total / 1e3, event.count))
    return sorted(rows, key=lambda row: -row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=32 * 4096 * 4096)
    parser.add_argument("--chunk-numel", type=int, default=1 << 24)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    threads = resolve_thread_budget().num_threads
    torch.set_num_threads(threads)
    report = {"threads": threads, "torch": torch.__version__}
    report["cpu"] = cpu_breakdown(args.numel, args.chunk_numel, args.repeat)
    if torch.cuda.is_available():
        report["profile_fraction_1"] = profile_step(
            args.chunk_numel, args.numel // args.chunk_numel
        )
    print(json.dumps(report, indent=1))
    if args.out:
        write_json(Path(args.out), report)


if __name__ == "__main__":
    main()
