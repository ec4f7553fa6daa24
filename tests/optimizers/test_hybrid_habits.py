"""Habits of torch.optim users: HybridDeviceOptimizer behaves as the torch optimizer it wraps.

Each parity test runs the same params, seed and grads through a plain torch optimizer (the
reference, torch's default single-tensor loop on fp32 params) and through the hybrid, and compares
the params at every step within OTHER_KERNEL (see _parity: the hybrid runs torch's fused CPU
kernels where they exist, which round differently by about an ulp per operation).
"""

from __future__ import annotations

import collections
import copy
import gc
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _parity import OTHER_KERNEL, fp32_copies

from optimizers import HybridDeviceOptimizer, OffloadPolicy, check_param_kind

FRACTIONS = [0.0, 0.5, 1.0]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# 49 elements in chunks of 8: at fraction 0.5 a param is cut between the devices, and params
# between chunks.
SHAPES = [(5, 7), (3,), (11,)]
CHUNK_NUMEL = 8
NUM_STEPS = 4

# Constructor arguments, each of which changes the trajectory (or, for the implementation flags,
# must not).
CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adagrad-initial_accumulator_value": (
        torch.optim.Adagrad,
        {"lr": 0.1, "initial_accumulator_value": 0.1},
    ),
    "adagrad-lr_decay": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.1}),
    "asgd": (torch.optim.ASGD, {"lr": 0.05, "t0": 2, "lambd": 1e-2, "alpha": 0.5}),
    "rprop": (torch.optim.Rprop, {"lr": 0.05, "etas": (0.3, 1.5), "step_sizes": (1e-4, 0.2)}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5, "rho": 0.5, "eps": 1e-5}),
    "rmsprop-centered-momentum": (
        torch.optim.RMSprop,
        {"lr": 1e-2, "alpha": 0.9, "centered": True, "momentum": 0.5},
    ),
    "nadam": (
        torch.optim.NAdam,
        {"lr": 1e-2, "momentum_decay": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1},
    ),
    "radam": (torch.optim.RAdam, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2, "betas": (0.5, 0.9)}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "sgd-dampening": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.3}),
    "sgd-maximize-weight_decay": (
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.5, "maximize": True, "weight_decay": 0.1},
    ),
    "adam-amsgrad-maximize": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    "adamw-tensor-lr-betas": (
        torch.optim.AdamW,
        {"lr": torch.tensor(1e-2), "betas": (torch.tensor(0.8), torch.tensor(0.99))},
    ),
    "adam-foreach-false": (torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
    "adamw-fused-true": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
}
# The optimizers that create a param's state at its first step (or, Adagrad, at construction
# for every param), in torch and in the hybrid alike. Adam, AdamW, Adamax, RAdam, RMSprop,
# Adadelta and SGD without dampening get theirs at the hybrid's construction instead (zeros,
# which is what their first step starts from).
LAZY_CASES = ["adagrad-initial_accumulator_value", "asgd", "rprop", "nadam", "sgd-dampening"]


def make_params(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in SHAPES]


def torch_kwargs(kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """``kwargs`` for a plain torch optimizer on ``device``: on CUDA, torch's default (foreach)
    kernels refuse a tensor lr or betas unless capturable; its fused kernels take them."""
    flat = [
        v for value in kwargs.values() for v in (value if isinstance(value, tuple) else [value])
    ]
    if device == "cuda" and any(torch.is_tensor(v) for v in flat):
        return {**kwargs, "fused": True}
    return kwargs


def policy(fraction: float, **kwargs: Any) -> OffloadPolicy:
    return OffloadPolicy(fraction=fraction, chunk_numel=CHUNK_NUMEL, num_threads=1, **kwargs)


def two_groups(params: list[torch.Tensor], lr: float | torch.Tensor) -> list[dict[str, Any]]:
    """The second group overrides the lr, as per-group settings do."""
    return [{"params": params[:2]}, {"params": params[2:], "lr": float(lr) / 2}]


def step_both(
    opt: torch.optim.Optimizer,
    ref_opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    refs: list[torch.Tensor],
    gen: torch.Generator,
    without_grad: frozenset[int] = frozenset(),
) -> None:
    """The same fresh grads for both (none for the params in ``without_grad``), then a step."""
    for index, (param, ref) in enumerate(zip(params, refs, strict=True)):
        if index in without_grad:
            param.grad = ref.grad = None
            continue
        grad = torch.randn(param.shape, generator=gen)
        param.grad, ref.grad = grad.to(param.device, copy=True), grad.to(ref.device, copy=True)
    opt.step()
    ref_opt.step()


def assert_params_match(params: list[torch.Tensor], refs: list[torch.Tensor], where: str) -> None:
    for index, (param, ref) in enumerate(zip(params, refs, strict=True)):
        torch.testing.assert_close(
            param.detach().cpu(), ref.detach().cpu(), rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1],
            msg=f"{where}: param {index}",
        )  # fmt: skip


