"""What the backward hooks cost: backward's wall time and its GPU time, hooks on and off.

HybridDeviceOptimizer sends each offloaded grad to the host from a post-accumulate-grad hook.
This times, for bf16 params at full offload, ``loss.backward()`` on the host clock and on CUDA
events, with ``d2h_during_backward`` on and off, and the host time spent inside the hooks.

    PYTHONPATH=$PWD python benchmarks/backward_hooks.py --num-tensors 32 --dim 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from optimizers import HybridDeviceOptimizer, OffloadPolicy, _host_part


def measure(num_tensors: int, dim: int, hooks: bool, iters: int) -> dict[str, float]:
    params = [
        torch.nn.Parameter(torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16) * 0.02)
        for _ in range(num_tensors)
    ]
    policy = OffloadPolicy(fraction=1.0, d2h_during_backward=hooks)
    opt = HybridDeviceOptimizer(params, policy=policy, lr=1e-4)
    x = torch.randn(8, dim, device="cuda", dtype=torch.bfloat16)
    hook_seconds = []
    original = _host_part.HostPart.send_grad

    def timed_send(self, record):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        original(self, record)
        hook_seconds.append(time.perf_counter() - start)

    _host_part.HostPart.send_grad = timed_send
    try:
        host_ms, gpu_ms, hook_ms = [], [], []
        for index in range(iters + 2):
            opt.zero_grad(set_to_none=True)
            loss = sum(
                ((x @ p).float().square().mean() for p in params), torch.zeros((), device="cuda")
            )
            torch.cuda.synchronize()
            hook_seconds.clear()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            loss.backward()
            end.record()
            host = time.perf_counter() - start
            torch.cuda.synchronize()
            if index >= 2:
                host_ms.append(host * 1e3)
                gpu_ms.append(begin.elapsed_time(end))
                hook_ms.append(sum(hook_seconds) * 1e3)
            opt.step()
            torch.cuda.synchronize()
    finally:
        _host_part.HostPart.send_grad = original
    return {
        "backward_host_ms": statistics.median(host_ms),
        "backward_gpu_ms": statistics.median(gpu_ms),
        "inside_hooks_host_ms": statistics.median(hook_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-tensors", type=int, default=32)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    report = {
        f"hooks_{'on' if hooks else 'off'}": measure(args.num_tensors, args.dim, hooks, args.iters)
        for hooks in (True, False)
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
