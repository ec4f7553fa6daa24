"""Trains a small byte-level GPT on the Python standard library's own source code.

The model reads the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, nothing is downloaded) as bytes and learns to predict the
next byte. Its AdamW optimizer is wrapped in ``HybridDeviceOptimizer``, which keeps
``--offload-fraction`` of the optimizer's elements (fp32 main weights, grads and Adam state) on
the CPU and steps them there while the rest is stepped on the accelerator. At the end the script
prints the first and last loss and where the optimizer's memory went.

Run it from the repository root (after ``pip install -e .``, or with ``PYTHONPATH=.``)::

    python examples/train_gpt.py                      # CPU: tiny preset, fp32, about a minute
    python examples/train_gpt.py --device cuda        # GPU (its default): small, 38M, bf16
    python examples/train_gpt.py --preset medium --offload-fraction 1 --steps 500  # 300M

``--offload-fraction 0`` keeps everything on the accelerator and ``1`` moves everything to the
CPU; ``--json PATH`` writes the per-step losses and timings; ``--help`` lists every flag. On a
CPU-only machine the "accelerator" is the CPU itself, so the split still runs both code paths.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from offload import format_bytes
from optimizers import HybridDeviceOptimizer, OffloadPolicy

VOCAB_SIZE = 256  # one token per byte
VAL_FRACTION = 0.05
NUM_VAL_BATCHES = 8
LAST_LOSS_WINDOW = 10  # "last loss" is the mean training loss over this many final steps


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    num_layers: int
    num_heads: int
    d_model: int
    seq_len: int


@dataclass(frozen=True)
class Preset:
    """A model size with the training settings that suit it."""

    model: GPTConfig
    batch_size: int
    steps: int
    lr: float
    max_data_bytes: int  # read at most this much source: small is quick to load, big overfits less


PRESETS = {
    # About a minute on 2 CPU cores in fp32.
    "tiny": Preset(
        GPTConfig(4, 4, 128, 128), batch_size=16, steps=350, lr=3e-3, max_data_bytes=8 << 20
    ),
    # About 38M params: about two minutes on one H100 (1.8 min measured, offload 0.5).
    "small": Preset(
        GPTConfig(12, 8, 512, 512), batch_size=32, steps=2000, lr=1e-3, max_data_bytes=32 << 20
    ),
    # About 300M params: GPT-2 medium's shape.
    "medium": Preset(
        GPTConfig(24, 16, 1024, 1024), batch_size=16, steps=2000, lr=3e-4, max_data_bytes=32 << 20
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.d_model % config.num_heads:
            raise ValueError(
                f"d_model ({config.d_model}) must be divisible by num_heads ({config.num_heads})"
            )
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, dim // self.num_heads)
        # (batch, seq, head, head_dim) -> (batch, head, seq, head_dim), as SDPA expects.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Byte-level GPT: token + position embeddings, blocks, final norm, head tied to tokens."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.token_emb.weight
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, 256) for int64 ``tokens`` of shape (batch, seq)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def compute_loss(model: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    # Cross-entropy in fp32 whatever the model dtype.
    return F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Data


def read_stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The standard library's ``.py`` files, sorted by path and concatenated, as 1-D uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, num_bytes = [], 0
    for path in sorted(root.rglob("*.py")):
        # Installed packages can live under the stdlib folder; they are not the stdlib.
        if {"site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_bytes()
        except OSError:
            continue
        parts.append(source[: max_bytes - num_bytes])
        num_bytes += len(parts[-1])
        if num_bytes >= max_bytes:
            break
    if num_bytes == 0:
        raise RuntimeError(f"found no readable .py files under {root}")
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def sample_batch(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: (inputs, targets), targets shifted one byte ahead."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"{len(data)} bytes of data are too few for seq_len {seq_len}")
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long().to(device)
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    losses = [compute_loss(model, inputs, targets).item() for inputs, targets in batches]
    model.train()
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------------------------------
# Optimizer and schedule


def build_optimizer(model: GPT, args: argparse.Namespace) -> HybridDeviceOptimizer:
    """AdamW with weight decay on the matrices only, wrapped to split its state across devices."""
    # Matrices (linear weights and the tied embedding) decay; biases and norms do not.
    params = list(model.parameters())  # the tied weight appears once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    policy = OffloadPolicy(fraction=args.offload_fraction, num_threads=args.threads)
    return HybridDeviceOptimizer.wrap(adamw, policy=policy)


def lr_factor(step: int, *, num_warmup: int, num_steps: int, floor: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to ``floor`` at ``num_steps``."""
    if step < num_warmup:
        return (step + 1) / num_warmup
    progress = min((step - num_warmup) / max(num_steps - num_warmup, 1), 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# Progress and reporting


class ProgressBar:
    """A one-line progress bar, redrawn at most ten times a second.

    When the stream is not a terminal (a log file), it writes a plain line every tenth of the run
    instead of redrawing.
    """

    def __init__(self, total: int, *, stream: TextIO = sys.stderr, width: int = 24) -> None:
        self.total = total
        self.stream = stream
        self.width = width
        self._interactive = stream.isatty()
        self._last_draw = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self._due(step):
            return
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"{step:>{len(str(self.total))}}/{self.total} [{bar}] "
            f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s"
        )
        self.stream.write(f"\r{line}" if self._interactive else f"{line}\n")
        self.stream.flush()

    def write(self, text: str) -> None:
        """Writes a line of its own under the bar."""
        self.stream.write(f"  {text}\n" if self._interactive else f"{text}\n")

    def close(self) -> None:
        if self._interactive:
            self.stream.write("\n")
        self.stream.flush()

    def _due(self, step: int) -> bool:
        if step == self.total:
            return True
        if not self._interactive:
            return step % max(self.total // 10, 1) == 0
        now = time.perf_counter()
        if now - self._last_draw < 0.1:
            return False
        self._last_draw = now
        return True


def describe_memory(opt: HybridDeviceOptimizer) -> str:
    report = opt.memory_report()
    staging = (
        "nothing offloaded"
        if report.pinned is None
        else f"staging {format_bytes(report.host_staging_bytes)}, pinned: {report.pinned}"
    )
    return (
        f"optimizer memory: accelerator share ({report.device}) "
        f"{format_bytes(report.device_bytes)}, host share {format_bytes(report.host_bytes)} "
        f"({staging})"
    )


# ---------------------------------------------------------------------------------------------
# Command line


def default_device() -> str:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return "cpu" if accelerator is None else accelerator.type


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=default_device(), help="default: the accelerator")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="model size; default tiny on CPU, else small"
    )
    parser.add_argument("--steps", type=int, help="default: the preset's")
    parser.add_argument("--batch-size", type=int, help="default: the preset's")
    parser.add_argument("--lr", type=float, help="peak learning rate; default: the preset's")
    parser.add_argument(
        "--offload-fraction", type=float, default=0.5, help="share on the CPU (default 0.5)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="param dtype; default bf16, fp32 on CPU"
    )
    parser.add_argument("--threads", type=int, help="CPU optimizer threads; default: cores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-every", type=int, default=0, help="steps between val evals (0: start and end)"
    )
    parser.add_argument("--json", type=Path, help="write per-step losses and timings here")
    parser.add_argument("--quiet", action="store_true", help="print nothing per step")
    args = parser.parse_args(argv)
    return fill_defaults(parser, args)


