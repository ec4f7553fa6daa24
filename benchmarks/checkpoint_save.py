"""Checkpoints of a zero-shard optimizer through DCP on several GPUs: save, async save, load.

Run with one process per GPU (NCCL), from the repository root::

    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/checkpoint_save.py \\
        --out $OUT/checkpoint_save

Check it without a GPU (CPU + gloo, a tiny size), under torchrun or as one process::

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/checkpoint_save.py --smoke --out runs/smoke
    PYTHONPATH=$PWD python benchmarks/checkpoint_save.py --smoke --out runs/smoke

The params: ``--params-b`` billion params (``--dtype``, default bf16), a stack of bias-free
``nn.Linear(4096, 4096)`` (1.0: 60 layers, 1.007B), replicated on every rank and wrapped with
``zero_shard.wrap`` (AdamW, stage 2, ``OffloadPolicy(fraction=--fraction)``: at 0.5, half of each
rank's fp32 main weights and AdamW state on the GPU, half in host memory), trained one step so the
state holds values. A bf16 checkpoint holds the model (2 bytes a param, written once) and the
sharded fp32 ``main_param``, ``exp_avg`` and ``exp_avg_sq`` (12 bytes a param): 14 GB for 1B
params; an fp32 one has no ``main_param``: 12 GB.

Each operation runs ``--reps`` times (default 3) after a barrier; the table gives the median of
the slowest rank's times (every rep is in the JSON) and the accelerator memory allocated at the
operation's peak beyond what was allocated before it:

- ``save``: ``zero_shard.checkpoint.save``, from the call to its return (every rank's shards
  written and synced to disk by DCP, then committed); bytes of the checkpoint directory, GB/s.
- ``async_save``: ``zero_shard.checkpoint.async_save``: ``blocked``, until the call returns (the
  state is copied to host memory; training waits that long), and ``complete``, until its future
  is done (written and committed); GB/s of ``complete``. Nothing runs meanwhile.
- ``load``: ``zero_shard.checkpoint.load`` of the last checkpoint written into the same model and
  optimizer (DCP reads into the tensors of their state dicts, which then load them). The files
  were just written, so they are read from the page cache rather than from the disk.
- ``state_dict``: ``opt.state_dict()`` alone, which save and load build first.

An operation that fails is recorded as ``{"failed": message}`` and the others go on. (On torch
2.13, DCP's async stager fails on the fp32 main weights of bf16 params, views at an offset into
a flat buffer: "Attempted to call copy_() on an invalid python storage"; ``--dtype float32`` has
none.)

The checkpoints go to ``--dir`` (default: a new folder under /tmp, removed at the end), one at a
time: each is deleted before the next rep (the script first checks there is room for one). The
default run writes 6 checkpoints and reads 3. Rank 0 prints a table and writes ``results.json``
to ``--out`` after each operation, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    Clock,
    describe_run,
    init_distributed,
    peak_memory,
    reset_peak_memory,
    write_json,
)
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import zero_shard

OPERATIONS = ("save", "async_save", "load", "state_dict")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def checkpoint_bytes_per_param(dtype: torch.dtype) -> int:
    """The model in its dtype, then exp_avg, exp_avg_sq and (below fp32) main_param in fp32."""
    return dtype.itemsize + 4 * (2 if dtype == torch.float32 else 3)


def build(
    device: torch.device, num_layers: int, width: int, dtype: torch.dtype, fraction: float
) -> tuple[nn.Module, zero_shard.ZeroShardOptimizer]:
    """The param set, wrapped, after one step."""
    torch.manual_seed(0)  # the same replicated params on every rank
    model = nn.Sequential(
        *[
            nn.Linear(width, width, bias=False, device=device, dtype=dtype)
            for _ in range(num_layers)
        ]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    offload = zero_shard.OffloadPolicy(fraction=fraction) if fraction > 0 else None
    opt = zero_shard.wrap(opt, model, offload=offload)
    x = torch.randn(2, width, device=device, dtype=dtype)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    opt.finish_param_sync()
    if opt.num_skipped_steps:
        raise RuntimeError("the step was skipped as non-finite: the state holds no values")
    return model, opt


def shared_folder(requested: Path | None) -> tuple[Path, bool]:
    """The checkpoint folder, the same on every rank; whether it was made here (and is removed
    at the end)."""
    box: list[Any] = [requested]
    if requested is None and dist.get_rank() == 0:
        box = [Path(tempfile.mkdtemp(prefix="zero_shard_ckpt_", dir="/tmp"))]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return folder, requested is None


def check_free_space(folder: Path, num_bytes: int) -> dict[str, int]:
    usage = shutil.disk_usage(folder)
    if usage.free < 1.1 * num_bytes:
        raise SystemExit(
            f"{folder} has {usage.free / 1e9:.1f} GB free; a checkpoint takes about "
            f"{num_bytes / 1e9:.1f} GB. Pass --dir on a larger disk or a smaller --params-b"
        )
    return {"total_bytes": usage.total, "free_bytes": usage.free}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_checkpoint(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        for leftover in (path, path.with_name(path.name + ".partial")):
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()


def repeat(
    operation: Callable[[], dict[str, float]],
    clock: Clock,
    reps: int,
    between: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Runs ``operation`` ``reps`` times, each after a barrier (``between`` after each but the
    last); it returns named values (seconds, bytes). Every rep keeps the largest value over the
    ranks (the slowest rank's time); the medians of those are added as ``<name>_median``."""
    samples = []
    for rep in range(reps):
        dist.barrier()
        clock.synchronize()
        base = reset_peak_memory(clock.device)
        values = operation()
        clock.synchronize()
        values["peak_device_gib"] = (peak_memory(clock.device) - base) / 2**30
        samples.append(values)
        if between is not None and rep < reps - 1:
            between()
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, samples)
    slowest = [
        {key: max(rank[rep][key] for rank in per_rank) for key in samples[rep]}
        for rep in range(reps)
    ]
    result: dict[str, Any] = {"reps": slowest}
    for key in slowest[0]:
        result[f"{key}_median"] = statistics.median(rep[key] for rep in slowest)
    return result