def assert_state_matches(
    opt: HybridDeviceOptimizer,
    ref_opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    refs: list[torch.Tensor],
) -> None:
    """``opt.state[p]`` has torch's keys and values (read after the checks that count state:
    reading torch's defaultdict adds the param to it)."""
    for index, (param, ref) in enumerate(zip(params, refs, strict=True)):
        mine, theirs = opt.state[param], ref_opt.state[ref]
        assert mine.keys() == theirs.keys(), f"param {index}: {mine.keys()} != {theirs.keys()}"
        for key, value in theirs.items():
            torch.testing.assert_close(
                torch.as_tensor(mine[key]).float().cpu(), torch.as_tensor(value).float().cpu(),
                rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1], msg=f"param {index}: {key}",
            )  # fmt: skip


def indices_with_state(state: Any, params: list[torch.Tensor]) -> list[int]:
    """Positions in ``params`` of the params ``state`` iterates, in its order."""
    position = {id(param): index for index, param in enumerate(params)}
    return [position[id(param)] for param in state]


# -- 1. constructor arguments reach both devices --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build", ["constructor", "wrap"])
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_constructor_arguments_give_torchs_trajectory(
    case: str, fraction: float, build: str, device: str
) -> None:
    cls, kwargs = CASES[case]
    params = make_params(device=device)
    refs = fp32_copies(params)
    ref_opt = cls(two_groups(refs, kwargs["lr"]), **torch_kwargs(kwargs, device))
    if build == "wrap":
        user_opt = cls(two_groups(params, kwargs["lr"]), **torch_kwargs(kwargs, device))
        opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
    else:
        groups = two_groups(params, kwargs["lr"])
        opt = HybridDeviceOptimizer(groups, cls, policy=policy(fraction), **kwargs)
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")
    assert_state_matches(opt, ref_opt, params, refs)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_adagrad_initial_sum_comes_from_the_constructor_as_in_torch(fraction: float) -> None:
    # torch's Adagrad fills `sum` from its constructor argument, whatever a group says.
    params = make_params()
    refs = fp32_copies(params)

    def groups(tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": tensors[:2], "initial_accumulator_value": 0.5}, {"params": tensors[2:]}]

    kwargs = {"lr": 0.1, "initial_accumulator_value": 0.2}
    ref_opt = torch.optim.Adagrad(groups(refs), **kwargs)
    opt = HybridDeviceOptimizer(
        groups(params), torch.optim.Adagrad, policy=policy(fraction), **kwargs
    )
    assert_state_matches(opt, ref_opt, params, refs)  # before any step
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")


class SubclassedAdamW(torch.optim.AdamW):
    """A subclass that changes nothing of the math (one for logging, say)."""


class WarmAdam(torch.optim.Adam):
    """Keeps torch's step, but its first step starts ``exp_avg_sq`` at 1."""

    def _init_group(self, group: dict[str, Any], params: list[torch.Tensor], *rest: Any) -> Any:
        fresh = [p for p in group["params"] if p.grad is not None and not self.state[p]]
        found = super()._init_group(group, params, *rest)
        for p in fresh:
            self.state[p]["exp_avg_sq"].fill_(1.0)
        return found


class PrimedSGD(torch.optim.SGD):
    """A step of its own (so marked elementwise) that makes each momentum buffer at 0.5."""

    _zero_shard_elementwise = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
        return super().step(closure)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("cls", [SubclassedAdamW, WarmAdam, PrimedSGD])
def test_subclasses_give_torchs_trajectory(cls: type, fraction: float) -> None:
    # The state each class's own first step makes, not torch's base class's zeros.
    kwargs = {"lr": 0.1, "momentum": 0.9} if issubclass(cls, torch.optim.SGD) else {"lr": 0.1}
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = cls(two_groups(refs, kwargs["lr"]), **kwargs)
    opt = HybridDeviceOptimizer.wrap(
        cls(two_groups(params, 0.1), **kwargs), policy=policy(fraction)
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")
    assert_state_matches(opt, ref_opt, params, refs)


# -- 2. wrap() shares the param groups; LR schedulers ---------------------------------------------


def test_wrap_shares_the_param_groups_and_leaves_them_as_they_were() -> None:
    params = make_params()
    user_opt = torch.optim.AdamW(two_groups(params, 1e-2), lr=1e-2, weight_decay=0.1)
    before = [{k: v for k, v in group.items() if k != "params"} for group in user_opt.param_groups]
    before_params = [list(group["params"]) for group in user_opt.param_groups]
    opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(0.5))
    assert len(opt.param_groups) == len(user_opt.param_groups) == 2
    for group, user_group, old, old_params in zip(
        opt.param_groups, user_opt.param_groups, before, before_params, strict=True
    ):
        assert group is user_group
        assert {k: v for k, v in user_group.items() if k != "params"} == old  # no key added
        assert all(a is b for a, b in zip(user_group["params"], old_params, strict=True))
    user_opt.param_groups[1]["lr"] = 1e-3  # an edit of the original reaches the hybrid's step
    for param in params:
        param.grad = torch.ones_like(param)
    opt.step()
    assert {sub["lr"] for sub, group in opt._sub_groups() if group is opt.param_groups[1]} == {1e-3}


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_step_hooks_run_once_around_the_step_as_torch_runs_them(fraction: float) -> None:
    # The wrapped optimizer's hooks (registered before or after wrap) and global ones run once
    # a step, given the hybrid: none around the hybrid's own sub-optimizers' steps.
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen: collections.Counter[str] = collections.Counter()
    handle = register_optimizer_step_pre_hook(lambda o, *_: seen.update([type(o).__name__]))
    try:
        param = torch.nn.Parameter(torch.randn(64))
        torch_opt = torch.optim.AdamW([param], lr=1e-2)
        torch_opt.register_step_pre_hook(lambda o, *_: seen.update([f"before {type(o).__name__}"]))
        opt = HybridDeviceOptimizer.wrap(
            torch_opt, policy=OffloadPolicy(fraction=fraction, chunk_numel=16)
        )
        torch_opt.register_step_post_hook(lambda o, *_: seen.update([f"after {type(o).__name__}"]))
        seen.clear()
        for _ in range(2):
            param.grad = torch.ones_like(param)
            opt.step()
    finally:
        handle.remove()
    expected = {name: 2 for name in ("HybridDeviceOptimizer", "before HybridDeviceOptimizer",
                                      "after HybridDeviceOptimizer")}  # fmt: skip
    assert seen == expected


def test_wrap_takes_the_state_over() -> None:
    params = make_params()
    user_opt = torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.3)
    for param in params:
        param.grad = torch.full_like(param, 0.5)
    user_opt.step()
    expected = {index: dict(user_opt.state[p]) for index, p in enumerate(params)}
    opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(0.5))
    assert not user_opt.state, "the original still holds a second copy of the state"
    for index, param in enumerate(params):
        assert torch.equal(opt.state[param]["sum"], expected[index]["sum"])
        assert float(opt.state[param]["step"]) == 1.0


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_made_at_construction_starts_in_fp32_under_bf16_params(fraction: float) -> None:
    # torch's Adagrad makes `sum` at construction in the param's dtype (0.1 rounds to
    # 0.10009765625 in bf16); wrapped before any step, the fp32 state starts at 0.1, as the
    # hybrid's own constructor starts it, not at the rounding.
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in make_params()]
    user_opt = torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1)
    built = HybridDeviceOptimizer(
        [torch.nn.Parameter(p.detach().clone()) for p in params], torch.optim.Adagrad,
        policy=policy(fraction), lr=0.1, initial_accumulator_value=0.1,
    )  # fmt: skip
    opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
    assert not user_opt.state, "the original still holds a second copy of the state"
    assert opt.state, "torch's Adagrad holds state from its construction on"
    assert built.state, "built directly, as torch's Adagrad"
    for param, other in zip(params, built.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[param]["sum"], torch.full(param.shape, 0.1)), param.shape
        assert torch.equal(opt.state[param]["sum"], built.state[other]["sum"])


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_the_user_set_before_wrap_is_taken_over(fraction: float) -> None:
    # State set in the torch optimizer before any step: Adagrad's accumulator filled with a
    # value of the user's, and AdamW moments loaded with their step counts reset to 0 (bias
    # correction restarted). torch steps from it; so does the wrapper, at every fraction.
    def adagrad(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = torch.optim.Adagrad(two_groups(params, 0.1), lr=0.1, initial_accumulator_value=0.1)
        opt.state[params[0]]["sum"].fill_(5.0)
        return opt

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(two_groups(params, 1e-2), lr=1e-2)
        for index, param in enumerate(params):
            opt.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.full_like(param, 0.01 * (index + 1)),
                "exp_avg_sq": torch.full_like(param, 0.02 * (index + 1)),
            }
        return opt

    def sgd_with_a_main_param(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        # Left by a zero-shard state dict loaded into torch's SGD (torch keeps the key and
        # never steps it): not taken over, as the params have moved on since.
        opt = torch.optim.SGD(params, lr=0.1)
        for param in params:
            opt.state[param]["main_param"] = param.detach() + 1.0
        return opt

    for make in (adagrad, adamw, sgd_with_a_main_param):
        params, refs = make_params(), make_params()
        opt = HybridDeviceOptimizer.wrap(make(params), policy=policy(fraction))
        ref_opt = make(refs)
        for step in range(2):
            for param, ref in zip(params, refs, strict=True):
                param.grad = torch.full_like(param, 0.5 - step)
                ref.grad = param.grad.clone()
            opt.step()
            ref_opt.step()
            for param, ref in zip(params, refs, strict=True):
                torch.testing.assert_close(param, ref, msg=f"{make.__name__}, step {step}")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_loop_over_the_state_keys_leaves_the_main_weights(fraction: float) -> None:
    # A reset that zeroes every tensor of each param's state (as torch's keys are: no fp32 main
    # weight among them) leaves a bf16 param's main weight; it is read by name.
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in make_params()]
    opt = HybridDeviceOptimizer.wrap(torch.optim.AdamW(params, lr=1e-2), policy=policy(fraction))
    for _ in range(2):
        for param in params:
            param.grad = torch.ones_like(param)
        opt.step()
    mains = [opt.state[param]["main_param"].clone() for param in params]
    for param in params:
        state = opt.state[param]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], sorted(state)
        for value in state.values():
            value.zero_()
    for param, main in zip(params, mains, strict=True):
        assert torch.equal(opt.state[param]["main_param"], main)
        assert float(opt.state[param]["step"]) == 0.0
        assert not opt.state[param]["exp_avg"].any()


