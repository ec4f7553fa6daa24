"""zero_shard.wrap on 2 CPU processes (gloo) where things go off the common path: ranks running
different modules, fp16 mixed with fp32, a NaN or an inf on one rank under inf-norms, a backward that
raises, and inputs that deserve a clear error."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import check_outcome, run_cases
from _models import (
    adamw,
    assert_params_close,
    global_batch,
    local_slice,
    make_model,
    mse,
    step_reference,
)
from torch import nn

import zero_shard
from zero_shard import OffloadPolicy

CASES = {}
TINY_BUCKETS = 0.0008


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


class Stack(nn.Module):
    """Twelve layers; ``depth`` says how many a forward runs (ranks may pick different depths)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))

    def forward(self, x: torch.Tensor, depth: int = 12) -> torch.Tensor:
        for layer in self.layers[:depth]:
            x = torch.tanh(layer(x))
        return x


def assert_replicas_agree(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        copies = [torch.empty_like(param) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, param.detach().contiguous())
        for other in copies[1:]:
            assert torch.equal(copies[0], other), name


@case
def ranks_running_different_modules_keep_collectives_in_order(rank: int, world: int) -> None:
    # With overlap, gathers are launched from the forward pre-hooks of the modules that run: a
    # rank that skips modules must still issue the same collectives in the same order (else
    # gloo times out). Plain and DDP models (DDP's own all-reduces share the group).
    for use_ddp in (False, True):
        torch.manual_seed(0)
        stack = Stack()
        model = (
            nn.parallel.DistributedDataParallel(stack, find_unused_parameters=True)
            if use_ddp
            else stack
        )
        opt = zero_shard.wrap(
            torch.optim.AdamW(stack.parameters(), lr=1e-2), model, stage=1 if use_ddp else 2,
            bucket_mb=0.0001,  # one param a bucket: 24 gathers, more than prefetch covers
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):
            depth = 2 if (step == 1 and rank == world - 1) else 12
            model(torch.randn(3, 8, generator=gen), depth=depth).square().sum().backward()
            opt.step()
            opt.zero_grad()
        opt.finish_param_sync()
        assert_replicas_agree(stack)


class Mixed(nn.Module):
    """An fp16 layer feeding an fp32 layer (as models that keep norms and heads in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.half_layer = nn.Linear(15, 7).half()
        self.full_layer = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.full_layer(torch.tanh(self.half_layer(x.half())).float())


@case
def fp16_and_fp32_grads_are_unscaled_once(rank: int, world: int) -> None:
    # The loss scale is a power of two: scaling and unscaling the fp32 layer's grads is exact,
    # so its step must equal the step of an unscaled run bit for bit.
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = Mixed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        models.append(model)
        opts.append(zero_shard.wrap(opt, model, offload=OffloadPolicy(fraction=0.5, num_threads=1),
                                    bucket_mb=TINY_BUCKETS))  # fmt: skip
    scaler = zero_shard.GradScaler("cpu", init_scale=2.0**10)
    x, y = global_batch(0)
    xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
    scaler.scale(mse(models[0](xs), ys)).backward()
    scaler.unscale_(opts[0])
    norm = opts[0].clip_grad_norm_(1e9)  # no clipping; the norm itself must be unscaled
    scaler.step(opts[0])
    scaler.update()
    mse(models[1](xs), ys).backward()
    reference_norm = opts[1].clip_grad_norm_(1e9)
    opts[1].step()
    for opt in opts:
        opt.finish_param_sync()
    torch.testing.assert_close(norm, reference_norm, rtol=1e-3, atol=0.0)  # fp16 grads round
    for name in ("weight", "bias"):
        scaled = getattr(models[0].full_layer, name)
        plain = getattr(models[1].full_layer, name)
        assert torch.equal(scaled, plain), name
    assert opts[0].num_skipped_steps == 0 and scaler.get_scale() == 2.0**10


@case
def a_nonfinite_grad_on_the_last_rank_under_inf_norms_skips_everywhere(
    rank: int, world: int
) -> None:
    # A NaN, inf or -inf in one grad element (the last rank's shard after the reduction), then
    # an inf-norm: zero-shard's clip, torch's clip or total norm, torch's clip with
    # error_if_nonfinite=True, or only a logged per-grad inf-norm. The norm is inf or NaN on
    # every rank, as torch's, torch's check raises on every rank, and the step is skipped with
    # the params as they were.
    torch_clip = torch.nn.utils.clip_grad_norm_
    norms: dict[str, Callable[[torch.nn.Module, Any], torch.Tensor | None]] = {
        "opt.clip_grad_norm_": lambda model, opt: opt.clip_grad_norm_(1.0, norm_type=math.inf),
        "torch clip": lambda model, opt: torch_clip(model.parameters(), 1.0, norm_type=math.inf),
        "get_total_norm": lambda model, opt: torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters()], norm_type=math.inf
        ),
        "logged p.grad.norm(inf)": lambda model, opt: model.inp.weight.grad.norm(math.inf),
        "error_if_nonfinite": lambda model, opt: torch_clip(
            model.parameters(), 1.0, norm_type=math.inf, error_if_nonfinite=True
        ),
    }
    for bad in (math.nan, math.inf, -math.inf):
        for name, norm_of in norms.items():
            for fraction in (0.0, 0.5):
                where = (bad, name, fraction)
                model = make_model()
                policy = OffloadPolicy(fraction=fraction, num_threads=1)
                opt = zero_shard.wrap(adamw(model), model, offload=policy, bucket_mb=TINY_BUCKETS)
                before = [p.detach().clone() for p in model.parameters()]

                def poison(grad: torch.Tensor, bad: float = bad) -> torch.Tensor:
                    grad = grad.clone()
                    grad[-1, 0] = bad  # the last row: the last rank's shard after the reduction
                    return grad

                handle = model.inp.weight.register_hook(poison) if rank == 0 else None
                x, y = global_batch(0)
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                if handle is not None:
                    handle.remove()
                if name == "error_if_nonfinite":
                    with pytest.raises(RuntimeError, match="non-finite"):
                        norm_of(model, opt)
                else:
                    norm = norm_of(model, opt)
                    # (on every rank, though only the last one holds the element)
                    assert not torch.isfinite(norm), (where, norm)
                    if not math.isnan(bad):
                        assert torch.isinf(norm), (where, norm)  # torch's: inf, not NaN
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt.step()
                opt.finish_param_sync()
                assert opt.num_skipped_steps == 1, where
                for old, new in zip(before, model.parameters(), strict=True):
                    assert torch.equal(old, new.detach()), where


@case
def a_backward_that_raises_leaves_nothing_behind(rank: int, world: int) -> None:
    # The batch is dropped, as a training loop does after an OOM, by any way of clearing grads.
    clears: dict[str, Callable[[torch.nn.Module, Any], None]] = {
        "opt.zero_grad()": lambda model, opt: opt.zero_grad(),
        "model.zero_grad()": lambda model, opt: model.zero_grad(),
        "p.grad = None": lambda model, opt: [setattr(p, "grad", None) for p in model.parameters()],
    }
    for name, clear in clears.items():
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(
            adamw(model), model, offload=OffloadPolicy(fraction=0.5, num_threads=1),
            bucket_mb=TINY_BUCKETS,
        )  # fmt: skip
        ref_opt = adamw(ref)
        for step in range(5):
            x, y = global_batch(step)
            handle = None
            if step in (1, 3):  # raises late in backward, after later buckets were reduced

                def fail(grad: torch.Tensor) -> torch.Tensor:
                    raise RuntimeError("simulated out of memory")

                handle = model.inp.weight.register_hook(fail)
            try:
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            except RuntimeError as err:
                assert "simulated" in str(err)
                handle.remove()
                clear(model, opt)
                continue
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"after failed backwards, cleared by {name}")


@case
def reload_right_after_a_step_keeps_that_step(rank: int, world: int) -> None:
    # With overlap, the params lag the shards until the next forward; a reload then must not
    # take the params' older values for the main weights.
    model, ref = make_model(), make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    ref_opt = adamw(ref)
    for step in range(3):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        opt.reload_model_params()
        step_reference(ref, ref_opt, x, y)
    opt.finish_param_sync()
    assert_params_close(model, ref, "reloaded after every step")


@case
def clear_errors_and_warnings(rank: int, world: int) -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="'weight' is not contiguous"):
        zero_shard.wrap(torch.optim.AdamW(conv.parameters()), conv)
    model = make_model()
    other = make_model()
    with pytest.raises(ValueError, match="not a param of the model"):
        zero_shard.wrap(adamw(other), model)
    model.out.weight.requires_grad_(False)
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    model.out.weight.requires_grad_(True)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    for call in (lambda: opt.clip_grad_norm_(1.0), opt.step):
        with pytest.raises(RuntimeError, match=r"params \['out.weight'\] had requires_grad=False"):
            call()
    opt.finish_param_sync()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # Unfrozen, then wrapped again as the error says (the refused backward's grads cleared
    # first; the new wrapper takes the params over): it trains.
    opt.zero_grad()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()
    opt.finish_param_sync()
    out = [name for name, _ in model.named_parameters()].index("out.weight")
    assert not torch.equal(before[out], model.out.weight)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    return run_cases(CASES, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
