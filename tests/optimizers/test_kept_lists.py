"""Adam's and AdamW's step lists kept between steps ([Note: kept step lists] in
optimizers/_kept_lists.py): the steps are those of torch's own ``_init_group``, bit for bit,
whatever a user changes between steps; torch's ``_init_group`` runs only where something did;
a load does not keep the replaced state alive.

Each run steps the same params and grads through the hybrid with the kept lists and through the
hybrid without them (``keep_step_lists`` made a no-op), compared bit for bit every step, and
through torch's AdamW on fp32 copies within OTHER_KERNEL.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _parity import OTHER_KERNEL

from optimizers import HybridDeviceOptimizer, OffloadPolicy, _fused_backends

SHAPES = [(7, 15), (3,), (0,), (16, 16), (5,)]
NUM_STEPS = 8


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]


def _load_earlier_state(opt: Any, params: list[torch.Tensor], step: int, saved: Any) -> None:
    opt.load_state_dict(saved)


def _hyperparameters_edited(opt: Any, params: list[torch.Tensor], step: int, saved: Any) -> None:
    group = opt.param_groups[0]
    group["lr"] = torch.tensor(3e-3) if step == 4 else 5e-3
    group["betas"] = (0.8, 0.95)
    opt.param_groups[1]["weight_decay"] = 0.05


def _state_edited(opt: Any, params: list[torch.Tensor], step: int, saved: Any) -> None:
    opt.state[params[0]]["exp_avg"].mul_(0.5)
    opt.state[params[3]]["exp_avg_sq"] = torch.ones(16, 16)
    opt.state[params[4]] = {}


# What happens before which steps, besides the grads of step 2, which leave out param 3 (a load
# of the state dict saved before step 1, hyperparameters, state edits).
EVENTS: dict[int, Callable[[Any, list[torch.Tensor], int, Any], None]] = {
    3: _load_earlier_state,
    4: _hyperparameters_edited,
    5: _hyperparameters_edited,
    6: _state_edited,
}


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    return [None if step == 2 and i == 3 else g for i, g in enumerate(grads)]


def _run(
    dtype: torch.dtype, fraction: float, amsgrad: bool, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Params after each step, and torch's ``_init_group`` calls at each step."""
    with monkeypatch.context() as patch:
        if not kept:
            patch.setattr(_fused_backends, "keep_step_lists", lambda optimizer: None)
        params = _params(dtype)
        opt = HybridDeviceOptimizer(
            _groups(params), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad,
            policy=OffloadPolicy(fraction=fraction, chunk_numel=8, num_threads=1),
        )  # fmt: skip
    calls = []
    init_group = torch.optim.AdamW._init_group  # (a Dynamo wrapper of it after a compile)

    def counted(*args: Any) -> bool:
        calls[-1] += 1
        return init_group(*args)

    history, saved = [], None
    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "_init_group", counted)
        for step in range(NUM_STEPS):
            calls.append(0)
            if step == 1:
                saved = opt.state_dict()
            if step in EVENTS:
                EVENTS[step](opt, params, step, saved)
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = None if g is None else g.to(dtype)
            opt.step()
            history.append([p.detach().clone() for p in params])
    return history, calls


def _torch_run(amsgrad: bool) -> list[list[torch.Tensor]]:
    params = _params(torch.float32)
    opt = torch.optim.AdamW(_groups(params), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    history, saved = [], None
    for step in range(NUM_STEPS):
        if step == 1:
            saved = opt.state_dict()
        if step in EVENTS:
            EVENTS[step](opt, params, step, saved)
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_lists_step_as_torchs_own_whatever_changes_between_steps(
    dtype: torch.dtype, fraction: float, amsgrad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, calls = _run(dtype, fraction, amsgrad, True, monkeypatch)
    unkept, unkept_calls = _run(dtype, fraction, amsgrad, False, monkeypatch)
    for step, (mine, theirs) in enumerate(zip(kept, unkept, strict=True)):
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(a, b), f"step {step}, param {index}: kept lists differ"
    if dtype == torch.float32:
        for step, (mine, ref) in enumerate(zip(kept, _torch_run(amsgrad), strict=True)):
            for index, (a, b) in enumerate(zip(mine, ref, strict=True)):
                torch.testing.assert_close(
                    a, b, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1],
                    msg=f"step {step}, param {index} against torch AdamW",
                )  # fmt: skip
    # torch's pass runs at each step without the kept lists (once a group on the accelerator);
    # with them at the first step and where something changed since the pass before: a param
    # without a grad (at step 2, and the step after, where it has one again), the state replaced
    # by the load (3); not for hyperparameters (4, 5) or state edited in place (6), nor in steps
    # where nothing changed.
    assert all(count > 0 for count in unkept_calls), unkept_calls
    stepped = [step for step, count in enumerate(calls) if count]
    assert stepped == [0, 2, 3], f"torch's _init_group ran at steps {stepped}: {calls}"


def test_a_load_leaves_no_replaced_state_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state tensors a load replaces are freed by the load, as without the kept lists, not
    held until the next step (at a 10B model's size, a second copy of the state)."""
    params = _params(torch.bfloat16)
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = None if g is None else g.to(torch.bfloat16)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as from a file: not the state's own tensors
    # The sub-optimizers' own tensors (``opt.state`` may hand out copies)
    old = [weakref.ref(piece.state["exp_avg"]) for r in opt._records for piece in r.pieces]
    opt.load_state_dict(saved)
    gc.collect()
    alive = [i for i, ref in enumerate(old) if ref() is not None]
    assert not alive, f"replaced exp_avg of params {alive} still alive after the load"


def _replace_a_moment(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    opt.state[params[0]]["exp_avg"] = torch.full_like(params[0], 0.25)


def _replace_a_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    state = opt.state[params[3]]
    opt.state[params[3]] = {key: value.clone() * 2 for key, value in state.items()}


def _clear_the_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    opt.state.clear()


def _load_a_state_dict(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _swap_params_of_a_group(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    group = opt.param_groups[0]["params"]
    group[0], group[1] = group[1], group[0]


@pytest.mark.parametrize(
    "replace",
    [_replace_a_moment, _replace_a_state, _clear_the_state, _load_a_state_dict,
     _swap_params_of_a_group],
    ids=lambda f: f.__name__.strip("_"),
)  # fmt: skip
def test_kept_lists_follow_what_replaces_state_or_params(
    replace: Callable[[torch.optim.Optimizer, list[torch.Tensor]], None],
) -> None:
    """On torch's own AdamW (the sub-optimizers' class), state or params replaced between steps
    (what a load through the hybrid calls ``forget_step_lists`` for, and what nothing in the
    hybrid does otherwise) are taken up at once: bit for bit the optimizer without kept lists."""
    from optimizers._kept_lists import keep_step_lists

    runs = []
    for kept in (True, False):
        params = _params(torch.float32)
        opt = torch.optim.AdamW(_groups(params), lr=1e-2, weight_decay=0.1, fused=True)
        if kept:
            keep_step_lists(opt)
            assert "_init_group" in vars(opt), "expected kept lists on torch's AdamW"
        history = []
        for step in range(4):
            if step == 2:
                replace(opt, params)
            for p, g in zip(params, _grads(params, 5 + step), strict=True):
                p.grad = g
            opt.step()
            history.append([p.detach().clone() for p in params])
        runs.append(history)
    for step, (mine, theirs) in enumerate(zip(*runs, strict=True)):
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(a, b), f"step {step}, param {index}: kept lists differ"