def lr_of(opt: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in opt.param_groups]


def scheduler_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]


@pytest.mark.parametrize("when", ["built_before_wrap", "built_on_the_hybrid"])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_lr_scheduler_gives_torchs_schedule(fraction: float, when: str) -> None:
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = torch.optim.AdamW(two_groups(refs, 1e-2), lr=1e-2, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    user_opt = torch.optim.AdamW(two_groups(params, 1e-2), lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if when == "built_before_wrap":
            sched = torch.optim.lr_scheduler.StepLR(user_opt, 1, gamma=0.5)
            opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
        else:
            opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        gen = torch.Generator().manual_seed(1)
        for step in range(NUM_STEPS):
            step_both(opt, ref_opt, params, refs, gen)
            sched.step()
            ref_sched.step()
            assert lr_of(opt) == lr_of(ref_opt), f"step {step}"
            assert_params_match(params, refs, f"step {step}")
    assert lr_of(opt) == [1e-2 * 0.5**NUM_STEPS, 5e-3 * 0.5**NUM_STEPS]
    assert not scheduler_warnings(caught)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_loaded_state_dicts_tensor_options_are_copied_as_in_torch(fraction: float) -> None:
    # torch's load deep-copies the saved groups: a tensor lr, which schedulers fill in place,
    # stays the state dict's own. Two optimizers loaded from one state dict, each with its own
    # scheduler, and a rollback to a state dict kept in memory (loaded twice), as torch.
    def build(params: list[torch.Tensor], ours: bool) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(params, lr=torch.tensor(0.5))
        return HybridDeviceOptimizer.wrap(opt, policy=policy(fraction)) if ours else opt

    def train(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> None:
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        for step in range(steps):
            for param in params:
                param.grad = torch.full_like(param, float(step + 1))
            opt.step()
            sched.step()

    results = {}
    for ours in (False, True):
        params = make_params()
        opt = build(params, ours)
        saved = copy.deepcopy(opt.state_dict())
        saved["param_groups"][0]["lr"] = torch.tensor(0.1)
        others = [make_params(seed=1), make_params(seed=2)]
        loaded = [build(each, ours) for each in others]
        for each in loaded:
            each.load_state_dict(saved)
        for each, each_params in zip(loaded, others, strict=True):
            train(each, each_params, 3)
        opt.load_state_dict(saved)  # a rollback: the saved lr, untouched by the others
        train(opt, params, 1)
        opt.load_state_dict(saved)
        results[ours] = (
            [lr_of(each) for each in (*loaded, opt)],
            float(saved["param_groups"][0]["lr"]),
            [p.detach().clone() for each in (*others, params) for p in each],
        )
    torch_lrs, torch_saved, torch_params = results[False]
    flat = [lr for lrs in torch_lrs for lr in lrs]
    assert flat == pytest.approx(
        [0.1 * 0.5**3, 0.1 * 0.5**3, 0.1]
    ) and torch_saved == pytest.approx(0.1)
    assert results[True][:2] == (torch_lrs, torch_saved), results[True][:2]
    assert_params_match(results[True][2], torch_params, "after the loads")


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_the_wrapped_optimizers_own_step_is_refused_before_anything_changes(
    fraction: float,
) -> None:
    # A library that kept the torch optimizer steps it by mistake: its state is the wrapper's
    # now, and its step would update the params a second time from empty state.
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1)
    user_opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        step_both(opt, ref_opt, params, refs, gen)
        for param in params:
            param.grad = torch.ones_like(param)
        before = [p.detach().clone() for p in params]
        with pytest.raises(RuntimeError, match="the AdamW that a HybridDeviceOptimizer wraps"):
            user_opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        assert not user_opt.state
        assert_params_match(params, refs, f"step {step}")
    # Once the wrapper is gone, the torch optimizer steps again, as a fresh one (no state left).
    del opt
    gc.collect()
    fresh = fp32_copies(params)
    fresh_opt = torch.optim.AdamW(fresh, lr=1e-2, weight_decay=0.1)
    for param, copy_ in zip(params, fresh, strict=True):
        param.grad = torch.ones_like(param)
        copy_.grad = torch.ones_like(copy_)
    user_opt.step()
    fresh_opt.step()
    assert_params_match(params, fresh, "stepped by the torch optimizer after the wrapper")
    # Wrapped again once a wrapper holding its state is gone: the state is lost, and said so.
    user_opt.state.clear()
    gone = "its wrapper, which held its optimizer state, is gone"
    with pytest.warns(RuntimeWarning, match=gone):
        again = HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # wrapped again while it lives: no word
        HybridDeviceOptimizer.wrap(user_opt, policy=policy(fraction))
    assert again is not None  # alive through the wrap above


def test_launch_step_counts_as_a_step_for_lr_schedulers() -> None:
    opt = HybridDeviceOptimizer(make_params(), torch.optim.AdamW, policy=policy(0.5), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.launch_step().wait()
        sched.step()
    assert not scheduler_warnings(caught)
    assert lr_of(opt) == [5e-3]


# -- 3. DTensor params -----------------------------------------------------------------------------


@pytest.fixture
def one_process_group() -> Iterator[None]:
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a process group already set up")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_params_point_to_zero_shard_wrap(one_process_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    with pytest.raises(
        TypeError, match=r"param 0 .* is a DTensor.*zero_shard\.wrap\(optimizer, model\)"
    ):
        HybridDeviceOptimizer([param], torch.optim.AdamW, lr=1e-3)
    check_param_kind(param, "param 'fc.weight'")  # zero_shard's check takes FSDP2's DTensors


def assert_same_state_dict(state_dict: dict[str, Any], expected: dict[str, Any]) -> None:
    for index, state in expected["state"].items():
        for key, value in state.items():
            now = state_dict["state"][index][key]
            assert torch.equal(torch.as_tensor(now), torch.as_tensor(value)), (index, key)


def test_a_sharded_state_dict_is_refused_before_anything_changes(one_process_group: None) -> None:
    # The state dict of zero_shard.wrap's optimizer holds DTensors: loaded into the hybrid (whose
    # CPU kernel reads its state by address) it is refused, naming the plain one to load.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    params = make_params()
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(0.5), lr=1e-2)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"] = distribute_tensor(torch.ones(SHAPES[0]), mesh, [Shard(0)])
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(TypeError, match=r"'exp_avg' of param 0 is a DTensor.*full_state_dict"):
        opt.load_state_dict(saved)
    assert_same_state_dict(opt.state_dict(), before)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_state_dict_missing_a_key_of_its_group_is_refused_at_load(fraction: float) -> None:
    # One param's state lacks a key its group's other params have (a state dict cut by hand):
    # refused at the load, before anything changes; the step would have stepped the others
    # before finding it missing.
    params = make_params()
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(fraction), lr=1e-2)
    step_both(opt, torch.optim.AdamW(make_params()), params, make_params(), torch.Generator())
    saved = copy.deepcopy(opt.state_dict())
    del saved["state"][2]["exp_avg_sq"]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"param 2 \(param group 0\) lacks \['exp_avg_sq'\]"):
        opt.load_state_dict(saved)
    assert_same_state_dict(opt.state_dict(), before)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("write", ["clamp after each step", "weights loaded after the state"])