def bench(
    args: argparse.Namespace,
    device: torch.device,
    report: dict[str, Any],
    write: Callable[[], None],
) -> None:
    num_layers = max(1, round(args.params_b * 1e9 / args.width**2))
    dtype = DTYPES[args.dtype]
    clock = Clock(device)
    model, opt = build(device, num_layers, args.width, dtype, args.fraction)
    num_params = num_layers * args.width**2
    memory = opt.memory_report()
    report["params"] = {
        "num_layers": num_layers,
        "width": args.width,
        "num_params": num_params,
        "dtype": args.dtype,
        "fraction": args.fraction,
        "rank0_memory_report": {
            key: getattr(memory, key)
            for key in ("device_bytes", "host_bytes", "host_staging_bytes", "pinned")
        },
    }
    folder, made_here = shared_folder(args.dir)
    report["disk"] = {
        "dir": str(folder),
        **check_free_space(folder, num_params * checkpoint_bytes_per_param(dtype)),
    }
    path = folder / "ckpt"
    results: dict[str, Any] = {}
    report["results"] = results
    parts = args.parts.split(",")

    def written() -> float:
        return float(folder_bytes(path)) if dist.get_rank() == 0 else 0.0

    def save() -> dict[str, float]:
        start = time.perf_counter()
        zero_shard.checkpoint.save(path, model=model, optimizer=opt, extra={"step": 1})
        return {"seconds": time.perf_counter() - start, "bytes": written()}

    def async_save() -> dict[str, float]:
        start = time.perf_counter()
        future = zero_shard.checkpoint.async_save(
            path, model=model, optimizer=opt, extra={"step": 1}
        )
        blocked = time.perf_counter() - start
        future.result()
        complete = time.perf_counter() - start
        dist.barrier()  # rank 0 commits last: the files are complete for everyone from here
        return {"blocked_seconds": blocked, "seconds": complete, "bytes": written()}

    def load() -> dict[str, float]:
        start = time.perf_counter()
        zero_shard.checkpoint.load(path, model=model, optimizer=opt)
        clock.synchronize()
        return {"seconds": time.perf_counter() - start}

    def state_dict() -> dict[str, float]:
        start = time.perf_counter()
        opt.state_dict()
        clock.synchronize()
        return {"seconds": time.perf_counter() - start}

    def run(
        name: str,
        operation: Callable[[], dict[str, float]],
        between: Callable[[], None] | None = None,
    ) -> None:
        if dist.get_rank() == 0:
            print(f"{name} x {args.reps} ...", flush=True)
        try:
            results[name] = repeat(operation, clock, args.reps, between)
        except (Exception, CheckpointException) as err:  # recorded; the other operations go on
            results[name] = {"failed": f"{type(err).__name__}: {err}"[:2000]}
            if dist.get_rank() == 0:
                print(f"  {name} FAILED: {results[name]['failed'][:300]}", flush=True)
            remove_checkpoint(path)
        if "bytes_median" in results[name]:
            row = results[name]
            row["gb_per_s_median"] = row["bytes_median"] / row["seconds_median"] / 1e9
        write()

    saves = [(n, op) for n, op in (("save", save), ("async_save", async_save)) if n in parts]
    try:
        for index, (name, operation) in enumerate(saves):
            # Each rep writes into an empty folder; the last checkpoint is kept for the load.
            run(name, operation, between=lambda: remove_checkpoint(path))
            if index < len(saves) - 1 or "load" not in parts:
                remove_checkpoint(path)
        if "load" in parts:
            if not path.exists():  # no save timed, or the last one failed
                save()
            run("load", load)
            remove_checkpoint(path)
        if "state_dict" in parts:
            run("state_dict", state_dict)
    finally:
        dist.barrier()
        if made_here and dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


