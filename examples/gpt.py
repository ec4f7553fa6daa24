"""The examples' model and data: a byte-level GPT and the Python standard library's source.

Nothing here knows about zero-shard; ``train_gpt.py`` and ``hf_causal_lm.py`` train on it.
The data is the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
read as bytes, so nothing is downloaded. Batches are drawn from a generator seeded by the step
number, and each rank takes its rows of the global batch: a run resumed at another world size
sees the same data.
"""

from __future__ import annotations

import copy
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

VOCAB_SIZE = 256  # one token per byte


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    num_layers: int
    num_heads: int
    d_model: int
    seq_len: int

    def num_params(self) -> int:
        """Parameter count (the head is tied to the token embedding)."""
        per_block = 12 * self.d_model**2 + 13 * self.d_model
        embeddings = (VOCAB_SIZE + self.seq_len) * self.d_model
        return self.num_layers * per_block + embeddings + 2 * self.d_model


@dataclass(frozen=True)
class Preset:
    """A model size with the training settings that suit it."""

    model: GPTConfig
    batch_size: int  # sequences per step, over all ranks and micro-batches
    steps: int
    lr: float
    max_data_bytes: int  # read at most this much source: small is quick to load, big overfits less


PRESETS = {
    # About a minute on 2 CPU cores in fp32.
    "tiny": Preset(
        GPTConfig(4, 4, 128, 128), batch_size=16, steps=300, lr=3e-3, max_data_bytes=8 << 20
    ),
    # 38M params: about two minutes on one H100.
    "small": Preset(
        GPTConfig(12, 8, 512, 512), batch_size=32, steps=2000, lr=1e-3, max_data_bytes=32 << 20
    ),
    # 303M params: GPT-2 medium's shape.
    "medium": Preset(
        GPTConfig(24, 16, 1024, 1024), batch_size=16, steps=2000, lr=3e-4, max_data_bytes=32 << 20
    ),
    # 1.0B params.
    "1b": Preset(
        GPTConfig(20, 16, 2048, 1024), batch_size=8, steps=300, lr=3e-4, max_data_bytes=32 << 20
    ),
    # 2.5B params.
    "3b": Preset(
        GPTConfig(32, 20, 2560, 1024), batch_size=8, steps=300, lr=2e-4, max_data_bytes=32 << 20
    ),
    # 4.5B params.
    "5b": Preset(
        GPTConfig(40, 24, 3072, 1024), batch_size=8, steps=300, lr=1.5e-4, max_data_bytes=32 << 20
    ),
    # 6.4B params.
    "7b": Preset(
        GPTConfig(32, 32, 4096, 1024), batch_size=8, steps=300, lr=1.5e-4, max_data_bytes=32 << 20
    ),
    # 8.9B and 9.7B params: full offload's reach on one 80 GB GPU and a 128 GiB host
    # (docs/benchmarks/e2e.md, largest).
    "9b": Preset(
        GPTConfig(44, 32, 4096, 1024), batch_size=8, steps=300, lr=1.2e-4, max_data_bytes=32 << 20
    ),
    "10b": Preset(
        GPTConfig(48, 32, 4096, 1024), batch_size=8, steps=300, lr=1.2e-4, max_data_bytes=32 << 20
    ),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.d_model % config.num_heads:
            raise ValueError(
                f"d_model ({config.d_model}) must be divisible by num_heads ({config.num_heads})"
            )
        self.head_dim = config.d_model // config.num_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # qkv's rows go head by head (a head's q, k and v together), so that a column-parallel
        # split (``parallelize``) gives each tensor-parallel rank whole heads: -1 heads is all of
        # them, or this rank's.
        qkv = self.qkv(x).view(batch, seq, -1, 3, self.head_dim)
        # (batch, seq, head, head_dim) -> (batch, head, seq, head_dim), as SDPA expects.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


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
    """Byte-level GPT: token + position embeddings, blocks, final norm, head tied to tokens.

    With ``checkpoint_activations`` each block's activations are recomputed in backward instead
    of kept (less memory for larger models, about a third more compute).
    """

    def __init__(self, config: GPTConfig, *, checkpoint_activations: bool = False) -> None:
        super().__init__()
        self.config = config
        self.checkpoint_activations = checkpoint_activations
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
            if self.checkpoint_activations and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_final(x))


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward, all-reduce backward: the input of a column-parallel linear is the same
    on every tensor-parallel rank, and each rank's input grad is its heads' (or hidden units')
    part of the sum (Megatron-LM's "copy to model parallel region")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # In place, as Megatron does: the output's only consumer is the F.linear in
        # ColumnParallelLinear.forward, so this grad is the input grad its matmul just allocated
        # (or a view of it) and no other live tensor shares its storage. contiguous() returns it
        # or a fresh copy.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward, identity backward: sums the row-parallel partial outputs, and the
    summed output's grad is already each rank's whole grad (Megatron-LM's "reduce from model
    parallel region")."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        # In place on the F.linear output of RowParallelLinear.forward, which nothing else holds
        # or saved for backward (a matmul saves its inputs, not its output). Not marked dirty, as
        # in Megatron: autograd then returns it as a view of itself, which is all the identity
        # backward needs, while Dynamo graph-breaks at ctx.mark_dirty under no_grad.
        partial = partial.contiguous()
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What autocast makes of a matmul's operand (float64 stays as it is, as under autocast)."""
    if dtype is None or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return tensor
    return tensor.to(dtype)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a matrix of its last dim's vectors (also where that dim is empty: a rank's
    empty share of a narrow layer)."""
    return tensor.reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1])


def _grad_of(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor param's grad from its local part (contiguous, in the param's layout), as
    ``to_local``'s own backward makes it: the param's spec, copied, with no placement checks or
    global-shape computation (``from_local`` costs the host about 6x more)."""
    return DTensor(local.to(param.dtype), copy.copy(param._spec), requires_grad=False)


def _save_operands(
    ctx: Any, x: torch.Tensor, weight: Any, bias: Any
) -> tuple[torch.dtype | None, torch.Tensor, torch.Tensor]:
    """A tensor-parallel linear's forward operands, as autocast makes them, saved for its
    backward: the autocast dtype, the input and the local weight."""
    dtype = _autocast_dtype(x)
    x_cast, w = _cast(x, dtype), _cast(weight.to_local(), dtype)
    ctx.save_for_backward(x_cast, w)
    ctx.params = (weight, bias)
    return dtype, x_cast, w


def _param_grads(ctx: Any, grad: torch.Tensor, x_cast: torch.Tensor) -> tuple[Any, Any]:
    """The weight's and the bias's grads (``None`` where not needed) from the output's and the
    saved input (read once by the caller: checkpointing unpacks each saved tensor once)."""
    weight, bias = ctx.params
    _, need_w, need_b, _ = ctx.needs_input_grad
    rows = _rows(grad)
    grad_w = _grad_of(weight, rows.t().mm(_rows(x_cast))) if need_w else None
    grad_b = _grad_of(bias, rows.sum(0)) if need_b else None
    return grad_w, grad_b


class _ColumnParallelLinearFn(torch.autograd.Function):
    """A column-parallel linear as one autograd node: forward on the local shards; backward
    starts the input grad's all-reduce, computes the weight and bias grads while it runs
    (Megatron-LM overlaps them alike), then waits. One node instead of a linear, two
    ``to_local`` and a copy-to-region node: each DTensor node costs the host a Python
    dispatch, and a tensor-parallel step is bound by the host's launches."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: Any, bias: Any, group: ProcessGroup
    ) -> torch.Tensor:
        dtype, x_cast, w = _save_operands(ctx, x, weight, bias)
        ctx.group, ctx.x_dtype = group, x.dtype
        b = None if bias is None else _cast(bias.to_local(), dtype)
        return F.linear(x_cast, w, b)

    @staticmethod
    @once_differentiable  # the grads it returns are not differentiable: refuse create_graph
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = work = None
        x_cast, w = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            # In the input's dtype: the sum over ranks is the unsplit layer's input grad.
            grad_x = grad.matmul(w).to(ctx.x_dtype)
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_w, grad_b = _param_grads(ctx, grad, x_cast)  # while the all-reduce runs
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None


class _RowParallelLinearFn(torch.autograd.Function):
    """A row-parallel linear as one autograd node: the local matmul, the all-reduce of the
    partial outputs, then the bias, added once (after the sum, not once per rank); the
    output's grad is every rank's whole grad."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: Any, bias: Any, group: ProcessGroup
    ) -> torch.Tensor:
        dtype, x_cast, w = _save_operands(ctx, x, weight, bias)
        out = F.linear(x_cast, w)
        dist.all_reduce(out, group=group)
        return out if bias is None else out.add_(_cast(bias.to_local(), dtype))

    @staticmethod
    @once_differentiable  # the grads it returns are not differentiable: refuse create_graph
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_cast, w = ctx.saved_tensors
        grad_x = grad.matmul(w) if ctx.needs_input_grad[0] else None
        return grad_x, *_param_grads(ctx, grad, x_cast), None


class _TensorParallelLinear(nn.Module):
    """An ``nn.Linear``'s params split over a tensor-parallel mesh, computed on local tensors.

    The params are DTensors in the layouts of torch's ``ColwiseParallel`` / ``RowwiseParallel``
    (so zero-shard, FSDP2 and DCP see what they see under ``parallelize_module``), under the
    names ``weight`` and ``bias`` (so a checkpoint's keys are an ``nn.Linear``'s). The forward
    takes their local shards and does its one collective itself, where torch's plan runs each
    op of a linear as an eager DTensor op, dispatched in Python (about 16 a linear each step).
    A second-order grad through them (``create_graph=True``) is refused.
    """

    weight_placement: Placement
    bias_placement: Placement
    weight: nn.Parameter  # DTensor over tp, placed by weight_placement
    bias: nn.Parameter | None  # DTensor over tp, placed by bias_placement

    def __init__(self, linear: nn.Linear, *, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # (distribute_tensor takes tp rank 0's values; a frozen linear stays frozen.)
        self.weight = nn.Parameter(
            distribute_tensor(linear.weight.detach(), tp_mesh, [self.weight_placement]),
            requires_grad=linear.weight.requires_grad,
        )
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(
                distribute_tensor(linear.bias.detach(), tp_mesh, [self.bias_placement]),
                requires_grad=linear.bias.requires_grad,
            )

    @property
    def group(self) -> ProcessGroup:
        """The tp mesh's group, which the all-reduces run over (asked of the weight's mesh, not
        kept: a process group cannot be copied, and ``copy.deepcopy(model)`` must work)."""
        return self.weight.device_mesh.get_group()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.weight_placement}"
        )