def test_params_written_between_steps_are_stepped_from_as_in_torch(
    write: str, fraction: float
) -> None:
    # torch steps from the params as they are: a weight constraint after the step, or model
    # weights loaded after the optimizer's state, must reach the CPU share's fp32 main weights
    # too (they are the params themselves only on the accelerator).
    params, refs = make_params(), make_params()
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(fraction), lr=0.1)
    ref_opt = torch.optim.AdamW(refs, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        if write == "clamp after each step":
            with torch.no_grad():
                for param in (*params, *refs):
                    param.clamp_(-0.5, 0.5)
        elif step == 1:  # a resume: the optimizer's state first, then the model's weights
            loaded = [torch.randn(p.shape, generator=gen) for p in params]
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            with torch.no_grad():
                for param, ref, value in zip(params, refs, loaded, strict=True):
                    param.copy_(value)
                    ref.copy_(value)
        assert_params_match(params, refs, f"{write}, fraction {fraction}, step {step}")


# -- 4. optimizer.state ----------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_of_a_frozen_param_is_empty_as_in_torch(fraction: float) -> None:
    params = make_params()
    refs = fp32_copies(params)
    for tensor in (params[1], refs[1]):
        tensor.requires_grad_(False)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2)
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(fraction), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen, without_grad=frozenset({1}))
        assert_params_match(params, refs, f"step {step}")
    assert (
        indices_with_state(opt.state, params) == indices_with_state(ref_opt.state, refs) == [0, 2]
    )
    assert len(opt.state) == len(ref_opt.state) == 2
    assert sorted(opt.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"])
    assert params[1] not in opt.state and params[0] in opt.state
    assert opt.state[params[1]] == {}
    assert len(opt.state) == 2  # reading it did not add it
    assert_state_matches(opt, ref_opt, params, refs)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("case", LAZY_CASES)
def test_state_of_a_param_without_grads_is_torchs(case: str, fraction: float) -> None:
    cls, kwargs = CASES[case]
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = cls(refs, **kwargs)
    opt = HybridDeviceOptimizer(params, cls, policy=policy(fraction), **kwargs)
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen, without_grad=frozenset({1}))
        assert_params_match(params, refs, f"step {step}")
    expected = indices_with_state(ref_opt.state, refs)
    assert indices_with_state(opt.state, params) == expected
    assert len(opt.state) == len(expected)
    assert sorted(opt.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"])
    assert_state_matches(opt, ref_opt, params, refs)


# Edits of optimizer.state[p] that torch users make (resetting or rescaling moments, the step
# count, a whole param's state), each run on both optimizers between steps 1 and 2. Param 0 is cut
# into several pieces at every fraction above 0 (chunks of 8): its state is handed out as copies.
def _edit_in_place(state: Any, p: torch.Tensor) -> None:
    state[p]["exp_avg"].zero_()
    state[p]["exp_avg_sq"].mul_(4.0)
    state[p]["step"].zero_()


def _assign_keys(state: Any, p: torch.Tensor) -> None:
    state[p]["step"] = torch.tensor(1.0)
    state[p]["exp_avg"] = torch.full_like(state[p]["exp_avg"], 0.5)
    state[p]["exp_avg_sq"].fill_(0.25)


def _assign_then_edit(state: Any, p: torch.Tensor) -> None:
    exp_avg = torch.zeros_like(state[p]["exp_avg"])
    state[p]["exp_avg"] = exp_avg
    exp_avg.add_(1.0)  # torch holds the tensor assigned: a later edit of it counts


STATE_EDITS: dict[str, Any] = {
    "in place": _edit_in_place,
    "keys assigned": _assign_keys,
    "a tensor assigned, then edited": _assign_then_edit,
    "state[p] = {}": lambda state, p: state.__setitem__(p, {}),
    "del state[p]": lambda state, p: state.__delitem__(p),
    "state.pop(p)": lambda state, p: state.pop(p),
    "state.clear()": lambda state, p: state.clear(),
}


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("edit", list(STATE_EDITS))
def test_state_edits_reach_the_state_as_in_torch(edit: str, fraction: float) -> None:
    params = make_params()
    refs = fp32_copies(params)
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(fraction), lr=1e-2)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        if step == 2:
            STATE_EDITS[edit](opt.state, params[0])
            STATE_EDITS[edit](ref_opt.state, refs[0])
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"{edit}, step {step}")
    assert_state_matches(opt, ref_opt, params, refs)