def print_table(report: dict[str, Any]) -> None:
    params = report["params"]
    print(
        f"\n{params['num_params'] / 1e9:.3f}B {params['dtype']} params ({params['num_layers']} x "
        f"{params['width']}^2), offload fraction {params['fraction']}, "
        f"{report['world_size']} ranks, {report['device']}, checkpoints in {report['disk']['dir']}"
    )
    header = f"{'operation':<22}{'median s':>10}  {'reps s':<26}{'GB':>8}{'GB/s':>8}"
    header += f"{'peak dev GiB':>14}"
    print(header)
    print("-" * len(header))
    for name, row in report["results"].items():
        if "failed" in row:
            print(f"{name:<22}FAILED: {row['failed'][:200]}")
            continue
        lines = [(name, "seconds")]
        if name == "async_save":
            lines = [("async_save blocked", "blocked_seconds"), ("async_save complete", "seconds")]
        for label, key in lines:
            reps = ", ".join(f"{rep[key]:.2f}" for rep in row["reps"])
            size = row.get("bytes_median")
            gb = f"{size / 1e9:.2f}" if size else "-"
            rate = f"{size / row[f'{key}_median'] / 1e9:.2f}" if size else "-"
            print(
                f"{label:<22}{row[f'{key}_median']:>10.3f}  {reps:<26}{gb:>8}{rate:>8}"
                f"{row['peak_device_gib_median']:>14.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-b", type=float, default=1.0, help="billions of params")
    parser.add_argument("--width", type=int, default=4096, help="each layer is width x width")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="model dtype")
    parser.add_argument("--fraction", type=float, default=0.5, help="offload fraction")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parts", default=",".join(OPERATIONS), help="operations to time")
    parser.add_argument("--dir", type=Path, default=None, help="default: a new folder in /tmp")
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny sizes")
    parser.add_argument("--out", type=Path, default=Path("runs/checkpoint_save"))
    args = parser.parse_args()
    unknown = set(args.parts.split(",")) - set(OPERATIONS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {list(OPERATIONS)}")
    if args.smoke:
        args.width, args.params_b = 64, 4 * 64**2 / 1e9  # 4 layers
    device = init_distributed("cpu" if args.smoke else "cuda")
    report: dict[str, Any] = {
        **describe_run(device),
        "world_size": dist.get_world_size(),
        "args": {key: str(value) for key, value in vars(args).items()},
    }

    def write() -> None:
        if dist.get_rank() == 0:
            write_json(args.out / "results.json", report)

    bench(args, device, report, write)
    if dist.get_rank() == 0:
        print_table(report)
        print(f"\nwrote {args.out / 'results.json'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
