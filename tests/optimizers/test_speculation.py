"""Speculative host steps ([Note: speculative host steps] in optimizers/_speculation.py): a
HybridDeviceOptimizer that steps its CPU chunks as their grads are given early, against one that
does not, on the same params and grads: every param, and the whole state at the end, the same
bits, whatever the step turns out to be."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import psutil
import pytest
import torch

from optimizers import HybridDeviceOptimizer, OffloadPolicy, SpeculationCounts
from optimizers import _host_part as host_part
from optimizers import _speculation as speculation
from optimizers._cpu_kernel import load_cpu_adam

SIZES = (300, 77, 1000, 5)  # chunks of 256 elements: pieces of several params in one chunk
STEPS = 10

# What happens between the early copies (``grads_ready``) and the step, by step number:
# None: nothing (the speculated step stands).
Event = Callable[[HybridDeviceOptimizer, list[torch.nn.Parameter]], None] | None


def _set_lr(opt: HybridDeviceOptimizer, params: list[torch.nn.Parameter]) -> None:
    opt.param_groups[0]["lr"] = 4e-3  # a scheduler stepped before the optimizer


def _edit_grad(opt: HybridDeviceOptimizer, params: list[torch.nn.Parameter]) -> None:
    params[2].grad.mul_(0.5)  # the early copy does not serve: copied again at the step


def _read_state(opt: HybridDeviceOptimizer, params: list[torch.nn.Parameter]) -> None:
    assert float(opt.state[params[0]]["step"]) >= 0  # reads the state as before the step


def _maximize(opt: HybridDeviceOptimizer, params: list[torch.nn.Parameter]) -> None:
    opt.param_groups[0]["maximize"] = True  # not on the kernel: torch steps the chunks


def _zero_grad_and_new(opt: HybridDeviceOptimizer, params: list[torch.nn.Parameter]) -> None:
    opt.zero_grad()  # the grads given are dropped: new ones, given after
    for p in params:
        p.grad = torch.full_like(p, 0.01)


def train(
    speculative: bool,
    dtype: torch.dtype,
    fraction: float,
    events: dict[int, Event],
    device: str = "cpu",
    before_grads: Callable[[], None] | None = None,
    wait: bool = True,
) -> tuple[list[list[torch.Tensor]], dict[str, Any], HybridDeviceOptimizer]:
    """``before_grads``: queued work on the device before each step's grads are written (a race
    test's: the host then runs far ahead of the device)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype).to(device)) for n in SIZES]
    policy = OffloadPolicy(
        fraction=fraction,
        chunk_numel=256,
        host_staging="per_chunk",
        speculative=speculative,
        num_threads=1,
    )
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2, weight_decay=0.1)
    opt._host._backoff.max_skip = 0  # white-box: every step speculates, redone or not
    trajectory = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen).to(device, dtype) for p in params]
        if before_grads is not None:
            before_grads()
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad * 1  # (written on the device's stream, behind before_grads)
        opt.grads_ready({i: p.grad for i, p in enumerate(params)})
        # White-box: the worker's speculations run before what follows (else those it has not
        # started when the step starts are cancelled, and which ones depends on timing).
        for each in opt._host._speculations.values() if wait else ():
            each.wait()
        event = events.get(step)
        if event is not None:
            event(opt, params)
        # A clip's factor (below 1, or exactly 1) and a verdict, as zero-shard gives them.
        factor = {1: torch.tensor(0.37), 2: torch.tensor(1.0)}.get(step)
        found_inf = torch.tensor([1.0 if step == 3 else 0.0], device=device)
        opt.step(grad_factor=None if factor is None else factor.to(device), found_inf=found_inf)
        trajectory.append([p.detach().cpu() for p in params])
    return trajectory, opt.state_dict(), opt