def test_state_replaced_by_an_empty_dict_starts_afresh_and_other_writes_raise() -> None:
    params = make_params()
    refs = fp32_copies(params)
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(0.5), lr=1e-2)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        if step == 2:
            opt.state = collections.defaultdict(dict)
            ref_opt.state = collections.defaultdict(dict)
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")
    with pytest.raises(TypeError, match="only be replaced by an empty dict"):
        opt.state = {params[0]: {}}
    with pytest.raises(ValueError, match=r"keys \['step'\].*assign every key"):
        opt.state[params[0]] = {"step": torch.tensor(0.0)}
    with pytest.raises(KeyError, match="keys cannot be added"):
        opt.state[params[0]]["momentum"] = torch.tensor(0.0)
    with pytest.raises(ValueError, match=r"param's shape \(5, 7\), got \(3,\)"):
        opt.state[params[0]]["exp_avg"] = torch.zeros(3)
    with pytest.raises(TypeError, match="del optimizer.state"):
        del opt.state[params[0]]["exp_avg"]
    assert copy.deepcopy(opt.state[params[0]]).keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[torch.zeros(2)] == {}  # not in the optimizer: {} as from torch's defaultdict


@pytest.mark.parametrize("case", list(CASES))
def test_state_read_after_every_step_and_kept_changes_nothing(case: str) -> None:
    """A logger reads every param's state after each step and keeps what it read (NAdam's
    ``mu_product``, ASGD's ``eta`` and ``mu``: a scalar state of a cut param is a copy, which
    the next step does not take for an edit): torch's trajectory."""
    cls, kwargs = CASES[case]
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = cls(two_groups(refs, kwargs["lr"]), **torch_kwargs(kwargs, "cpu"))
    opt = HybridDeviceOptimizer(two_groups(params, kwargs["lr"]), cls, policy=policy(0.5), **kwargs)
    gen = torch.Generator().manual_seed(1)
    logged = []
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")
        logged.append([dict(opt.state[p]) for p in params])
    assert_state_matches(opt, ref_opt, params, refs)


