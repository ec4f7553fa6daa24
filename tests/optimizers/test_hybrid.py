"""HybridDeviceOptimizer on CPU: parity with plain torch optimizers, state dicts, reloads."""

from __future__ import annotations

import gc
import io
import itertools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from _parity import (
    EXACT,
    OPTIMIZERS,
    OTHER_KERNEL,
    SAME_KERNEL,
    assert_matches,
    fp32_copies,
    groups_of,
    main_weights,
    make_params,
    set_grads,
    train_side_by_side,
)

from offload import _host_memory as offload_host_memory
from optimizers import HybridDeviceOptimizer, OffloadPolicy
from optimizers import _device_part as device_part
from optimizers import _host_part as host_part
from optimizers._cpu_kernel import load_cpu_adam

FRACTIONS = [0.0, 0.37, 1.0]
DTYPES = [torch.bfloat16, torch.float32]


def hybrid(
    params, name: str, fraction: float, chunk_numel: int = 40, staging: str = "auto"
) -> HybridDeviceOptimizer:
    cls, kwargs = OPTIMIZERS[name]
    policy = OffloadPolicy(
        fraction=fraction, chunk_numel=chunk_numel, num_threads=2, host_staging=staging
    )
    return HybridDeviceOptimizer(groups_of(params), cls, policy=policy, **kwargs)


def reference(refs, name: str, fused: bool) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(groups_of(refs), **kwargs, **({"fused": True} if fused else {}))


@pytest.mark.parametrize(
    ("name", "fraction", "dtype"), list(itertools.product(OPTIMIZERS, FRACTIONS, DTYPES))
)
def test_parity_every_step(name: str, fraction: float, dtype: torch.dtype) -> None:
    # Against torch's default (single-tensor) implementation: within RTOL/ATOL (see _parity).
    # The default staging ("auto": a buffer per chunk on a host with room), then bounded.
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, name, fraction), reference(refs, name, fused=False)
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5):
        assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"step {step}")
    # Against torch's fused CPU kernel, which both devices run here: bit for bit.
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)
    opt = hybrid(params, name, fraction, staging="bounded")
    ref_opt = reference(refs, name, fused=True)
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"fused, step {step}")
    state = opt.state_dict()["state"]
    for index, ref in enumerate(refs):
        for key, value in ref_opt.state[ref].items():
            torch.testing.assert_close(
                state[index][key].cpu().float(),
                value.float(),
                rtol=SAME_KERNEL[0],
                atol=SAME_KERNEL[1],
            )


def test_split_really_moves_elements_to_the_host() -> None:
    params = make_params(torch.bfloat16, "cpu")
    opt = hybrid(params, "adamw", 0.37)
    report = opt.memory_report()
    total = sum(p.numel() for p in params)
    assert report.num_host_elements == round(0.37 * total)
    assert report.num_device_elements == total - report.num_host_elements
    assert report.host_bytes > 0 and report.device_bytes > 0
    assert report.pinned is False and report.device == "cpu"  # nothing to pin for on a CPU run
    full = hybrid(make_params(torch.bfloat16, "cpu"), "adamw", 1.0).memory_report()
    assert full.device_bytes == 0 and full.num_host_elements == total
    none = hybrid(make_params(torch.bfloat16, "cpu"), "adamw", 0.0).memory_report()
    assert none.host_bytes == 0 and none.pinned is None


def test_lr_scheduler_and_manual_edits_reach_both_devices() -> None:
    params = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, "adamw", 0.5), reference(refs, "adamw", fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 0.5**step)
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=4):
        sched.step()
        ref_sched.step()
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")
    # The sub-optimizers took the lr of the last step (the scheduler has moved on since).
    sub_lrs = {round(sub["lr"], 12) for sub, _ in opt._sub_groups()}
    assert sub_lrs == {round(3e-3 * 0.5**3, 12), round(1e-2 * 0.5**3, 12)}
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups, strict=True):
        group["weight_decay"] = ref_group["weight_decay"] = 0.3
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=2, seed=7):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"after edit, step {step}")