EVENTS: dict[int, Event] = {4: _set_lr, 5: _edit_grad, 6: _read_state, 7: _zero_grad_and_new}


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculated_steps_are_the_steps_bit_for_bit(dtype: torch.dtype, fraction: float) -> None:
    """Steps that stand (steps 0, 2: a factor of exactly 1), a clip's factor (1), a skipped step
    (3), an lr set after the grads were given (4), a grad edited in place after (5), the state
    read before the step (6), the grads cleared and given anew (7): the same bits every step."""
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    plain, plain_state, _ = train(False, dtype, fraction, EVENTS)
    speculated, state, opt = train(True, dtype, fraction, EVENTS)
    for step, (want, got) in enumerate(zip(plain, speculated, strict=True)):
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"step {step}, param {index}"
    for index, param_state in plain_state["state"].items():
        for key, value in param_state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state["state"][index][key]))
    # Stood: 0, 2, 8, 9 (settled by the state dict), and 5 where some chunk holds nothing of the
    # edited param (at fraction 1: the first ones); redone or rolled back: 1, 3, 4; dropped
    # before the step (not counted): 6, 7.
    stood = 5 if fraction == 1.0 else 4
    assert opt.speculation_counts == SpeculationCounts(stood=stood, redone=3)


def test_redone_steps_back_off_and_a_step_that_stands_ends_it() -> None:
    """Steps 0-7 clipped (a speculation redone), 8 on not: after 1, 2 and 3 redone steps in a row
    the next 1, 3 and 7 steps are not speculated (0, 2, 6 and 14 are); 14 stands and 15 is
    speculated again. The same bits as without speculation every step."""
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    runs = []
    for speculative in (False, True):
        params, opt = _pair(speculative, back_off=True)
        trajectory, speculated = [], []
        for step in range(16):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.grads_ready({i: p.grad for i, p in enumerate(params)})
            if opt._host._speculations:  # white-box: which steps speculate, run before the step
                speculated.append(step)
            for each in opt._host._speculations.values():
                each.wait()
            opt.step(grad_factor=torch.tensor(0.37) if step < 8 else None)
            trajectory.append([p.detach().clone() for p in params])
        runs.append((trajectory, speculated, opt))
    (plain, _, _), (got, speculated, opt) = runs
    for step, (want, have) in enumerate(zip(plain, got, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), f"step {step}"
    assert speculated == [0, 2, 6, 14, 15]
    opt.state_dict()  # (settles step 15)
    assert opt.speculation_counts == SpeculationCounts(stood=2, redone=3)


def test_speculations_not_started_when_the_step_starts_are_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker held on its first speculation until the step has started: the later ones are
    cancelled (never run), their chunks step as without speculation; the same bits."""
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    started, release, original = threading.Event(), threading.Event(), speculation.speculate

    def held(*args: Any) -> None:
        started.set()
        release.wait(30)
        original(*args)

    monkeypatch.setattr(host_part, "speculate", held)
    monkeypatch.setattr(host_part.HostPart, "_attach_speculations", _releasing(started, release))
    torch.manual_seed(0)
    plain, _, _ = train(False, torch.float32, 1.0, {}, wait=False)
    speculated, _, opt = train(True, torch.float32, 1.0, {}, wait=False)
    for step, (want, got) in enumerate(zip(plain, speculated, strict=True)):
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"step {step}, param {index}"
    # Each step the held chunk's speculation settled (redone at step 1's clip, rolled back at
    # step 3's skip), the others were cancelled.
    assert opt.speculation_counts == SpeculationCounts(stood=STEPS - 2, redone=2)


def _releasing(started: threading.Event, release: threading.Event) -> Callable[..., None]:
    """The step's start, once the worker holds its first speculation: the others are
    cancelled; then the held one goes on."""
    attach = host_part.HostPart._attach_speculations

    def call(self: Any, jobs: Any) -> None:
        if self._speculations:
            assert started.wait(30), "expected the worker to start a speculation"
        queued = [s for s in self._speculations.values() if not s.future.running()]
        attach(self, jobs)
        assert all(s.future.cancelled() for s in queued), "expected them cancelled"
        started.clear()
        release.set()
        release.clear()  # (the next step's first speculation is held again)

    return call


def test_an_option_the_kernel_lacks_set_after_the_grads_steps_as_torch() -> None:
    """maximize=True set between the early copies and the step: the chunks leave the kernel for
    torch's kernel at the step, and the speculated steps are rolled back first."""
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    plain, _, _ = train(False, torch.float32, 1.0, {0: _maximize})
    speculated, _, _ = train(True, torch.float32, 1.0, {0: _maximize})
    for step, (want, got) in enumerate(zip(plain, speculated, strict=True)):
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"step {step}, {index}")