def test_a_copy_held_across_a_step_and_edited_after_it_raises() -> None:
    params = make_params()
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(0.5), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    exp_avg = opt.state[params[0]]["exp_avg"]  # param 0 is cut: a copy
    step_both(opt, torch.optim.AdamW(fp32_copies(params)), params, fp32_copies(params), gen)
    before = opt.state_dict()["state"][0]["exp_avg"].clone()
    exp_avg.zero_()
    with pytest.raises(RuntimeError, match="before the last step were edited after it"):
        opt.step()
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before)


# -- 5. other habits ---------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_group_edits_reach_both_devices_as_in_torch(fraction: float) -> None:
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = torch.optim.AdamW(two_groups(refs, 1e-2), lr=1e-2)
    opt = HybridDeviceOptimizer(
        two_groups(params, 1e-2), torch.optim.AdamW, policy=policy(fraction, cpu_kernel="torch"),
        lr=1e-2,
    )  # fmt: skip
    edits = {
        1: {"lr": 3e-2, "betas": (0.5, 0.9)},
        2: {"eps": 1e-3, "weight_decay": 0.3},
        3: {"maximize": True},
    }
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        for group, ref_group in zip(opt.param_groups, ref_opt.param_groups, strict=True):
            group.update(edits.get(step, {}))
            ref_group.update(edits.get(step, {}))
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize(
    ("key", "bad"), [("lr", "1e-3"), ("betas", ("0.9", 0.99)), ("weight_decay", None)]
)
def test_an_option_that_is_no_number_is_refused_before_anything_changes(
    key: str, bad: Any, fraction: float
) -> None:
    """An option read from a config as a string: torch raises inside its kernels, after step
    counts moved (a fused kernel's, every param's), so that the run, once the option is fixed,
    goes on a step count ahead. The hybrid refuses it before anything changes; fixed, it goes on
    as torch's run that never had it."""
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = torch.optim.AdamW(two_groups(refs, 1e-2), lr=1e-2)
    opt = HybridDeviceOptimizer(
        two_groups(params, 1e-2), torch.optim.AdamW, policy=policy(fraction), lr=1e-2
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        if step == 2:
            good = opt.param_groups[1][key]
            opt.param_groups[1][key] = bad
            before = copy.deepcopy(opt.state_dict())
            weights = [p.detach().clone() for p in params]
            with pytest.raises(TypeError, match=rf"param_groups\[1\]\['{key}'\] must be"):
                step_both(opt, torch.optim.SGD(refs, lr=0.0), params, refs, gen)
            assert_same_state_dict(opt.state_dict(), before)
            assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
            opt.param_groups[1][key] = good
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")
    assert_state_matches(opt, ref_opt, params, refs)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_named_parameters_as_in_torch(fraction: float) -> None:
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = torch.optim.AdamW([(f"p{i}", p) for i, p in enumerate(refs)], lr=1e-2)
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = HybridDeviceOptimizer(named, torch.optim.AdamW, policy=policy(fraction), lr=1e-2)
    assert opt.param_groups[0]["param_names"] == ref_opt.param_groups[0]["param_names"]
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")


def test_group_dicts_are_the_optimizers_as_in_torch() -> None:
    groups = two_groups(make_params(), 1e-2)
    opt = HybridDeviceOptimizer(groups, torch.optim.AdamW, lr=1e-2)
    assert all(a is b for a, b in zip(opt.param_groups, groups, strict=True))


def test_a_group_with_a_set_of_params_is_refused_as_in_torch() -> None:
    with pytest.raises(TypeError, match="ordered collections"):
        HybridDeviceOptimizer([{"params": set(make_params())}], torch.optim.AdamW, lr=1e-2)


def test_differentiable_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="differentiable=True is not supported"):
        HybridDeviceOptimizer(make_params(), torch.optim.AdamW, lr=1e-2, differentiable=True)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_capturable_is_ignored_with_a_warning(fraction: float) -> None:
    params = make_params()
    refs = fp32_copies(params)
    ref_opt = torch.optim.Adam(refs, lr=1e-2)
    with pytest.warns(UserWarning, match="capturable=True is ignored"):
        opt = HybridDeviceOptimizer(
            params, torch.optim.Adam, policy=policy(fraction), lr=1e-2, capturable=True
        )
    gen = torch.Generator().manual_seed(1)
    for step in range(NUM_STEPS):
        step_both(opt, ref_opt, params, refs, gen)
        assert_params_match(params, refs, f"step {step}")


