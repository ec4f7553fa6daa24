"""The grads are read at step(): whatever happened to them after backward (accumulation, clipping
in place, a new .grad, in-place writes that bump no version counter) is what the step uses, as
in torch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _parity import OTHER_KERNEL

from optimizers import HybridDeviceOptimizer, OffloadPolicy


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(15, 33), torch.nn.Tanh(), torch.nn.Linear(33, 7), torch.nn.Linear(7, 3)
    )
    return model.to(dtype)


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    between: Callable[[torch.nn.Module], None] = lambda model: None,
    micro_batches: int = 1,
) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(5, 15, generator=gen).to(next(model.parameters()).dtype)
            loss = model(x).float().square().mean()
            loss.backward()
        between(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def hybrid(model: torch.nn.Module) -> HybridDeviceOptimizer:
    policy = OffloadPolicy(fraction=0.6, chunk_numel=64, num_threads=2)
    return HybridDeviceOptimizer(model.parameters(), policy=policy, lr=1e-2, weight_decay=0.1)


def clip(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # scales the grads in place


def replace_grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = param.grad * 0.5  # a new tensor


def unscale(model: torch.nn.Module) -> None:
    # GradScaler.unscale_ divides the grads in place without bumping their version counter,
    # and so does a write through .data.
    found_inf = torch.zeros(1)
    grads = [p.grad for p in model.parameters()]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 0.25))
    next(model.parameters()).grad.data.mul_(0.5)


@pytest.mark.parametrize(
    ("between", "micro_batches"),
    [(clip, 1), (replace_grads, 1), (clip, 2), (unscale, 1), (lambda m: None, 3)],
    ids=["clipping", "new-grad", "accumulation+clipping", "unscale", "accumulation"],
)
def test_the_step_uses_the_grads_as_they_are_at_step(between: Callable, micro_batches: int) -> None:
    model, reference = make_model(torch.float32), make_model(torch.float32)
    opt = hybrid(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    losses = train(model, opt, steps=4, between=between, micro_batches=micro_batches)
    ref_losses = train(reference, ref_opt, steps=4, between=between, micro_batches=micro_batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])


def test_reload_after_backward_keeps_the_grads() -> None:
    # reload_model_params() refills the staging buffers with weights; the grads of the backward
    # before it are still the ones the step uses.
    model, reference = make_model(torch.float32), make_model(torch.float32)
    opt = hybrid(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for net, optimizer in ((model, opt), (reference, ref_opt)):
        net(torch.ones(5, 15)).sum().backward()
        if optimizer is opt:
            opt.reload_model_params()
        optimizer.step()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])


@pytest.mark.parametrize("warmup", [0, 2])
def test_delayed_update_lags_the_params_one_step(warmup: int) -> None:
    # OffloadPolicy(delayed_update=True): the CPU step of step k reaches the params at step k+1,
    # so the grads of step k+1 are taken at the weights of step k-1. The reference writes that
    # out with torch AdamW on a master copy; state_dict() applies the update in flight. With
    # delayed_update_warmup=2 the updates of steps 0 and 1 reach the params at once, as exact
    # steps do, and the lag starts with step 2's.
    model, params_ref, master = (make_model(torch.float32) for _ in range(3))
    policy = OffloadPolicy(
        fraction=1.0,
        chunk_numel=64,
        num_threads=2,
        delayed_update=True,
        delayed_update_warmup=warmup,
    )
    opt = HybridDeviceOptimizer(model.parameters(), policy=policy, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(5, 15, generator=gen)
        # At step 1 without warm-up: the initial weights (step 0's update is still in flight).
        for param, ref in zip(model.parameters(), params_ref.parameters(), strict=True):
            torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])
        model(x).square().mean().backward()
        params_ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for ref, mast in zip(params_ref.parameters(), master.parameters(), strict=True):
                mast.grad, ref.grad = ref.grad, None
                ref.copy_(mast)  # the last step's update reaches the params
        ref_opt.step()
        ref_opt.zero_grad()
        if step < warmup:  # a warm-up step: its own update reaches the params at once
            with torch.no_grad():
                for ref, mast in zip(params_ref.parameters(), master.parameters(), strict=True):
                    ref.copy_(mast)
    opt.state_dict()
    for param, mast in zip(model.parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(param, mast, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])
