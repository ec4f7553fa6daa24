"""Param groups and their options after wrap, on 1 and 2 CPU processes (gloo), against torch
AdamW in one process every step: a tensor lr a scheduler writes while the CPU's share of the
step is still in flight applies from the next step, as in torch; maximize switched on mid-run
steps as torch's; SGD with momentum takes first steps that come late or are skipped as torch;
groups changed on the wrapped torch optimizer are refused on every rank before
anything changes, and wrapping again trains them."""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

import pytest
import torch
from _harness import check_outcome, run_cases
from _models import (
    LR,
    adamw,
    assert_params_close,
    global_batch,
    local_slice,
    make_model,
    mse,
    param_groups,
)
from torch import nn
from torch.distributed.tensor import DTensor

import zero_shard
from optimizers import _host_part as host_part
from zero_shard import OffloadPolicy

CASES = {}
STEPS = 4
TINY_BUCKETS = 0.0008  # MiB: the test model's params fill several buckets
HOLD_TIMEOUT = 30.0  # seconds; a CPU step held longer means step() waited for it (a hang)


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def offload() -> OffloadPolicy:
    return OffloadPolicy(fraction=1.0, num_threads=1, chunk_numel=16)


class HeldCpuStep:
    """Holds the CPU step of every chunk until ``release()``: a step's CPU share then runs only
    after what the caller does once ``step()`` returned (a scheduler's step)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._original = host_part._step_chunk

    def _held(self, *args: Any) -> None:
        if not self._event.wait(HOLD_TIMEOUT):
            raise AssertionError("the CPU step was held and never released: step() waited")
        self._original(*args)

    def hold(self) -> None:
        self._event.clear()

    def release(self) -> None:
        self._event.set()

    def __enter__(self) -> HeldCpuStep:
        host_part._step_chunk = self._held
        return self

    def __exit__(self, *exc: object) -> None:
        host_part._step_chunk = self._original
        self._event.set()


def tensor_lr_adamw(model: nn.Module) -> torch.optim.AdamW:
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "lr": torch.tensor(LR / 2)},
        ],
        lr=torch.tensor(LR),
    )


def schedule(step: int) -> float:
    return 0.5**step


@case
def a_scheduled_tensor_lr_applies_from_the_next_step(rank: int, world: int) -> None:
    model, ref = make_model(), make_model()
    torch_opt = tensor_lr_adamw(model)
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, schedule)
    opt = zero_shard.wrap(torch_opt, model, offload=offload(), bucket_mb=TINY_BUCKETS)
    ref_opt = tensor_lr_adamw(ref)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    with HeldCpuStep() as held:
        for step in range(STEPS):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            held.hold()
            opt.step()
            opt.zero_grad()
            sched.step()  # in place: lr.fill_(...), before the CPU step reads it
            held.release()
            mse(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"step {step}")


@case
def maximize_switched_on_mid_run_steps_as_torch(rank: int, world: int) -> None:
    # The default cpu_kernel ("auto") steps with the single-pass kernel where it can be built;
    # it has no maximize: those groups go on with torch's CPU kernel, with one warning.
    model, ref = make_model(), make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(), bucket_mb=TINY_BUCKETS)
    ref_opt = adamw(ref)
    on_kernel = any(chunk.kernel is not None for chunk in opt._hybrid._host.chunks)
    for step in range(STEPS):
        if step == 2:
            for group in (*opt.param_groups, *ref_opt.param_groups):
                group["maximize"] = True
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        fallbacks = [w for w in caught if "cpu_kernel='torch'" in str(w.message)]
        assert len(fallbacks) == (step == 2 and on_kernel), [str(w.message) for w in caught]
        opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"step {step}")


def wrapped_without_the_out_layer(
    model: nn.Module,
) -> tuple[torch.optim.AdamW, zero_shard.ZeroShardOptimizer]:
    torch_opt = torch.optim.AdamW(
        [{"params": model.inp.parameters()}, {"params": model.mid.parameters(), "lr": LR / 2}],
        lr=LR,
    )
    opt = zero_shard.wrap(torch_opt, model, offload=offload(), bucket_mb=TINY_BUCKETS)
    return torch_opt, opt


def step_on_batch(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int,
                  world: int, scale: float = 1.0) -> None:  # fmt: skip
    x, y = global_batch(step)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).mul(scale).backward()
    opt.step()
    opt.zero_grad()


def refused_without_change(opt: zero_shard.ZeroShardOptimizer, model: nn.Module, step: int,
                           rank: int, world: int) -> None:  # fmt: skip
    opt.finish_param_sync()  # the last step's gathers, in flight: not the refused step's
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.full_tensor().clone() for k, v in opt.state_dict()["state"]["inp.weight"].items()
             if isinstance(v, DTensor)}  # fmt: skip
    for _ in range(2):  # every step, not once
        with pytest.raises(
            RuntimeError, match=r"param_groups of the .* changed after wrap.*zero_shard\.wrap"
        ):
            step_on_batch(model, opt, step, rank, world)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    after = opt.state_dict()["state"]["inp.weight"]
    assert all(torch.equal(after[k].full_tensor(), v) for k, v in state.items())
    opt.finish_param_sync()
    model.zero_grad()  # the refused steps' grads; the out layer's too (no wrapper clears them)


@case
def groups_changed_on_the_torch_optimizer_are_refused_until_wrapped_again(
    rank: int, world: int
) -> None:
    model = make_model()
    torch_opt, opt = wrapped_without_the_out_layer(model)
    # A state dict saved before (the wrapped optimizer's own state_dict() is refused): new group
    # dicts, not the wrapper's.
    sizes = [len(group["params"]) for group in torch_opt.param_groups]
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    groups = zip(torch_opt.param_groups, starts, sizes, strict=True)
    saved_groups = [{**group, "params": list(range(start, start + size))}
                    for group, start, size in groups]  # fmt: skip
    torch_opt.load_state_dict({"state": {}, "param_groups": saved_groups})
    refused_without_change(opt, model, 0, rank, world)
    # The params lists are the user's to edit, as in torch (progressive unfreezing, a param moved
    # to a group with other options), and the groups list too: each edit is refused.
    edits = [
        lambda torch_opt, opt: torch_opt.param_groups[0]["params"].extend(model.out.parameters()),
        lambda torch_opt, opt: torch_opt.param_groups[1]["params"].append(
            torch_opt.param_groups[0]["params"].pop()
        ),
        lambda torch_opt, opt: opt.param_groups.append(
            {**opt.param_groups[1], "params": list(model.out.parameters())}
        ),
    ]
    for edit in edits:
        del opt
        torch_opt, opt = wrapped_without_the_out_layer(model)
        edit(torch_opt, opt)
        refused_without_change(opt, model, 0, rank, world)
    del opt
    torch_opt, opt = wrapped_without_the_out_layer(model)
    step_on_batch(model, opt, 0, rank, world)
    torch_opt.add_param_group({"params": list(model.out.parameters()), "lr": 2 * LR})
    refused_without_change(opt, model, 1, rank, world)


@case
def a_group_added_then_wrapped_again_trains_on_as_torchs_optimizer(rank: int, world: int) -> None:
    # The fix the error names: the torch optimizer wrapped again while the wrapper lives takes
    # the params and their state (main weights included) over, as torch's optimizer keeps its
    # state through add_param_group.
    # A scheduler built on the first wrapper and kept (Trainer keeps its own) drives the added
    # group too, as torch's, built on the optimizer before add_param_group, does.
    model, ref = make_model(), make_model()
    torch_opt, opt = wrapped_without_the_out_layer(model)
    ref_opt = torch.optim.AdamW(
        [{"params": ref.inp.parameters()}, {"params": ref.mid.parameters(), "lr": LR / 2}],
        lr=LR,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    for step in range(STEPS + 1):
        if step == 2:
            for net, optimizer in ((model, torch_opt), (ref, ref_opt)):
                net.zero_grad()
                optimizer.add_param_group({"params": list(net.out.parameters()), "lr": 2 * LR})
            opt = zero_shard.wrap(torch_opt, model, offload=offload(), bucket_mb=TINY_BUCKETS)
        step_on_batch(model, opt, step, rank, world)
        step_on_batch(ref, ref_opt, step, 0, 1)
        sched.step()
        ref_sched.step()
        lrs = [group["lr"] for group in opt.param_groups]
        assert lrs == [group["lr"] for group in ref_opt.param_groups], (step, lrs)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"wrapped again at step 2, step {step}")
    for name, param in model.named_parameters():
        count = float(opt.state[param]["step"])
        expected = float(ref_opt.state[ref.get_parameter(name)]["step"])
        assert count == expected, f"{name}: step count {count}, torch's {expected}"


@case
def unfrozen_params_are_trained_after_the_fix_the_error_names(rank: int, world: int) -> None:
    # Params frozen at wrap, in the optimizer's groups, unfrozen at step 2: the step refuses;
    # wrapping again between the backward and the step is refused too (that backward's grads
    # are the old wrapper's); the fix the errors name (zero_grad, wrap the torch optimizer
    # again, backward again) gives torch's run, where unfreezing needs nothing.
    model, ref = make_model(), make_model()
    for net in (model, ref):
        net.out.requires_grad_(False)
    torch_opt = adamw(model)
    opt = zero_shard.wrap(torch_opt, model, offload=offload(), bucket_mb=TINY_BUCKETS)
    ref_opt = adamw(ref)
    for step in range(STEPS + 1):
        if step == 2:
            for net in (model, ref):
                net.out.requires_grad_(True)
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            with pytest.raises(RuntimeError, match="had requires_grad=False when the optimizer"):
                opt.step()
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match="came between a backward and its step"):
                zero_shard.wrap(torch_opt, model, offload=offload(), bucket_mb=TINY_BUCKETS)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
            opt.zero_grad()
            opt = zero_shard.wrap(torch_opt, model, offload=offload(), bucket_mb=TINY_BUCKETS)
        step_on_batch(model, opt, step, rank, world)
        step_on_batch(ref, ref_opt, step, 0, 1)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"unfrozen at step 2, step {step}")


def sgd(model: nn.Module, momentum: float, dampening: float) -> torch.optim.SGD:
    return torch.optim.SGD(
        param_groups(model), lr=0.05, momentum=momentum, dampening=dampening, weight_decay=1e-2
    )


@case
def sgd_with_momentum_takes_late_and_skipped_first_steps_as_torch(rank: int, world: int) -> None:
    # torch's fused SGD (which the hybrid runs) fails where some params have a momentum buffer and
    # others not yet, and keeps uninitialized buffers after a first step it skipped on found_inf
    # ([Note: SGD's late first steps]): a first step skipped on a NaN, a layer unfrozen at step
    # 2, a param's state dropped at step 3; torch's SGD (its default path) beside it. Buffers are
    # made at a param's first step with dampening, and where momentum is switched on after wrap
    # (OneCycleLR's cycle_momentum does it when it is built).
    for (momentum, dampening), fraction in itertools.product(((0.9, 0.5), (0.0, 0.0)),
                                                             (0.0, 0.5, 1.0)):  # fmt: skip
        model, ref = make_model(), make_model()
        policy = OffloadPolicy(fraction=fraction, chunk_numel=16) if fraction else None
        opt = zero_shard.wrap(sgd(model, momentum, dampening), model, offload=policy,
                              bucket_mb=TINY_BUCKETS)  # fmt: skip
        ref_opt = sgd(ref, momentum, dampening)
        for groups in (opt.param_groups, ref_opt.param_groups):
            for group in groups:
                group["momentum"] = 0.9
        for net in (model, ref):
            net.out.requires_grad_(False)
        for step in range(6):
            if step == 2:
                for net in (model, ref):
                    net.out.requires_grad_(True)
            if step == 3:
                del opt.state[model.mid.weight], ref_opt.state[ref.mid.weight]
            x, y = global_batch(step)
            nan = float("nan") if step == 0 else 1.0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the skipped step's warning
                step_on_batch(model, opt, step, rank, world, scale=nan)
            mse(ref(x), y).mul(nan).backward()
            if step != 0:
                ref_opt.step()
            ref_opt.zero_grad()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"{dampening=}, fraction {fraction}, step {step}")
        assert opt.num_skipped_steps == 1


@pytest.fixture(scope="module", params=[1, 2], ids=lambda world: f"world{world}")
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_distributed(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
