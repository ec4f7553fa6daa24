"""Trains a byte-level GPT on the Python standard library's source with zero-shard.

The model's AdamW is wrapped by ``zero_shard.wrap``: its fp32 main weights, grads and Adam state
are split by rows over the ranks, ``--offload-fraction`` of each rank's share lives and is
stepped on the CPU, grads are reduce-scattered during backward and the updated weights are
all-gathered during the next forward. No DDP. Checkpoints go through DCP and resume at any world
size. At the end it writes a JSON log and a plot (loss; step time split into forward, backward,
optimizer step and the rest) into ``--out``.

Run it from the repository root (after ``pip install -e ".[examples]"``)::

    python examples/train_gpt.py                      # one process, CPU: tiny preset, a minute
    torchrun --nproc-per-node 2 examples/train_gpt.py # two ranks (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/train_gpt.py --device cuda --preset 1b --offload-fraction 1
    python examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 50 --resume
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2  # tensor parallel, dp 2 x tp 2

Without torchrun it runs as a single rank (a one-process group). ``--optimizer adamw`` trains the
same model with plain ``torch.optim.AdamW`` instead (fp32 params, autocast to ``--dtype``; DDP on
several ranks): the reference that zero-shard's loss curve is compared with.
``--optimizer megatron-hdo`` steps the same bf16 model with Megatron-Core's HybridDeviceOptimizer
at ``--offload-fraction`` (one GPU, ``pip install megatron-core``; see ``megatron_hdo.py``);
``--optimizer torchao-offload`` with torchao's CPUOffloadOptimizer (fp32 params, bf16 autocast,
one GPU) and ``--optimizer fsdp2-offload`` with FSDP2's CPUOffloadPolicy (fp32 params cast to
``--dtype`` per unit, any number of ranks; see ``offload_peers.py``): the peers that zero-shard's
speed is compared with (``benchmarks/e2e_gpt.py peers``). ``--tp N`` splits each layer over N ranks
(tensor parallelism, ``gpt.parallelize``) on a ``("dp", "tp")`` mesh, and zero-shard shards
each rank's parts over ``dp``: the linears are column- and row-parallel, computed on their
local shards with one explicit all-reduce each, and the norms, residuals, attention over the
rank's heads, embeddings and tied head run on plain tensors (replicated over ``tp``);
``--sequence-parallel`` runs torch's ``parallelize_module`` plan instead, which splits the
norms and residuals over the sequence (eager DTensor ops for the linears and between them).
``--help`` lists every flag.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import megatron_hdo
import offload_peers
import psutil
import torch
import torch.distributed as dist
from gpt import (
    GPT,
    PRESETS,
    cross_entropy,
    global_batch,
    parallelize,
    read_stdlib_bytes,
    split_train_val,
    split_windows,
    weight_decay_groups,
)
from reporting import PHASES, Log, PhaseTimer, ProgressBar, peak_memory_bytes, plot
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import zero_shard
from offload import format_bytes, resolve_thread_budget

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SPECULATIVE = {"auto": "auto", "on": True, "off": False}  # --speculative -> OffloadPolicy's
NUM_VAL_BATCHES = 4
LAST_LOSS_WINDOW = 10  # "last loss" is the mean training loss over this many final steps
RSS_WARMUP_STEPS = 10  # steady host RSS is taken over a process's steps after its first ten
CHECKPOINT_NAME = "latest"
# The --optimizer choices whose model params are fp32 (lower precision by autocast, or by FSDP2's
# cast per unit); the others' params are --dtype.
FP32_PARAMS = ("adamw", "torchao-offload", "fsdp2-offload")
# Those whose own CPU AdamW runs on torch's intra-op threads, which torchrun sets to one.
HOST_STEP_ON_TORCH_THREADS = ("megatron-hdo", "torchao-offload", "fsdp2-offload")


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device
    tp: int = 1  # ranks per tensor-parallel group: consecutive ranks, on a ("dp", "tp") mesh

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp


@contextlib.contextmanager
def process_group(device_type: str, tp: int = 1) -> Iterator[Ranks]:
    """Joins torchrun's process group, or makes a one-process group when run without torchrun.

    GPUs get ``"cpu:gloo,cuda:nccl"``: NCCL for training, gloo for CPU tensors (checkpoints).
    """
    under_torchrun = "RANK" in os.environ
    if device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device(device_type, local_rank)
        torch.get_device_module(device_type).set_device(device)
        backend = f"cpu:gloo,{device_type}:{dist.Backend.default_device_backend_map[device_type]}"
    if under_torchrun:
        store, rank, world_size = next(dist.rendezvous("env://"))
        # A restarted job (torchrun --max-restarts) may find the last attempt's addresses in the
        # store, and gloo would then connect to dead ranks: each attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"train_gpt_attempt_{attempt}", store)
    else:
        store, rank, world_size = dist.HashStore(), 0, 1
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        device_id=device if device.type != "cpu" else None,
    )
    try:
        yield Ranks(dist.get_rank(), dist.get_world_size(), device, tp)
    finally:
        dist.destroy_process_group()


def rows_of_rank(windows: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """This data-parallel rank's rows (the ranks of one tensor-parallel group take the same)."""
    per_rank = len(windows) // ranks.dp_size
    return windows[ranks.dp_rank * per_rank : (ranks.dp_rank + 1) * per_rank]


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)  # gloo has no AVG
    return value.item() / dist.get_world_size()


