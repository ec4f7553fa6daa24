"""Grads sent to the host during backward (post-accumulate-grad hooks): the same result as sending
them at step(), also when the grads change after their hook fired."""

from __future__ import annotations

import copy
import gc
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


def hybrid(model: torch.nn.Module, hooks: bool) -> HybridDeviceOptimizer:
    policy = OffloadPolicy(fraction=0.6, chunk_numel=64, num_threads=2, d2h_during_backward=hooks)
    return HybridDeviceOptimizer(model.parameters(), policy=policy, lr=1e-2, weight_decay=0.1)


def clip(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # scales the grads in place


def replace_grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = param.grad * 0.5  # a new tensor, not the one the hook sent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("between", "micro_batches"),
    [(lambda m: None, 1), (lambda m: None, 3), (clip, 1), (replace_grads, 1), (clip, 2)],
    ids=["plain", "accumulation", "clipping", "new-grad", "accumulation+clipping"],
)
def test_hooks_give_the_same_bits_as_sending_at_step(
    dtype: torch.dtype, between: Callable, micro_batches: int
) -> None:
    results = {}
    for hooks in (True, False):
        model = make_model(dtype)
        opt = hybrid(model, hooks)
        losses = train(model, opt, steps=4, between=between, micro_batches=micro_batches)
        results[hooks] = (losses, [p.detach().clone() for p in model.parameters()])
    assert results[True][0] == results[False][0]
    for with_hooks, without in zip(results[True][1], results[False][1], strict=True):
        assert torch.equal(with_hooks, without)


def test_hooks_fire_and_match_torch() -> None:
    model = make_model(torch.float32)
    reference = copy.deepcopy(model)
    opt = hybrid(model, hooks=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    offloaded = [r for r in opt._records if any(p.staging is not None for p in r.pieces)]
    assert offloaded, "the test needs offloaded params"
    first = torch.randn(5, 15)
    model(first).sum().backward()
    assert all(record.sent is not None for record in offloaded), "a hook did not send its grad"
    opt.step()
    assert all(record.sent is None for record in offloaded)
    opt.zero_grad()
    losses = train(model, opt, steps=5)
    reference(first).sum().backward()  # the same first step as above
    ref_opt.step()
    ref_opt.zero_grad()
    ref_losses = train(reference, ref_opt, steps=5)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])


def test_hooks_do_not_keep_the_optimizer_alive() -> None:
    model = make_model(torch.float32)
    opt = hybrid(model, hooks=True)
    host = opt._host
    probe = [host]
    del opt, host
    probe.clear()
    gc.collect()
    model(torch.randn(2, 15)).sum().backward()  # hooks of a dead optimizer: removed, no error
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_hooks_are_off_by_default() -> None:
    assert OffloadPolicy().d2h_during_backward is False


def test_default_handles_grads_changed_without_a_version_bump() -> None:
    # GradScaler.unscale_ divides the grads in place without bumping their version counter,
    # and so does a write through .data: grads are read at step() by default, so both count.
    def unscale(model: torch.nn.Module) -> None:
        found_inf = torch.zeros(1)
        grads = [p.grad for p in model.parameters()]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 0.25))
        next(model.parameters()).grad.data.mul_(0.5)

    model, reference = make_model(torch.float32), make_model(torch.float32)
    policy = OffloadPolicy(fraction=0.6, chunk_numel=64, num_threads=2)
    opt = HybridDeviceOptimizer(model.parameters(), policy=policy, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, steps=4, between=unscale)
    train(reference, ref_opt, steps=4, between=unscale)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])


def test_reload_after_backward_resends_the_grads() -> None:
    # reload_model_params() refills the staging buffers with weights: grads sent by the hooks
    # before it must be sent again.
    model, reference = make_model(torch.float32), make_model(torch.float32)
    opt = hybrid(model, hooks=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for net, optimizer in ((model, opt), (reference, ref_opt)):
        net(torch.ones(5, 15)).sum().backward()
        if optimizer is opt:
            opt.reload_model_params()
        optimizer.step()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])
