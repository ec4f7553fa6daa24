"""torch.compile of a model under zero_shard.wrap on 1 and 2 CPU processes (gloo), backend
"aot_eager": the whole model (``torch.compile(model)``, with and without ``fullgraph``, and
``model.compile()``) and each block (``block.compile()``), against single-process torch AdamW on
the uncompiled model, every step. The gathers are issued late on purpose and a share of the step
runs on the CPU: a compiled forward that did not wait for them would read the weights of the
step before ([Note: compiled models] in ``zero_shard/_compiled.py``)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from _harness import check_outcome, run_cases
from _models import GLOBAL_BATCH, PARAM_TOL, local_slice, mean_over_ranks
from torch import nn
from torch._dynamo.utils import counters

import zero_shard
from zero_shard import OffloadPolicy

CASES = {}
STEPS = 3
SEQ, VOCAB, DIM = 8, 32, 16
LR = 1e-2
# AdamW's eps well above the grad noise: a grad that is zero but for rounding would otherwise
# become a whole step of size lr, with a sign that differs between two summation orders.
EPS = 1e-3
# aot_eager runs the same aten ops as eager; what differs from the reference is the mean over
# ranks, a few ulps, which AdamW carries at O(lr) a step (as _models.PARAM_TOL says).
TOL = PARAM_TOL
ONE_PER_BUCKET = 1e-6  # MiB: a bucket (a gather) per param


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias would get rounding-only grads
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Tiny(nn.Module):
    """A small GPT: the default units are its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tokens(step: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step)
    )


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def late_all_gather(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """``wrap(all_gather=...)`` issuing each gather late on rank 0 (so on every rank)."""
    if dist.get_rank() == 0:
        time.sleep(0.01)
    return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)


def compile_whole(model: Tiny, **options: Any) -> nn.Module:
    return torch.compile(model, backend="aot_eager", **options)


def compile_method(model: Tiny, **options: Any) -> nn.Module:
    model.compile(backend="aot_eager", **options)
    return model


def compile_blocks(model: Tiny, **options: Any) -> nn.Module:
    for block in model.layers:
        block.compile(backend="aot_eager", **options)
    return model


def build(overlap: bool, fraction: float) -> tuple[Tiny, zero_shard.ZeroShardOptimizer]:
    torch.manual_seed(0)
    model = Tiny()
    offload = OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=64) if fraction else None
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS),
        model,
        offload=offload,
        overlap_param_gather=overlap,
        bucket_mb=ONE_PER_BUCKET,
        all_gather=late_all_gather,
    )
    return model, opt


def forget_compiled() -> None:
    """Each case compiles afresh: no code (or count) of an earlier model carries over."""
    torch._dynamo.reset()
    counters.clear()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda text: f"{where}: {text}")


def train_against_torch(
    rank: int,
    world: int,
    compile_fn: Callable[..., nn.Module],
    *,
    overlap: bool,
    fraction: float = 0.5,
    **options: Any,
) -> None:
    """Compiles the wrapped model (before its first call) and trains it beside torch; compares
    the logits and loss every step and the params after every step."""
    forget_compiled()
    model, opt = build(overlap, fraction)
    compiled = compile_fn(model, **options)
    torch.manual_seed(0)
    ref = Tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    where = f"{compile_fn.__name__}{options}, overlap {overlap}, fraction {fraction}"
    for step in range(STEPS):
        idx = tokens(step)
        logits = compiled(local_slice(idx, rank, world))
        ref_logits = ref(idx)
        expected = local_slice(ref_logits, rank, world).detach()
        assert_close(logits, expected, f"{where}: logits at step {step}")
        loss = loss_of(logits, local_slice(idx, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(ref_logits, idx)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(mean_over_ranks(loss), ref_loss.detach(), f"{where}: loss at step {step}")
    opt.finish_param_sync()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(param.detach(), ref_param.detach(), f"{where}: {name}")
    assert counters["stats"]["unique_graphs"] > 0, f"{where}: nothing was compiled"
    # With overlap the waits are graph breaks, run eagerly; without, they are not in the graphs.
    waits = sum(n for reason, n in counters["graph_break"].items() if "zero-shard's" in reason)
    assert (waits > 0) == overlap, f"{where}: {waits} graph breaks at zero-shard's waits"


@case
def whole_model_waits_at_graph_breaks(rank: int, world: int) -> None:
    # Overlapping gathers: the graph breaks at each hook, which waits eagerly.
    train_against_torch(rank, world, compile_whole, overlap=True)
    train_against_torch(rank, world, compile_method, overlap=True, fraction=0.0)


@case
def per_block_compile_waits_at_graph_breaks(rank: int, world: int) -> None:
    train_against_torch(rank, world, compile_blocks, overlap=True)


@case
def fullgraph_without_overlap_compiles_whole_graphs(rank: int, world: int) -> None:
    # The params are current once step() returns: the hooks are left out of the compiled code
    # (fullgraph=True would refuse a graph break).
    for compile_fn in (compile_whole, compile_blocks):
        train_against_torch(rank, world, compile_fn, overlap=False, fullgraph=True)


@case
def fullgraph_with_overlap_names_the_fix(rank: int, world: int) -> None:
    for compile_fn in (compile_whole, compile_blocks):
        forget_compiled()
        model, opt = build(overlap=True, fraction=0.0)
        compiled = compile_fn(model, fullgraph=True)
        with pytest.raises(
            torch._dynamo.exc.Unsupported, match=r"overlap_param_gather=False\).*fullgraph=False"
        ):
            compiled(local_slice(tokens(0), rank, world))
        del opt


@pytest.fixture(scope="module", params=[1, 2])
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