# ---------------------------------------------------------------------------------------------
# Model, optimizer, schedule


@dataclass(frozen=True)
class Clipping:
    """Whether an optimizer's step reads the grads that ``clip_grad_norm_`` scaled, and why."""

    honoured: bool
    how: str


CLIPPING = {
    "zero-shard": Clipping(True, "clip_grad_norm_ scales the grads the step reads, with one norm "
                           "over all ranks: on the accelerator before any copy to the host (on "
                           "the host under --fsdp2-cpu-offload)"),
    "adamw": Clipping(True, "torch.nn.utils.clip_grad_norm_ scales the grads the step reads"),
    "megatron-hdo": Clipping(True, "its step() copies the grads to the host, after clipping"),
    # torchao's post-accumulate-grad hook queues each grad's copy to the host as backward makes
    # it, before clip_grad_norm_ runs; the host AdamW reads those copies. The clip's in-place
    # scaling of the device grads may even race copies still in flight on torchao's stream.
    "torchao-offload": Clipping(False, "its backward hook copies each grad of >= 4096 elements to "
                                "the host during backward, before clipping: the host step reads "
                                "unclipped grads (only the small params stepped on the GPU see "
                                "the clip)"),
    "fsdp2-offload": Clipping(True, "torch.nn.utils.clip_grad_norm_ scales the sharded host grads "
                              "(DTensors, one norm over all ranks) that the host AdamW reads"),
}  # fmt: skip


@dataclass
class Trainer:
    """The model and what steps it."""

    kind: str  # --optimizer: "zero-shard", "adamw", "megatron-hdo", "torchao-offload", ...
    # The GPT, its DDP wrapper (--optimizer adamw on several ranks) or the fully_shard-ed GPT
    # (fsdp2-offload).
    model: nn.Module
    # A ZeroShardOptimizer, plain AdamW (also over FSDP2's shards), Megatron's HDO or torchao's
    # CPUOffloadOptimizer.
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None  # fp16 only
    autocast_dtype: torch.dtype | None  # fp32 params (adamw, torchao-offload, --fp32-params)
    #                                     with --dtype bf16/fp16

    @property
    def zero_shard(self) -> bool:
        return self.kind == "zero-shard"


def lr_factor(step: int, *, num_warmup: int, num_steps: int, floor: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to ``floor`` at ``num_steps``."""
    if step < num_warmup:
        return (step + 1) / num_warmup
    progress = min((step - num_warmup) / max(num_steps - num_warmup, 1), 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build(args: argparse.Namespace, ranks: Ranks) -> Trainer:
    """The GPT on this rank's device, its AdamW (weight decay on matrices only), wrapped by
    zero-shard (or plain, or a peer: ``--optimizer``), an LR schedule and, for fp16, a loss
    scaler."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(ranks.device):  # initialized where it trains: fast for billions of params
        model = GPT(PRESETS[args.preset].model, checkpoint_activations=args.checkpoint_activations)
    dtype = DTYPES[args.dtype]
    fp32_params = args.optimizer in FP32_PARAMS or args.fsdp2_cpu_offload or args.fp32_params
    model = model.to(torch.float32 if fp32_params else dtype)
    if args.optimizer == "fsdp2-offload" or args.fsdp2_cpu_offload:
        # Before the groups: sharding replaces the params.
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        param_dtype = None if dtype == torch.float32 else dtype
        model = offload_peers.shard_with_fsdp2_offload(model, mesh, param_dtype=param_dtype)
    groups = weight_decay_groups(model, weight_decay=0.1)
    betas = (0.9, 0.95)
    scaler_type = torch.amp.GradScaler
    if args.optimizer in HOST_STEP_ON_TORCH_THREADS:  # as many threads as zero-shard's would be
        torch.set_num_threads(resolve_thread_budget(args.threads).num_threads)
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=betas, fused=True)
        if ranks.world_size > 1:
            model = DistributedDataParallel(model)
    elif args.optimizer == "megatron-hdo":
        optimizer = megatron_hdo.build_hybrid_device_optimizer(
            groups, offload_fraction=args.offload_fraction, lr=args.lr, betas=betas
        )
    elif args.optimizer == "torchao-offload":
        # torchao's default (the device grads stay): right under accumulation, and the setting
        # of the peer figures in docs/benchmarks/e2e.md (17.34 GiB at 1B).
        optimizer = offload_peers.build_torchao_offload(
            groups, lr=args.lr, betas=betas, offload_gradients=False
        )
    elif args.optimizer == "fsdp2-offload":
        optimizer = offload_peers.build_fsdp2_adamw(groups, lr=args.lr, betas=betas)
    else:
        if ranks.tp > 1:  # each layer split over tp; zero-shard shards the rest over dp
            mesh = init_device_mesh(
                ranks.device.type, (ranks.dp_size, ranks.tp), mesh_dim_names=("dp", "tp")
            )
            model = parallelize(model, mesh["tp"], sequence_parallel=args.sequence_parallel)
            groups = weight_decay_groups(model, weight_decay=0.1)
        adamw = torch.optim.AdamW(groups, lr=args.lr, betas=betas)
        options = {}  # unset: the policy's defaults; a switch interval of 0: the interpreter's
        if args.gil_switch_interval is not None:
            options["gil_switch_interval"] = args.gil_switch_interval or None
        if args.chunk_numel is not None:  # unset: the policy's default
            options["chunk_numel"] = args.chunk_numel
        policy = zero_shard.OffloadPolicy(
            fraction=args.offload_fraction,
            num_threads=args.threads,
            delayed_update=args.delayed_update,
            delayed_update_warmup=args.delayed_update_warmup,
            host_staging=args.host_staging,
            speculative=SPECULATIVE[args.speculative],
            **options,
        )
        buckets = {} if args.bucket_mb is None else {"bucket_mb": args.bucket_mb}
        optimizer = zero_shard.wrap(adamw, model, offload=policy, stage=args.stage, **buckets)
        scaler_type = zero_shard.GradScaler
    if args.compile:  # after wrap: zero-shard's hooks must be there at the first compiled call
        blocks = (model.module if isinstance(model, DistributedDataParallel) else model).blocks
        for block in blocks:
            block.compile(backend=args.compile)
    schedule = functools.partial(lr_factor, num_warmup=args.warmup, num_steps=args.steps)
    autocast = args.optimizer in ("adamw", "torchao-offload") or args.fp32_params
    autocast = autocast and dtype != torch.float32
    return Trainer(
        kind=args.optimizer,
        model=model,
        optimizer=optimizer,
        # torchao's CPUOffloadOptimizer is an Optimizer whose param_groups property lists its
        # inner AdamWs' group dicts themselves, in a fixed order: LambdaLR sets their lr.
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        scaler=scaler_type(ranks.device.type) if dtype == torch.float16 else None,
        autocast_dtype=dtype if autocast else None,
    )


