"""The one-step delayed update (``OffloadPolicy(delayed_update=True)``), on one CPU process
(gloo; the delayed update runs on one process only) and its refusals at two.

The reference is the delayed update written out with torch AdamW in one process on the whole
batch: the model's params P give the grads; at each step the master copy M's last update reaches
P first, then M steps with the new grads (clipped by their own norm). So the grads of step k+1
are taken at the weights of step k-1. zero-shard must give the same losses and params at every
forward, the same M after ``finish_param_sync()``, the optimizer's ``state_dict()``, a module's
``state_dict()`` and ``zero_shard.checkpoint.save``; skip a non-finite step (by its own verdict or
``zero_shard.GradScaler``'s) with the update before it still applied; keep the lag when the state
is only read; let weights loaded after ``step()`` win over the update in flight; and refuse what
it cannot honour (more processes, DDP, FSDP2).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from _harness import check_outcome, run_cases
from _models import (
    LOSS_TOL,
    PARAM_TOL,
    adamw,
    global_batch,
    local_slice,
    make_model,
    mean_over_ranks,
    mse,
)
from torch import nn

import zero_shard
from zero_shard import OffloadPolicy

STEPS = 6
CLIP = 0.5
TINY_BUCKETS = 0.0008  # MiB: a few params a bucket


def delayed() -> OffloadPolicy:
    return OffloadPolicy(fraction=1.0, num_threads=1, chunk_numel=16, delayed_update=True)


def batch(step: int, skip: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch; at step ``skip`` an inf in rank 0's first row (its grads are inf)."""
    x, y = global_batch(step)
    if step == skip:
        x[0, 0] = float("inf")
    return x, y


def reference_steps(
    skip: int | None = None, flush_at: frozenset[int] = frozenset()
) -> Iterator[tuple[torch.Tensor, nn.Module, nn.Module]]:
    """Yields (loss, P, M) per step: the loss and params of the step's forward, then M after
    the step. At step ``skip`` the grads are non-finite: M does not step (P still gets M). Before
    the steps in ``flush_at`` P gets M (a flush)."""
    params, master = make_model(), make_model()
    opt = adamw(master)
    for step in range(STEPS):
        if step in flush_at:
            with torch.no_grad():
                for p, m in zip(params.parameters(), master.parameters(), strict=True):
                    p.copy_(m)
        x, y = batch(step, skip)
        loss = mse(params(x), y)
        snapshot = [p.detach().clone() for p in params.parameters()]
        loss.backward()
        for p, m in zip(params.parameters(), master.parameters(), strict=True):
            m.grad, p.grad = p.grad.clone(), None
        torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP)
        with torch.no_grad():
            for p, m in zip(params.parameters(), master.parameters(), strict=True):
                p.copy_(m)  # the last step's update reaches the params
        if step != skip:
            opt.step()
        opt.zero_grad()
        yield loss.detach(), snapshot, master


def train_and_compare(
    rank: int,
    world: int,
    skip: int | None = None,
    *,
    policy: OffloadPolicy | None = None,
    flush_at: frozenset[int] = frozenset(),
) -> tuple[nn.Module, zero_shard.ZeroShardOptimizer, nn.Module]:
    model = make_model()
    policy = delayed() if policy is None else policy
    opt = zero_shard.wrap(adamw(model), model, offload=policy, bucket_mb=TINY_BUCKETS)
    for step, (ref_loss, ref_params, master) in enumerate(reference_steps(skip, flush_at)):
        x, y = batch(step, skip)
        loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        # The forward waited for the params it read: they are the lagging ones, as in the
        # reference (the losses differ by rank: each holds its slice of the batch).
        for (name, param), ref in zip(model.named_parameters(), ref_params, strict=True):
            torch.testing.assert_close(param.detach(), ref, **PARAM_TOL, msg=f"step {step}: {name}")
        torch.testing.assert_close(mean_over_ranks(loss), ref_loss, **LOSS_TOL)
        loss.backward()  # at step skip, rank 0's grads are not finite: every rank skips
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        last_master = master
    assert opt.num_skipped_steps == (0 if skip is None else 1)
    return model, opt, last_master


def trains_as_the_reference_and_flushes(rank: int, world: int) -> None:
    model, opt, master = train_and_compare(rank, world)
    opt.finish_param_sync()  # the update in flight reaches the params
    for (name, param), ref in zip(model.named_parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL, msg=name)


