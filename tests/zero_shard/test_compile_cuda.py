"""torch.compile with inductor of a model under zero_shard.wrap, on the GPUs there are (up to 4)
with NCCL: the whole model and each block, graph breaks allowed and refused
(``fullgraph=True``), compiled from the first call and after eager steps, against eager torch
AdamW on one GPU, every step. The gathers are issued late (the first one of the step before the
first compiled call held until that call has run) and half the step runs on the CPU, as in the
gloo version (``test_compile.py``). Skipped without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _harness import check_outcome, run_cases
from _models import local_slice, mean_over_ranks
from test_compile import (
    EPS,
    HELD,
    LR,
    ONE_PER_BUCKET,
    STEPS,
    Tiny,
    forget_compiled,
    late_all_gather,
    loss_of,
    tokens,
)
from torch import nn
from torch._dynamo.utils import counters

import zero_shard
from zero_shard import OffloadPolicy

pytestmark = pytest.mark.cuda

CASES = {}
WORLD = min(torch.cuda.device_count(), 4)
# Inductor fuses what eager runs op by op (other roundings, ~1e-6 relative), and the reference
# sees the whole batch on one GPU; AdamW carries that at O(lr) a step. A forward that read the
# weights of the step before is off by ~1e-1.
TOL = {"rtol": 1e-4, "atol": 1e-4}


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def whole(model: Tiny, **options: Any) -> nn.Module:
    return torch.compile(model, **options)


def blocks(model: Tiny, **options: Any) -> nn.Module:
    for block in model.layers:
        block.compile(**options)
    return model


def train(
    rank: int, world: int, compile_fn: Callable[..., nn.Module], eager_steps: int, **options: Any
) -> None:
    forget_compiled()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = Tiny().to(device)
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS),
        model,
        offload=OffloadPolicy(fraction=0.5, chunk_numel=64),
        bucket_mb=ONE_PER_BUCKET,
        all_gather=late_all_gather,
    )
    torch.manual_seed(0)
    ref = Tiny().to(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    where = f"{compile_fn.__name__}{options}, compiled after {eager_steps} steps"
    run: nn.Module = model
    for step in range(STEPS + eager_steps):
        if step == eager_steps:
            run = compile_fn(model, **options)
        idx = tokens(step).to(device)
        logits = run(local_slice(idx, rank, world))
        HELD.released.set()
        ref_logits = ref(idx)
        torch.testing.assert_close(
            logits, local_slice(ref_logits, rank, world).detach(), **TOL, msg=f"{where}: {step}"
        )
        loss = loss_of(logits, local_slice(idx, rank, world))
        loss.backward()
        if step == eager_steps - 1:
            HELD.arm()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(ref_logits, idx)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(mean_over_ranks(loss), ref_loss.detach(), **TOL)
    opt.finish_param_sync()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param, ref_param, **TOL, msg=f"{where}: {name}")
    assert counters["stats"]["unique_graphs"] > 0, f"{where}: nothing was compiled"


@case
def inductor_matches_eager_torch(rank: int, world: int) -> None:
    for compile_fn in (whole, blocks):
        for fullgraph in (False, True):
            train(rank, world, compile_fn, 0, fullgraph=fullgraph)
    train(rank, world, whole, 2, fullgraph=True)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    if WORLD == 0:
        pytest.skip("needs a GPU; runs on the GPU machines")
    return run_cases(CASES, WORLD, backend="nccl")


@pytest.mark.parametrize("name", list(CASES))
def test_on_gpus(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