class ColumnParallelLinear(_TensorParallelLinear):
    """Output features split over tensor-parallel ranks (weight and bias ``Shard(0)``): takes
    the whole input, returns this rank's features."""

    weight_placement = Shard(0)
    bias_placement = Shard(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # ops Dynamo traces (no async collective in backward)
            x = _CopyToTensorParallel.apply(x, self.group)
            bias = None if self.bias is None else self.bias.to_local()
            return F.linear(x, self.weight.to_local(), bias)
        return _ColumnParallelLinearFn.apply(x, self.weight, self.bias, self.group)


class RowParallelLinear(_TensorParallelLinear):
    """Input features split over tensor-parallel ranks (weight ``Shard(1)``, bias
    ``Replicate()``): takes this rank's features, returns the whole output on every rank."""

    weight_placement = Shard(1)
    bias_placement = Replicate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = _ReduceFromTensorParallel.apply(F.linear(x, self.weight.to_local()), self.group)
            # After the sum: the bias is added once, not once per rank.
            return out if self.bias is None else out + self.bias.to_local()
        return _RowParallelLinearFn.apply(x, self.weight, self.bias, self.group)


def parallelize(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> GPT:
    """Tensor parallelism over ``tp_mesh`` in Megatron-LM's layout: column-parallel ``qkv`` and
    first MLP layer, row-parallel ``proj`` and second MLP layer, each rank attending with its
    own heads. Compose with zero-shard's sharding (or FSDP2) over the data-parallel dim after.

    Both plans give the linears' params the same DTensor layouts under the same names, so a
    checkpoint of either (or of the model without tensor parallelism) resumes in the other.

    Args:
        model: the GPT, on its device.
        tp_mesh: the 1-D tensor-parallel mesh (``mesh["tp"]`` of a ``("dp", "tp")`` mesh).
        sequence_parallel: default ``False``: the four linears of each block become
            ``ColumnParallelLinear`` / ``RowParallelLinear``, which compute on local tensors
            with one all-reduce each (the row-parallel ones' in forward, the column-parallel
            ones' in backward); the norms, residuals, attention, embeddings and tied head run
            on plain tensors, replicated over ``tp`` (the vocabulary is 256 bytes): build the
            model alike on every ``tp`` rank (the same seed), as nothing broadcasts them. ``True``:
            torch's ``parallelize_module`` with sequence parallelism between the linears (the
            norms and residuals hold this rank's positions) and vocab-split embeddings with the
            tied head split alike: less activation memory per rank, and every op on a param or
            between the linears an eager DTensor op.

    Example::

        mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = parallelize(GPT(config).cuda(), mesh["tp"])
        optimizer = zero_shard.wrap(torch.optim.AdamW(model.parameters()), model)
    """
    config, size = model.config, tp_mesh.size()
    divisors = [("num_heads", config.num_heads)]
    if sequence_parallel:
        divisors += [("seq_len", config.seq_len), ("vocab size", VOCAB_SIZE)]
    for name, value in divisors:
        if value % size:
            raise ValueError(f"{name} {value} must divide over {size} tensor-parallel ranks")
    if not sequence_parallel:
        for block in model.blocks:
            block.attn.qkv = ColumnParallelLinear(block.attn.qkv, tp_mesh=tp_mesh)
            block.attn.proj = RowParallelLinear(block.attn.proj, tp_mesh=tp_mesh)
            block.mlp[0] = ColumnParallelLinear(block.mlp[0], tp_mesh=tp_mesh)
            block.mlp[2] = RowParallelLinear(block.mlp[2], tp_mesh=tp_mesh)
        return model
    parallelize_module(
        model,
        tp_mesh,
        {
            "token_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_final": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    model.head.weight = model.token_emb.weight  # both Shard(0) over the vocab
    gather_sequence = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    block_plan = {
        "ln_attn": SequenceParallel(),
        "attn": gather_sequence,
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_mlp": SequenceParallel(),
        "mlp": gather_sequence,
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    return model


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Param groups with weight decay on the matrices (linear weights, the tied embedding) and
    none on biases and norms."""
    params = list(model.parameters())  # a tied weight appears once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte loss, in fp32 whatever the model dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


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


def split_train_val(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, ...]:
    num_train = int(len(data) * (1 - val_fraction))
    return data[:num_train], data[num_train:]


def global_batch(
    data: torch.Tensor, *, batch_size: int, seq_len: int, seed: int, step: int
) -> torch.Tensor:
    """The step's whole batch (every rank's rows): ``batch_size`` random windows of
    ``seq_len + 1`` bytes, int64, on the CPU. The same for a given seed and step whatever the
    world size, so runs resumed at another world size see the same data."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"{len(data)} bytes of data are too few for seq_len {seq_len}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()


def split_windows(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of windows of ``seq_len + 1`` bytes: targets are one byte ahead."""
    return windows[:, :-1], windows[:, 1:]