def a_skipped_step_keeps_the_update_before_it(rank: int, world: int) -> None:
    model, opt, master = train_and_compare(rank, world, skip=3)
    opt.finish_param_sync()
    for (name, param), ref in zip(model.named_parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL, msg=name)


def the_warmup_steps_are_exact(rank: int, world: int) -> None:
    # delayed_update_warmup=2: the updates of steps 0 and 1 reach the params before the next
    # forward (in the reference: before steps 1 and 2); the lag starts with step 2's update.
    policy = dataclasses.replace(delayed(), delayed_update_warmup=2)
    model, opt, master = train_and_compare(rank, world, policy=policy, flush_at=frozenset({1, 2}))
    opt.finish_param_sync()
    for (name, param), ref in zip(model.named_parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL, msg=name)


def a_skipped_step_is_not_a_warmup_update(rank: int, world: int) -> None:
    # Step 0's grads are not finite: skipped, it is no update, so steps 1 and 2 are the warm-up's
    # two exact ones (in the reference: their updates reach the params before steps 2 and 3).
    policy = dataclasses.replace(delayed(), delayed_update_warmup=2)
    model, opt, master = train_and_compare(
        rank, world, skip=0, policy=policy, flush_at=frozenset({1, 2, 3})
    )
    opt.finish_param_sync()
    for (name, param), ref in zip(model.named_parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL, msg=name)


def a_resumed_run_does_not_warm_up_again(rank: int, world: int) -> None:
    # The warm-up counts steps from the loaded state's step: after a load at step 3 (past a
    # warm-up of 2) the next update is in flight after step(); a fresh run's first is not.
    policy = dataclasses.replace(delayed(), delayed_update_warmup=2)

    def one_step(model: nn.Module, opt: zero_shard.ZeroShardOptimizer, step: int) -> bool:
        """Steps once; whether the params changed by the next forward."""
        x, y = global_batch(step)
        mse(model(x), y).backward()
        opt.clip_grad_norm_(CLIP)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)  # its pre-hooks wait for whatever the step gathered
        return any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))

    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=policy, bucket_mb=TINY_BUCKETS)
    assert [one_step(model, opt, step) for step in range(3)] == [True, True, False]
    weights, saved = model.state_dict(), opt.state_dict()
    resumed = make_model()
    resumed_opt = zero_shard.wrap(adamw(resumed), resumed, offload=policy, bucket_mb=TINY_BUCKETS)
    resumed.load_state_dict(weights)
    resumed_opt.load_state_dict(saved)
    assert not one_step(resumed, resumed_opt, 3)  # delayed at once: its update is in flight


def state_dicts_apply_the_update_in_flight(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=delayed(), bucket_mb=TINY_BUCKETS)
    ref = reference_steps(flush_at=frozenset({3}))  # model.state_dict() below flushes
    for step in range(3):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        _, _, master = next(ref)
    weights = model.state_dict()  # a module's state_dict applies the update in flight
    for (name, _), ref_param in zip(model.named_parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(weights[name], ref_param.detach(), **PARAM_TOL, msg=name)
    saved = opt.state_dict()
    assert set(saved["state"]) == {name for name, _ in model.named_parameters()}
    # zero_shard.checkpoint applies an update in flight before it reads the model.
    x, y = global_batch(3)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.clip_grad_norm_(CLIP)
    opt.step()
    opt.zero_grad()
    _, _, master = next(ref)
    path = os.environ["ZERO_SHARD_TEST_DIR"]
    zero_shard.checkpoint.save(f"{path}/world{world}", model=model, optimizer=opt)
    for (name, param), ref_param in zip(model.named_parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref_param.detach(), **PARAM_TOL, msg=name)


def state_reads_keep_the_lag(rank: int, world: int) -> None:
    # Reading the state (logging a moment) waits for the CPU step but does not apply its update.
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=delayed(), bucket_mb=TINY_BUCKETS)
    for step, (_, ref_params, _) in enumerate(reference_steps()):
        x, y = global_batch(step)
        loss = mse(model(x), y)
        for (name, param), ref in zip(model.named_parameters(), ref_params, strict=True):
            torch.testing.assert_close(param.detach(), ref, **PARAM_TOL, msg=f"step {step}: {name}")
        loss.backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        assert opt.state[model.inp.weight]["exp_avg"].abs().sum() > 0
        opt.zero_grad()