@pytest.mark.parametrize(
    ("name", "before", "after", "dtype"),
    [
        ("adamw", 0.37, 0.37, torch.bfloat16),  # same layout: bit for bit
        ("adamw", 0.37, 1.0, torch.bfloat16),
        ("adamw", 1.0, 0.0, torch.float32),
        ("adam", 0.0, 0.6, torch.bfloat16),
        ("sgd", 0.5, 0.2, torch.float16),
    ],
)
def test_state_dict_round_trip_into_another_fraction(
    name: str, before: float, after: float, dtype: torch.dtype
) -> None:
    tol = EXACT if before == after else SAME_KERNEL
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)  # unused reference optimizer: only drives the same grads
    opt, ref_opt = hybrid(params, name, before), reference(refs, name, fused=True)
    steps = train_side_by_side(opt, ref_opt, params, refs, steps=6)
    for _ in range(3):
        next(steps)
    buffer = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = [torch.nn.Parameter(t) for t in saved["model"]]
    resumed = hybrid(resumed_params, name, after, chunk_numel=40 if tol == EXACT else 17)
    resumed.load_state_dict(saved["optim"])
    gen = torch.Generator().manual_seed(99)
    for step in range(3):  # the uninterrupted run and the resumed one see the same grads
        set_grads(params, refs, gen)
        for param, resumed_param in zip(params, resumed_params, strict=True):
            resumed_param.grad = None if param.grad is None else param.grad.clone()
        opt.step()
        resumed.step()
        for index, (a, b) in enumerate(
            zip(main_weights(opt, params), main_weights(resumed, resumed_params), strict=True)
        ):
            torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1], msg=f"step {step}: {index}")
            assert torch.equal(resumed_params[index], b.to(dtype))


def test_load_torch_optimizer_state_through_wrap() -> None:
    params = make_params(torch.float32, "cpu")
    refs = fp32_copies(params)
    cls, kwargs = OPTIMIZERS["adamw"]
    user_opt = cls(groups_of(params), **kwargs, fused=True)
    ref_opt = cls(groups_of(refs), **kwargs, fused=True)
    for _ in train_side_by_side(user_opt, ref_opt, params, refs, steps=2):
        pass
    opt = HybridDeviceOptimizer.wrap(user_opt, offload_fraction=0.5)
    assert opt.optimizer_cls is cls
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=3):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_reload_model_params_after_model_only_load(fraction: float) -> None:
    params = make_params(torch.bfloat16, "cpu")
    opt = hybrid(params, "adamw", fraction)
    loaded = make_params(torch.bfloat16, "cpu", seed=5)  # "the checkpoint"
    with torch.no_grad():
        for param, weights in zip(params, loaded, strict=True):
            param.copy_(weights)
    stale = main_weights(opt, params)
    assert any(
        not torch.equal(m, w.float()) for m, w in zip(stale, loaded, strict=True) if w.numel()
    ), "without a reload the main weights are still the old ones"
    opt.reload_model_params()
    refs = fp32_copies(loaded)
    ref_opt = reference(refs, "adamw", fused=True)
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=2):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_params_without_grad_are_left_alone_like_torch(fraction: float) -> None:
    params = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, "adamw", fraction), reference(refs, "adamw", fused=True)
    skip = {0: {0, 5}, 1: {5}, 3: {0, 1, 2, 3, 4, 5}}  # step -> params without a grad
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5, skip=skip):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")
    state = opt.state_dict()["state"]
    for index, ref in enumerate(refs):
        assert torch.equal(state[index]["step"].cpu(), ref_opt.state[ref]["step"].cpu())


