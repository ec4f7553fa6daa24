"""Grads copied to the host before the step (``grads_ready``) and a grad factor applied in the
grads' dtype (``grad_factor``): the same bits as multiplying the grads in place and copying them
at the step, whatever happens to the grads in between; see [Note: early grad copies]."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _parity import groups_of, main_weights, make_params

from optimizers import HybridDeviceOptimizer, OffloadPolicy, scale_grads_
from optimizers._host_step import ChunkJob
from optimizers._staging import _lead_with_a_landed_copy

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
FACTORS = [None, 0.3713, 1.0]


def build(params: list[torch.Tensor], fraction: float, **policy: Any) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(
        groups_of(params),
        torch.optim.AdamW,
        policy=OffloadPolicy(fraction=fraction, chunk_numel=64, **policy),
        lr=1e-2,
        weight_decay=0.1,
    )


class CountCopies:
    """Counts the D2H copies the host part queues (a step that found every chunk copied early
    queues none)."""

    def __init__(self, opt: HybridDeviceOptimizer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        engine = opt._host.engine
        d2h = engine.d2h

        def counted(pairs: Any, **kwargs: Any) -> Any:
            self.count += 1
            return d2h(pairs, **kwargs)

        monkeypatch.setattr(engine, "d2h", counted)


def run_pair(
    dtype: torch.dtype,
    device: str,
    fraction: float,
    factor: float | None,
    between: Callable[[HybridDeviceOptimizer, list[torch.Tensor], int], None],
    monkeypatch: pytest.MonkeyPatch,
    *,
    cpu_kernel: str = "auto",
    steps: int = 3,
) -> list[int]:
    """Trains two optimizers on the same grads: one told of the grads early (in two calls, the
    last params first, as backward reduces them) and stepped with ``grad_factor``; the other with
    bounded staging and the grads multiplied in place by ``scale_grads_`` (as a clip does) before
    a plain step.
    ``between(opt, params, step)`` runs on both after ``grads_ready`` and before the step.
    Returns the D2H copies each of the
    early side's steps queued."""
    params = make_params(dtype, device)
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = build(params, fraction, host_staging="per_chunk", cpu_kernel=cpu_kernel)
    ref_opt = build(refs, fraction, cpu_kernel=cpu_kernel)
    copies = CountCopies(opt, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    counts = []
    for step in range(steps):
        for param, ref in zip(params, refs, strict=True):
            grad = (torch.randn(param.shape, generator=gen) * 0.5).to(dtype)
            param.grad, ref.grad = grad.to(device), grad.to(device).clone()
        half = len(params) // 2
        opt.grads_ready({i: params[i].grad for i in range(half, len(params))})
        opt.grads_ready({i: params[i].grad for i in range(half)})
        between(opt, params, step)
        between(ref_opt, refs, step)
        grad_factor = None
        if factor is not None:
            grad_factor = torch.tensor([factor], device=device)
            scale_grads_([r.grad for r in refs if r.grad is not None], grad_factor)
        before = copies.count
        opt.step(grad_factor=grad_factor)
        ref_opt.step()
        counts.append(copies.count - before)
        for index, (main, ref_main) in enumerate(
            zip(main_weights(opt, params), main_weights(ref_opt, refs), strict=True)
        ):
            assert torch.equal(main, ref_main), f"step {step}, param {index}"
            assert torch.equal(params[index], refs[index]), f"step {step}, param {index}"
    return counts


def nothing(opt: HybridDeviceOptimizer, params: list[torch.Tensor], step: int) -> None:
    pass


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("factor", FACTORS)
def test_early_copies_and_factor_are_the_bits_of_a_clip_then_a_step(
    device: str,
    dtype: torch.dtype,
    fraction: float,
    factor: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = run_pair(dtype, device, fraction, factor, nothing, monkeypatch)
    assert counts == [0, 0, 0]  # every chunk was copied before its step, none again


@pytest.mark.parametrize("device", DEVICES)
def test_the_torch_cpu_path_applies_the_factor_too(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = run_pair(torch.bfloat16, device, 1.0, 0.3713, nothing, monkeypatch, cpu_kernel="torch")
    assert counts == [0, 0, 0]


def grads_changed(opt: HybridDeviceOptimizer, params: list[torch.Tensor], step: int) -> None:
    """What may happen to grads between backward and the step, one kind each step."""
    with torch.no_grad():
        if step == 0:
            params[0].grad.mul_(0.5)  # an in-place clip or unscale
        elif step == 1:
            params[3].grad.add_(torch.ones_like(params[3].grad))  # another backward adds to it
        else:
            params[5].grad = params[5].grad * 2.0  # a new grad
            params[1].grad = None  # no grad: not stepped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor", [None, 0.3713])
def test_grads_changed_after_the_copy_are_copied_again(
    device: str, factor: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = run_pair(torch.bfloat16, device, 1.0, factor, grads_changed, monkeypatch)
    assert all(count > 0 for count in counts), counts  # the changed chunks only
    assert all(count < 6 for count in counts), counts


@pytest.mark.parametrize("device", DEVICES)
def test_a_reload_between_copy_and_step_copies_again(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload goes through the staging buffers: the early copies are lost, not used."""

    def reload(opt: HybridDeviceOptimizer, params: list[torch.Tensor], step: int) -> None:
        opt.reload_model_params()

    counts = run_pair(torch.bfloat16, device, 1.0, None, reload, monkeypatch)
    assert all(count > 0 for count in counts), counts


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_nothing_holds_the_grads_once_copied_or_dropped(fraction: float) -> None:
    """Grads given to grads_ready are held only until every chunk with a piece of them is
    copied, or until drop_grads_ready (zero_grad before any step)."""
    params = make_params(torch.bfloat16, "cpu")
    opt = build(params, fraction, host_staging="per_chunk")

    def give(indices: Any) -> list[weakref.ref]:
        grads = {i: torch.ones_like(params[i]) for i in indices}
        opt.grads_ready(grads)
        return [weakref.ref(grad) for grad in grads.values()]

    every = give(range(len(params)))
    gc.collect()
    assert all(ref() is None for ref in every)  # every chunk copied: none held
    if fraction == 1.0:
        first = give([0])
        gc.collect()
        assert first[0]() is not None  # its second chunk waits for param 1's grad
        opt.drop_grads_ready()
        gc.collect()
        assert first[0]() is None


def test_bounded_staging_and_a_delayed_update_copy_nothing_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for policy in ({"host_staging": "bounded"}, {"delayed_update": True}):
        params = make_params(torch.bfloat16, "cpu")
        opt = build(params, 1.0, **policy)
        copies = CountCopies(opt, monkeypatch)
        for param in params:
            param.grad = torch.ones_like(param)
        opt.grads_ready({i: p.grad for i, p in enumerate(params)})
        assert copies.count == 0, policy
        opt.step()
        assert copies.count > 0, policy


def test_the_host_share_of_the_grads_is_left_unscaled() -> None:
    """The factor multiplies the accelerator's share in place and the CPU's on the host."""
    params = make_params(torch.bfloat16, "cpu")
    opt = build(params, 0.5, host_staging="per_chunk")
    grads = [torch.ones_like(p) for p in params]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    opt.step(grad_factor=torch.tensor([0.5]))
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    assert flat.unique().tolist() == [0.5, 1.0]  # some elements scaled in place, others not
    host = sum(chunk.spec.numel for chunk in opt._host.chunks)
    assert int((flat == 1.0).sum()) == host


def test_bad_grads_and_factors_are_refused() -> None:
    params = make_params(torch.bfloat16, "cpu")
    opt = build(params, 1.0, host_staging="per_chunk")
    with pytest.raises(ValueError, match=r"param 0 \(shape \(7, 15\)\) has shape \(3,\)"):
        opt.grads_ready({0: torch.zeros(3)})
    with pytest.raises(ValueError, match="not contiguous"):
        opt.grads_ready({0: torch.zeros(15, 7).t()})
    for param in params:
        param.grad = torch.ones_like(param)
    with pytest.raises(TypeError, match=r"grad_factor must be a one-element float32 tensor"):
        opt.step(grad_factor=torch.tensor([0.5], dtype=torch.float64))
    with pytest.raises(TypeError, match="grad_factor .* got float"):
        opt.step(grad_factor=0.5)  # type: ignore[arg-type]


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_chunk_on_the_host_goes_first_when_the_first_is_not() -> None:
    def job(name: str, early: bool, landed: bool = True) -> ChunkJob:
        made = ChunkJob(name, [], 0, torch.empty(0))  # type: ignore[arg-type]
        if early:
            made.d2h_done = FakeEvent(landed)
            made.d2h_queued.set()
        return made

    def order(jobs: list[ChunkJob]) -> list[str]:
        _lead_with_a_landed_copy(jobs)
        return [j.chunk for j in jobs]  # type: ignore[misc]

    pending, landed, copied_now = job("a", True, False), job("b", True), job("c", False)
    assert order([pending, copied_now, landed, job("d", True)]) == ["b", "a", "c", "d"]
    assert order([landed, pending]) == ["b", "a"]  # the first is there: as it was
    assert order([pending, copied_now]) == ["a", "c"]  # none on the host: as it was
    assert order([]) == []