def test_memory_report_counts_the_kept_state() -> None:
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    *_, plain = train(False, torch.bfloat16, 1.0, {})
    *_, speculative = train(True, torch.bfloat16, 1.0, {})
    numel = sum(SIZES)
    extra = speculative.memory_report().host_bytes - plain.memory_report().host_bytes
    assert extra >= numel * (12 + 2), extra  # the kept fp32 state and the bf16 weights


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_speculated_steps_on_cuda_race_nothing(
    fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU: the grads are written behind tens of ms of queued work (the early copies wait
    for them on the copy stream), and the worker's speculation and its settling at the step are
    each held 20 ms (the H2D copies and the next reads of the params must wait for them): the
    same bits as without speculation, every step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    slow = {name: getattr(speculation, name) for name in ("speculate", "settle_speculation")}

    def held(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.02)
            return slow[name](*args, **kwargs)

        return call

    monkeypatch.setattr(host_part, "speculate", held("speculate"))
    monkeypatch.setattr(host_part, "settle_speculation", held("settle_speculation"))

    def queued() -> None:
        torch.cuda._sleep(50_000_000)

    plain, plain_state, _ = train(False, torch.bfloat16, fraction, EVENTS, "cuda", queued)
    speculated, state, opt = train(True, torch.bfloat16, fraction, EVENTS, "cuda", queued)
    for step, (want, got) in enumerate(zip(plain, speculated, strict=True)):
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"step {step}, param {index}"
    for index, param_state in plain_state["state"].items():
        for key, value in param_state.items():
            want = torch.as_tensor(value).cpu()
            assert torch.equal(want, torch.as_tensor(state["state"][index][key]).cpu())
    assert opt.speculation_counts.stood >= 3


def test_the_host_memory_check_counts_the_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with room for the CPU share but not for the twins speculative steps write: with
    ``speculative=True`` refused before anything is allocated, naming the option; without it,
    and with "auto", built, not speculating."""
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    monkeypatch.delenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # fp32: 16 bytes an element without (main, two states, staging), 16 more with the twins.
    room = mock.Mock(total=sum(SIZES) * 24, available=sum(SIZES) * 24)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: room)

    def build(speculative: bool | str) -> HybridDeviceOptimizer:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
        policy = OffloadPolicy(
            fraction=1.0, chunk_numel=256, host_staging="per_chunk", speculative=speculative
        )
        return HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy)

    assert not build(False).speculates
    assert not build("auto").speculates
    with pytest.raises(ValueError, match=r"speculative steps write.*speculative=False"):
        build(True)
    room.total = room.available = sum(SIZES) * 32 * 4  # with the twins, 3/4 left available
    assert build("auto").speculates


def _pair(
    speculative: bool, *, back_off: bool = False
) -> tuple[list[torch.nn.Parameter], HybridDeviceOptimizer]:
    """``back_off``: as it is by default, speculating not at every step after redone ones."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    policy = OffloadPolicy(
        fraction=1.0,
        chunk_numel=256,
        host_staging="per_chunk",
        speculative=speculative,
        num_threads=1,
    )
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2, weight_decay=0.1)
    if not back_off:
        opt._host._backoff.max_skip = 0  # white-box: every step speculates, redone or not
    return params, opt


def _give(opt: HybridDeviceOptimizer, params: list[torch.nn.Parameter], step: int) -> None:
    """Grads given early, and (white-box) the worker's speculations run."""
    gen = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.grads_ready({i: p.grad for i, p in enumerate(params)})
    for each in opt._host._speculations.values():
        each.wait()


def _state(opt: HybridDeviceOptimizer) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [torch.as_tensor(v).clone() for i in sorted(state) for v in state[i].values()]


Case = Callable[[list[torch.nn.Parameter], HybridDeviceOptimizer], Any]


def _run_both(case: Case) -> list[Any]:
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    return [case(*_pair(speculative)) for speculative in (False, True)]