def test_frozen_params_are_ignored_but_keep_their_index() -> None:
    params = make_params(torch.bfloat16, "cpu")
    params[3].requires_grad_(False)
    opt = hybrid(params, "adamw", 0.5)
    total = sum(p.numel() for i, p in enumerate(params) if i != 3)
    report = opt.memory_report()
    assert report.num_device_elements + report.num_host_elements == total
    state_dict = opt.state_dict()
    assert 3 not in state_dict["state"]
    assert [g["params"] for g in state_dict["param_groups"]] == [[0, 1, 2], [3, 4, 5]]
    before = params[3].detach().clone()
    others = [p.detach().clone() for p in params]
    for param in params:
        param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match="requires_grad=False when the optimizer was built"):
        opt.step()  # refused: torch's optimizer would step it; nothing was stepped
    assert all(torch.equal(p, o) for p, o in zip(params, others, strict=True))
    params[3].grad = None
    opt.step()
    assert torch.equal(params[3], before)
    assert not torch.equal(params[0], others[0])


def test_state_exists_from_construction() -> None:
    opt = hybrid(make_params(torch.bfloat16, "cpu"), "adamw", 0.37)
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1, 2, 3, 4, 5]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq", "main_param"} for s in state.values())
    assert all(s["step"].item() == 0 for s in state.values())


def test_state_dict_views_alias_live_state_when_param_is_whole() -> None:
    params = make_params(torch.float32, "cpu")
    opt = hybrid(params, "adamw", 0.0)
    state = opt.state_dict()["state"]
    state[0]["exp_avg"].fill_(3.0)
    assert torch.all(opt.state_dict()["state"][0]["exp_avg"] == 3.0)


@pytest.mark.parametrize("fraction", [0.0, 0.37, 1.0])
def test_load_into_the_views_state_dict_returned(fraction: float) -> None:
    # DCP's way: fill the tensors state_dict() returned in place, then load_state_dict(them).
    # The fp32 main weights must come through exactly, not be replaced by the bf16 model weights.
    trained = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(trained)
    source, ref_opt = hybrid(trained, "adamw", 0.5), reference(refs, "adamw", fused=True)
    for _ in train_side_by_side(source, ref_opt, trained, refs, steps=3):
        pass
    saved = {
        index: {key: value.clone() for key, value in state.items()}
        for index, state in source.state_dict()["state"].items()
    }
    params = [torch.nn.Parameter(p.detach().clone()) for p in trained]  # the model, loaded
    opt = hybrid(params, "adamw", fraction)
    target = opt.state_dict()
    for index, state in target["state"].items():
        for key, value in state.items():
            value.copy_(saved[index][key])
    opt.load_state_dict(target)
    after = opt.state_dict()["state"]
    for index, state in saved.items():
        for key, value in state.items():
            assert torch.equal(after[index][key], value), (index, key)


