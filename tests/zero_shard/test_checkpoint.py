"""Checkpoints on CPU processes (gloo): saved at one world size and offload fraction, loaded at
others and compared with uninterrupted training; interchange with FSDP2 + torch AdamW; model-only
loads; the torch.save path; async saves; a save killed mid-write.

The phases share a folder through ZERO_SHARD_TEST_DIR, set before the processes are spawned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _harness import check_outcome, run_cases
from _models import (
    LR,
    PARAM_TOL,
    adamw,
    assert_params_close,
    global_batch,
    local_slice,
    make_model,
    mse,
    param_groups,
    step_reference,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy
from zero_shard.checkpoint import IncompleteCheckpointError

TINY_BUCKETS = 0.0008
SAVE_AT, CONTINUE = 3, 5
# Loaded at another world size, the grads are reduced in another order: they differ by a few
# ulps, which AdamW carries into the params at O(lr) a step (as in _models.PARAM_TOL).
RESHARD_TOL = PARAM_TOL


def folder() -> Path:
    return Path(os.environ["ZERO_SHARD_TEST_DIR"])


def policy(fraction: float) -> OffloadPolicy | None:
    return (
        None if fraction == 0 else OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)
    )


def build(fraction: float, stage: int = 2, seed: int = 0):  # type: ignore[no-untyped-def]
    model = make_model(seed=seed)
    opt = zero_shard.wrap(adamw(model), model, offload=policy(fraction), stage=stage,
                          bucket_mb=TINY_BUCKETS)  # fmt: skip
    return model, opt


def train(model, opt, rank: int, world: int, steps: range) -> None:  # type: ignore[no-untyped-def]
    for step in steps:
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    if isinstance(opt, zero_shard.ZeroShardOptimizer):
        opt.finish_param_sync()


def compare_with_reference(model, opt, where: str, exact: bool) -> None:  # type: ignore[no-untyped-def]
    reference = torch.load(folder() / "reference.pt")
    tol = {"rtol": 0.0, "atol": 0.0} if exact else RESHARD_TOL
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.detach(), reference["params"][name], **tol, msg=f"{where}: {name}"
        )
        state = opt.state[param]
        assert int(state["step"]) == SAVE_AT + CONTINUE
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key].full_tensor(), reference["state"][name][key], **tol,
                                       msg=f"{where}: {name} {key}")  # fmt: skip


# Nested values too: a scheduler's state dict, a list of per-step records.
EXTRA = {"step": SAVE_AT, "scheduler": {"last_epoch": SAVE_AT, "base_lrs": [0.1]}, "log": [{}]}


def save_at_three_ranks_then_go_on(rank: int, world: int) -> None:
    assert world == 3
    model, opt = build(fraction=0.5)
    train(model, opt, rank, world, range(SAVE_AT))
    zero_shard.checkpoint.save(folder() / "ckpt", model=model, optimizer=opt, extra=EXTRA)
    full = zero_shard.checkpoint.full_state_dict(opt)  # for the torch.save path, rank 0 only
    if rank == 0:
        torch.save({"optim": full, "model": model.state_dict()}, folder() / "full.pt")
    else:
        assert full == {}
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE))
    reference = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": {n: {k: opt.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}
                  for n, p in model.named_parameters()},
    }  # fmt: skip
    if rank == 0:
        torch.save(reference, folder() / "reference.pt")
    dist.barrier()


def resume_and_go_on(rank: int, world: int, *, fraction: float, stage: int, exact: bool) -> None:
    model, opt = build(fraction, stage, seed=1)  # other weights: the checkpoint replaces them
    extra = zero_shard.checkpoint.load(folder() / "ckpt", model=model, optimizer=opt)
    assert extra == EXTRA
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE))
    compare_with_reference(model, opt, f"{world} ranks, fraction {fraction}, stage {stage}", exact)


def resume_at_two_ranks_all_offloaded(rank: int, world: int) -> None:
    resume_and_go_on(rank, world, fraction=1.0, stage=2, exact=False)


def resume_in_one_process(rank: int, world: int) -> None:
    resume_and_go_on(rank, world, fraction=0.0, stage=2, exact=False)


def resume_at_three_ranks(rank: int, world: int) -> None:
    # Stage 1 all-reduces where stage 2 reduce-scattered: another summation, a tolerance.
    resume_and_go_on(rank, world, fraction=0.5, stage=1, exact=False)
    # The same layout and arithmetic as the saving run: bit for bit.
    resume_and_go_on(rank, world, fraction=0.5, stage=2, exact=True)
    # The torch.save path: the full state dict, given on rank 0 only.
    model, opt = build(fraction=0.5, seed=1)
    full = torch.load(folder() / "full.pt") if rank == 0 else None
    model.load_state_dict(torch.load(folder() / "full.pt")["model"])
    zero_shard.checkpoint.load_full_state_dict(opt, full["optim"] if full else None)
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE))
    compare_with_reference(model, opt, "from full_state_dict", exact=True)


def fsdp2_model(world: int):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in (model.inp, model.mid, model.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def assert_same_training(ours, ours_opt, theirs, theirs_opt, where: str) -> None:  # type: ignore[no-untyped-def]
    for (name, param), their_param in zip(
        ours.named_parameters(), theirs.parameters(), strict=True
    ):
        mine = param.full_tensor() if isinstance(param, DTensor) else param
        other = their_param.full_tensor() if isinstance(their_param, DTensor) else their_param
        torch.testing.assert_close(
            mine.detach(), other.detach(), **PARAM_TOL, msg=f"{where}: {name}"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours_opt.state[param][key], theirs_opt.state[their_param][key]
            a = a.full_tensor() if isinstance(a, DTensor) else a
            b = b.full_tensor() if isinstance(b, DTensor) else b
            torch.testing.assert_close(a, b, **PARAM_TOL, msg=f"{where}: {name} {key}")


def fsdp2_interchange_both_ways(rank: int, world: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # FSDP2 + torch AdamW writes; zero-shard (a replicated model) reads.
    fsdp, fsdp_opt = fsdp2_model(world), None
    fsdp_opt = adamw(fsdp)
    train(fsdp, _Plain(fsdp_opt), rank, world, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(fsdp, fsdp_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder() / "from_fsdp2"))
    model, opt = build(fraction=0.5, seed=1)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=str(folder() / "from_fsdp2"))
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    train(fsdp, _Plain(fsdp_opt), rank, world, range(SAVE_AT, SAVE_AT + 3))
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + 3))
    assert_same_training(model, opt, fsdp, fsdp_opt, "FSDP2 -> zero-shard")

    # zero-shard writes (with its helper); FSDP2 + torch AdamW reads.
    zero_shard.checkpoint.save(folder() / "to_fsdp2", model=model, optimizer=opt)
    fresh, fresh_opt = fsdp2_model(world), None
    fresh_opt = adamw(fresh)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(folder() / "to_fsdp2"))
    set_state_dict(
        fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    train(fresh, _Plain(fresh_opt), rank, world, range(SAVE_AT + 3, SAVE_AT + 6))
    train(model, opt, rank, world, range(SAVE_AT + 3, SAVE_AT + 6))
    assert_same_training(model, opt, fresh, fresh_opt, "zero-shard -> FSDP2")


class _Plain:
    """A torch optimizer with the one method `train` calls on zero-shard's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self) -> None:
        self._optimizer.step()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad()

    def finish_param_sync(self) -> None:
        return None