def register_recording_hooks(opt: torch.optim.Optimizer, ran: list[str]) -> None:
    """torch's four state-dict hooks, each noting that it ran; the post-hook and the load
    pre-hook return new state dicts (the first with a key added, the second with another lr),
    which take the place of the ones they were given, as in torch."""

    def post(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        ran.append("state_dict post")
        return {**state_dict, "extra": len(ran)}

    def load_pre(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        ran.append("load pre")
        groups = [{**group, "lr": 0.125} for group in state_dict["param_groups"]]
        return {**state_dict, "param_groups": groups}

    opt.register_state_dict_pre_hook(lambda opt: ran.append("state_dict pre"))
    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda opt: ran.append("load post"))


def saved_and_loaded_as_torch(
    opt: torch.optim.Optimizer,
    ref_opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    refs: list[torch.Tensor],
    ran: dict[str, list[str]],
) -> None:
    """A state dict taken and loaded back on both, through the hooks ``register_recording_hooks``
    registered: the same hooks ran, the same state dict and lr came out, the next step agrees."""
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    assert state["extra"] == ref_state["extra"] == 2
    opt.load_state_dict(state)
    ref_opt.load_state_dict(ref_state)
    assert ran["hybrid"] == ran["torch"]
    assert lr_of(opt) == lr_of(ref_opt) == [0.125]
    step_both(opt, ref_opt, params, refs, torch.Generator().manual_seed(1))
    assert_params_match(params, refs, "after the load")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_dict_hooks_run_as_in_torch(fraction: float) -> None:
    params, refs = make_params(), make_params()
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy(fraction), lr=1e-2)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2)
    step_both(opt, ref_opt, params, refs, torch.Generator().manual_seed(0))
    ran: dict[str, list[str]] = {"hybrid": [], "torch": []}
    register_recording_hooks(opt, ran["hybrid"])
    register_recording_hooks(ref_opt, ran["torch"])
    saved_and_loaded_as_torch(opt, ref_opt, params, refs, ran)


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
def test_state_dict_hooks_on_the_wrapped_optimizer_run_as_in_torch(when: str) -> None:
    # A library registers its hooks on the torch optimizer (before the wrap, or on the one it
    # kept): they run around the wrapper's state_dict and load_state_dict, as around torch's;
    # the torch optimizer's own state_dict(), whose state the wrapper holds, is refused while
    # the wrapper lives, and serves again once it is gone.
    params, refs = make_params(), make_params()
    user_opt = torch.optim.AdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2)
    ran: dict[str, list[str]] = {"hybrid": [], "torch": []}
    register_recording_hooks(ref_opt, ran["torch"])
    if when == "before_wrap":
        register_recording_hooks(user_opt, ran["hybrid"])
    opt = HybridDeviceOptimizer.wrap(user_opt, policy=policy(0.5))
    if when == "after_wrap":
        register_recording_hooks(user_opt, ran["hybrid"])
    step_both(opt, ref_opt, params, refs, torch.Generator().manual_seed(0))
    saved_and_loaded_as_torch(opt, ref_opt, params, refs, ran)
    with pytest.raises(RuntimeError, match="state_dict\\(\\) was called on the AdamW that a "
                       "HybridDeviceOptimizer wraps"):  # fmt: skip
        user_opt.state_dict()
    del opt
    gc.collect()
    assert user_opt.state_dict()["state"] == {}