def test_failed_accelerator_step_still_finishes_the_host_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = make_params(torch.bfloat16, "cpu")
    opt = hybrid(params, "adamw", 0.5)

    def fail(grads, grad_scale=None, found_inf=None, grad_factor=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(opt._device, "step", fail)
    gen = torch.Generator().manual_seed(0)
    set_grads(params, fp32_copies(params), gen)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    # The CPU share stepped and its new weights reached the model: main and model agree.
    mains = main_weights(opt, params)
    for record in opt._records:
        for piece in record.pieces:
            if piece.offset is None:  # on the accelerator
                continue
            start, numel = piece.spec.start, piece.spec.numel
            model = params[record.index].detach().reshape(-1)[start : start + numel]
            main = mains[record.index].reshape(-1)[start : start + numel]
            assert torch.equal(model, main.to(model.dtype))
    # Nothing of the failed step is left running: the next step works and agrees with itself.
    monkeypatch.undo()
    set_grads(params, fp32_copies(params), gen)
    opt.step()
    for index, main in enumerate(main_weights(opt, params)):
        assert torch.equal(params[index].detach(), main.to(params[index].dtype))


def test_a_step_completed_on_another_thread_is_in_flight_until_it_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One chunk, held on the worker: while another thread completes it (waiting for the
    # worker), the step is still in flight here, and a read of the state waits for it.
    params = make_params(torch.bfloat16, "cpu")
    policy = OffloadPolicy(fraction=1.0, chunk_numel=1 << 20, num_threads=1)
    opt = HybridDeviceOptimizer([{"params": params}], torch.optim.AdamW, policy=policy, lr=0.1)
    set_grads(params, fp32_copies(params), torch.Generator().manual_seed(0))
    release = threading.Event()
    original = host_part._step_chunk

    def held(*args):  # type: ignore[no-untyped-def]
        release.wait(30)
        return original(*args)

    monkeypatch.setattr(host_part, "_step_chunk", held)
    pending = opt.launch_step()
    waiter = threading.Thread(target=pending.wait)
    waiter.start()
    deadline = time.monotonic() + 30
    while pending._num_completed < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the waiter is inside the completion of the one chunk
    assert opt.step_in_flight and not pending.done
    reader = threading.Thread(target=opt.param_state, args=(params[0],))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # waits for the worker, which is held
    release.set()
    waiter.join(30)
    reader.join(30)
    assert pending.done and not opt.step_in_flight and not reader.is_alive()


def test_launch_step_completes_chunks_in_the_order_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    # launch_step returns before the CPU share is done; wait_for completes only the chunks up to
    # the params asked for, in need_order; the end result is step()'s, bit for bit.
    params, others = make_params(torch.bfloat16, "cpu"), make_params(torch.bfloat16, "cpu")
    launched, stepped = hybrid(params, "adamw", 1.0, 8), hybrid(others, "adamw", 1.0, 8)
    set_grads(params, fp32_copies(params), torch.Generator().manual_seed(0))
    for param, other in zip(params, others, strict=True):
        other.grad = param.grad.clone()
    order = list(range(len(params)))[::-1]
    release = threading.Event()
    original = host_part._step_chunk

    def held(*args):  # type: ignore[no-untyped-def]
        release.wait()
        return original(*args)

    monkeypatch.setattr(host_part, "_step_chunk", held)
    before = [p.detach().clone() for p in params]
    pending = launched.launch_step(need_order=order)
    assert not pending.done and launched._host.pending is pending
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # nothing yet
    release.set()
    last = order[0]
    pending.wait_for([last])
    assert not torch.equal(params[last], before[last])  # the param asked for has its step
    assert torch.equal(params[order[-1]], before[order[-1]])  # the one needed last does not yet
    monkeypatch.undo()
    stepped.step()
    state = launched.state_dict()  # completes the rest first
    assert pending.done and launched._host.pending is None
    for param, other in zip(params, others, strict=True):
        assert torch.equal(param, other)
    for key, value in stepped.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(torch.as_tensor(state["state"][key][name]), torch.as_tensor(tensor))
    with pytest.raises(ValueError, match="need_order must hold every param index"):
        launched.launch_step(need_order=[0, 0])


@pytest.mark.parametrize("interval", [0.0005, None])
def test_the_gil_switch_interval_is_short_while_a_step_is_in_flight(
    interval: float | None,
) -> None:
    # The worker takes the GIL back after each chunk's kernel: the interval is shortened from
    # launch until the step is complete, then the user's is back; None leaves it alone.
    params = make_params(torch.bfloat16, "cpu")
    cls, kwargs = OPTIMIZERS["adamw"]
    policy = OffloadPolicy(
        fraction=1.0, chunk_numel=40, num_threads=2, gil_switch_interval=interval
    )
    opt = HybridDeviceOptimizer(groups_of(params), cls, policy=policy, **kwargs)
    set_grads(params, fp32_copies(params), torch.Generator().manual_seed(0))
    user = 0.004
    before = sys.getswitchinterval()
    sys.setswitchinterval(user)
    try:
        pending = opt.launch_step()
        assert sys.getswitchinterval() == pytest.approx(user if interval is None else interval)
        pending.wait()
        assert sys.getswitchinterval() == pytest.approx(user)
        opt.step()  # step() completes the step before it returns
        assert sys.getswitchinterval() == pytest.approx(user)
        opt.zero_grad()
        opt.launch_step().wait()  # no grads: nothing in flight, nothing held
        assert sys.getswitchinterval() == pytest.approx(user)
        # A step never completed, its optimizer dropped: the hold ends when they are collected.
        set_grads(params, fp32_copies(params), torch.Generator().manual_seed(1))
        opt.launch_step()
        opt._host.wait_for_worker()
        del opt, pending  # the first step refers to the host part too
        for _ in range(500):  # until the copier thread let go of the step too
            gc.collect()
            if sys.getswitchinterval() == pytest.approx(user):
                break
            time.sleep(0.01)
        assert sys.getswitchinterval() == pytest.approx(user)
    finally:
        sys.setswitchinterval(before)


def _snapshot(opt: HybridDeviceOptimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    tensors = [p.detach().clone() for p in params]
    for key in sorted(state):
        tensors += [torch.as_tensor(state[key][name]).clone() for name in sorted(state[key])]
    return tensors


WITH_RMSPROP = {**OPTIMIZERS, "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9})}


@pytest.mark.parametrize(("name", "fraction"), list(itertools.product(WITH_RMSPROP, FRACTIONS)))
def test_found_inf_skips_the_step_bit_for_bit(name: str, fraction: float) -> None:
    # A nonzero found_inf leaves params and every state tensor (the step counts included) as
    # they were, on both devices; a zero one is the plain step, bit for bit.
    params, others = make_params(torch.bfloat16, "cpu"), make_params(torch.bfloat16, "cpu")
    cls, kwargs = WITH_RMSPROP[name]
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt, plain = (
        HybridDeviceOptimizer(groups_of(p), cls, policy=policy, **kwargs) for p in (params, others)
    )
    # RMSprop has no fused kernel: the host reads the flag before the accelerator's step.
    if name != "rmsprop" or fraction < 1.0:
        assert opt.skips_on_device == (name != "rmsprop")
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        set_grads(params, fp32_copies(params), gen)
        for param, other in zip(params, others, strict=True):
            other.grad = param.grad.clone()
        before = _snapshot(opt, params)
        opt.launch_step(found_inf=torch.ones(1)).wait()
        after = _snapshot(opt, params)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), f"step {step}"
        opt.step(found_inf=torch.zeros(()))
        plain.step()
        mine, theirs = _snapshot(opt, params), _snapshot(plain, others)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), f"step {step}"
    with pytest.raises(TypeError, match="found_inf must be a one-element float32 tensor"):
        opt.step(found_inf=torch.zeros(2))


@pytest.mark.parametrize(("fraction", "round_numel"), [(0.0, 40), (0.0, 365), (0.37, 40)])
def test_device_share_steps_in_bounded_rounds_as_in_one(
    monkeypatch: pytest.MonkeyPatch, fraction: float, round_numel: int
) -> None:
    # The accelerator casts its share's bf16 grads to fp32 a round at a time into one scratch
    # ([Note: main grads]). Small rounds: a param larger than a round alone, rounds of several
    # params (of both groups, with 365), an empty param, grads missing for some params at one
    # step. It steps as torch's fused kernel on whole params; a found_inf step changes nothing;
    # and it holds fewer bytes than with one round.
    whole = hybrid(make_params(torch.bfloat16, "cpu"), "adamw", fraction).memory_report()
    monkeypatch.setattr(device_part, "ROUND_NUMEL", round_numel)
    params = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, "adamw", fraction), reference(refs, "adamw", fused=True)
    assert opt.memory_report().device_bytes < whole.device_bytes
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5, skip={2: {0, 4}}):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")
        before = _snapshot(opt, params)
        opt.step(found_inf=torch.ones(()))
        after = _snapshot(opt, params)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), f"step {step}"