def model_only_load_trains_from_the_loaded_weights(rank: int, world: int) -> None:
    pretrained = make_model(seed=7).state_dict()
    for policy_name in ("reload", "error"):
        model = make_model(seed=0)
        opt = zero_shard.wrap(adamw(model), model, offload=policy(0.5), bucket_mb=TINY_BUCKETS,
                              stale_params=policy_name)  # fmt: skip
        model.load_state_dict(pretrained)  # after the optimizer was built (Megatron-Bridge order)
        ref = make_model(seed=7)
        ref_opt = adamw(ref)
        x, y = global_batch(0)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        if policy_name == "error":
            with pytest.raises(RuntimeError, match=r"'inp.weight'.*written since the optimizer"):
                opt.step()
            opt.reload_model_params()  # the fix the message names
        opt.step()
        opt.zero_grad()
        step_reference(ref, ref_opt, x, y)
        train(model, opt, rank, world, range(1, 4))
        for step in range(1, 4):
            x, y = global_batch(step)
            step_reference(ref, ref_opt, x, y)
        for (name, param), ref_param in zip(
            model.named_parameters(), ref.parameters(), strict=True
        ):
            torch.testing.assert_close(param.detach(), ref_param.detach(), **PARAM_TOL, msg=name)


def async_save_keeps_the_snapshot(rank: int, world: int) -> None:
    model, opt = build(fraction=0.5)
    train(model, opt, rank, world, range(2))
    snapshot = [p.detach().clone() for p in model.parameters()]
    future = zero_shard.checkpoint.async_save(folder() / "async", model=model, optimizer=opt,
                                              extra={"step": 2})  # fmt: skip
    train(model, opt, rank, world, range(2, 4))  # training goes on while it writes
    future.result()
    dist.barrier()
    loaded, loaded_opt = build(fraction=0.0, seed=1)
    assert zero_shard.checkpoint.load(folder() / "async", model=loaded, optimizer=loaded_opt) == {
        "step": 2
    }
    for old, new in zip(snapshot, loaded.parameters(), strict=True):
        assert torch.equal(old, new.detach())