def fill_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fills the flags whose defaults depend on the device and preset, and checks them."""
    on_cpu = torch.device(args.device).type == "cpu"
    args.preset = args.preset or ("tiny" if on_cpu else "small")
    args.dtype = args.dtype or ("fp32" if on_cpu else "bf16")
    preset = PRESETS[args.preset]
    args.steps = preset.steps if args.steps is None else args.steps
    args.batch_size = preset.batch_size if args.batch_size is None else args.batch_size
    args.lr = preset.lr if args.lr is None else args.lr
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.offload_fraction <= 1.0:
        parser.error(f"--offload-fraction must be in [0, 1], got {args.offload_fraction}")
    if args.eval_every < 0:
        parser.error("--eval-every must be 0 (start and end only) or positive")
    return args


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class Run:
    """What training produced, step by step."""

    losses: list[float]
    step_seconds: list[float]
    val_losses: dict[int, float]  # step -> validation loss
    num_tokens: int = 0
    train_seconds: float = 0.0


def train_step(
    model: GPT,
    opt: HybridDeviceOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    loss = compute_loss(model, inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()  # waits for the step, so the caller's timing is honest


def train(
    model: GPT,
    opt: HybridDeviceOptimizer,
    train_data: torch.Tensor,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> Run:
    seq_len, device = model.pos_emb.num_embeddings, model.pos_emb.weight.device
    schedule = functools.partial(
        lr_factor, num_warmup=max(args.steps // 20, 1), num_steps=args.steps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    generator = torch.Generator().manual_seed(args.seed)
    run = Run(losses=[], step_seconds=[], val_losses={0: evaluate(model, val_batches)})
    bar = None if args.quiet else ProgressBar(args.steps)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, targets = sample_batch(train_data, args.batch_size, seq_len, generator, device)
        run.losses.append(train_step(model, opt, scheduler, inputs, targets))
        run.step_seconds.append(time.perf_counter() - start)
        run.num_tokens += inputs.numel()
        run.train_seconds += run.step_seconds[-1]
        if bar is not None:
            bar.update(step, run.losses[-1], run.num_tokens / run.train_seconds)
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            run.val_losses[step] = evaluate(model, val_batches)
            if bar is not None and step < args.steps:
                bar.write(f"step {step}: val loss {run.val_losses[step]:.3f}")
    if bar is not None:
        bar.close()
    return run


def summarize(
    run: Run, opt: HybridDeviceOptimizer, num_params: int, args: argparse.Namespace
) -> dict[str, Any]:
    window = run.losses[-LAST_LOSS_WINDOW:]
    return {
        "preset": args.preset,
        "device": args.device,
        "dtype": args.dtype,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "offload_fraction": args.offload_fraction,
        "num_params": num_params,
        "first_loss": run.losses[0],
        "last_loss": sum(window) / len(window),
        "last_loss_window": len(window),
        "val_loss_start": run.val_losses[0],
        "val_loss_end": run.val_losses[args.steps],
        "tokens_per_s": run.num_tokens / run.train_seconds,
        "train_seconds": run.train_seconds,
        "memory": asdict(opt.memory_report()),
    }


def print_summary(summary: dict[str, Any], memory_line: str) -> None:
    print(f"first loss {summary['first_loss']:.4f}")
    print(
        f"last loss  {summary['last_loss']:.4f} "
        f"(mean training loss of the last {summary['last_loss_window']} steps)"
    )
    print(
        f"val loss   {summary['val_loss_start']:.4f} at start, {summary['val_loss_end']:.4f} at end"
    )
    print(f"throughput {summary['tokens_per_s']:,.0f} tokens/s ({summary['train_seconds']:.1f} s)")
    print(memory_line)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains as the flags in ``argv`` say and returns a summary (losses, params, memory)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    preset = PRESETS[args.preset]
    config = preset.model
    torch.manual_seed(args.seed)
    data = read_stdlib_bytes(preset.max_data_bytes)
    num_train = int(len(data) * (1 - VAL_FRACTION))
    val_generator = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [
        sample_batch(data[num_train:], args.batch_size, config.seq_len, val_generator, device)
        for _ in range(NUM_VAL_BATCHES)
    ]
    model = GPT(config).to(device=device, dtype=DTYPES[args.dtype])
    opt = build_optimizer(model, args)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.preset}: {num_params / 1e6:.2f}M params, {args.dtype} on {device}, "
        f"{len(data) / 2**20:.1f} MiB of stdlib source, {args.steps} steps of "
        f"{args.batch_size}x{config.seq_len} bytes, offload fraction {args.offload_fraction}"
    )
    run = train(model, opt, data[:num_train], val_batches, args)
    summary = summarize(run, opt, num_params, args)
    print_summary(summary, describe_memory(opt))
    if args.json is not None:
        record = {**summary, "losses": run.losses, "step_seconds": run.step_seconds}
        record["val_losses"] = {str(step): loss for step, loss in run.val_losses.items()}
        args.json.write_text(json.dumps(record, indent=1))
    return summary


if __name__ == "__main__":
    main()