def test_a_hybrid_on_the_host_steps_its_params_with_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Params on the CPU (a CPU run, FSDP2's CPUOffloadPolicy) are stepped in place on the caller's
    # thread: with the rank's budget, not torchrun's one thread, which is then given back.
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun leaves a rank
    seen: list[int] = []
    param = torch.nn.Parameter(torch.ones(16))
    opt = HybridDeviceOptimizer(
        [param], torch.optim.AdamW, policy=OffloadPolicy(fraction=0.0, num_threads=2), lr=0.1
    )
    original = torch._fused_adamw_

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", recording)
    param.grad = torch.ones(16)
    try:
        opt.step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen == [2]
    assert torch.all(param < 1)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_bounded_host_staging_is_the_same_whatever_the_model(kernel: str) -> None:
    # The chunks take STAGING_SLOTS buffers in turn (see [Note: staging ring]): ten times the
    # chunks hold the same staging, and the host holds the fp32 main weight and the two states
    # per param beside it (and the fp32 grads where torch steps bf16 chunks), and the step
    # counts. A delayed update keeps a buffer per chunk. Trained against torch AdamW with 3 and
    # 20 chunks per buffer, some params without a grad.
    chunk_numel = 64

    def build(num_params: int, delayed: bool = False) -> tuple[HybridDeviceOptimizer, list]:
        gen = torch.Generator().manual_seed(num_params)
        params = [
            torch.nn.Parameter(torch.randn(chunk_numel, generator=gen).bfloat16())
            for _ in range(num_params)
        ]
        policy = OffloadPolicy(
            fraction=1.0, chunk_numel=chunk_numel, num_threads=1, cpu_kernel=kernel,
            delayed_update=delayed, host_staging="bounded",
        )  # fmt: skip
        return HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=0.01), params

    small, large = build(12)[0].memory_report(), build(80)[0].memory_report()
    assert small.host_staging_bytes == large.host_staging_bytes, (small, large)
    assert large.host_staging_bytes < 80 * chunk_numel * 2 / 4
    numel = 80 * chunk_numel
    grads = 4 * numel if kernel == "torch" else 0  # the kernel reads bf16 grads from staging
    assert large.host_bytes - large.host_staging_bytes <= 12 * numel + grads + 80 * 4 * 8
    delayed = build(80, delayed=True)[0].memory_report()
    assert delayed.host_staging_bytes >= 80 * chunk_numel * 2
    params = [torch.nn.Parameter(torch.ones(chunk_numel).bfloat16()) for _ in range(80)]
    policy = OffloadPolicy(fraction=1.0, chunk_numel=chunk_numel, host_staging="per_chunk")
    per_chunk = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy).memory_report()
    assert per_chunk.host_staging_bytes >= 80 * chunk_numel * 2
    with pytest.raises(ValueError, match=r"host_staging must be one of .*got 'ring'"):
        OffloadPolicy(host_staging="ring")
    for num_params in (12, 80):
        opt, params = build(num_params)
        refs = fp32_copies(params)
        ref_opt = torch.optim.AdamW(refs, lr=0.01)
        skip = {1: {0, 5, num_params - 1}}  # chunks without grads shift the buffers taken
        for step in train_side_by_side(opt, ref_opt, params, refs, steps=3, skip=skip):
            assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"{num_params}: {step}")


