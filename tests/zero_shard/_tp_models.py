"""Tensor-parallel models for the 2-D mesh tests: a small Llama-shaped transformer with the tensor-
parallel plan torchtitan applies to Llama (column-parallel q/k/v and w1/w3, row-parallel wo and
w2, sequence-parallel norms, a row-parallel embedding), the same plan without sequence
parallelism ("llama_plain_norms": the norms are left out of the plan and stay plain params, which
FSDP2 then shards over ``dp`` alone, on the 1-D mesh), and an MLP whose shards are uneven or
empty. Written here from the plan's description, not copied.

The Llama's sizes keep every tensor-parallel split even (torch's row-parallel input needs it) and
leave the data-parallel splits uneven: the FFN's 6 rows split 3 + 3 over 2 tensor-parallel ranks,
then 2 + 1 over 2 data-parallel ones, or 2 + 2 + 2 + 0 over 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HEADS, HIDDEN, SEQ = 10, 8, 4, 8, 4
BATCH = 4  # sequences in a global batch: split over the data-parallel ranks


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: the local ones under tensor parallelism (q, k, v are column-parallel).
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize_llama(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """torchtitan's Llama plan: sequence parallel between the blocks' matmuls."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block_plan)
    return model


def parallelize_llama_plain_norms(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """torchtitan's Llama plan with sequence parallelism off: replicated activations between the
    blocks' matmuls, and the norms not in the plan (plain params)."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block_plan)
    return model


class MLP(nn.Module):
    """A column-parallel layer of 2 rows (1 per tensor-parallel rank: an empty data-parallel
    shard at dp 2), then a row-parallel one with a replicated bias."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 2)
        self.down = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def parallelize_mlp(model: MLP, tp_mesh: DeviceMesh) -> MLP:
    return parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def mesh_2d(dp: int, tp: int, device_type: str = "cpu") -> DeviceMesh:
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def tp_model(
    kind: str, mesh: DeviceMesh, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The model ``kind`` ("llama", "llama_plain_norms" or "mlp") in ``dtype``, tensor-parallel
    over ``mesh["tp"]``."""
    torch.manual_seed(seed)
    if kind == "llama":
        return parallelize_llama(Llama().to(dtype), mesh["tp"])
    if kind == "llama_plain_norms":
        return parallelize_llama_plain_norms(Llama().to(dtype), mesh["tp"])
    return parallelize_mlp(MLP().to(dtype), mesh["tp"])


def fsdp_tp(
    kind: str, mesh: DeviceMesh, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """``tp_model``, sharded by FSDP2 over ``mesh["dp"]`` (the blocks, then the root), as
    torchtitan composes them."""
    model = tp_model(kind, mesh, seed, dtype)
    for layer in getattr(model, "layers", []):
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only, a second group with its own lr."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]


def batch(kind: str, step: int, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's slice of step ``step``'s global batch (the tensor-parallel ranks
    of one data-parallel rank take the same)."""
    gen = torch.Generator().manual_seed(100 + step)
    if kind.startswith("llama"):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        inputs, targets = torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 3, generator=gen)
    per_rank = BATCH // mesh["dp"].size()
    start = mesh["dp"].get_local_rank() * per_rank
    rows = slice(start, start + per_rank)
    device = mesh.device_type  # the current device of that type (the harness sets it)
    return inputs[rows].to(device), targets[rows].to(device)


def loss_of(
    kind: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    out = model(inputs).float()
    if kind.startswith("llama"):
        return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))
    return F.mse_loss(out, targets)
