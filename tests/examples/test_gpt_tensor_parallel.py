"""``gpt.parallelize``'s default plan on two CPU processes (gloo): each ``ColumnParallelLinear``
and ``RowParallelLinear`` is one autograd node that computes on the local shards and does its
own all-reduce. Its loss and grads are the unsplit GPT's, in fp32 and under bf16 autocast, over
two backwards that accumulate, with a frozen bias in each kind of linear, and with activation
checkpointing; the grads are DTensors in their params' layouts. Layers narrower than the ranks work; a second-order grad is refused."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS.parent / "examples"))
sys.path.insert(0, str(TESTS / "zero_shard"))

from _harness import check_outcome, run_cases  # noqa: E402
from gpt import (  # noqa: E402
    GPT,
    ColumnParallelLinear,
    GPTConfig,
    RowParallelLinear,
    cross_entropy,
    parallelize,
)

CONFIG = GPTConfig(num_layers=2, num_heads=4, d_model=32, seq_len=16)
FROZEN = ("blocks.1.mlp.0.bias", "blocks.0.attn.proj.bias")  # a column's and a row's


def _grads_match_the_unsplit_model(world: int, autocast: bool, checkpointed: bool = False) -> None:
    torch.manual_seed(0)
    full = GPT(CONFIG)
    for name, param in full.named_parameters():
        if param.dim() == 1:  # biases start at zero: nonzero, a bias added twice would show
            torch.nn.init.normal_(param, std=0.1)
        param.requires_grad_(name not in FROZEN)
    split = parallelize(copy.deepcopy(full), init_device_mesh("cpu", (world,)))
    split.checkpoint_activations = checkpointed  # each saved tensor unpacked once in backward
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second backward adds to the first's grads
        windows = torch.randint(256, (3, CONFIG.seq_len + 1), generator=generator)
        losses = []
        for model in (full, split):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = cross_entropy(model(windows[:, :-1]), windows[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        tol = 2e-2 if autocast else 1e-5
        torch.testing.assert_close(losses[1], losses[0], rtol=tol, atol=tol)
    params = dict(split.named_parameters())
    for name, param in full.named_parameters():
        got = params[name].grad
        if name in FROZEN:
            assert got is None, f"{name}: a frozen param got a grad"
            continue
        if isinstance(params[name], DTensor):
            assert isinstance(got, DTensor), f"{name}: grad of type {type(got).__name__}"
            assert got.placements == params[name].placements, name
            got = got.full_tensor()
        want = param.grad
        if autocast:  # bf16 matmuls split over ranks round differently: compare as vectors
            error = (got - want).norm() / want.norm()
            assert error < 2e-2, f"{name}: relative error {error:.3g}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


def grads_match_in_fp32(rank: int, world: int) -> None:
    _grads_match_the_unsplit_model(world, autocast=False)


def grads_match_under_bf16_autocast(rank: int, world: int) -> None:
    _grads_match_the_unsplit_model(world, autocast=True)


def grads_match_with_activation_checkpointing(rank: int, world: int) -> None:
    _grads_match_the_unsplit_model(world, autocast=False, checkpointed=True)


def a_rank_with_an_empty_share_and_double_backward(rank: int, world: int) -> None:
    """Layers narrower than the ranks (one rank's share empty) give the unsplit layers' grads;
    a second-order grad through them is refused (their backward is not differentiable), not
    computed wrong."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 1), nn.Linear(1, 8))
    mesh = init_device_mesh("cpu", (world,))
    split = nn.Sequential(
        ColumnParallelLinear(copy.deepcopy(full[0]), tp_mesh=mesh),
        RowParallelLinear(copy.deepcopy(full[1]), tp_mesh=mesh),
    )
    x = torch.randn(3, 8, requires_grad=True)
    x_split = x.detach().clone().requires_grad_(True)
    full(x).square().sum().backward()
    split(x_split).square().sum().backward()
    torch.testing.assert_close(x_split.grad, x.grad)
    for (name, want), got in zip(full.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)
    (grad,) = torch.autograd.grad(split(x_split).square().sum(), x_split, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.square().sum().backward()


CASES = {
    case.__name__: case
    for case in (
        grads_match_in_fp32,
        grads_match_under_bf16_autocast,
        grads_match_with_activation_checkpointing,
        a_rank_with_an_empty_share_and_double_backward,
    )
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    return run_cases(CASES, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_tensor_parallel(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