def test_auto_staging_takes_a_buffer_per_chunk_where_the_host_keeps_room(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # host_staging="auto" (the default): a buffer per chunk where the host keeps a quarter of
    # its memory available after every local rank has taken its share with one, bounded
    # staging otherwise; what the host reports is made up here, around that line.
    chunk_numel, num_params, total = 4096, 80, 64 << 30
    reported = {"available": total}
    monkeypatch.setattr(
        offload_host_memory.psutil,
        "virtual_memory",
        lambda: types.SimpleNamespace(total=total, available=reported["available"]),
    )
    monkeypatch.delenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def build(**options: object) -> HybridDeviceOptimizer:
        params = [
            torch.nn.Parameter(torch.full((chunk_numel,), float(i)).bfloat16())
            for i in range(num_params)
        ]
        options = {"speculative": False, **options}  # (its own choice is checked first)
        policy = OffloadPolicy(fraction=1.0, chunk_numel=chunk_numel, num_threads=1, **options)
        return HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=0.01)

    # speculative="auto" decides after the staging, by the same rule (on one rank a host).
    with caplog.at_level(logging.INFO, logger="zero_shard"):
        assert build(speculative="auto").speculates == (load_cpu_adam() is not None)
    if load_cpu_adam() is not None:
        assert "speculative host steps on (speculative='auto'" in caplog.text
        # Not with another rank on the host: its backward would share the cores.
        caplog.clear()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        with caplog.at_level(logging.INFO, logger="zero_shard"):
            assert not build(speculative="auto").speculates
        assert "speculative host steps off (speculative='auto': 2 ranks on this host" in caplog.text
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_shard"):
        roomy = build()
    assert roomy.host_staging == "per_chunk"
    report = roomy.memory_report()
    assert report.host_staging == "per_chunk"
    assert report.host_staging_bytes >= num_params * chunk_numel * 2, report
    assert "host staging 'per_chunk' (host_staging='auto'" in caplog.text
    need = report.host_bytes  # the CPU share's bytes with a buffer per chunk
    assert build(host_staging="bounded").memory_report().host_bytes < need

    keep = total // 4
    reported["available"] = keep + need + need // 10
    assert build().host_staging == "per_chunk"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # another rank on the host takes as much
    assert build().host_staging == "bounded"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    reported["available"] = keep + need - need // 10
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_shard"):
        tight = build()
    assert tight.host_staging == "bounded" and tight.memory_report().host_staging == "bounded"
    assert tight.memory_report().host_staging_bytes < num_params * chunk_numel * 2 / 4
    assert "host staging 'bounded'" in caplog.text
    assert build(host_staging="per_chunk").host_staging == "per_chunk"  # asked for: as asked
    assert build(delayed_update=True).host_staging == "per_chunk"  # its weights wait in them
    reported["available"] = total
    monkeypatch.setenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK", "1")  # the report is not trusted
    assert build().host_staging == "bounded"
    monkeypatch.delenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK")
    nothing = HybridDeviceOptimizer(
        [torch.nn.Parameter(torch.ones(8))], torch.optim.AdamW, offload_fraction=0.0
    )
    assert nothing.host_staging == "bounded" and nothing.memory_report().host_staging_bytes == 0
    # Trained, each way, as torch trains.
    for staging_of, available in (("per_chunk", total), ("bounded", keep)):
        reported["available"] = available
        params = make_params(torch.bfloat16, "cpu")
        refs = fp32_copies(params)
        opt = hybrid(params, "adamw", 1.0)
        assert opt.host_staging == staging_of
        ref_opt = reference(refs, "adamw", fused=True)
        for step in train_side_by_side(opt, ref_opt, params, refs, steps=3):
            assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"{staging_of}, {step}")


