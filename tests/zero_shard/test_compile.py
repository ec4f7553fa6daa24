"""torch.compile of a model under zero_shard.wrap on 1 and 2 CPU processes (gloo), backend
"aot_eager": the whole model (``torch.compile(model)``, with and without ``fullgraph``, and
``model.compile()``) and each block (``block.compile()``), plain, under DDP and under FSDP2,
against single-process torch AdamW on the uncompiled model, every step. The gathers are issued late on purpose and a share of the step
runs on the CPU: a compiled forward that did not wait for them would read the weights of the
step before ([Note: compiled models] in ``zero_shard/_compiled.py``): it waits at graph breaks
where breaks are allowed, and with ``fullgraph=True`` the gathers end before ``step()`` returns."""

from __future__ import annotations

import threading
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

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


class _Held:
    """Holds the first gather of one step on rank 0 until the forward after it has run (or
    ``HOLD_S`` passed): a forward that did not wait for it reads the weights before the step,
    however long its trace takes."""

    HOLD_S = 5.0

    def __init__(self) -> None:
        self.armed = False
        self.released = threading.Event()

    def arm(self) -> None:
        self.released.clear()
        self.armed = True

    def hold(self) -> None:
        if self.armed:
            self.armed = False
            self.released.wait(self.HOLD_S)


HELD = _Held()


def late_all_gather(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """``wrap(all_gather=...)`` issuing each gather late on rank 0 (so on every rank)."""
    if dist.get_rank() == 0:
        HELD.hold()
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
    eager_steps: int = 0,
    breaks_refused: bool = False,
    **options: Any,
) -> None:
    """Trains the wrapped model beside torch, compiled (``compile_fn``) from the start or after
    ``eager_steps`` eager steps (the first trace then meets gathers in flight); compares the
    logits and loss every step and the params after every step. ``breaks_refused``: graph
    breaks are refused by the caller's context rather than ``fullgraph=True``."""
    forget_compiled()
    model, opt = build(overlap, fraction)
    torch.manual_seed(0)
    ref = Tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    where = f"{compile_fn.__name__}{options}, overlap {overlap}, fraction {fraction}"
    run: nn.Module = model
    for step in range(STEPS + eager_steps):
        if step == eager_steps:
            run = compile_fn(model, **options)
        idx = tokens(step)
        logits = run(local_slice(idx, rank, world))
        HELD.released.set()
        ref_logits = ref(idx)
        expected = local_slice(ref_logits, rank, world).detach()
        assert_close(logits, expected, f"{where}: logits at step {step}")
        loss = loss_of(logits, local_slice(idx, rank, world))
        loss.backward()
        if step == eager_steps - 1:
            HELD.arm()  # the first compiled call's trace meets this step's gathers in flight
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
    # With overlap and breaks allowed the waits are graph breaks, run eagerly; otherwise they
    # are not in the graphs.
    waits = sum(n for reason, n in counters["graph_break"].items() if "zero-shard's" in reason)
    breaks = overlap and not options.get("fullgraph", False) and not breaks_refused
    assert (waits > 0) == breaks, f"{where}: {waits} graph breaks at zero-shard's waits"


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
def fullgraph_with_overlap_gathers_before_step_returns(rank: int, world: int) -> None:
    # The default overlap: the trace waits for the gathers in flight and turns the overlap off,
    # so the graphs are whole and read current params; compiled from the first call, and after
    # eager steps (the trace then meets the late gathers of the step before).
    for compile_fn in (compile_whole, compile_method, compile_blocks):
        train_against_torch(rank, world, compile_fn, overlap=True, fullgraph=True)
    for fraction in (0.0, 0.5):
        train_against_torch(
            rank,
            world,
            compile_whole,
            overlap=True,
            fraction=fraction,
            eager_steps=2,
            fullgraph=True,
        )