def halving(step: int) -> float:
    return 0.5**step


class SavedConfig:
    """A value of the user's in a checkpoint's extra, pickled by reference to its class."""


def local_state_tensors(opt: zero_shard.ZeroShardOptimizer) -> list[torch.Tensor]:
    """This rank's part of every state tensor, copied."""
    state = opt.state_dict()["state"]
    values = [v for fqn in sorted(state) for _, v in sorted(state[fqn].items())]
    return [
        (v.to_local() if isinstance(v, DTensor) else v).clone()
        for v in values
        if torch.is_tensor(v)
    ]


def train_scheduled(model, opt, scheduler, rank: int, world: int, steps: range) -> None:  # type: ignore[no-untyped-def]
    for step in steps:
        train(model, opt, rank, world, range(step, step + 1))
        scheduler.step()


def a_scheduler_saved_with_the_checkpoint_resumes_its_schedule(rank: int, world: int) -> None:
    whole, whole_opt = build(fraction=0.5)
    whole_schedule = torch.optim.lr_scheduler.LambdaLR(whole_opt, halving)
    train_scheduled(whole, whole_opt, whole_schedule, rank, world, range(6))
    model, opt = build(fraction=0.5)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, halving)
    train_scheduled(model, opt, schedule, rank, world, range(3))
    path = folder() / "scheduled"
    zero_shard.checkpoint.save(path, model=model, optimizer=opt, scheduler=schedule)
    zero_shard.checkpoint.save(folder() / "unscheduled", model=model, optimizer=opt)
    resumed, resumed_opt = build(fraction=0.5, seed=1)
    resumed_schedule = torch.optim.lr_scheduler.LambdaLR(resumed_opt, halving)
    before = [p.detach().clone() for p in resumed.parameters()]
    with pytest.raises(ValueError, match="holds no scheduler state"):  # on every rank, at once
        zero_shard.checkpoint.load(folder() / "unscheduled", model=resumed,
                                   optimizer=resumed_opt, scheduler=resumed_schedule)  # fmt: skip
    assert all(
        torch.equal(a, b.detach()) for a, b in zip(before, resumed.parameters(), strict=True)
    )
    # A scheduler of another class, and an extra whose class does not import where it is loaded
    # (defined in the saving script's __main__): refused before the model or optimizer change.
    other = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    zero_shard.checkpoint.save(folder() / "step_scheduled", model=model, optimizer=opt,
                               scheduler=other, extra={"config": SavedConfig()})  # fmt: skip
    state_before = local_state_tensors(resumed_opt)
    with pytest.raises(ValueError, match="scheduler state does not load into a LambdaLR"):
        zero_shard.checkpoint.load(folder() / "step_scheduled", model=resumed,
                                   optimizer=resumed_opt, scheduler=resumed_schedule)  # fmt: skip
    saved_config = globals().pop("SavedConfig")
    try:
        with pytest.raises(ValueError, match="extra does not unpickle here"):
            zero_shard.checkpoint.load(folder() / "step_scheduled", model=resumed,
                                       optimizer=resumed_opt)  # fmt: skip
    finally:
        globals()["SavedConfig"] = saved_config
    assert all(
        torch.equal(a, b.detach()) for a, b in zip(before, resumed.parameters(), strict=True)
    )
    state_after = local_state_tensors(resumed_opt)
    assert all(torch.equal(a, b) for a, b in zip(state_before, state_after, strict=True))
    zero_shard.checkpoint.load(
        path, model=resumed, optimizer=resumed_opt, scheduler=resumed_schedule
    )
    assert resumed_schedule.last_epoch == 3
    assert [g["lr"] for g in resumed_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    train_scheduled(resumed, resumed_opt, resumed_schedule, rank, world, range(3, 6))
    assert resumed_schedule.get_last_lr() == whole_schedule.get_last_lr()
    for (name, param), expected in zip(resumed.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(param.detach(), expected.detach()), name


def sgd_dampened_and_plain(model: torch.nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "dampening": 0.1}, {"params": vectors}]
    return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)