def test_the_interpreter_exits_with_a_step_in_flight() -> None:
    # At exit concurrent.futures stops the copier before the worker is done: the chunks that
    # take a buffer after it must still be copied, or the worker waits forever and exit hangs.
    script = textwrap.dedent(
        """
        import torch
        from optimizers import HybridDeviceOptimizer, OffloadPolicy
        params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(24)]
        policy = OffloadPolicy(
            fraction=1.0, chunk_numel=1 << 20, num_threads=1, host_staging="bounded"
        )
        opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.launch_step()
        print("launched", flush=True)
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0 and "launched" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_loaded_0_dim_params_state_has_its_main_weights_layout(fraction: float) -> None:
    # The fused CUDA kernels refuse a 0-dim exp_avg beside a (1,) flat main weight (the CPU ones
    # do not): a 0-dim param's elementwise state is loaded as its main weight is laid out.
    def build() -> HybridDeviceOptimizer:
        params = [torch.nn.Parameter(torch.tensor(2.5)), torch.nn.Parameter(torch.ones(3, 4))]
        return HybridDeviceOptimizer(params, torch.optim.AdamW, offload_fraction=fraction)

    first = build()
    for param in first.param_groups[0]["params"]:
        param.grad = torch.full_like(param, 0.5)
    first.step()
    second = build()
    second.load_state_dict(first.state_dict())
    # Private: the pieces' own state is what the kernels are handed.
    for record in second._records:
        for piece in record.pieces:
            state = piece.optimizer.state[piece.main]
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key].shape == piece.main.shape, (key, state[key].shape)
