"""Speculative host steps under zero_shard.wrap, on 1 and 3 CPU processes (gloo): the CPU's
chunks step as backward reduces their grads ([Note: speculative host steps] in
optimizers/_speculation.py), against the same run without speculation (bit for bit, every step)
and torch AdamW on the whole batch in one process (PARAM_TOL): steps that stand, a clip that
scales the grads on some steps, an inf on one rank that skips a step, the state read between
backward and the step, a write through a DTensor of the state (stepped as written), stage 1
and 2, fractions 0.5 and 1."""

from __future__ import annotations

import warnings

import pytest
import torch
from _harness import check_outcome, run_cases
from _models import (
    adamw,
    assert_params_close,
    global_batch,
    local_slice,
    make_model,
    mse,
)
from torch.nn.parallel import DistributedDataParallel

import zero_shard
from optimizers._cpu_kernel import load_cpu_adam
from zero_shard import OffloadPolicy

CASES = {}
STEPS = 6
ONE_PER_BUCKET = 1e-6  # MiB: a bucket a param; backward reduces (and copies) all but the first


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def wrapped(
    model: torch.nn.Module, fraction: float, stage: int, speculative: bool
) -> zero_shard.ZeroShardOptimizer:
    policy = OffloadPolicy(
        fraction=fraction,
        chunk_numel=16,
        num_threads=1,
        host_staging="per_chunk",
        speculative=speculative,
    )
    return zero_shard.wrap(
        adamw(model), model, offload=policy, stage=stage, bucket_mb=ONE_PER_BUCKET
    )


@case
def speculated_steps_are_the_steps_bit_for_bit_and_torchs(rank: int, world: int) -> None:
    if load_cpu_adam() is None:
        pytest.skip("no C compiler: no single-pass kernel")
    for fraction, stage in ((1.0, 2), (0.5, 1), (0.5, 2)):
        models = [make_model() for _ in range(3)]
        ref = models.pop()
        plain, speculative = (
            wrapped(net, fraction, stage, on) for net, on in zip(models, (False, True), strict=True)
        )
        speculative._hybrid._host._backoff.max_skip = 0  # white-box: every step speculates
        ref_opt = adamw(ref)
        before = torch.empty(0)  # a state after step 3
        for step in range(STEPS):
            where = f"fraction {fraction}, stage {stage}, step {step}"
            x, y = global_batch(step)
            for net, opt in zip(models, (plain, speculative), strict=True):
                loss = mse(net(local_slice(x, rank, world)), local_slice(y, rank, world))
                if step == 3 and rank == world - 1:
                    loss = loss * float("inf")  # the step is skipped on every rank
                loss.backward()
                # White-box: the worker's speculations run before the step (else those it has
                # not started by then are cancelled, which ones depending on timing).
                for each in opt._hybrid._host._speculations.values():
                    each.wait()
                if step == 4:  # the state read before the step: as before it (nothing stepped)
                    exp_avg = opt.state_dict()["state"]["mid.weight"]["exp_avg"].full_tensor()
                    assert torch.equal(exp_avg, before), where
                # A clip that scales on the odd steps, and one that leaves the grads (factor 1).
                opt.clip_grad_norm_(0.05 if step % 2 else 1e3)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the skipped step's warning
                    opt.step()
                opt.zero_grad()
            if step != 3:
                mse(ref(x), y).backward()
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05 if step % 2 else 1e3)
                ref_opt.step()
                ref_opt.zero_grad()
            for opt in (plain, speculative):
                opt.finish_param_sync()
            if step == 3:
                before = plain.state_dict()["state"]["mid.weight"]["exp_avg"].full_tensor()
            for a, b in zip(*(net.parameters() for net in models), strict=True):
                assert torch.equal(a, b), where
            assert_params_close(models[1], ref, where)
        counts = speculative.speculation_counts
        assert counts.stood >= 1 and counts.redone >= 2, (fraction, stage, counts)
        assert speculative.num_skipped_steps == plain.num_skipped_steps == 1


@case
def state_written_through_its_dtensor_during_backward_is_stepped_as_written(
    rank: int, world: int
) -> None:
    # A DTensor read from optimizer.state before backward is the live state; an in-place op on it
    # moves its own version counter, not its local tensor's. Written once the step was
    # speculated, the step reads the state as written, as torch's does (the write, then the
    # step): the same bits as without speculation.
    if load_cpu_adam() is None:
        pytest.skip("no C compiler: no single-pass kernel")
    for fraction, stage in ((1.0, 2), (0.5, 1)):
        models = [make_model() for _ in range(2)]
        plain, speculative = (
            wrapped(net, fraction, stage, on) for net, on in zip(models, (False, True), strict=True)
        )
        speculative._hybrid._host._backoff.max_skip = 0  # white-box: every step speculates
        for step in range(3):
            x, y = global_batch(step)
            for net, opt in zip(models, (plain, speculative), strict=True):
                held = opt.state[net.out.weight]["exp_avg"]  # (a DTensor over the live state)
                mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                for each in opt._hybrid._host._speculations.values():
                    each.wait()  # (white-box: the speculations ran)
                if step == 1:
                    held.mul_(0.5)
                opt.step()
                opt.zero_grad()
                opt.finish_param_sync()
            for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
                assert torch.equal(a, b), (fraction, stage, step)
            written, unwritten = (
                opt.state[net.out.weight]["exp_avg"].full_tensor()
                for net, opt in zip(models, (plain, speculative), strict=True)
            )
            assert torch.equal(written, unwritten), (fraction, stage, step)


@case
def speculative_on_a_ddp_model_warns_that_it_has_no_effect(rank: int, world: int) -> None:
    # Under DDP the grads are the model's own: none go to the host while backward runs.
    if load_cpu_adam() is None:
        pytest.skip("no C compiler: no single-pass kernel")
    model = DistributedDataParallel(make_model())
    with pytest.warns(RuntimeWarning, match=r"speculative=True\) has no effect for this model"):
        wrapped(model, 1.0, 2, True)


@pytest.fixture(scope="module", params=[1, 3], ids=lambda world: f"world{world}")
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_distributed(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