def sgd_momentum_later(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.0)


def momentum_on(opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["momentum"] = 0.9  # a momentum warm-up, after wrap


class SignMomentum(torch.optim.Optimizer):
    """An elementwise class of a user's own: its state, made at the first step, holds a Python
    number (saved by DCP as an object, not a tensor)."""

    _zero_shard_elementwise = True

    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(momentum=torch.full_like(p, 0.25), count=0)
                state["count"] += 1
                state["momentum"].mul_(group["beta"]).add_(p.grad.sign())
                p.add_(state["momentum"], alpha=-group["lr"] / state["count"] ** 0.5)


def save_through_torch(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load_through_torch(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    # The layout first, as torch's docs load: get_state_dict makes a fresh optimizer's state.
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def state_made_at_the_first_step_is_restored(rank: int, world: int) -> None:
    # State a fresh optimizer has not made yet (made at a param's first step: SGD with
    # dampening, NAdam, a class of the user's own with a Python number in its state; or by an
    # option switched on after wrap) is read from the checkpoint, not left out: the resumed run
    # is the uninterrupted one, bit for bit. Through zero_shard.checkpoint, and through torch's
    # get_state_dict / dcp / set_state_dict, which make a fresh optimizer's state by a step at
    # lr 0 where its `state` is empty, as a fresh wrapper's reads.
    runs = (
        (sgd_dampened_and_plain, None),
        (sgd_momentum_later, momentum_on),
        (lambda model: torch.optim.NAdam(model.parameters(), lr=1e-2), None),
        (lambda model: SignMomentum(model.parameters()), None),
    )
    routes = {
        "zero_shard.checkpoint": (zero_shard.checkpoint.save, zero_shard.checkpoint.load),
        "torch's get_state_dict / set_state_dict": (save_through_torch, load_through_torch),
    }
    for index, (make_optimizer, after_wrap) in enumerate(runs):
        whole, whole_opt = build_with(make_optimizer, after_wrap, seed=0)
        train(whole, whole_opt, rank, world, range(6))
        for route_index, (route, (save, load)) in enumerate(routes.items()):
            model, opt = build_with(make_optimizer, after_wrap, seed=0)
            train(model, opt, rank, world, range(3))
            path = folder() / f"first_step_state_{index}_{route_index}"
            save(path, model=model, optimizer=opt)
            resumed, resumed_opt = build_with(make_optimizer, after_wrap, seed=1)  # no state yet
            load(path, model=resumed, optimizer=resumed_opt)
            train(resumed, resumed_opt, rank, world, range(3, 6))
            for (name, param), expected in zip(
                resumed.named_parameters(), whole.parameters(), strict=True
            ):
                where = (route, type(opt).__name__, index, name)
                assert torch.equal(param.detach(), expected.detach()), where
    # torch's state dict of a fresh torch optimizer steps it at lr 0 first (AdamW's step count is
    # then 1): the same call on a fresh wrapper does the same, so both go on alike.
    ref = make_model()
    ref_opt = adamw(ref)
    get_state_dict(ref, ref_opt)
    model, opt = build(fraction=0.5)
    get_state_dict(model, opt)
    train(model, opt, rank, world, range(3))
    for step in range(3):
        step_reference(ref, ref_opt, *global_batch(step))
    assert_params_close(model, ref, "after get_state_dict of fresh optimizers")


def a_fresh_wrapper_loads_a_torch_optimizers_checkpoint(rank: int, world: int) -> None:
    # A DDP + torch NAdam run saved (the torch optimizer's state_dict numbers its params),
    # resumed by a fresh wrapper that holds no state yet: it goes on as DDP + NAdam.
    def nadam(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.NAdam(model.parameters(), lr=1e-2)

    whole = torch.nn.parallel.DistributedDataParallel(make_model())
    whole_opt = nadam(whole)
    train(whole, whole_opt, rank, world, range(6))
    saved = torch.nn.parallel.DistributedDataParallel(make_model())
    saved_opt = nadam(saved)
    train(saved, saved_opt, rank, world, range(3))
    path = folder() / "torch_nadam"
    zero_shard.checkpoint.save(path, model=saved.module, optimizer=saved_opt)
    resumed = make_model(seed=1)
    resumed_opt = zero_shard.wrap(nadam(resumed), resumed, offload=policy(0.5),
                                  bucket_mb=TINY_BUCKETS)  # fmt: skip
    zero_shard.checkpoint.load(path, model=resumed, optimizer=resumed_opt)
    train(resumed, resumed_opt, rank, world, range(3, 6))
    for (name, param), expected in zip(
        resumed.named_parameters(), whole.module.parameters(), strict=True
    ):
        torch.testing.assert_close(param.detach(), expected.detach(), **PARAM_TOL, msg=name)


def saved_after_two_steps(
    rank: int, world: int, name: str, frozen: str | None = None
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, Path]:
    """Two steps of zero-shard (fraction 0.5) and of torch AdamW on the whole batch, the module
    ``frozen`` (a name) frozen in both; zero-shard's saved as ``name``. Returns (model, reference,
    its optimizer, the checkpoint's path)."""
    model, ref = make_model(), make_model()
    for net in (model, ref) if frozen else ():
        getattr(net, frozen).requires_grad_(False)
    opt, ref_opt = zero_shard.wrap(adamw(model), model, offload=policy(0.5)), adamw(ref)
    train(model, opt, rank, world, range(2))
    for step in range(2):
        step_reference(ref, ref_opt, *global_batch(step))
    path = folder() / name
    zero_shard.checkpoint.save(path, model=model, optimizer=opt)
    return model, ref, ref_opt, path


def a_param_frozen_when_saved_loads_no_state_as_in_torch(rank: int, world: int) -> None:
    # Fine-tuning in phases: `inp` frozen (still in the optimizer's groups) while the rest
    # trains, saved; then unfrozen, and the checkpoint loaded into an optimizer that has taken a
    # step already. `inp` had no state when saved: it loads none and starts afresh, as torch's
    # load_state_dict leaves it, against torch AdamW on the whole batch.
    model, ref, ref_opt, path = saved_after_two_steps(rank, world, "frozen_when_saved", "inp")
    saved = ref_opt.state_dict()
    resumed, resumed_opt = build(fraction=0.5, seed=1)
    ref_opt = adamw(ref)
    for net in (resumed, ref):
        net.inp.requires_grad_(True)
    for net, optimizer in ((resumed, resumed_opt), (ref, ref_opt)):  # a step, then the load
        x, y = global_batch(9)
        mse(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    ref.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(saved)
    zero_shard.checkpoint.load(path, model=resumed, optimizer=resumed_opt)
    assert not ref_opt.state[ref.inp.weight]
    assert int(resumed_opt.state[resumed.inp.weight]["step"]) == 0
    train(resumed, resumed_opt, rank, world, range(2, 5))
    for step in range(2, 5):
        step_reference(ref, ref_opt, *global_batch(step))
    assert_params_close(resumed, ref, "unfrozen after the load")


def saved_without_amsgrad_loads_into_amsgrad_as_in_torch(rank: int, world: int) -> None:
    # A checkpoint of AdamW without amsgrad, loaded into an optimizer built with amsgrad=True:
    # the saved options replace the new ones (amsgrad off), as torch's load_state_dict does, and
    # training goes on as torch's.
    _, ref, ref_opt, path = saved_after_two_steps(rank, world, "without_amsgrad")
    resumed = make_model(seed=1)
    amsgrad = torch.optim.AdamW(param_groups(resumed), lr=LR, amsgrad=True)
    resumed_opt = zero_shard.wrap(amsgrad, resumed, offload=policy(0.5))
    # A scheduler built before the load adds `initial_lr`, which the saved groups lack: no
    # option of the class, it is not read (and not refused).
    torch.optim.lr_scheduler.StepLR(resumed_opt, step_size=100)
    saved, ref_opt = ref_opt.state_dict(), torch.optim.AdamW(param_groups(ref), amsgrad=True)
    torch.optim.lr_scheduler.StepLR(ref_opt, step_size=100)
    ref_opt.load_state_dict(saved)
    zero_shard.checkpoint.load(path, model=resumed, optimizer=resumed_opt)
    assert [g["amsgrad"] for g in resumed_opt.param_groups] == [False, False]
    assert "max_exp_avg_sq" not in resumed_opt.state[resumed.inp.weight]
    train(resumed, resumed_opt, rank, world, range(2, 5))
    for step in range(2, 5):
        step_reference(ref, ref_opt, *global_batch(step))
    assert_params_close(resumed, ref, "resumed without amsgrad")
    # NAdam's options are not the checkpoint's: refused as another class (nothing left out).
    nadam = torch.optim.NAdam(param_groups(resumed), lr=LR)
    nadam_opt = zero_shard.wrap(nadam, resumed, offload=policy(0.5))
    with pytest.raises(
        ValueError, match=r"no option \['momentum_decay'\].*another optimizer class"
    ):
        zero_shard.checkpoint.load(path, model=resumed, optimizer=nadam_opt)


def build_with(make_optimizer, after_wrap, *, seed: int):  # type: ignore[no-untyped-def]
    model = make_model(seed=seed)
    opt = zero_shard.wrap(make_optimizer(model), model, offload=policy(0.5),
                          bucket_mb=TINY_BUCKETS)  # fmt: skip
    if after_wrap is not None:
        after_wrap(opt)
    return model, opt


def bad_checkpoints_are_refused(rank: int, world: int) -> None:
    model, opt = build(fraction=0.0)
    other = torch.nn.Linear(3, 3)
    other_opt = zero_shard.wrap(torch.optim.AdamW(other.parameters()), other)
    with pytest.raises(ValueError, match="has 2 param groups, this optimizer has 1"):
        other_opt.load_state_dict(opt.state_dict())
    groups = [{"params": [other.weight]}, {"params": [other.bias]}]
    del other_opt
    other_opt = zero_shard.wrap(torch.optim.AdamW(groups), other)
    with pytest.raises(
        ValueError, match=r"does not hold this optimizer's params: missing \['weight'\]"
    ):
        other_opt.load_state_dict(opt.state_dict())
    state = opt.state_dict()
    state["state"]["inp.weight"]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'inp.weight' has shape \(3, 3\)"):
        opt.load_state_dict(state)
    # A param's state without a key its group's other params have: refused at the load (the
    # step would find it missing only after stepping the others, at fraction 0.5).
    model, opt = build(fraction=0.5)
    train(model, opt, rank, world, range(1))
    before = local_state_tensors(opt)
    state = opt.state_dict()
    del state["state"]["out.bias"]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"'out.bias' \(param group 1\) lacks \['exp_avg_sq'\]"):
        opt.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, local_state_tensors(opt), strict=True))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        zero_shard.checkpoint.load(folder() / "nothing here", model=model, optimizer=opt)


CASES_BY_WORLD = {
    3: {"save_at_three_ranks_then_go_on": save_at_three_ranks_then_go_on},
    2: {
        "resume_at_two_ranks_all_offloaded": resume_at_two_ranks_all_offloaded,
        "fsdp2_interchange_both_ways": fsdp2_interchange_both_ways,
        "model_only_load_trains_from_the_loaded_weights": model_only_load_trains_from_the_loaded_weights,
        "async_save_keeps_the_snapshot": async_save_keeps_the_snapshot,
        "bad_checkpoints_are_refused": bad_checkpoints_are_refused,
        "state_made_at_the_first_step_is_restored": state_made_at_the_first_step_is_restored,
        "a_fresh_wrapper_loads_a_torch_optimizers_checkpoint": (
            a_fresh_wrapper_loads_a_torch_optimizers_checkpoint
        ),
        "a_scheduler_saved_with_the_checkpoint_resumes_its_schedule": (
            a_scheduler_saved_with_the_checkpoint_resumes_its_schedule
        ),
        "a_param_frozen_when_saved_loads_no_state_as_in_torch": (
            a_param_frozen_when_saved_loads_no_state_as_in_torch
        ),
        "saved_without_amsgrad_loads_into_amsgrad_as_in_torch": (
            saved_without_amsgrad_loads_into_amsgrad_as_in_torch
        ),
    },
    1: {"resume_in_one_process": resume_in_one_process},
}
LATE = {"resume_at_three_ranks": resume_at_three_ranks}  # needs the files of the first phase


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("checkpoints"))
    results: dict[str, str | None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for world, cases in CASES_BY_WORLD.items():
            results.update(run_cases(cases, world))
        results.update(run_cases(LATE, 3))
    return results


ALL = [name for cases in (*CASES_BY_WORLD.values(), LATE) for name in cases]


@pytest.mark.parametrize("name", ALL)
def test_checkpoints(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)


# One process and its group, a model and its wrapper, the checkpoint's path: what a script run in a
# fresh interpreter starts with (its process group would outlive a test run here).
ONE_PROCESS_PREAMBLE = textwrap.dedent(
    """
    import os, signal, sys, warnings
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    sys.path.insert(0, {tests!r})
    from _models import adamw, make_model
    import zero_shard
    from zero_shard import checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    path = {path!r}
    """
)

KILLED_SAVE = ONE_PROCESS_PREAMBLE + textwrap.dedent(
    """
    zero_shard.checkpoint.save(path, model=model, optimizer=opt, extra={{"step": 1}})
    torch.save({{n: p.detach().clone() for n, p in model.named_parameters()}}, path + ".expected")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    write = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        result = write(self, plan, planner)
        result.wait()
        os.kill(os.getpid(), signal.SIGKILL)  # mid-save: data written, no metadata, no commit

    dcp.FileSystemWriter.write_data = write_then_die
    zero_shard.checkpoint.save(path, model=model, optimizer=opt, extra={{"step": 2}})
    """
)


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    path = str(tmp_path / "ckpt")
    tests = str(Path(__file__).parent)
    script = KILLED_SAVE.format(tests=tests, port=port, path=path)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9, done.stderr[-2000:]  # it was killed, mid-save
    assert (tmp_path / "ckpt.partial").exists()  # the unfinished save is there, unmarked
    script = textwrap.dedent(
        f"""
        import os, sys, torch, torch.distributed as dist
        sys.path.insert(0, {tests!r})
        from _models import adamw, make_model
        import zero_shard
        from zero_shard.checkpoint import IncompleteCheckpointError
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = make_model(seed=3)
        opt = zero_shard.wrap(adamw(model), model)
        extra = zero_shard.checkpoint.load({path!r}, model=model, optimizer=opt)
        assert extra == {{"step": 1}}, extra
        expected = torch.load({path!r} + ".expected")
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), expected[name]), name
        try:
            zero_shard.checkpoint.load({path!r} + ".partial", model=model, optimizer=opt)
        except IncompleteCheckpointError as err:
            print("refused:", err)
        else:
            raise AssertionError("the partial checkpoint was loaded")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "did not finish" in done.stdout
    assert IncompleteCheckpointError.__mro__[1] is RuntimeError


FAILED_RENAMES = ONE_PROCESS_PREAMBLE + textwrap.dedent(
    """
    replace = os.replace

    def commits_fail(src, dst):  # the commit's last rename fails (EIO), nothing else
        if sys._getframe(1).f_code.co_name == "_commit" and str(src).endswith(".partial"):
            raise OSError(5, "Input/output error")
        return replace(src, dst)

    def load_step():
        fresh = make_model(seed=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = checkpoint.load(path, model=fresh, optimizer=zero_shard.wrap(adamw(fresh), fresh))
        return extra["step"], [str(w.message) for w in caught]

    checkpoint.save(path, model=model, optimizer=opt, extra={{"step": 1}})
    for step in (2, 3):  # two failed commits in a row: the newest complete save still loads
        os.replace = commits_fail
        try:
            checkpoint.save(path, model=model, optimizer=opt, extra={{"step": step}})
        except OSError:
            pass
        else:
            raise AssertionError("the commit did not fail")
        finally:
            os.replace = replace
        loaded, warned = load_step()
        assert loaded == step, (step, loaded)
        assert any("marked complete but not moved into place" in w for w in warned), warned
    checkpoint.save(path, model=model, optimizer=opt, extra={{"step": 4}})
    loaded, warned = load_step()
    assert loaded == 4 and not warned, (loaded, warned)
    assert not os.path.exists(path + ".partial") and not os.path.exists(path + ".previous")
    print("ok")
    """
)


def test_failed_commits_in_a_row_keep_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    # The commit's last rename fails twice in a row (an I/O error): each time the newest complete
    # save stays loadable (load falls back to it, with a warning), none is removed before a newer
    # one is in place, and the next save puts everything back in order.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = FAILED_RENAMES.format(
        tests=str(Path(__file__).parent), port=port, path=str(tmp_path / "ckpt")
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


ASYNC_SAVE_THEN_DESTROY = textwrap.dedent(
    """
    import sys, threading, time, torch.distributed as dist, torch.distributed.checkpoint as dcp
    sys.path.insert(0, {tests!r})
    from _models import adamw, make_model
    import zero_shard

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    write = dcp.FileSystemWriter.write_data
    writing = threading.Event()

    def slow_write(self, plan, planner):
        writing.set()
        time.sleep(1.0)  # still writing when the group is destroyed
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow_write
    zero_shard.checkpoint.async_save({path!r}, model=model, optimizer=opt)
    assert writing.wait(60)  # the save's write has begun: DCP planned it with the group
    dist.destroy_process_group()
    """
)


def test_an_async_save_cut_off_by_destroy_process_group_is_reported_at_exit(
    tmp_path: Path,
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    path = str(tmp_path / "ckpt")
    script = ASYNC_SAVE_THEN_DESTROY.format(tests=str(Path(__file__).parent), port=port, path=path)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"the last async_save, to {path}, failed" in done.stderr, done.stderr[-2000:]
    assert "future.result()) before torch.distributed.destroy_process_group()" in done.stderr
    assert not (tmp_path / "ckpt").exists()
