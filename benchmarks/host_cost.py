"""The host's work per training iteration, counted: zero-shard against torch, on the CPU.

On a GPU the host's work per step is time the kernels may wait for, and at small models it is
what sets zero-shard apart from torch's AdamW. Timing it on a CPU would measure the compute, so
it is counted instead, per phase of an iteration (forward, backward, clip, step, zero_grad):

- the Python calls into zero-shard's packages (``zero_shard``, ``optimizers``, ``offload``), on
  the main thread and, apart, on the others (the param gathers);
- the aten ops dispatched on the main thread (a ``TorchDispatchMode``): each is a dispatch, and
  most a kernel launch, on a GPU.

The model is ``examples/gpt.py``'s GPT, narrow (``--d-model``, 16) so that the counts, not the
compute, dominate, at each of ``--layers`` (12 params a layer), fp32, fraction 0, against
torch's fused AdamW with a foreach clip (one process) or DDP + fused AdamW (``--world 2``, gloo).
The counts are deterministic but for the gather thread's few calls (a wait finds its gather
done or not). ``tests/zero_shard/test_host_cost.py`` holds the bounds::

    python benchmarks/host_cost.py --out runs/host_cost              # world 1 and 2, 4 and 8 layers
    python benchmarks/host_cost.py --d-model 64 --out runs/host_cost64  # shards back to back
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import write_json
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, GPTConfig, cross_entropy, weight_decay_groups  # noqa: E402

OURS = tuple(str(ROOT / package) + os.sep for package in ("zero_shard", "optimizers", "offload"))
PHASES = ("forward", "backward", "clip", "step", "zero_grad")
NUM_WARMUP, NUM_STEPS = 2, 3


class _Counts(TorchDispatchMode):
    """Python calls into zero-shard's packages (a profile function, every thread) and aten ops
    (this thread), by phase."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.calls: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()
        self._main = threading.get_ident()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and self.phase and frame.f_code.co_filename.startswith(OURS):
            main = threading.get_ident() == self._main
            self.calls[self.phase if main else "threads"] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.phase:
            self.ops[self.phase] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _profiled(counts: _Counts) -> Iterator[None]:
    sys.setprofile(counts.profile)
    threading.setprofile(counts.profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def _build(
    system: str, num_layers: int, d_model: int
) -> tuple[torch.nn.Module, Any, Callable[[], Any]]:
    import zero_shard

    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers, 2, d_model, 16))
    groups = weight_decay_groups(model, 0.1)
    if system == "zero_shard":
        opt = zero_shard.wrap(torch.optim.AdamW(groups, lr=1e-3), model)
        return model, opt, lambda: opt.clip_grad_norm_(1.0)
    params = list(model.parameters())
    if dist.is_initialized() and dist.get_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    return model, opt, lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)


def count(system: str, num_layers: int, d_model: int = 16) -> dict[str, Any]:
    """Per iteration: calls and ops by phase, for ``system`` (zero_shard or torch)."""
    model, opt, clip = _build(system, num_layers, d_model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    counts = _Counts()
    with _profiled(counts), counts:
        for step in range(NUM_WARMUP + NUM_STEPS):
            counted = step >= NUM_WARMUP
            counts.phase = "forward" if counted else None
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            for name, action in (("backward", loss.backward), ("clip", clip),
                                 ("step", opt.step), ("zero_grad", opt.zero_grad)):  # fmt: skip
                counts.phase = name if counted else None
                action()
            counts.phase = None
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    return {
        "system": system,
        "num_layers": num_layers,
        "num_params": len(list(model.parameters())),
        "calls": {k: counts.calls[k] / NUM_STEPS for k in (*PHASES, "threads")},
        "ops": {k: counts.ops[k] / NUM_STEPS for k in PHASES},
    }


def _worker(
    rank: int, world_size: int, port: int, layers: list[int], d_model: int, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = [count(system, n, d_model) for n in layers for system in ("torch", "zero_shard")]
    if rank == 0:
        write_json(Path(out), [{**row, "world_size": world_size} for row in rows])
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def print_table(rows: list[dict[str, Any]]) -> None:
    """Calls and aten ops per iteration by phase, as a markdown table."""
    print("| world | layers (params) | system | calls: " + " / ".join(PHASES) + " / threads "
          "| aten ops: " + " / ".join(PHASES) + " |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in rows:
        calls = " / ".join(f"{row['calls'][k]:.0f}" for k in (*PHASES, "threads"))
        ops = " / ".join(f"{row['ops'][k]:.0f}" for k in PHASES)
        print(f"| {row['world_size']} | {row['num_layers']} ({row['num_params']}) | "
              f"{row['system']} | {calls} | {ops} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,8", help="GPT layers, comma-separated")
    parser.add_argument(
        "--d-model", type=int, default=16, help="GPT width (64: shards back to back at 2 ranks)"
    )
    parser.add_argument("--worlds", default="1,2", help="process counts, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("runs/host_cost"))
    args = parser.parse_args()
    layers = [int(n) for n in args.layers.split(",")]
    rows = []
    for world_size in (int(w) for w in args.worlds.split(",")):
        out = args.out / f"world{world_size}.json"
        torch.multiprocessing.spawn(
            _worker,
            args=(world_size, _free_port(), layers, args.d_model, str(out)),
            nprocs=world_size,
        )
        rows += json.loads(out.read_text())
    write_json(args.out / "results.json", rows)
    print_table(rows)


if __name__ == "__main__":
    main()