@case
def no_breaks_by_context_is_fullgraph_too(rank: int, world: int) -> None:
    # torch._dynamo.error_on_graph_break(True) refuses breaks like fullgraph=True.
    error_on_graph_break = getattr(torch._dynamo, "error_on_graph_break", None)
    if error_on_graph_break is None:
        return  # a torch without it (before 2.9)
    with error_on_graph_break(True):
        train_against_torch(rank, world, compile_whole, overlap=True, breaks_refused=True)


def train_kind_against_torch(rank: int, world: int, kind: str, per_block: bool) -> None:
    """A DDP or FSDP2 model under wrap (half the step on the CPU), compiled whole or per block,
    against torch AdamW on the uncompiled model, every step."""
    forget_compiled()
    torch.manual_seed(0)
    tiny = Tiny()
    options: dict[str, Any] = {}
    if kind == "ddp":  # zero-shard gathers the params after DDP reduced the grads
        model: nn.Module = nn.parallel.DistributedDataParallel(tiny)
        options = {"bucket_mb": ONE_PER_BUCKET, "all_gather": late_all_gather}
    else:
        for block in tiny.layers:
            fully_shard(block)
        model = fully_shard(tiny)
    offload = OffloadPolicy(fraction=0.5, num_threads=1, chunk_numel=64)
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), model, offload=offload, **options
    )
    if per_block:
        for block in tiny.layers:
            block.compile(backend="aot_eager")
    run = model if per_block else torch.compile(model, backend="aot_eager")
    torch.manual_seed(0)
    ref = Tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    where = f"{kind}, compiled {'per block' if per_block else 'whole'}"
    for step in range(STEPS):
        idx = tokens(step)
        logits = run(local_slice(idx, rank, world))
        ref_logits = ref(idx)
        expected = local_slice(ref_logits, rank, world).detach()
        assert_close(logits, expected, f"{where}: logits at step {step}")
        loss_of(logits, local_slice(idx, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref_logits, idx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.finish_param_sync()
    for (name, param), ref_param in zip(tiny.named_parameters(), ref.parameters(), strict=True):
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        assert_close(whole.detach(), ref_param.detach(), f"{where}: {name}")
    assert counters["stats"]["unique_graphs"] > 0, f"{where}: nothing was compiled"


@case
def a_compiled_train_step_runs_zero_shards_work_eagerly(rank: int, world: int) -> None:
    # torch.compile of a whole train step (forward, backward, step, zero_grad), with inductor:
    # dynamo traces what the eager parts call, the backward's hooks included; zero-shard's
    # reductions and step run eagerly (torch.compiler.disable): inductor failed on their
    # aliasing set_ at fraction 0.5 (aot_eager traced them).
    for fraction in (0.5,):
        forget_compiled()
        model, opt = build(True, fraction)
        torch.manual_seed(0)
        ref = Tiny()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)

        def train_step(
            idx: torch.Tensor, model: nn.Module = model, opt: torch.optim.Optimizer = opt
        ) -> torch.Tensor:
            loss = loss_of(model(idx), idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        compiled = torch.compile(train_step)
        for step in range(STEPS):
            idx = tokens(step)
            loss = compiled(local_slice(idx, rank, world))
            HELD.released.set()
            ref_loss = loss_of(ref(idx), idx)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            where = f"compiled train step, fraction {fraction}, step {step}"
            assert_close(mean_over_ranks(loss), ref_loss.detach(), where)
        opt.finish_param_sync()
        pairs = zip(model.named_parameters(), ref.parameters(), strict=True)
        for (name, param), ref_param in pairs:
            assert_close(param.detach(), ref_param.detach(), f"fraction {fraction}: {name}")


@case
def ddp_and_fsdp2_models_compiled(rank: int, world: int) -> None:
    for kind in ("ddp", "fsdp2"):
        for per_block in (True, False):
            train_kind_against_torch(rank, world, kind, per_block)


@pytest.fixture(scope="module", params=[1, 2])
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