# ---------------------------------------------------------------------------------------------
# One step


def forward_backward(
    trainer: Trainer, micro_batch: torch.Tensor, num_micro: int, timer: PhaseTimer
) -> torch.Tensor:
    inputs, targets = split_windows(micro_batch)
    timer.begin("forward")
    autocast = (
        torch.autocast(inputs.device.type, trainer.autocast_dtype)
        if trainer.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        loss = cross_entropy(trainer.model(inputs), targets) / num_micro
    timer.end()
    timer.begin("backward")
    (loss if trainer.scaler is None else trainer.scaler.scale(loss)).backward()
    timer.end()
    return loss.detach()


def no_sync(trainer: Trainer) -> contextlib.AbstractContextManager:
    """Accumulate grads locally (no communication) for all but the last micro-batch."""
    if trainer.zero_shard:
        return trainer.optimizer.no_sync()
    if trainer.kind == "fsdp2-offload":
        return offload_peers.fsdp2_no_sync(trainer.model)
    if isinstance(trainer.model, DistributedDataParallel):
        return trainer.model.no_sync()
    return contextlib.nullcontext()


def optimizer_step(trainer: Trainer, clip: float) -> torch.Tensor:
    """Unscales (fp16), clips by the global norm, steps; returns the norm before clipping."""
    opt, scaler = trainer.optimizer, trainer.scaler
    if scaler is not None:
        scaler.unscale_(opt)
    if trainer.zero_shard:
        norm = opt.clip_grad_norm_(clip)  # over every rank's shards, on the accelerator
    else:
        # Whether the step then reads the clipped grads: CLIPPING (torchao's does not).
        norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), clip)
        if isinstance(norm, DTensor):  # FSDP2's: replicated, reduced over the ranks
            norm = norm.full_tensor()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    trainer.scheduler.step()
    return norm


def train_step(
    trainer: Trainer,
    windows: torch.Tensor,
    args: argparse.Namespace,
    timer: PhaseTimer,
    *,
    settle: bool,
) -> dict[str, float]:
    """One optimizer step over this rank's rows of the global batch, in micro-batches.

    zero-shard's step returns before its CPU share is done (the next forward waits for it). With
    ``settle`` (an eval or checkpoint comes next, or the run ends) the step waits for it, so that
    the time is counted in this step and not hidden in the eval."""
    timer.start_step()
    lr = trainer.optimizer.param_groups[0]["lr"]
    micro_batches = windows.chunk(args.micro_batches)
    loss = torch.zeros((), device=windows.device)
    for index, micro_batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync(trainer):
            loss += forward_backward(trainer, micro_batch, len(micro_batches), timer)
    timer.begin("step")
    norm = optimizer_step(trainer, args.clip)
    if settle and trainer.zero_shard:
        trainer.optimizer.finish_param_sync()
    timer.end()
    record = {"loss": mean_over_ranks(loss), "grad_norm": float(norm), "lr": lr}
    times = timer.finish_step()
    record.update({f"{phase}_ms": seconds * 1e3 for phase, seconds in times.items()})
    return record


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], autocast: torch.dtype | None) -> float:
    model.eval()
    total = torch.zeros((), device=batches[0].device)
    for windows in batches:
        inputs, targets = split_windows(windows)
        with torch.autocast(inputs.device.type, autocast, enabled=autocast is not None):
            total += cross_entropy(model(inputs), targets)
    model.train()
    return mean_over_ranks(total) / len(batches)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(
    trainer: Trainer, log: Log, step: int, args: argparse.Namespace, pending: Any
) -> Any:
    """Saves model, optimizer, schedule, scaler and the log so far (atomically); returns the
    async save's future, if ``--async-checkpoint``. Waits for the previous one first."""
    if pending is not None:
        pending.result()
    extra = {
        "step": step,
        "scaler": None if trainer.scaler is None else trainer.scaler.state_dict(),
        "log": {"steps": log.steps, "val_losses": log.val_losses},
        "run": run_identity(args),
    }
    path = args.checkpoint_dir / CHECKPOINT_NAME
    save = zero_shard.checkpoint.async_save if args.async_checkpoint else zero_shard.checkpoint.save
    return save(
        path, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
        extra=extra,
    )  # fmt: skip


