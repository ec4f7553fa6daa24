"""Param-group options edited during a run, as torch honours them: a scheduled tensor lr while
the CPU share is in flight, options the single-pass kernel does not implement, amsgrad (and
RMSprop's centered and momentum) switched on, and groups added to an optimizer after ``wrap``."""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _parity import (
    OTHER_KERNEL,
    SAME_KERNEL,
    assert_matches,
    fp32_copies,
    groups_of,
    make_params,
    set_grads,
    train_side_by_side,
)

from optimizers import HybridDeviceOptimizer, OffloadPolicy
from optimizers import _host_part as host_part
from optimizers._cpu_kernel import load_cpu_adam

STEPS = 5
HOLD_TIMEOUT = 30.0  # seconds; a worker held longer means the step waited for it (a hang)


def schedule(step: int) -> float:
    return 0.5**step


@pytest.fixture
def held_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds the CPU step of every chunk until the event is set: a launched step's CPU share
    then runs only after whatever the test does meanwhile (a scheduler's step, an edit)."""
    release = threading.Event()
    original = host_part._step_chunk

    def held(*args: Any) -> None:
        if not release.wait(HOLD_TIMEOUT):
            raise AssertionError("the CPU step was held and never released: something waited")
        original(*args)

    monkeypatch.setattr(host_part, "_step_chunk", held)
    return release


def tensor_hyperparams() -> dict[str, Any]:
    return {"lr": torch.tensor(1e-2), "betas": (torch.tensor(0.9), torch.tensor(0.999))}


def edit_betas_in_place(groups: list[dict[str, Any]], step: int) -> None:
    for group in groups:
        group["betas"][0].fill_(0.9 - 0.1 * (step + 1))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_tensor_hyperparams_edited_after_launch_apply_to_the_next_step(
    held_worker: threading.Event, fraction: float
) -> None:
    # A scheduler writes a tensor lr in place, after step() returned (here, after launch_step,
    # whose CPU share is held until then); torch's step has read it already, so must ours.
    params = make_params(torch.float32, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt = HybridDeviceOptimizer(params, policy=policy, **tensor_hyperparams())
    ref_opt = torch.optim.AdamW(refs, fused=True, **tensor_hyperparams())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        set_grads(params, refs, gen)
        held_worker.clear()
        pending = opt.launch_step()
        sched.step()
        edit_betas_in_place(opt.param_groups, step)
        held_worker.set()
        pending.wait()
        ref_opt.step()
        ref_sched.step()
        edit_betas_in_place(ref_opt.param_groups, step)
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")


def needs_kernel() -> None:
    if load_cpu_adam() is None:
        pytest.skip("the single-pass kernel cannot be built here (no C compiler)")


def switched_on_at(step: int, edit: dict[str, Any]) -> Callable[[list[dict], int], None]:
    def switch(groups: list[dict[str, Any]], at: int) -> None:
        if at == step:
            for group in groups:
                group.update(edit)

    return switch


@pytest.mark.parametrize(
    ("fraction", "dtype", "edit"),
    [
        (1.0, torch.bfloat16, {"maximize": True}),
        (0.5, torch.float32, {"maximize": True}),
        (1.0, torch.bfloat16, {"lr": torch.tensor(3e-3)}),
    ],
)
def test_options_the_kernel_lacks_switched_on_mid_run_step_as_torch(
    fraction: float, dtype: torch.dtype, edit: dict[str, Any]
) -> None:
    needs_kernel()
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt = HybridDeviceOptimizer(groups_of(params), policy=policy, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(groups_of(refs), lr=1e-2, weight_decay=0.1, fused=True)
    assert all(chunk.kernel is not None for chunk in opt._host.chunks)
    switch = switched_on_at(2, edit)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        switch(opt.param_groups, step)
        switch(ref_opt.param_groups, step)
        set_grads(params, refs, gen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        ref_opt.step()
        fallbacks = [w for w in caught if "cpu_kernel='torch'" in str(w.message)]
        assert len(fallbacks) == (step == 2), (step, [str(w.message) for w in caught])
        if fallbacks:
            assert f"{next(iter(edit))}=" in str(fallbacks[0].message)
        assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"step {step}")
    assert all(chunk.kernel is None for chunk in opt._host.chunks)


@pytest.mark.parametrize(("fraction", "dtype"), [(1.0, torch.bfloat16), (0.5, torch.float32)])
def test_adamw_groups_with_decoupled_weight_decay_off_step_as_torch(
    fraction: float, dtype: torch.dtype
) -> None:
    # torch's AdamW decays as Adam's L2 in a group with decoupled_weight_decay=False: set at
    # build in group 0, switched off mid-run in group 1; the single-pass kernel does both.
    needs_kernel()
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    groups, ref_groups = groups_of(params), groups_of(refs)
    for group in (groups[0], ref_groups[0]):
        group["decoupled_weight_decay"] = False
    for group in (*groups, *ref_groups):
        group["weight_decay"] = 0.3
    opt = HybridDeviceOptimizer(groups, policy=policy, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, fused=True)
    assert all(chunk.kernel is not None for chunk in opt._host.chunks)
    switch = switched_on_at(2, {"decoupled_weight_decay": False})
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        switch(opt.param_groups[1:], step)
        switch(ref_opt.param_groups[1:], step)
        set_grads(params, refs, gen)
        opt.step()
        ref_opt.step()
        assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"step {step}")
    assert all(chunk.kernel is not None for chunk in opt._host.chunks)


@pytest.mark.parametrize(("fraction", "dtype"), [(1.0, torch.bfloat16), (0.37, torch.float32)])
def test_amsgrad_switched_on_after_a_step_is_refused_before_anything_changes(
    fraction: float, dtype: torch.dtype
) -> None:
    # torch's own AdamW raises KeyError('max_exp_avg_sq') here: the running maximum would have
    # to start from the steps already taken.
    params = make_params(dtype, "cpu")
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt = HybridDeviceOptimizer(groups_of(params), policy=policy, lr=1e-2)
    set_grads(params, fp32_copies(params), torch.Generator().manual_seed(0))
    opt.step()
    opt.param_groups[1]["amsgrad"] = True
    before_params = [p.detach().clone() for p in params]
    before_state = {
        i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
    }
    with pytest.raises(RuntimeError, match=r"amsgrad=True.*param group 1.*amsgrad=True when"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before_params, strict=True))
    for index, state in opt.state_dict()["state"].items():
        assert all(torch.equal(v, before_state[index][k]) for k, v in state.items()), index


@pytest.mark.parametrize("fraction", [0.0, 0.37, 1.0])
def test_amsgrad_switched_on_before_the_first_step_steps_as_torch(fraction: float) -> None:
    params = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt = HybridDeviceOptimizer(groups_of(params), policy=policy, lr=1e-2)
    ref_opt = torch.optim.AdamW(groups_of(refs), lr=1e-2, fused=True)
    for group in (*opt.param_groups, *ref_opt.param_groups):
        group["amsgrad"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernel's fallback
        for step in train_side_by_side(opt, ref_opt, params, refs, steps=3):
            assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"step {step}")
    state = opt.state_dict()["state"][0]
    assert torch.equal(state["max_exp_avg_sq"], ref_opt.state[refs[0]]["max_exp_avg_sq"])


@pytest.mark.parametrize("fraction", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("options", [{"centered": True}, {"momentum": 0.9}])
def test_rmsprop_state_switched_on_before_the_first_step_steps_as_torch(
    fraction: float, options: dict[str, Any]
) -> None:
    # torch's first step makes grad_avg and momentum_buffer (zeros) for the options on then.
    params = make_params(torch.float32, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt = HybridDeviceOptimizer(groups_of(params), torch.optim.RMSprop, policy=policy, lr=1e-2)
    ref_opt = torch.optim.RMSprop(groups_of(refs), lr=1e-2)
    for group in (*opt.param_groups, *ref_opt.param_groups):
        group.update(options)
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=3):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")
    # After a step, torch's own step raises KeyError: refused before anything changes.
    opt.param_groups[0].update({"centered": True} if "momentum" in options else {"momentum": 0.5})
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"param group 0, switched on after its params stepped"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_sgd_dampening_set_before_a_params_first_step_is_refused_after_it_steps_as_torch(
    fraction: float,
) -> None:
    # torch's SGD copies a param's first grad into its momentum buffer undampened; the buffer
    # made at zeros at construction (dampening 0 then) would dampen it: refused, not wrong.
    params = make_params(torch.float32, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2)
    opt = HybridDeviceOptimizer(params, torch.optim.SGD, policy=policy, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(refs, lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    opt.param_groups[0]["dampening"] = 0.5
    set_grads(params, refs, gen)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"dampening=0.5 in param group 0 was set after"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    opt.param_groups[0]["dampening"] = 0
    for step in range(3):
        if step == 1:  # after the first step: dampened from then on, as in torch
            for group in (*opt.param_groups, *ref_opt.param_groups):
                group["dampening"] = 0.5
        set_grads(params, refs, gen)
        opt.step()
        ref_opt.step()
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")


def groups_saved(torch_opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch state dict of ``torch_opt``'s groups, without state (a state dict saved before
    the wrap, say; the wrapped optimizer's own ``state_dict()`` is refused while wrapped)."""
    groups, start = [], 0
    for group in torch_opt.param_groups:
        options = {key: value for key, value in group.items() if key != "params"}
        groups.append({**options, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": {}, "param_groups": groups}


ADDERS: dict[str, Callable[[torch.optim.Optimizer], None]] = {
    "add_param_group": lambda torch_opt: torch_opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.randn(4))], "lr": 1e-3}
    ),
    "a group replaced": lambda torch_opt: torch_opt.param_groups.__setitem__(
        0, {**torch_opt.param_groups[0]}
    ),
    "load_state_dict": lambda torch_opt: torch_opt.load_state_dict(groups_saved(torch_opt)),
    "a param appended to a group": lambda torch_opt: torch_opt.param_groups[0]["params"].append(
        torch.nn.Parameter(torch.randn(4))
    ),
    "a param moved to another group": lambda torch_opt: torch_opt.param_groups[1]["params"].append(
        torch_opt.param_groups[0]["params"].pop()
    ),
}


@pytest.mark.parametrize(("how", "stepped"), list(itertools.product(ADDERS, [False, True])))
def test_groups_changed_on_the_wrapped_optimizer_are_refused(how: str, stepped: bool) -> None:
    params = make_params(torch.bfloat16, "cpu")
    torch_opt = torch.optim.AdamW(groups_of(params), lr=1e-2)
    opt = HybridDeviceOptimizer.wrap(torch_opt, offload_fraction=0.5)
    gen = torch.Generator().manual_seed(0)
    if stepped:
        set_grads(params, fp32_copies(params), gen)
        opt.step()
    ADDERS[how](torch_opt)
    set_grads(params, fp32_copies(params), gen)
    before = [p.detach().clone() for p in params]
    for _ in range(2):  # every call, not once
        with pytest.raises(RuntimeError, match=r"param_groups.*HybridDeviceOptimizer\.wrap"):
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