def test_state_written_in_place_during_backward_is_stepped_as_written() -> None:
    """A tensor read from optimizer.state before backward, written in place after the grads were
    given and stepped speculatively: the step reads the written state, as torch's does (the
    speculation read it before the write and is redone), every bit the same as without
    speculation; the chunk without the written param stands."""

    def case(params: list[torch.nn.Parameter], opt: HybridDeviceOptimizer) -> list[torch.Tensor]:
        _give(opt, params, 0)
        opt.step()
        held = opt.state[params[1]]
        _give(opt, params, 1)
        held["exp_avg"].mul_(0.5)
        held["step"].fill_(5.0)
        opt.step()
        return [*_state(opt), *(p.detach().clone() for p in params)]

    plain, speculative = _run_both(case)
    assert all(torch.equal(a, b) for a, b in zip(plain, speculative, strict=True))


def test_a_state_dict_filled_in_place_and_loaded_before_the_step_is_loaded() -> None:
    """dcp.load's way: a state dict taken before backward, filled in place, loaded between
    backward and the step: the loaded values, as without speculation."""

    def case(params: list[torch.nn.Parameter], opt: HybridDeviceOptimizer) -> list[torch.Tensor]:
        _give(opt, params, 0)
        opt.step()
        state_dict = opt.state_dict()
        _give(opt, params, 1)
        state_dict["state"][1]["exp_avg"].fill_(0.5)
        state_dict["state"][1]["step"].fill_(7.0)
        opt.load_state_dict(state_dict)
        opt.step()
        return [*_state(opt), *(p.detach().clone() for p in params)]

    plain, speculative = _run_both(case)
    assert all(torch.equal(a, b) for a, b in zip(plain, speculative, strict=True))


def test_amsgrad_switched_on_before_the_first_step_steps_as_without_speculation() -> None:
    def case(params: list[torch.nn.Parameter], opt: HybridDeviceOptimizer) -> list[torch.Tensor]:
        _give(opt, params, 0)
        opt.param_groups[0]["amsgrad"] = True  # (read with the step counts: before the first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the kernel lacks amsgrad: torch's steps it)
            opt.step()
        return [*_state(opt), *(p.detach().clone() for p in params)]

    plain, speculative = _run_both(case)
    assert all(torch.equal(a, b) for a, b in zip(plain, speculative, strict=True))


def test_awkward_steps_leave_the_state_as_without_speculation() -> None:
    """A skipped step at a count past 2**24 (where +1 rounds away); a step that fails (betas[0]
    = 1: a division by zero), then retried; a step with no grads left, then a read: the same
    state and params as without speculation."""

    def case(params: list[torch.nn.Parameter], opt: HybridDeviceOptimizer) -> list[torch.Tensor]:
        _give(opt, params, 0)
        opt.step()
        for p in params:
            opt.state[p]["step"] = torch.tensor(2.0**24)
        _give(opt, params, 1)
        opt.step(found_inf=torch.tensor([1.0]))
        _give(opt, params, 2)
        opt.param_groups[0]["betas"] = (1.0, 0.999)
        with pytest.raises(ZeroDivisionError):
            opt.step()
        opt.param_groups[0]["betas"] = (0.9, 0.999)
        opt.step()
        _give(opt, params, 3)
        for p in params:
            p.grad = None
        opt.step()
        return [*_state(opt), *(p.detach().clone() for p in params)]

    plain, speculative = _run_both(case)
    assert all(torch.equal(a, b) for a, b in zip(plain, speculative, strict=True))


def test_speculative_where_it_cannot_apply_warns_once() -> None:
    """Bounded staging copies no grads early: the option warns, and the steps run without it."""
    if load_cpu_adam() is None:
        pytest.skip("no C compiler on this machine: no single-pass kernel")
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    policy = OffloadPolicy(fraction=1.0, host_staging="bounded", speculative=True)
    says = r"speculative=True\) has no effect here: .* lacks a staging buffer per chunk"
    with pytest.warns(RuntimeWarning, match=says):
        opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy)
    assert not opt.speculates
    # A delayed update keeps its weights in staging through the next backward: no early copies.
    policy = OffloadPolicy(
        fraction=1.0, host_staging="per_chunk", speculative=True, delayed_update=True
    )
    says = r"has no effect here: .* lacks grads on the host during backward \(a delayed update"
    with pytest.warns(RuntimeWarning, match=says):
        opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy)
    assert not opt.speculates