def load_checkpoint(trainer: Trainer, log: Log, args: argparse.Namespace) -> int:
    """Resumes from ``--checkpoint-dir`` (written at any world size); returns the step it
    reached, or 0 if there is no checkpoint yet."""
    path = args.checkpoint_dir / CHECKPOINT_NAME
    if not path.exists() and not path.with_name(path.name + ".previous").exists():
        return 0
    extra = zero_shard.checkpoint.load(
        path, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler
    )
    if extra["run"] != run_identity(args):
        raise ValueError(
            f"the checkpoint in {args.checkpoint_dir} is of another run: {extra['run']}, this "
            f"run is {run_identity(args)}; use another --checkpoint-dir or the same flags"
        )
    if trainer.scaler is not None and extra["scaler"] is not None:
        trainer.scaler.load_state_dict(extra["scaler"])
    log.steps[:] = extra["log"]["steps"]
    log.val_losses.update(extra["log"]["val_losses"])
    return extra["step"]


def run_identity(args: argparse.Namespace) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint's run (world size and offload may
    differ)."""
    keys = ("preset", "steps", "batch_size", "seed", "lr")
    return {key: getattr(args, key) for key in keys}


def maybe_crash(step: int, ranks: Ranks, args: argparse.Namespace) -> None:
    """``--simulate-crash STEP``: the last rank kills itself at that step, in a job's first
    attempt only (torchrun sets TORCHELASTIC_RESTART_COUNT), to test resuming."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if step == args.simulate_crash and first_attempt and ranks.rank == ranks.world_size - 1:
        print(f"rank {ranks.rank}: simulated crash at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The run


def measure_memory(trainer: Trainer, ranks: Ranks, rss_after_warmup: list[int]) -> dict[str, Any]:
    """Peak memory (max over ranks; the accelerator's, or host RSS on the CPU), host RSS now
    and over this process's steps after warm-up (``rss_after_warmup``, one sample per step: the
    median and the max), and where rank 0's optimizer state is, in bytes and as a line to print.
    Each RSS figure is the max over ranks."""
    rss_now = psutil.Process().memory_info().rss
    samples = sorted(rss_after_warmup) or [rss_now]  # a run of at most RSS_WARMUP_STEPS steps
    peaks = torch.tensor(
        [peak_memory_bytes(ranks.device), rss_now, samples[len(samples) // 2], samples[-1]],
        device=ranks.device,
        dtype=torch.float64,  # bytes beyond 2**24 are not exact in float32
    )
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    keys = ("peak_bytes", "host_rss_bytes", "host_rss_steady_bytes", "host_rss_max_bytes")
    memory: dict[str, Any] = dict(zip(keys, map(int, peaks.tolist()), strict=True))
    where = "host RSS" if ranks.device.type == "cpu" else "accelerator memory"
    line = f"peak {where} (max over ranks) {format_bytes(memory['peak_bytes'])}"
    line += f"; host RSS after warm-up: median {format_bytes(memory['host_rss_steady_bytes'])}"
    if trainer.kind != "adamw":
        device_bytes, host_bytes = optimizer_memory_bytes(trainer)
        memory.update(optimizer_device_bytes=device_bytes, optimizer_host_bytes=host_bytes)
        line += (
            f"; rank {ranks.rank}'s optimizer state: {format_bytes(device_bytes)} on "
            f"{ranks.device}, {format_bytes(host_bytes)} on the host"
        )
        if trainer.zero_shard:
            memory["host_staging"] = trainer.optimizer.memory_report().host_staging
            line += f" (host staging {memory['host_staging']})"
    memory["line"] = line
    return memory


def optimizer_memory_bytes(trainer: Trainer) -> tuple[int, int]:
    """(accelerator bytes, host bytes) of this rank's optimizer's own memory (not the model's
    params and grads)."""
    if trainer.zero_shard:
        report = trainer.optimizer.memory_report()
        return report.device_bytes, report.host_bytes
    measure = {
        "megatron-hdo": megatron_hdo.memory_bytes,
        "torchao-offload": offload_peers.torchao_memory_bytes,
        "fsdp2-offload": offload_peers.fsdp2_memory_bytes,
    }[trainer.kind]
    return measure(trainer.optimizer)


def train(args: argparse.Namespace, ranks: Ranks) -> dict[str, Any]:
    preset = PRESETS[args.preset]
    config = preset.model
    train_data, val_data = split_train_val(read_stdlib_bytes(preset.max_data_bytes))
    trainer = build(args, ranks)
    if ranks.device.type != "cpu":  # the peak to report is training's, not the fp32 init's
        torch.get_device_module(ranks.device).reset_peak_memory_stats(ranks.device)
    log = Log(config={**vars(args), "world_size": ranks.world_size, "num_params": 0})
    log.config["num_params"] = sum(p.numel() for p in trainer.model.parameters())
    for key in ("out", "checkpoint_dir"):
        log.config[key] = None if log.config[key] is None else str(log.config[key])
    say = print if ranks.rank == 0 else (lambda *_, **__: None)
    say(
        f"{args.preset}: {log.config['num_params'] / 1e6:.2f}M params, {args.dtype}, "
        f"{ranks.world_size} rank(s) on {ranks.device.type}, optimizer {describe_optimizer(args)}"
        f", {args.steps} steps of {args.batch_size}x{config.seq_len} bytes"
    )
    val_batches = [
        rows_of_rank(
            global_batch(val_data, batch_size=args.batch_size, seq_len=config.seq_len,
                         seed=args.seed + 1, step=index),
            ranks,
        ).to(ranks.device)
        for index in range(NUM_VAL_BATCHES)
    ]  # fmt: skip
    first = load_checkpoint(trainer, log, args) if args.resume else 0
    if first:
        say(f"resumed from {args.checkpoint_dir / CHECKPOINT_NAME} at step {first}")
    else:
        log.val_losses[0] = evaluate(trainer.model, val_batches, trainer.autocast_dtype)
    rss_samples = run_steps(trainer, log, train_data, val_batches, first, args, ranks)
    log.summary = summarize(log, args, first)
    log.summary["memory"] = measure_memory(trainer, ranks, rss_samples[RSS_WARMUP_STEPS:])
    log.summary["clipping"] = {"max_norm": args.clip, **dataclasses.asdict(CLIPPING[trainer.kind])}
    if isinstance(trainer.optimizer, zero_shard.ZeroShardOptimizer):
        counts = trainer.optimizer.speculation_counts
        if counts.stood or counts.redone or args.speculative == "on":
            log.summary["speculation"] = dataclasses.asdict(counts)
    if ranks.rank == 0:
        report(log, args)
    return log.to_json()


class StepProfiler:
    """``--profile-step STEP`` (``--profile-steps N``: that many steps from STEP on) under
    ``torch.profiler``; rank 0 writes the op table (``profile.txt``) and every rank its Chrome
    trace (``trace_rank{R}.json``) into ``--out``. At several ranks a collective's time is mostly
    its wait for the others, which only the traces side by side show; two steps show what the
    step leaves in flight (the param gathers) and the next forward waiting for it."""

    def __init__(self, ranks: Ranks, args: argparse.Namespace, last: int) -> None:
        self._ranks, self._args = ranks, args
        first = args.profile_step
        self._steps = () if first is None else (first, min(first + args.profile_steps, last + 1))
        self._profiler: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self._steps and step == self._steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._ranks.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        try:
            yield
        except BaseException:
            if self._profiler is not None:  # the run ends here: stop, write nothing
                profiler, self._profiler = self._profiler, None
                profiler.__exit__(None, None, None)
            raise
        if self._profiler is not None and step == self._steps[1] - 1:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)
            self._write(profiler)

    def _write(self, profiler: torch.profiler.profile) -> None:
        out = self._args.out
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        if self._ranks.rank == 0:
            table = profiler.key_averages().table(sort_by="cpu_time_total", row_limit=60)
            (out / "profile.txt").write_text(table)
        profiler.export_chrome_trace(str(out / f"trace_rank{self._ranks.rank}.json"))


def run_steps(
    trainer: Trainer,
    log: Log,
    train_data: torch.Tensor,
    val_batches: list[torch.Tensor],
    first: int,
    args: argparse.Namespace,
    ranks: Ranks,
) -> list[int]:
    """Trains from step ``first + 1`` to the last (``--stop-after`` or ``--steps``); returns
    this rank's host RSS after each of those steps."""
    seq_len = PRESETS[args.preset].model.seq_len
    last = last_step(args)
    timer = PhaseTimer(ranks.device)
    profiler = StepProfiler(ranks, args, last)
    bar = None if args.quiet or ranks.rank else ProgressBar(last, first=first + 1)
    pending = None  # the last async checkpoint's future
    rss_samples = []
    for step in range(first + 1, last + 1):
        maybe_crash(step, ranks, args)
        windows = global_batch(
            train_data, batch_size=args.batch_size, seq_len=seq_len, seed=args.seed, step=step
        )
        windows = rows_of_rank(windows, ranks).to(ranks.device, non_blocking=True)
        evaluate_now = step == last or bool(args.eval_every and step % args.eval_every == 0)
        checkpoint_now = args.checkpoint_dir is not None and (
            step == last or bool(args.checkpoint_every and step % args.checkpoint_every == 0)
        )
        with profiler.step(step):
            # The summary leaves out the first step: its CPU share must not spill into the second.
            settle = evaluate_now or checkpoint_now or step == first + 1
            record = {"step": step, **train_step(trainer, windows, args, timer, settle=settle)}
        record["tokens_per_s"] = args.batch_size * seq_len / (record["wall_ms"] / 1e3)
        rss_samples.append(psutil.Process().memory_info().rss)
        record["host_rss_bytes"] = rss_samples[-1]  # this rank's: the log is rank 0's
        log.steps.append(record)
        if evaluate_now:
            log.val_losses[step] = evaluate(trainer.model, val_batches, trainer.autocast_dtype)
            if bar is not None and step < last:
                bar.write(f"step {step}: val loss {log.val_losses[step]:.3f}")
        if bar is not None:
            memory = format_bytes(peak_memory_bytes(ranks.device))
            bar.update(
                step,
                f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s | mem {memory}",
            )
        if checkpoint_now:
            pending = save_checkpoint(trainer, log, step, args, pending)
    if pending is not None:
        pending.result()
    if bar is not None:
        bar.close()
    return rss_samples


def last_step(args: argparse.Namespace) -> int:
    """Where this process stops: ``--stop-after``, or the end of the run."""
    return args.steps if args.stop_after is None else args.stop_after


def summarize(log: Log, args: argparse.Namespace, first: int) -> dict[str, Any]:
    """Losses over every step, the checkpoint's run's included; times over this process's steps
    after ``first`` (the step it started at): the first compiles kernels and warms caches, and a
    run resumed from a checkpoint may have run elsewhere, at another world size or offload."""
    losses = [record["loss"] for record in log.steps]
    window = losses[-LAST_LOSS_WINDOW:]
    ours = [record for record in log.steps if record["step"] > first]
    timed = ours[1:] or ours or log.steps
    mean = {f"{key}_ms": _mean(r[f"{key}_ms"] for r in timed) for key in (*PHASES, "other")}
    wall_s = sum(record["wall_ms"] for record in timed) / 1e3
    seq_len = PRESETS[args.preset].model.seq_len
    return {
        "first_loss": losses[0],
        "last_loss": sum(window) / len(window),
        "last_loss_window": len(window),
        "val_loss_start": log.val_losses.get(0),
        "val_loss_end": log.val_losses[last_step(args)],
        "tokens_per_s": len(timed) * args.batch_size * seq_len / wall_s,
        "iteration_ms": wall_s * 1e3 / len(timed),
        **mean,
        "num_skipped": sum(1 for r in log.steps if not math.isfinite(r["grad_norm"])),
    }


def _mean(values: Iterator[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(log: Log, args: argparse.Namespace) -> None:
    summary = log.summary
    print(f"first loss {summary['first_loss']:.4f}")
    print(f"last loss  {summary['last_loss']:.4f} (mean of the last {summary['last_loss_window']})")
    if summary["val_loss_start"] is not None:
        print(f"val loss   {summary['val_loss_start']:.4f} at start", end=", ")
    print(f"{summary['val_loss_end']:.4f} at end")
    split = ", ".join(f"{phase} {summary[f'{phase}_ms']:.1f}" for phase in (*PHASES, "other"))
    print(
        f"throughput {summary['tokens_per_s']:,.0f} tokens/s; iteration {summary['iteration_ms']:.1f} ms "
        f"({split} ms)"
    )
    print(summary["memory"]["line"])
    speculation = summary.get("speculation")
    if speculation is not None:  # rank 0's; the last step's is counted at the next one
        print(
            f"speculative CPU steps: {speculation['stood']} stood, {speculation['redone']} redone "
            "or rolled back"
        )
    if args.out is None:
        return
    log.write(args.out / "log.json")
    title = f"{args.preset}, {describe_optimizer(args)}, {log.config['world_size']} rank(s)"
    problem = plot(log, args.out / "plot.png", title)
    print(problem or f"wrote {args.out / 'log.json'} and {args.out / 'plot.png'}")


def describe_optimizer(args: argparse.Namespace) -> str:
    if args.optimizer == "adamw":
        return "plain torch AdamW"
    if args.optimizer == "megatron-hdo":
        return f"Megatron-Core HybridDeviceOptimizer, offload fraction {args.offload_fraction}"
    if args.optimizer == "torchao-offload":
        return "torchao CPUOffloadOptimizer(AdamW fused), fp32 params"
    if args.optimizer == "fsdp2-offload":
        return f"FSDP2 CPUOffloadPolicy, fp32 params computed in {args.dtype}, AdamW fused"
    if args.tp > 1:
        sequence = ", sequence parallel" if args.sequence_parallel else ""
        return (
            f"zero-shard stage {args.stage} with tp {args.tp}{sequence}, offload fraction "
            f"{args.offload_fraction}"
        )
    delayed = ""
    if args.delayed_update:
        warmup = args.delayed_update_warmup
        delayed = ", delayed update" + (f" after {warmup} exact steps" if warmup else "")
    return f"zero-shard stage {args.stage}, offload fraction {args.offload_fraction}{delayed}"


# ---------------------------------------------------------------------------------------------
# Command line


def default_device() -> str:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return "cpu" if accelerator is None else accelerator.type


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", default=default_device(), help="cpu or an accelerator type; default: the "
        "accelerator if there is one")  # fmt: skip
    add("--preset", choices=list(PRESETS), help="model size; default tiny on CPU, else small")
    add("--steps", type=int, help="default: the preset's")
    add("--batch-size", type=int, help="sequences per step over all ranks; default: preset's")
    add("--micro-batches", type=int, default=1, help="per rank and step (grad accumulation)")
    add("--lr", type=float, help="peak learning rate; default: the preset's")
    add("--warmup", type=int, metavar="STEPS", help="steps of linear warmup to --lr, then cosine "
        "decay; default: a tenth of the preset's steps, at most a quarter of --steps")  # fmt: skip
    add("--clip", type=float, default=1.0, help="max global grad norm (default 1): of "
        "zero-shard's fp32 main grads; the others clip the model's grads with "
        "torch.nn.utils.clip_grad_norm_, which torchao-offload's host step does not see (the "
        "log's summary says which honour it)")  # fmt: skip
    add("--dtype", choices=list(DTYPES), help="param dtype; default bf16, fp32 on CPU")
    add("--fp32-params", action="store_true", help="zero-shard with fp32 params and autocast to "
        "--dtype: plain AdamW's recipe, for comparing the curves")  # fmt: skip
    add("--optimizer", default="zero-shard", choices=["zero-shard", "adamw", "megatron-hdo",
        "torchao-offload", "fsdp2-offload"], help="zero-shard.wrap(AdamW) (default); adamw: "
        "plain torch AdamW, fp32 params, autocast (the reference); megatron-hdo: Megatron-Core's "
        "HybridDeviceOptimizer, one CUDA GPU (needs megatron-core); torchao-offload: torchao's "
        "CPUOffloadOptimizer, fp32 params, autocast, one CUDA GPU (needs torchao); "
        "fsdp2-offload: FSDP2 fully_shard with CPUOffloadPolicy, fp32 params")  # fmt: skip
    add("--offload-fraction", type=float, default=0.5, help="share on the CPU (default 0.5)")
    add("--stage", type=int, choices=[1, 2], default=2)
    add("--tp", type=int, default=1, help="tensor-parallel ranks per layer (default 1): a "
        "(dp, tp) mesh, zero-shard sharding over dp; zero-shard only")  # fmt: skip
    add("--sequence-parallel", action="store_true", help="with --tp: torch's plan with "
        "sequence parallelism between the linears and vocab-split embeddings (eager DTensor "
        "ops); default: the linears on local shards, the rest plain, replicated over tp")  # fmt: skip
    add("--threads", type=int, help="CPU optimizer threads per rank (the peers: torch's "
        "intra-op threads); default: cores / ranks")  # fmt: skip
    add("--gil-switch-interval", type=float, metavar="SECONDS", help="the GIL switch interval "
        "while zero-shard's CPU step is in flight (0: leave the interpreter's alone); default: "
        "OffloadPolicy's")  # fmt: skip
    add("--chunk-numel", type=int, metavar="N", help="elements per chunk of zero-shard's host "
        "pipeline (a kernel call, a copy each way); default: OffloadPolicy's (64M)")  # fmt: skip
    add("--host-staging", choices=["auto", "bounded", "per_chunk"], default="auto", help="zero-"
        "shard's host buffers for grads and weights: per_chunk (2 bytes a param more; each "
        "chunk's grads go to the host as backward reduces them), bounded, or auto (default: "
        "per_chunk where the host keeps a quarter of its memory available)")  # fmt: skip
    add("--bucket-mb", type=float, metavar="MIB", help="zero-shard's bucket size (a reduction "
        "and a gather each); default: wrap's (256)")  # fmt: skip
    add("--speculative", choices=list(SPECULATIVE), default="off", help="on: zero-shard steps "
        "each CPU chunk as its grads reach the host during backward, into twins of its state; "
        "the step then stands, or is redone or forgotten (exact; per_chunk staging). auto: on "
        "where this is the host's only rank and the host keeps a quarter of its memory "
        "available with it. Default off")  # fmt: skip
    add("--delayed-update", action="store_true", help="with --offload-fraction 1, one process: "
        "the CPU step of step k runs during step k+1's forward and backward (the params lag one "
        "step, except after an evaluation or a checkpoint, which complete it: set --eval-every)")  # fmt: skip
    add("--delayed-update-warmup", type=int, default=0, metavar="STEPS", help="with "
        "--delayed-update: the first STEPS steps are exact, the delay starts after them")  # fmt: skip
    add("--fsdp2-cpu-offload", action="store_true", help="zero-shard over the model sharded as "
        "--optimizer fsdp2-offload shards it (FSDP2's CPUOffloadPolicy: the params on the host); "
        "zero-shard steps them there (--offload-fraction 1)")  # fmt: skip
    add("--checkpoint-activations", action="store_true", help="recompute in backward")
    add("--compile", nargs="?", const="inductor", metavar="BACKEND", help="torch.compile each "
        "block, for every --optimizer (BACKEND: inductor by default; aot_eager on a CPU without "
        "a C++ compiler)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--eval-every", type=int, help="steps between evals; default a tenth of the run")
    add("--checkpoint-dir", type=Path, help="save checkpoints here (at the end at least)")
    add("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    add("--async-checkpoint", action="store_true", help="write checkpoints in the background")
    add("--resume", action="store_true", help="go on from --checkpoint-dir's, if it has one")
    add("--stop-after", type=int, metavar="STEP", help="stop after STEP (checkpointed, with "
        "--checkpoint-dir); the LR schedule stays that of --steps, and --resume goes on")  # fmt: skip
    add("--simulate-crash", type=int, metavar="STEP", help="the last rank dies at STEP (tests)")
    add("--profile-step", type=int, metavar="STEP", help="profile that step (see --out)")
    add("--profile-steps", type=int, default=1, metavar="N", help="profile N steps from STEP")
    add("--out", type=Path, default=Path("runs/train_gpt"), help="JSON log and plot go here")
    add("--quiet", action="store_true", help="no progress bar")
    return check_args(parser, parser.parse_args(argv))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fills the flags whose defaults depend on the device and preset, and checks them."""
    on_cpu = torch.device(args.device).type == "cpu"
    args.preset = args.preset or ("tiny" if on_cpu else "small")
    args.dtype = args.dtype or ("fp32" if on_cpu else "bf16")
    preset = PRESETS[args.preset]
    for name in ("steps", "batch_size", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.warmup is None:
        args.warmup = max(min(preset.steps // 10, args.steps // 4), 1)
    if args.eval_every is None:
        args.eval_every = max(args.steps // 10, 1)
    for name in ("steps", "batch_size", "micro_batches", "warmup", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.tp < 1 or world_size % args.tp:
        parser.error(f"--tp must be at least 1 and divide the {world_size} rank(s), got {args.tp}")
    if args.fp32_params and args.optimizer != "zero-shard":
        parser.error(f"--optimizer {args.optimizer} has a recipe of its own: --fp32-params is "
                     "for zero-shard (plain AdamW's params are fp32 already)")  # fmt: skip
    if args.tp > 1 and args.optimizer != "zero-shard":
        parser.error("--tp runs with --optimizer zero-shard only")
    if args.sequence_parallel and args.tp == 1:
        parser.error("--sequence-parallel splits the sequence over --tp ranks: add --tp 2 or more")
    if args.delayed_update and (args.offload_fraction != 1.0 or world_size > 1):
        parser.error(f"--delayed-update runs with --offload-fraction 1 on one process, got "
                     f"--offload-fraction {args.offload_fraction} on {world_size} rank(s)")  # fmt: skip
    if args.delayed_update_warmup and not args.delayed_update:
        parser.error("--delayed-update-warmup counts the exact steps before --delayed-update: "
                     "add --delayed-update")  # fmt: skip
    if args.delayed_update_warmup < 0:
        parser.error(f"--delayed-update-warmup must be >= 0, got {args.delayed_update_warmup}")
    if args.fsdp2_cpu_offload and (
        args.optimizer != "zero-shard"
        or args.offload_fraction != 1.0
        or args.tp > 1
        or args.delayed_update
        or args.dtype == "fp16"
    ):
        parser.error("--fsdp2-cpu-offload runs with --optimizer zero-shard --offload-fraction 1, "
                     "without --tp, --delayed-update or --dtype fp16 (use --optimizer "
                     "fsdp2-offload for FSDP2 with torch AdamW)")  # fmt: skip
    dp_size = world_size // args.tp
    if args.batch_size % (dp_size * args.micro_batches):
        parser.error(
            f"--batch-size {args.batch_size} must divide evenly over {dp_size} data-parallel "
            f"rank(s) x {args.micro_batches} micro-batch(es)"
        )
    if not 0.0 <= args.offload_fraction <= 1.0:
        parser.error(f"--offload-fraction must be in [0, 1], got {args.offload_fraction}")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.checkpoint_dir is not None and args.optimizer != "zero-shard":
        parser.error("checkpoints are written for --optimizer zero-shard only")
    if args.optimizer in ("megatron-hdo", "torchao-offload"):
        check_one_gpu_peer(parser, args, world_size)
    if args.optimizer in ("megatron-hdo", "torchao-offload", "fsdp2-offload") and (
        args.dtype == "fp16"
    ):
        parser.error(f"--optimizer {args.optimizer} takes --dtype bf16 or fp32 (no loss scaling "
                     "here)")  # fmt: skip
    if args.eval_every < 0 or args.checkpoint_every < 0:
        parser.error("--eval-every and --checkpoint-every must be 0 (off) or positive")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        parser.error(f"--stop-after must be in [1, --steps={args.steps}], got {args.stop_after}")
    return args


def check_one_gpu_peer(
    parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int
) -> None:
    """What Megatron-Core's HybridDeviceOptimizer and torchao's CPUOffloadOptimizer can run here:
    one process on one CUDA GPU."""
    why_cuda = {
        "megatron-hdo": "Megatron-Core's HybridDeviceOptimizer uses torch.cuda streams",
        "torchao-offload": "torchao's CPUOffloadOptimizer offloads from a CUDA (or XPU) device "
        "and refuses to build without one",
    }[args.optimizer]
    if torch.device(args.device).type != "cuda":
        parser.error(
            f"--optimizer {args.optimizer} needs --device cuda, got {args.device}: {why_cuda}"
        )
    if world_size > 1:
        parser.error(
            f"--optimizer {args.optimizer} runs in one process (it shards nothing), got "
            f"{world_size} ranks; run without torchrun or with --nproc-per-node 1"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains as the flags in ``argv`` say; returns the log (``"summary"``, ``"steps"``, ...)."""
    args = parse_args(argv)
    with process_group(torch.device(args.device).type, args.tp) as ranks:
        return train(args, ranks)


if __name__ == "__main__":
    main()