def a_load_after_step_wins(rank: int, world: int) -> None:
    # Weights written in place after step() and a forward (a load), while the update of that
    # step is still in flight: the next step takes them (stale_params="reload") instead of the
    # update overwriting them.
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=delayed(), bucket_mb=TINY_BUCKETS)
    for step in range(4):
        x, y = global_batch(step)
        mse(model(x), y).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        if step == 1:
            with torch.no_grad():
                model(x)  # an eval forward: the gathers issued at step() are done
                model.inp.weight.fill_(0.5)  # the update of step 1 is still in flight
    opt.finish_param_sync()
    moved = (model.inp.weight.detach() - 0.5).abs().max().item()
    assert moved < 0.05, f"the loaded weights were lost: they moved by {moved}"


def a_grad_scaler_skip_keeps_the_update_before_it(rank: int, world: int) -> None:
    # zero_shard.GradScaler skips step() itself on an inf: the update in flight is still applied
    # there, as at a step the optimizer skips.
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=delayed(), bucket_mb=TINY_BUCKETS)
    scaler = zero_shard.GradScaler("cpu")
    for step, (_, ref_params, master) in enumerate(reference_steps(skip=3)):
        x, y = batch(step, 3)
        loss = mse(model(x), y)
        for (name, param), ref in zip(model.named_parameters(), ref_params, strict=True):
            torch.testing.assert_close(param.detach(), ref, **PARAM_TOL, msg=f"step {step}: {name}")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        last_master = master
    opt.finish_param_sync()
    for (name, param), ref in zip(model.named_parameters(), last_master.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL, msg=name)


def refuses_ddp_and_fsdp2(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_model())
    with pytest.raises(ValueError, match="delayed_update=True\\) needs a plain model"):
        zero_shard.wrap(adamw(ddp.module), ddp, offload=delayed())
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    with pytest.raises(ValueError, match="got a FSDP model"):
        zero_shard.wrap(adamw(model), model, offload=delayed())


def refuses_more_processes(rank: int, world: int) -> None:
    model = make_model()
    with pytest.raises(ValueError, match="runs on one process only, got 2"):
        zero_shard.wrap(adamw(model), model, offload=delayed())


CASES_BY_WORLD = {
    1: {
        "trains_as_the_reference_and_flushes": trains_as_the_reference_and_flushes,
        "a_skipped_step_keeps_the_update_before_it": a_skipped_step_keeps_the_update_before_it,
        "the_warmup_steps_are_exact": the_warmup_steps_are_exact,
        "a_skipped_step_is_not_a_warmup_update": a_skipped_step_is_not_a_warmup_update,
        "a_resumed_run_does_not_warm_up_again": a_resumed_run_does_not_warm_up_again,
        "state_dicts_apply_the_update_in_flight": state_dicts_apply_the_update_in_flight,
        "state_reads_keep_the_lag": state_reads_keep_the_lag,
        "a_load_after_step_wins": a_load_after_step_wins,
        "a_grad_scaler_skip_keeps_the_update_before_it": (
            a_grad_scaler_skip_keeps_the_update_before_it
        ),
        "refuses_ddp_and_fsdp2": refuses_ddp_and_fsdp2,
    },
    2: {"refuses_more_processes": refuses_more_processes},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str | None]]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("delayed"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {world: run_cases(cases, world) for world, cases in CASES_BY_WORLD.items()}


@pytest.mark.parametrize(
    "world, name", [(world, name) for world, cases in CASES_BY_WORLD.items() for name in cases]
)
def test_distributed(outcomes: dict[int, dict[str, str | None]], world: int, name: str) -> None:
    check_outcome(outcomes[world], name)


def test_delayed_update_needs_full_offload() -> None:
    with pytest.raises(ValueError, match="needs fraction=1.0 .* got fraction=0.5"):
        OffloadPolicy(fraction=0.5, delayed_update=True)
    with pytest.raises(TypeError, match="delayed_update must be a bool"):
        OffloadPolicy(delayed_update=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delayed_update_warmup=3 counts .* needs delayed_upd"):
        OffloadPolicy(delayed_update_warmup=3)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="delayed_update_warmup must be an integer >= 0"):
            OffloadPolicy(delayed_update=True, delayed_update_warmup=bad)  # type: ignore[arg-type]
