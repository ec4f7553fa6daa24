"""The habits users bring from DDP and torch.optim, on 2 and 3 CPU processes (gloo): each gives
torch's result (single-process torch AdamW with the same habit, compared every step) or a clear
error on every rank. Grads cleared the model's way, steps without backward, torch's clipping,
replicas built with per-rank seeds, schedulers built before wrapping, wrapping twice, and
optimizer state dicts saved on one rank."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import io
import itertools
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _harness import check_outcome, run_cases
from _models import (
    GLOBAL_BATCH,
    LOSS_TOL,
    LR,
    PARAM_TOL,
    adamw,
    assert_params_close,
    global_batch,
    local_slice,
    make_model,
    mean_over_ranks,
    mse,
    step_reference,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import zero_shard
from zero_shard import OffloadPolicy, _released
from zero_shard._buckets import FlagsBefore

CASES = {}
DDP = nn.parallel.DistributedDataParallel
STEPS = 4
TINY_BUCKETS = 0.0008  # MiB: the test model's params fill several buckets
SIDE_ROWS = 2  # rows of the global batch that use the model's `side` layer (rank 0's alone)


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def offload(fraction: float) -> OffloadPolicy | None:
    return (
        None if fraction == 0 else OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)
    )


def wrapped_and_torch(
    *, fraction: float = 0.0, stage: int = 2, with_side: bool = False
) -> tuple[nn.Module, zero_shard.ZeroShardOptimizer, nn.Module, torch.optim.Optimizer]:
    """The test model wrapped by zero-shard (tiny buckets), and an equal one with torch AdamW."""
    model, ref = make_model(with_side=with_side), make_model(with_side=with_side)
    opt = zero_shard.wrap(adamw(model), model, stage=stage, offload=offload(fraction),
                          bucket_mb=TINY_BUCKETS)  # fmt: skip
    return model, opt, ref, adamw(ref)


def train_with_torch(
    model: nn.Module, opt: zero_shard.ZeroShardOptimizer, ref: nn.Module, rank: int, world: int,
    *, where: str,
) -> None:  # fmt: skip
    """Trains ``model`` with ``opt`` on this rank's slices and ``ref`` with torch AdamW on the
    whole batches, ``STEPS`` steps; compares the params at the end."""
    ref_opt = adamw(ref)
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, where)


# -- grads ---------------------------------------------------------------------------------------

Clear = Callable[[nn.Module, torch.optim.Optimizer], None]


def clear_out_layer_by_hand(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.out.weight.grad = None  # the rest keeps accumulating


# How users clear grads between steps (None: they never do, and grads accumulate over steps).
CLEARS: dict[str, Clear | None] = {
    "opt.zero_grad()": lambda model, opt: opt.zero_grad(),
    "opt.zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda model, opt: model.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False),
    "p.grad = None": lambda model, opt: [setattr(p, "grad", None) for p in model.parameters()],
    "out.weight.grad = None": clear_out_layer_by_hand,
    "never": None,
}


def backward_in_micro_batches(
    model: nn.Module, opt: zero_shard.ZeroShardOptimizer, x: torch.Tensor, y: torch.Tensor,
    rank: int, *, no_sync: bool,
) -> torch.Tensor:  # fmt: skip
    """Two equal micro-batches, the first inside ``no_sync()`` if asked: the sum of their halved
    losses is the local mean loss. The side layer sees rank 0's first rows only."""
    half = x.shape[0] // 2
    total = torch.zeros(())
    for index, rows in enumerate((slice(0, half), slice(half, None))):
        first_rows = SIDE_ROWS if rank == 0 and index == 0 else 0
        with opt.no_sync() if no_sync and index == 0 else contextlib.nullcontext():
            loss = mse(model(x[rows], first_rows=first_rows), y[rows]) / 2
            loss.backward()
        total = total + loss.detach()
    return total


def train_with_habit(rank: int, world: int, clear: Clear | None, *, stage: int, no_sync: bool,
                     fraction: float) -> None:  # fmt: skip
    model, opt, ref, ref_opt = wrapped_and_torch(with_side=True, stage=stage, fraction=fraction)
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = backward_in_micro_batches(
            model, opt, local_slice(x, rank, world), local_slice(y, rank, world), rank,
            no_sync=no_sync,
        )  # fmt: skip
        opt.step()
        ref_loss = mse(ref(x, first_rows=SIDE_ROWS), y)
        ref_loss.backward()
        ref_opt.step()
        if clear is not None:
            clear(model, opt)
            clear(ref, ref_opt)
        torch.testing.assert_close(mean_over_ranks(loss), ref_loss.detach(), **LOSS_TOL)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"step {step}")


@case
def grads_cleared_the_ways_torch_users_clear_them(rank: int, world: int) -> None:
    for name, clear in CLEARS.items():
        for stage, no_sync, fraction in ((2, False, 0.0), (2, True, 0.5), (1, True, 0.0)):
            try:
                train_with_habit(
                    rank, world, clear, stage=stage, no_sync=no_sync, fraction=fraction
                )
            except AssertionError as err:
                raise AssertionError(f"{name}, stage {stage}, no_sync {no_sync}: {err}") from err


@case
def steps_under_a_torch_dispatch_mode(rank: int, world: int) -> None:
    """A ``FlopCounterMode`` (a TorchDispatchMode) around whole steps, the way MFU is measured:
    torch's result, with the gathers in the background and in the step (in-place ops under a
    Python mode move no version counter; the copy into the params must not look like a user's
    write)."""
    for overlap in (True, False):
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(adamw(model), model, overlap_param_gather=overlap,
                              bucket_mb=TINY_BUCKETS)  # fmt: skip
        ref_opt = adamw(ref)
        for step in range(STEPS):
            x, y = global_batch(step)
            with FlopCounterMode(display=False):
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
                opt.zero_grad()
            mse(ref(x), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"overlap_param_gather={overlap}")


def _train_bf16(rank: int, world: int, fraction: float, between: Callable | None) -> list:
    model = make_model().to(torch.bfloat16)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS)
    for step in range(STEPS):
        x, y = global_batch(step)
        out = model(local_slice(x, rank, world).bfloat16()).float()
        mse(out, local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            opt.finish_param_sync()
            with torch.no_grad():
                between(model, x)
    opt.finish_param_sync()
    return [p.detach().clone() for p in model.parameters()]


def _swap_for_an_evaluation(model: nn.Module, x: torch.Tensor) -> None:
    saved = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        param.mul_(0.5)  # an EMA's weights, say
    model(x.bfloat16())
    for param, values in zip(model.parameters(), saved, strict=True):
        param.copy_(values)


@case
def weights_swapped_out_for_an_evaluation_and_back_keep_the_main_weights(
    rank: int, world: int
) -> None:
    """A bf16 model's weights swapped for others between steps (an EMA's, to evaluate) and
    copied back bit for bit: training goes on as without the swap, the fp32 main weights keep
    their precision (reloading them from the bf16 params would round them, as it did). A param
    with an element written to another value is reloaded."""
    for fraction in (0.0, 0.5):
        plain = _train_bf16(rank, world, fraction, None)
        swapped = _train_bf16(rank, world, fraction, _swap_for_an_evaluation)
        for got, want in zip(swapped, plain, strict=True):
            assert torch.equal(got, want), f"fraction {fraction}: {(got - want).abs().max()}"

        def write_one(model: nn.Module, x: torch.Tensor) -> None:
            next(model.parameters()).view(-1)[0] += 1.0

        written = _train_bf16(rank, world, fraction, write_one)
        assert (written[0].view(-1)[0] - plain[0].view(-1)[0]).abs() > 1.0, f"fraction {fraction}"
        # Element by element: the written element takes its value, the others of its param keep
        # their fp32 main weights, whichever piece (fraction, rank) holds them.
        model = make_model().to(torch.bfloat16)
        opt = zero_shard.wrap(adamw(model), model, offload=offload(fraction),
                              bucket_mb=TINY_BUCKETS)  # fmt: skip
        for step in range(2):
            x, y = global_batch(step)
            out = model(local_slice(x, rank, world).bfloat16()).float()
            mse(out, local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        opt.finish_param_sync()
        for name, param in model.named_parameters():
            before = zero_shard.full_state_dict(opt, rank=rank)["state"][name]["main_param"]
            with torch.no_grad():
                param.view(-1)[0] += 1.0
            opt.reload_model_params()
            after = zero_shard.full_state_dict(opt, rank=rank)["state"][name]["main_param"]
            where = f"fraction {fraction}, {name}"
            assert after.view(-1)[0] == param.detach().view(-1)[0].float(), where
            assert torch.equal(after.view(-1)[1:], before.view(-1)[1:]), where


@case
def steps_without_a_backward_in_between(rank: int, world: int) -> None:
    # A second step with the grads left as they are steps them again, as torch does; grads
    # cleared between backward and step leave no grad (None: not stepped) or zeros (stepped).
    between: dict[str, Clear] = {
        "again": lambda model, opt: None,
        "model.zero_grad()": lambda model, opt: model.zero_grad(),
        "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(False),
    }
    for name, clear in between.items():
        model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
        for step in range(STEPS):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            mse(ref(x), y).backward()
            if step % 2:
                clear(model, opt)
                clear(ref, ref_opt)
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.step()  # no backward since: the same grads (or none) again
                optimizer.zero_grad()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"{name}, step {step}")


@case
def a_clip_stays_on_grads_kept_across_the_step(rank: int, world: int) -> None:
    # torch clips the grads in place, so grads kept after the step are clipped ones: the next
    # backward adds to them and a second step steps them again. With a CPU share the clip is
    # deferred into the step ([Note: clip at the step]), which multiplies only what it reads.
    for staging in ("per_chunk", "bounded"):
        for name in ("never", "model.zero_grad()", "out.weight.grad = None"):
            clear = CLEARS[name]
            model, ref = make_model(), make_model()
            policy = OffloadPolicy(fraction=0.5, num_threads=1, chunk_numel=16,
                                   host_staging=staging)  # fmt: skip
            opt = zero_shard.wrap(adamw(model), model, offload=policy, bucket_mb=TINY_BUCKETS)
            ref_opt = adamw(ref)
            for step in range(STEPS):
                x, y = global_batch(step)
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                mse(ref(x), y).backward()
                if step % 2:
                    norm = opt.clip_grad_norm_(0.01)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
                where = f"{staging}, {name}, step {step}"
                torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7, msg=where)
                for optimizer in (opt, ref_opt):
                    optimizer.step()
                    if step == 2:
                        optimizer.step()  # the same grads, clipped once, again
                if clear is not None:
                    clear(model, opt)
                    clear(ref, ref_opt)
                opt.finish_param_sync()
                assert_params_close(model, ref, where)


def other_loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = global_batch(100 + step)
    return mse(model(x[:4]), y[:4])


@case
def clears_around_autograd_grad_and_no_sync_micro_batches(rank: int, world: int) -> None:
    # torch.autograd.grad between steps accumulates nothing (a clear after it is still seen);
    # a clear after a no_sync() micro-batch drops that micro-batch and what was carried over.
    for stage in (1, 2):
        model, opt, ref, ref_opt = wrapped_and_torch(stage=stage)
        for step in range(STEPS):
            x, y = global_batch(step)
            xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
            if step % 2:
                # Grads carried over from the last step (never cleared), a micro-batch thrown
                # away after backward inside no_sync(), then the batch.
                with opt.no_sync():
                    mse(model(xs), ys).backward()
                model.zero_grad()
                ref.zero_grad()
            else:
                for net in (model, ref):
                    torch.autograd.grad(other_loss(net, step), list(net.parameters()))
                    net.zero_grad()
            mse(model(xs), ys).backward()
            mse(ref(x), y).backward()
            opt.step()
            ref_opt.step()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"stage {stage}, step {step}")


class ReentrantNet(nn.Module):
    """Reentrant activation checkpointing where a param gets grads in several backwards of one:
    a block applied twice, each call checkpointed (ALBERT's shared layer), its weight also used
    outside them, and a layer that rank 0's first rows use inside a checkpointed call and every
    rank uses outside (so which of its grads comes after its bucket's reduction differs by rank).
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(15, 7)
        self.shared = nn.Linear(7, 7)
        self.out = nn.Linear(7, 2)
        self.side = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor, first_rows: int = 0) -> torch.Tensor:
        def block(h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.shared(h))

        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(block, h, use_reentrant=True)
        y = self.out(h)
        if first_rows:
            side = checkpoint(self.side, h[:first_rows], use_reentrant=True)
            y = torch.cat([y[:first_rows] + side, y[first_rows:]])
        return y

    def penalty(self) -> torch.Tensor:
        return 1e-2 * (self.shared.weight.square().sum() + self.side.weight.square().sum())


@case
def reentrant_checkpointing_with_grads_in_several_backwards_of_one(rank: int, world: int) -> None:
    # See [Note: grads after their reduction]: every grad of the backward is reduced, once. Last,
    # observing post-accumulate-grad hooks registered after wrap on rank 0 alone (grad logging):
    # its grads are taken as complete later, and the ranks must still agree on the late ones.
    for fraction, observed in ((0.0, False), (0.5, False), (0.0, True)):
        model, ref = ReentrantNet(), ReentrantNet()
        opt = zero_shard.wrap(adamw(model), model, offload=offload(fraction),
                              bucket_mb=TINY_BUCKETS)  # fmt: skip
        if observed and rank == 0:
            for param in model.parameters():
                param.register_post_accumulate_grad_hook(lambda param: None)
        ref_opt = adamw(ref)
        for step in range(STEPS):
            x, y = global_batch(step)
            rows = SIDE_ROWS if rank == 0 else 0
            local = mse(model(local_slice(x, rank, world), rows), local_slice(y, rank, world))
            (local + model.penalty()).backward()
            opt.step()
            opt.zero_grad()
            (mse(ref(x, SIDE_ROWS), y) + ref.penalty()).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"fraction {fraction}, step {step}")


def _edit_state_in_place(state: Any, p: torch.Tensor) -> None:
    state[p]["exp_avg"].zero_()
    state[p]["exp_avg_sq"].mul_(4.0)
    state[p]["step"].zero_()


def _edit_state_locally(state: Any, p: torch.Tensor) -> None:
    to_local = getattr(state[p]["exp_avg"], "to_local", None)  # torch's are plain tensors
    (to_local() if to_local else state[p]["exp_avg"]).mul_(100.0)


def _assign_state_keys(state: Any, p: torch.Tensor) -> None:
    state[p]["step"] = torch.tensor(1.0)
    exp_avg = torch.full_like(state[p]["exp_avg"], 0.5)
    state[p]["exp_avg"] = exp_avg
    exp_avg.mul_(0.5)  # torch holds the tensor assigned: a later edit of it counts
    state[p]["exp_avg_sq"].copy_(torch.full_like(state[p]["exp_avg_sq"], 0.25))


# Edits of optimizer.state that torch users make (resetting or rescaling moments, the step count,
# a param's whole state), on a param that the offloaded runs cut into pieces (chunks of 16).
STATE_EDITS: dict[str, Callable[[Any, torch.Tensor], None]] = {
    "in place": _edit_state_in_place,
    "in place through to_local()": _edit_state_locally,
    "keys assigned": _assign_state_keys,
    "state[p] = {}": lambda state, p: state.__setitem__(p, {}),
    "del state[p]": lambda state, p: state.__delitem__(p),
    "state.clear()": lambda state, p: state.clear(),
}


@case
def optimizer_state_edited_the_ways_torch_users_edit_it(rank: int, world: int) -> None:
    # See [Note: state edits] in optimizers/_state.py.
    for (edit_name, edit), fraction in itertools.product(STATE_EDITS.items(), (0.0, 0.5, 1.0)):
        model, opt, ref, ref_opt = wrapped_and_torch(fraction=fraction)
        for step in range(STEPS):
            if step == 2:
                for name in ("inp.weight", "out.bias"):
                    edit(opt.state, dict(model.named_parameters())[name])
                    edit(ref_opt.state, dict(ref.named_parameters())[name])
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
            opt.finish_param_sync()
            assert_params_close(model, ref, f"{edit_name}, fraction {fraction}, step {step}")
    model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
    opt.state = collections.defaultdict(dict)  # drops every state, as torch's does
    assert all(float(opt.state[p]["step"]) == 0 for p in model.parameters())
    with pytest.raises(TypeError, match="only be replaced by an empty dict"):
        opt.state = {model.inp.weight: {}}
    # Cleared after steps, the state reads as empty on every rank (whatever its shards hold), as
    # torch's does: torch's get_optimizer_state_dict then steps both at lr 0 alike, and they go on
    # alike (a rank that read otherwise would leave the others in that step's collectives).
    model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
    for round_ in range(2):
        for step in range(2 * round_, 2 * round_ + 2):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
        if round_ == 0:
            opt.state.clear()
            ref_opt.state.clear()
            assert not opt.state and not ref_opt.state
            get_optimizer_state_dict(model, opt)
            get_optimizer_state_dict(ref, ref_opt)
            assert opt.state and ref_opt.state
    opt.finish_param_sync()
    assert_params_close(model, ref, "state.clear(), then torch's get_optimizer_state_dict")


@case
def fp16_grads_whose_sum_overflows_but_mean_does_not_step_as_under_ddp(
    rank: int, world: int
) -> None:
    # Each rank's fp16 grad is 40000: their sum overflows fp16, their mean does not. DDP divides
    # each by the world size before its all-reduce and steps; so must zero-shard.
    x = torch.ones(1, 1, dtype=torch.float16)
    for stage in (1, 2):
        model = nn.Linear(1, 1, bias=False).half()
        nn.init.ones_(model.weight)
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        opt = zero_shard.wrap(torch.optim.SGD(model.parameters(), lr=1e-6), model, stage=stage)
        (model(x).sum() * 40000.0).backward()
        (ddp(x).sum() * 40000.0).backward()
        assert torch.equal(opt.main_grad(model.weight).full_tensor(), ddp.module.weight.grad)
        opt.step()
        opt.finish_param_sync()
        assert opt.num_skipped_steps == 0, f"stage {stage}: a finite mean was skipped"


@case
def a_low_precision_models_state_dict_saved_per_rank_with_torch_save_resumes(
    rank: int, world: int
) -> None:
    # Hugging Face's Trainer and accelerate torch.save the optimizer's state dict, and users
    # hand it to dcp.async_save; a bf16 model's holds main_param DTensors over views of the flat
    # main weights ([Note: DTensors over views] in zero_shard/_state_dict.py). Saved, loaded
    # back: the same trajectory.
    folder = os.path.dirname(shared_path(rank))
    for fraction in (0.0, 0.5):
        model = make_model().to(torch.bfloat16)
        opt = zero_shard.wrap(adamw(model), model, offload=offload(fraction),
                              bucket_mb=TINY_BUCKETS)  # fmt: skip

        def steps(first: int, model: nn.Module = model, opt: Any = opt) -> list[torch.Tensor]:
            for step in range(first, first + 2):
                x, y = (t.to(torch.bfloat16) for t in global_batch(step))
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                opt.step()
                opt.zero_grad()
            opt.finish_param_sync()
            return [p.detach().clone() for p in model.parameters()]

        steps(0)
        saved, weights = io.BytesIO(), copy.deepcopy(model.state_dict())
        torch.save(opt.state_dict(), saved)
        kept = copy.deepcopy(opt.state_dict())
        written = os.path.join(folder, f"dcp_{fraction}")
        dcp.async_save({"optim": opt.state_dict()}, checkpoint_id=written).result()
        expected = steps(2)
        for source in ("torch.save", "copy.deepcopy", "dcp.async_save"):
            model.load_state_dict(weights)
            if source == "torch.save":
                saved.seek(0)
                opt.load_state_dict(torch.load(saved, weights_only=False))
            elif source == "copy.deepcopy":
                opt.load_state_dict(kept)
            else:
                into = {"optim": opt.state_dict()}
                dcp.load(into, checkpoint_id=written)
                opt.load_state_dict(into["optim"])
            got = steps(2)
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b), f"{source} at fraction {fraction}"


@case
def a_state_dict_kept_without_a_copy_and_loaded_after_steps_changes_nothing(
    rank: int, world: int
) -> None:
    # torch's state dict holds the live state: sd = opt.state_dict(), steps, then
    # opt.load_state_dict(sd) changes nothing. Copies handed out for params in several pieces
    # are taken as the live state there too ([Note: state edits]).
    # Written into in place first (as dcp.load writes), it loads what was written.
    for fraction, overwrite in itertools.product((0.0, 0.5, 1.0), (False, True)):
        model, opt, ref, ref_opt = wrapped_and_torch(fraction=fraction)
        kept = ref_kept = snapshot = ref_snapshot = None
        for step in range(6):
            if step == 2:
                kept, ref_kept = opt.state_dict(), ref_opt.state_dict()
                snapshot = copy.deepcopy(opt.state_dict())
                ref_snapshot = copy.deepcopy(ref_opt.state_dict())
            if step == 4:
                if overwrite:
                    for held, values in ((kept, snapshot), (ref_kept, ref_snapshot)):
                        for key, state in held["state"].items():
                            for name, value in state.items():
                                value.copy_(values["state"][key][name])
                opt.load_state_dict(kept)
                ref_opt.load_state_dict(ref_kept)
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
            opt.finish_param_sync()
            assert_params_close(model, ref, f"fraction {fraction}, {overwrite=}, step {step}")


@case
def zeroed_grads_are_stepped_as_zeros_and_unused_params_have_none(rank: int, world: int) -> None:
    # zero_grad(set_to_none=False) leaves zeros, which torch steps (AdamW's moments and weight
    # decay move the params) even with no backward, or when the param is not used again.
    model, opt, ref, ref_opt = wrapped_and_torch(with_side=True, fraction=0.5)
    for step in range(STEPS):
        x, y = global_batch(step)
        side_rows = SIDE_ROWS if step == 0 else 0  # `side` is used at the first step only
        if step != 2:  # no backward at all at step 2
            local = model(local_slice(x, rank, world), first_rows=side_rows if rank == 0 else 0)
            mse(local, local_slice(y, rank, world)).backward()
            mse(ref(x, first_rows=side_rows), y).backward()
        opt.step()
        ref_opt.step()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"step {step}")
        # `never` had no grad on any rank: None, as in torch (not a placeholder).
        assert model.never.weight.grad is None and ref.never.weight.grad is None
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        if step == 0:
            check_flags_kept_where_a_grad_lacked(
                opt, lacked=("never.", *(("side.",) if rank else ()))
            )


def check_flags_kept_where_a_grad_lacked(
    opt: zero_shard.ZeroShardOptimizer, lacked: tuple[str, ...]
) -> None:
    """After the grads were dropped, a bucket keeps a copy of its presence flags only where a
    param lacked a grad on this rank (params whose names start with one of ``lacked``); a param
    no rank had a grad for is flagged absent there."""
    for bucket in opt.kind.buckets:
        fqns = [sharded.fqn for sharded in bucket.params]
        kept = bucket.flags_before
        if not any(fqn.startswith(lacked) for fqn in fqns):
            assert kept is FlagsBefore.ALL_PRESENT, (fqns, kept)
            continue
        assert isinstance(kept, torch.Tensor), (fqns, kept)
        for position, fqn in enumerate(fqns):
            assert bool(kept[position] > 0) != fqn.startswith("never."), (fqn, kept)


@case
def clears_between_backward_and_step_with_clip_or_main_grad_between(rank: int, world: int) -> None:
    # A clear after backward, then clip / main_grad (each reads the grads), then the step; and
    # zero_grad(set_to_none=False) on params no rank used (torch leaves those None).
    model, opt, ref, ref_opt = wrapped_and_torch(with_side=True, fraction=0.5)
    for step in range(STEPS):
        x, y = global_batch(step)
        for net, optimizer, xs, ys in (
            (model, opt, local_slice(x, rank, world), local_slice(y, rank, world)),
            (ref, ref_opt, x, y),
        ):
            mse(net(xs), ys).backward()  # `side` and `never` unused
            if step % 2:
                optimizer.zero_grad(set_to_none=False)
                mse(net(xs), ys).backward()
            net.out.weight.grad = None
            if optimizer is opt:
                if rank == 0:
                    opt.main_grad(model.inp.weight)
                opt.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"step {step}")


@case
def a_clip_norm_is_not_the_verdict_once_the_grads_change(rank: int, world: int) -> None:
    model, opt, ref, ref_opt = wrapped_and_torch()
    x, y = global_batch(0)
    xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
    inf_target = torch.full_like(ys, float("inf"))
    # A non-finite backward, clipped (a NaN norm), cleared, then a finite one: stepped.
    mse(model(xs), inf_target).backward()
    assert not torch.isfinite(opt.clip_grad_norm_(1.0))
    model.zero_grad()
    mse(model(xs), ys).backward()
    opt.step()
    opt.zero_grad()
    mse(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "the finite backward after the cleared one")
    # A finite backward, clipped, cleared, then a non-finite one: skipped, nothing changed.
    before = [p.detach().clone() for p in model.parameters()]
    mse(model(xs), ys).backward()
    assert torch.isfinite(opt.clip_grad_norm_(1.0))
    model.zero_grad()
    mse(model(xs), inf_target).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
        assert opt.num_skipped_steps == 1
    opt.finish_param_sync()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@case
def a_grad_set_by_hand_after_backward_is_warned_and_the_reduced_one_steps(
    rank: int, world: int
) -> None:
    model, opt, ref, ref_opt = wrapped_and_torch()
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    model.out.weight.grad = torch.ones_like(model.out.weight)
    with pytest.warns(RuntimeWarning, match="this step uses the reduced grads"):
        opt.step()
    mse(ref(x), y).backward()
    ref_opt.step()
    opt.finish_param_sync()
    assert_params_close(model, ref, "the reduced grads stepped")


@case
def grads_edited_in_place_through_main_grad_reach_the_step(rank: int, world: int) -> None:
    # Gradient noise added through the DTensor main_grad hands out (as the placeholder's error
    # says to): its in-place op moves the DTensor's version counter, not the grad's, and the
    # CPU share's early host copies (per-chunk staging, several buckets) must not be taken.
    for fraction, staging in ((0.5, "per_chunk"), (1.0, "per_chunk"), (0.5, "bounded")):
        model, ref = make_model(), make_model()
        policy = OffloadPolicy(
            fraction=fraction, num_threads=1, chunk_numel=16, host_staging=staging
        )
        opt = zero_shard.wrap(adamw(model), model, offload=policy, bucket_mb=TINY_BUCKETS)
        ref_opt = adamw(ref)
        for step in range(3):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            params = list(model.parameters())
            for param in params[::2]:
                opt.main_grad(param).add_(0.05)  # a temporary, edited at once
            collected = [opt.main_grad(param) for param in params[1::2]]
            opt.clip_grad_norm_(1e6)  # reads the grads between the hand-out and the edit
            for grad in collected:
                grad.add_(0.05)
            opt.step()
            opt.zero_grad()
            mse(ref(x), y).backward()
            for param in ref.parameters():
                param.grad.add_(0.05)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
            ref_opt.step()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"fraction {fraction}, {staging} staging")


@case
def post_accumulate_grad_hooks_registered_after_wrap_see_the_local_grad(
    rank: int, world: int
) -> None:
    # Per-element grad clipping in a post-accumulate-grad hook: registered before wrap or after
    # it, it clamps each rank's own grad before the reduction, as under DDP (zero-shard's hook,
    # registered at wrap, ran first and reduced a bucket the moment its last grad came).
    def clamp(param: torch.Tensor) -> None:
        param.grad.clamp_(-0.01, 0.01)

    def hooked(model: nn.Module) -> nn.Module:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(clamp)
        return model

    for fraction, registered_after in ((0.0, True), (0.5, True), (0.5, False)):
        model, ref = make_model(), hooked(make_model())
        ddp = nn.parallel.DistributedDataParallel(ref)
        ref_opt = adamw(ref)
        if not registered_after:
            hooked(model)
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        if registered_after:
            hooked(model)
        for step in range(3):
            x, y = global_batch(step)
            for net, optimizer in ((model, opt), (ddp, ref_opt)):
                mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                optimizer.step()
                optimizer.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"fraction {fraction}, after wrap: {registered_after}")
    # A hook before or after wrap that takes the grad (p.grad = None, as optimizer-in-backward
    # does): the param is not stepped, as torch's optimizer skips a param without a grad.
    for registered_after in (True, False):
        model, ref = make_model(), make_model()
        for net in (model, ref) if not registered_after else (ref,):
            net.mid.weight.register_post_accumulate_grad_hook(
                lambda param: setattr(param, "grad", None)
            )
        opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
        ref_opt = adamw(ref)
        if registered_after:
            model.mid.weight.register_post_accumulate_grad_hook(
                lambda param: setattr(param, "grad", None)
            )
        for step in range(3):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
        opt.finish_param_sync()
        assert_params_close(
            model, ref, f"a hook that takes the grad, after wrap: {registered_after}"
        )
    # Accumulated over two backwards, torch's hook sees their sum; here the second backward's
    # grad reaches it alone, added to the reduced one after: a warning says so, and under
    # no_sync() (the backwards but the last) the hook sees the sum, as in torch.
    model, ref = hooked(make_model()), hooked(make_model())
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ref_opt = adamw(ref)
    x, y = global_batch(0)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    mse(model(x[:1]), y[:1]).backward()
    with mock.patch.object(_released, "_warned_hooks_on_a_sum", False):
        with pytest.warns(RuntimeWarning, match="has a post-accumulate-grad hook .* opt.no_sync"):
            mse(model(x[1:]), y[1:]).backward()
    opt.zero_grad()
    for step in range(3):
        x, y = global_batch(step)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        for net, optimizer, no_sync in ((model, opt, opt.no_sync), (ddp, ref_opt, ddp.no_sync)):
            with no_sync():
                mse(net(x[:1]), y[:1]).backward()
            mse(net(x[1:]), y[1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "hooks over backwards accumulated in no_sync()")


@case
def main_grad_on_one_rank_alone_communicates_nothing(rank: int, world: int) -> None:
    model, opt, ref, ref_opt = wrapped_and_torch()
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        mse(ref(x), y).backward()
        if rank == 0:  # logging on rank 0, before and after the step
            assert opt.main_grad(model.inp.weight) is not None
        opt.step()
        if rank == 0:
            local = opt.main_grad(model.inp.weight).to_local()
            rows = ref.inp.weight.grad[: local.shape[0]]
            torch.testing.assert_close(local, rows, **LOSS_TOL)
        ref_opt.step()
        for optimizer in (opt, ref_opt):
            optimizer.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "after logging on rank 0")


@case
def placeholders_convert_with_the_model_and_go_with_the_optimizer(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    model.double()  # nn.Module._apply converts the grads too
    assert model.inp.weight.grad.dtype == torch.float64
    model.zero_grad()
    with pytest.raises(RuntimeError, match="is torch.float64 on cpu now.*wrap a new optimizer"):
        mse(model(local_slice(x, rank, world).double()), local_slice(y, rank, world)).backward()
    del opt
    gc.collect()
    # No placeholder is left (the grads the failed backward accumulated stay, as in torch).
    assert all(p.grad is None or type(p.grad) is torch.Tensor for p in model.parameters())
    torch.optim.AdamW(model.parameters()).step()


@case
def a_stock_transformer_trained_with_ddp_habits(rank: int, world: int) -> None:
    # nn.TransformerEncoder (its attention reads out_proj.weight itself), with the habits of a
    # DDP + torch.optim loop: a scheduler built before wrapping, torch's clip tried first (it
    # raises), model.zero_grad() to clear. Dropout 0: the reference runs other batch rows. Both
    # stagings: per-chunk copies grads to the host in backward ([Note: early grad copies]).
    for staging in ("bounded", "per_chunk"):
        _train_a_stock_transformer(rank, world, staging)


def _train_a_stock_transformer(rank: int, world: int, staging: str) -> None:
    def encoder() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    model, ref = encoder(), encoder()
    torch_opt, ref_opt = (
        torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3) for m in (model, ref)
    )
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    policy = dataclasses.replace(offload(0.5), host_staging=staging)
    opt = zero_shard.wrap(torch_opt, model, offload=policy)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 5, 8, generator=gen), torch.randn(12, 5, 8, generator=gen)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        # torch's clip on the placeholders; on odd steps the optimizer's own
        if step % 2:
            norm = opt.clip_grad_norm_(0.5)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        model.zero_grad()
        sched.step()
        mse(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref.zero_grad()
        ref_sched.step()
        torch.testing.assert_close(norm, ref_norm, **LOSS_TOL)
    opt.finish_param_sync()
    assert_params_close(model, ref, f"nn.TransformerEncoder with DDP habits, {staging} staging")


# -- clipping ------------------------------------------------------------------------------------


@case
def reading_released_grads_raises_and_names_what_works(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    grad = model.inp.weight.grad
    assert grad is not None and grad.shape == model.inp.weight.shape  # a placeholder
    assert "main_grad" in repr(grad)
    # Norms, scaling and clamping work (tests/zero_shard/test_torch_clip.py); reading the
    # values or using them in other math does not.
    reads: list[Callable[[], object]] = [
        lambda: model.inp.weight.grad.sum(),
        lambda: model.inp.weight.grad.add_(1.0),
        lambda: model.inp.weight.grad * 2,
        lambda: torch.stack([model.inp.weight.grad]),
    ]
    for read in reads:
        with pytest.raises(RuntimeError, match=r"clip_grad_norm_.*opt\.main_grad"):
            read()
    # The raising calls changed nothing: the step equals torch's with the clip that works.
    ref = make_model()
    ref_opt = adamw(ref)
    mse(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    torch.testing.assert_close(opt.clip_grad_norm_(0.05), ref_norm, **LOSS_TOL)
    opt.step()
    ref_opt.step()
    opt.finish_param_sync()
    assert_params_close(model, ref, "after the clipped step")


def fsdp2(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.inp, model.mid, model.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@case
def an_fsdp2_model_left_unsharded_by_a_forward_gives_and_takes_its_state(
    rank: int, world: int
) -> None:
    # FSDP2 swaps the unsharded params in under the params' names between a forward and the
    # reshard: the root's after every forward (out's params here), every module's with
    # reshard_after_forward=False. A state dict or a load then (after an eval forward) names
    # the optimizer's params as before, and loads.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x, y = global_batch(0)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    for reshard in (True, False):
        model = make_model()
        for layer in (model.inp, model.mid):  # out's params stay the root's
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        mse(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        before = zero_shard.full_state_dict(opt, rank=rank)
        with torch.no_grad():
            model(x)
        state = opt.state_dict()
        after = zero_shard.full_state_dict(opt, rank=rank)
        opt.load_state_dict(state)
        for fqn, param_state in before["state"].items():
            for key, value in param_state.items():
                assert torch.equal(after["state"][fqn][key], value), (reshard, fqn, key)


@case
def torch_clipping_and_model_zero_grad_on_ddp_and_fsdp2_models(rank: int, world: int) -> None:
    # DDP and FSDP2 keep the reduced grads on the params (FSDP2's as DTensors): torch's clip sees
    # the global grads there, and model.zero_grad() clears them. References: DDP's grads are
    # the whole batch's, so one process with torch AdamW; FSDP2 with torch AdamW.
    for kind in ("ddp", "fsdp2"):
        model, ref = make_model(), make_model()
        if kind == "ddp":
            net = nn.parallel.DistributedDataParallel(model)
        else:
            net, ref = fsdp2(model, world), fsdp2(ref, world)
        opt = zero_shard.wrap(adamw(model), net, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        ref_opt = adamw(ref)
        for step in range(STEPS):
            x, y = global_batch(step)
            mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
            net.zero_grad()
            ref_x, ref_y = (
                (x, y)
                if kind == "ddp"
                else (local_slice(x, rank, world), local_slice(y, rank, world))
            )
            mse(ref(ref_x), ref_y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref.zero_grad()
            torch.testing.assert_close(norm, ref_norm, **LOSS_TOL)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"{kind} with torch's clipping")


@case
def ddp_grads_zeroed_in_place_right_after_step(rank: int, world: int) -> None:
    # DDP's grads are the model's: zeroing them in place right after step() (torch's
    # zero_grad(set_to_none=False), the model's or the optimizer's) must not reach the CPU step
    # still copying them. Dozens of chunks per rank, so that with bounded staging most would be
    # copied late. Reference: one process, torch AdamW, whole batch.
    width, depth = 256, 12
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
    for layer in model:  # norm-preserving: the grads stay far above their rounding
        nn.init.orthogonal_(layer.weight)
    ref = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
    ref.load_state_dict(model.state_dict())
    net = nn.parallel.DistributedDataParallel(model)
    policy = OffloadPolicy(
        fraction=1.0, num_threads=1, chunk_numel=width * width // 8, cpu_kernel="torch"
    )
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3), net, offload=policy
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(GLOBAL_BATCH, width, generator=gen)
        net(local_slice(x, rank, world)).square().mean().backward()
        opt.step()
        (opt, net)[step % 2].zero_grad(set_to_none=False)
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"DDP, grads zeroed in place after step {step}")


# -- replicas ------------------------------------------------------------------------------------


class NetWithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(seed=torch.initial_seed())  # the caller's seed
        self.register_buffer("shift", torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.shift


def net_with_buffer(seed: int) -> NetWithBuffer:
    torch.manual_seed(seed)
    return NetWithBuffer()


@case
def replicas_built_with_per_rank_seeds_start_from_rank_0s(rank: int, world: int) -> None:
    model, ref = net_with_buffer(seed=100 + rank), net_with_buffer(seed=100)
    assert rank == 0 or not torch.equal(model.shift, ref.shift)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    assert torch.equal(model.shift, ref.shift)
    assert_params_close(model, ref, "right after wrap", exact=True)
    train_with_torch(model, opt, ref, rank, world, where="after training")


# -- one optimizer, one set of param groups ------------------------------------------------------


def lr_schedule_run(rank: int, world: int, *, before_wrap: bool) -> None:
    model, ref = make_model(), make_model()
    torch_opt = adamw(model)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    opt = zero_shard.wrap(torch_opt, model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    if not before_wrap:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert all(
        ours is theirs
        for ours, theirs in zip(opt.param_groups, torch_opt.param_groups, strict=True)
    )
    ref_opt = adamw(ref)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            sched.step()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    opt.finish_param_sync()
    assert_params_close(model, ref, f"scheduler built {'before' if before_wrap else 'after'} wrap")


@case
def lr_schedulers_built_before_or_after_wrap_drive_the_wrapper(rank: int, world: int) -> None:
    lr_schedule_run(rank, world, before_wrap=True)
    lr_schedule_run(rank, world, before_wrap=False)


@case
def a_stepped_torch_optimizer_is_taken_over_and_frozen_params_have_no_state(
    rank: int, world: int
) -> None:
    model, ref = make_model(), make_model()
    for net in (model, ref):
        net.mid.bias.requires_grad_(False)  # frozen, but in the optimizer's groups
    torch_opt, ref_opt = adamw(model), adamw(ref)
    for step in range(STEPS):
        x, y = global_batch(step)
        if step < 2:  # the torch optimizer trains first, on the whole batch on every rank
            mse(model(x), y).backward()
            torch_opt.step()
            torch_opt.zero_grad()
        if step == 2:
            opt = zero_shard.wrap(torch_opt, model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
            assert not torch_opt.state  # taken over, not held twice
        if step >= 2:
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "after the take-over")
    assert opt.state[model.mid.bias] == {} and model.mid.bias not in opt.state
    assert int(opt.state[model.inp.weight]["step"]) == STEPS
    assert len(opt.state) == len(ref_opt.state) == 5


@case
def a_new_wrap_takes_the_params_over_from_a_live_one(rank: int, world: int) -> None:
    # Torch users re-create the optimizer after unfreezing layers, the old one still referenced
    # (by `opt` until reassigned, or a scheduler): the new wrapper takes over, as in torch.
    for fraction in (0.0, 0.5):
        model, ref = make_model(), make_model()
        for module in (model, ref):
            module.inp.requires_grad_(False)
        first = zero_shard.wrap(
            torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
            model, offload=offload(fraction), bucket_mb=TINY_BUCKETS,
        )  # fmt: skip
        scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)  # keeps `first` alive
        ref_first = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
        x, y = global_batch(0)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        mse(ref(x), y).backward()
        first.step()  # its update is still being gathered when the new wrap comes
        ref_first.step()
        for module in (model, ref):
            module.inp.requires_grad_(True)
            module.zero_grad()
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        with pytest.raises(RuntimeError, match="was retired: a later zero_shard.wrap"):
            first.step()
        assert scheduler.optimizer is first
        train_with_torch(model, opt, ref, rank, world, where=f"taken over, fraction {fraction}")
    # The same torch optimizer wrapped again: the same.
    model, ref = make_model(), make_model()
    torch_opt = adamw(model)
    first = zero_shard.wrap(torch_opt, model, bucket_mb=TINY_BUCKETS)
    opt = zero_shard.wrap(torch_opt, model, bucket_mb=TINY_BUCKETS)
    train_with_torch(model, opt, ref, rank, world, where="the same torch optimizer again")


@case
def two_wrappers_over_disjoint_params_of_one_model(rank: int, world: int) -> None:
    # Two optimizers over one model (say, other settings for the last layer) both train it.
    model, ref = make_model(), make_model()
    head = [model.out.weight, model.out.bias]
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    # The reference's eps for both (default eps let rounding noise in near-zero grads decide
    # whole steps: it passed or not with the thread count an earlier case left).
    torch_opts = [torch.optim.AdamW(params, lr=1e-2, eps=1e-3) for params in (body, head)]
    opts = [zero_shard.wrap(o, model, bucket_mb=TINY_BUCKETS) for o in torch_opts]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for opt in opts:
        opt.finish_param_sync()
    assert_params_close(model, ref, "two wrappers")


class Chain(nn.Module):
    """Three layers in a row and a `side` layer that only some calls use (a branch only some
    ranks' data reach)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(15, 15), nn.Linear(15, 15)
        self.c, self.side = nn.Linear(15, 2), nn.Linear(15, 2)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return h + self.side(x) if use_side else h


@case
def two_wrappers_in_one_backward_with_a_layer_some_ranks_use(rank: int, world: int) -> None:
    # Two models of one shape, a wrapper each, trained by one backward of the summed losses;
    # model A's `side` layer gets grads on rank 0 alone, so A's bucket is reduced during
    # backward there and at backward's end on the others, after B's. The two wrappers'
    # reductions must not pair with each other's across ranks ([Note: reductions of several
    # wrappers] in zero_shard/_reduce.py): equal in size, they would be summed silently.
    for stage, fraction in ((2, 0.0), (1, 0.5)):
        nets, refs = [Chain(0), Chain(1)], [Chain(0), Chain(1)]
        opts = [zero_shard.wrap(adamw(net), net, stage=stage, offload=offload(fraction))
                for net in nets]  # fmt: skip
        ref_opts = [adamw(ref) for ref in refs]
        for step in range(STEPS):
            x, y = global_batch(step)
            xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
            (mse(nets[0](xs, rank == 0), ys) + mse(nets[1](xs, False), ys)).backward()
            for each in range(world):  # the reference: each rank's rows, as the ranks run them
                xr, yr = local_slice(x, each, world), local_slice(y, each, world)
                ((mse(refs[0](xr, each == 0), yr) + mse(refs[1](xr, False), yr)) / world).backward()
            for each in (*opts, *ref_opts):
                each.step()
                each.zero_grad()
        for opt in opts:
            opt.finish_param_sync()
        for net, ref in zip(nets, refs, strict=True):
            assert_params_close(net, ref, f"stage {stage}, fraction {fraction}")


# -- weights loaded on one rank, models copied ---------------------------------------------------


def load_on_rank_0_and_broadcast(model: nn.Module, rank: int, weights: dict) -> None:
    """A DDP habit: rank 0 alone loads a checkpoint, then sends each param to the others (a
    collective into a param bumps no version counter on the ranks it writes)."""
    if rank == 0:
        model.load_state_dict(weights)
    for param in model.parameters():
        dist.broadcast(param.detach(), 0)


@case
def weights_loaded_on_rank_0_and_broadcast_are_trained_on_every_rank(rank: int, world: int) -> None:
    weights = make_model(seed=5).state_dict()
    for fraction, stage, mid_run in ((0.0, 2, False), (1.0, 2, True), (0.5, 1, True)):
        model, opt, ref, ref_opt = wrapped_and_torch(fraction=fraction, stage=stage)
        for step in range(STEPS):
            if step == (2 if mid_run else 0):
                opt.finish_param_sync()  # writes to params after a step wait for it first
                load_on_rank_0_and_broadcast(model, rank, weights)
                ref.load_state_dict(weights)
                if stage == 1:  # a save before the next step: rank 0 reloads there, alone
                    opt.state_dict()
            x, y = global_batch(step)
            loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
            ref_loss = mse(ref(x), y)
            where = f"fraction {fraction}, stage {stage}, step {step}"
            torch.testing.assert_close(
                mean_over_ranks(loss), ref_loss.detach(), **LOSS_TOL, msg=where
            )
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"fraction {fraction}, the end")
    # stale_params="error": every rank raises at the step, naming the params, none hangs.
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS, stale_params="error")
    load_on_rank_0_and_broadcast(model, rank, weights)
    mse(model(global_batch(0)[0]), global_batch(0)[1]).backward()
    with pytest.raises(RuntimeError, match=r"model params \['inp.weight', .*were written since"):
        opt.step()


@case
def a_load_after_a_save_that_saw_a_write_keeps_the_fp32_main_weights(rank: int, world: int) -> None:
    # bf16 params, written after wrap; a save (state_dict) reloads the main weights from them on
    # this rank and notes it for the next step; a load of fp32 main weights then supersedes it:
    # the next step must not round them to the params' bf16 again.
    def run(write_and_save: bool) -> dict[str, torch.Tensor]:
        model = make_model().to(torch.bfloat16)
        opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
        x, y = global_batch(0)
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        saved = zero_shard.full_state_dict(opt)  # every rank's copy: a collective
        if write_and_save:
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(0.5)
            opt.state_dict()
        zero_shard.load_full_state_dict(opt, saved)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        state = opt.state_dict()["state"]
        return {fqn: entry["main_param"].full_tensor() for fqn, entry in state.items()}

    plain, written = run(False), run(True)
    for fqn, value in plain.items():
        assert torch.equal(written[fqn], value), fqn


def hooks_of(model: nn.Module) -> list[int]:
    names = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")  # fmt: skip
    return [len(getattr(module, name)) for module in model.modules() for name in names]


def users_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 1.0  # a hook of the user's own: copies keep it


@case
def pickles_and_deep_copies_of_a_wrapped_model_are_plain_models(rank: int, world: int) -> None:
    # An EMA copy, AveragedModel, or torch.save(model) right after a step (its gathers in
    # flight): the copy holds the step's weights and none of zero-shard's hooks.
    model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
    model.inp.register_forward_hook(users_hook)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    mse(ref(x), y).backward()
    opt.step()
    ref_opt.step()
    ema = torch.optim.swa_utils.AveragedModel(model)
    plain = copy.deepcopy(model)
    for copied in (ema.module, plain):
        assert sum(hooks_of(copied)) == 1, hooks_of(copied)  # the user's forward hook alone
        assert_params_close(copied, ref, "a copy right after the step")
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(model).half(), buffer)
    assert b"zero_shard" not in buffer.getvalue()  # it loads where zero-shard is not installed
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert sum(hooks_of(loaded)) == 1, hooks_of(loaded)
    for (name, value), expected in zip(loaded.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(value, expected.half(), rtol=0, atol=0, msg=name)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert sum(hooks_of(torch.load(buffer, weights_only=False))) == 1
    assert sum(hooks_of(model)) > 1  # the wrapped model keeps its hooks and trains on
    for step in range(1, STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        mse(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    opt.finish_param_sync()
    assert_params_close(model, ref, "trained on after the copies")


# -- optimizer state dicts -----------------------------------------------------------------------


def shared_path(rank: int) -> str:
    """A file name every rank agrees on (made by rank 0)."""
    box = [os.path.join(tempfile.mkdtemp(), "optim.pt") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@case
def a_state_dict_saved_on_rank_0_is_refused_on_every_rank(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    for step in range(2):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    path = shared_path(rank)
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    before = {k: v.full_tensor() for k, v in opt.state_dict()["state"]["inp.weight"].items()
              if hasattr(v, "full_tensor")}  # fmt: skip
    loaded = torch.load(path, weights_only=False)
    # Rank 0's own rows would load on rank 0: the others' refusal refuses there too.
    with pytest.raises(ValueError, match=r"rows of rank 0.*zero_shard\.full_state_dict"):
        opt.load_state_dict(loaded)
    # A torch optimizer's state dict, keyed by index, says how to load one.
    ref = make_model()
    ref_opt = adamw(ref)
    mse(ref(global_batch(0)[0]), global_batch(0)[1]).backward()
    ref_opt.step()
    with pytest.raises(ValueError, match="keys its params by index.*get_optimizer_state_dict"):
        opt.load_state_dict(ref_opt.state_dict())
    after = opt.state_dict()["state"]["inp.weight"]
    for key, value in before.items():
        assert torch.equal(after[key].full_tensor(), value), key  # the refusals changed nothing
    # The way the message gives loads it: the torch optimizer's state, keyed by FQN.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_fqn = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))
    opt.load_state_dict(by_fqn)
    loaded_state = opt.state_dict()["state"]["inp.weight"]
    ref_state = ref_opt.state[ref.inp.weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded_state[key].full_tensor(), ref_state[key]), key


def record_hooks(opt: torch.optim.Optimizer, ran: list[str]) -> None:
    """torch's four state-dict hooks, each noting that it ran; the post-hook and the load
    pre-hook return new state dicts (a key added; every lr set to 0.125), which take the place of
    the ones they were given, as in torch."""

    def post(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        ran.append("state_dict post")
        return {**state_dict, "extra": 1}

    def load_pre(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        ran.append("load pre")
        groups = [{**group, "lr": 0.125} for group in state_dict["param_groups"]]
        return {**state_dict, "param_groups": groups}

    opt.register_state_dict_pre_hook(lambda opt: ran.append("state_dict pre"))
    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda opt: ran.append("load post"))


SAVED = ["state_dict pre", "state_dict post"]
LOADED = ["load pre", "load post"]
FULL = StateDictOptions(full_state_dict=True)


@case
def state_dict_hooks_run_as_torchs_and_in_the_checkpoint_helpers(rank: int, world: int) -> None:
    folder = os.path.dirname(shared_path(rank))
    round_trips = {
        "state_dict and load_state_dict": lambda m, o: o.load_state_dict(o.state_dict()),
        "get/set_optimizer_state_dict": lambda m, o: set_optimizer_state_dict(
            m, o, get_optimizer_state_dict(m, o)
        ),
        "the same, full_state_dict=True": lambda m, o: set_optimizer_state_dict(
            m, o, get_optimizer_state_dict(m, o, options=FULL), options=FULL
        ),
    }
    for fraction in (0.0, 0.5, 1.0):
        model, opt, ref, ref_opt = wrapped_and_torch(fraction=fraction)
        ran: dict[str, list[str]] = {"zero-shard": [], "torch": []}
        x, y = global_batch(0)  # torch's state starts at the first step, zero-shard's at wrap
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        step_reference(ref, ref_opt, x, y)
        record_hooks(opt, ran["zero-shard"])
        record_hooks(ref_opt, ran["torch"])
        assert opt.state_dict()["extra"] == 1
        for name, round_trip in round_trips.items():
            for who, (m, o) in {"zero-shard": (model, opt), "torch": (ref, ref_opt)}.items():
                ran[who].clear()
                round_trip(m, o)
            assert ran["zero-shard"] == ran["torch"], (fraction, name, ran)
        assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]  # the hook's state dict
        opt.zero_grad()
        x, y = global_batch(1)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        step_reference(ref, ref_opt, x, y)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"fraction {fraction}, stepped at the hook's lr")
        # The helpers call state_dict() and load_state_dict(), and their hooks run there.
        hooks = ran["zero-shard"]
        hooks.clear()
        zero_shard.load_full_state_dict(opt, zero_shard.full_state_dict(opt) or None)
        assert hooks == SAVED + LOADED, hooks
        hooks.clear()
        path = os.path.join(folder, f"ckpt{fraction}")
        zero_shard.checkpoint.save(path, model=model, optimizer=opt)
        assert hooks == SAVED, hooks
        hooks.clear()
        zero_shard.checkpoint.load(path, model=model, optimizer=opt)
        assert hooks == SAVED + LOADED, hooks  # the first for the layout the load reads into


def assert_same_state(state: dict, expected: dict, where: str, **tol: float) -> None:
    """Keys, groups and tensors (a DTensor's layout and local part) equal (``tol``: close)."""

    # torch's full-state load hands tuples (betas) over as lists, to torch's optimizers too.
    def groups(state: dict) -> list:
        return [{k: tuple(v) if isinstance(v, list) and k != "params" else v
                 for k, v in group.items()} for group in state["param_groups"]]  # fmt: skip

    assert groups(state) == groups(expected), where
    assert list(state["state"]) == list(expected["state"]), where
    for fqn, param_state in expected["state"].items():
        assert list(state["state"][fqn]) == list(param_state), (where, fqn)
        for key, value in param_state.items():
            got = state["state"][fqn][key]
            assert type(got) is type(value), (where, fqn, key, type(got), type(value))
            if isinstance(value, DTensor):
                assert got.placements == value.placements and got.shape == value.shape
                got, value = got.to_local(), value.to_local()
            close = tol or {"rtol": 0.0, "atol": 0.0}
            torch.testing.assert_close(got, value, **close, msg=f"{where}: {fqn} {key}")


SAVE_AT, GO_ON = 2, 2


def go_on(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int,
          trajectory: list[list[torch.Tensor]], where: str) -> None:  # fmt: skip
    """Trains from ``SAVE_AT`` on, comparing the params after every step with ``trajectory``
    (the uninterrupted single-process torch run's)."""
    for index, step in enumerate(range(SAVE_AT, SAVE_AT + GO_ON)):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if isinstance(opt, zero_shard.ZeroShardOptimizer):
            opt.finish_param_sync()
        for (name, param), expected in zip(
            model.named_parameters(), trajectory[index], strict=True
        ):
            at = f"{where}, step {step}: {name}"
            close = torch.testing.assert_close
            close(param.detach(), expected, **PARAM_TOL, msg=lambda m, at=at: f"{at}: {m}")


class ForwardingOptimizer(torch.optim.Optimizer):
    """An optimizer wrapper whose state_dict() calls the wrapped one's, as accelerate's
    AcceleratedOptimizer does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no Optimizer.__init__
        self.optimizer = optimizer

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def train_either(
    net: nn.Module, opt: Any, steps: range, rank: int, world: int, sched: Any = None
) -> None:
    """``steps`` steps: a ZeroShardOptimizer on this rank's slices of the batches, a torch
    optimizer on the whole batches (the reference); ``sched`` stepped after each."""
    for step in steps:
        x, y = global_batch(step)
        if isinstance(opt, zero_shard.ZeroShardOptimizer):
            mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        else:
            step_reference(net, opt, x, y)
        if sched is not None:
            sched.step()


class Blocks(nn.Module):
    """Blocks applied in the order the list holds them: reordering it renames every param it
    keeps (``blocks.0.weight`` is another block's after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 7)
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(3))
        self.out = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


@case
def state_moved_after_params_were_renamed_goes_to_the_same_params(rank: int, world: int) -> None:
    # Blocks reordered after wrap (the same params under other names), then the state moved
    # three ways: opt.state_dict() into a new wrapper of the reordered model, a
    # zero_shard.checkpoint resume, and a wrap again of the torch optimizer (a layer added with
    # add_param_group). torch keys its state by the params themselves: each must go on as
    # torch's optimizer goes on, every step.
    def build() -> tuple[Blocks, torch.optim.AdamW]:
        torch.manual_seed(0)
        net = Blocks()
        return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)

    def reorder(net: Blocks) -> None:
        net.blocks = nn.ModuleList([net.blocks[2], net.blocks[0], net.blocks[1]])

    def train(net: nn.Module, opt: Any, steps: range) -> None:
        train_either(net, opt, steps, rank, world)

    for way in ("state_dict", "checkpoint", "wrap again"):
        ref, ref_opt = build()
        model, torch_opt = build()
        opt = zero_shard.wrap(torch_opt, model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        train(model, opt, range(2))
        train(ref, ref_opt, range(2))
        opt.finish_param_sync()
        reorder(model)
        reorder(ref)
        if way == "wrap again":
            for net, each in ((model, torch_opt), (ref, ref_opt)):
                torch.manual_seed(1)
                net.blocks.append(nn.Linear(7, 7))
                each.add_param_group({"params": list(net.blocks[3].parameters())})
            opt = zero_shard.wrap(torch_opt, model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        else:
            saved = opt.state_dict()
            path = os.path.join(os.path.dirname(shared_path(rank)), "renamed")
            if way == "checkpoint":
                zero_shard.checkpoint.save(path, model=model, optimizer=opt)
            other, other_opt = build()
            reorder(other)
            other.load_state_dict(model.state_dict())
            other_opt = zero_shard.wrap(
                other_opt, other, offload=offload(0.5), bucket_mb=TINY_BUCKETS
            )
            if way == "checkpoint":
                zero_shard.checkpoint.load(path, model=other, optimizer=other_opt)
            else:
                other_opt.load_state_dict(saved)
            model, opt = other, other_opt
        for step in range(2, 4):
            train(model, opt, range(step, step + 1))
            train(ref, ref_opt, range(step, step + 1))
            opt.finish_param_sync()
            assert_params_close(model, ref, f"{way}, step {step}")


@case
def a_param_replaced_after_wrap_is_named_not_saved_as_the_new_ones(rank: int, world: int) -> None:
    # A head re-initialised by assigning a new nn.Parameter after wrap (or a load with
    # assign=True): the optimizer steps the old param, as torch's would. Its state and bf16 main
    # weight saved under the name would go to the new param at a load; the save says so, on
    # every rank, and writes nothing. Wrapping again over the model's params is the fix.
    model = make_model().to(torch.bfloat16)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world).bfloat16()), local_slice(y, rank, world)).backward()
    opt.step()
    opt.zero_grad()
    model.out.weight = nn.Parameter(torch.full_like(model.out.weight, 0.25))
    path = os.path.join(os.path.dirname(shared_path(rank)), "replaced")
    for save in (opt.state_dict, lambda: zero_shard.checkpoint.save(path, model=model,
                                                                    optimizer=opt)):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"params \['out.weight'\] are not the params"):
            save()
    assert not os.path.exists(path)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    zero_shard.checkpoint.save(path, model=model, optimizer=opt)
    other = make_model().to(torch.bfloat16)
    other_opt = zero_shard.wrap(adamw(other), other, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    zero_shard.checkpoint.load(path, model=other, optimizer=other_opt)
    assert torch.equal(other.out.weight, torch.full_like(other.out.weight, 0.25))


@case
def state_saved_with_wrappers_on_loads_with_them_off(rank: int, world: int) -> None:
    # A model compiled (torch.compile(model) handed to wrap) with a block under activation
    # checkpointing: the state dict names the params as torch's get_optimizer_state_dict does
    # (no _orig_mod., no _checkpoint_wrapped_module.), so that it loads into a wrapper of the
    # same model with both off, through opt.load_state_dict and zero_shard.checkpoint, and goes
    # on as torch's optimizer goes on; a state dict keyed by named_parameters() names, the
    # wrappers' segments in, loads as well.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build(wrappers: bool) -> tuple[nn.Module, torch.optim.AdamW]:
        torch.manual_seed(0)
        net: nn.Module = Blocks()
        if wrappers:
            net.blocks[1] = checkpoint_wrapper(net.blocks[1])
            net = torch.compile(net, backend="eager")
        return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)

    def train(net: nn.Module, opt: zero_shard.ZeroShardOptimizer, step: int) -> None:
        x, y = global_batch(step)
        mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()

    ref, ref_opt = build(wrappers=False)
    compiled, torch_opt = build(wrappers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compiled model runs its forward: nothing to warn
        opt = zero_shard.wrap(torch_opt, compiled, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    torch_names = build(wrappers=True)
    torch_names[0](global_batch(0)[0]).sum().backward()
    torch_names[1].step()
    expected = sorted(get_optimizer_state_dict(*torch_names)["state"])
    for step in range(2):
        train(compiled, opt, step)
        x, y = global_batch(step)
        step_reference(ref, ref_opt, x, y)
    saved = opt.state_dict()
    assert sorted(saved["state"]) == expected, (sorted(saved["state"]), expected)
    path = os.path.join(os.path.dirname(shared_path(rank)), "wrappers_off")
    zero_shard.checkpoint.save(path, model=compiled, optimizer=opt)
    inner = compiled._orig_mod
    raw = [name for name, _ in compiled.named_parameters()]  # the segments in
    assert "_orig_mod.blocks.1._checkpoint_wrapped_module.weight" in raw, raw
    segments = ("_orig_mod.", "_checkpoint_wrapped_module.")
    by_name = {name.replace(segments[0], "").replace(segments[1], ""): name for name in raw}
    by_hand = {
        "state": {by_name[k]: v for k, v in saved["state"].items()},
        "param_groups": [
            {**g, "params": [by_name[n] for n in g["params"]]} for g in saved["param_groups"]
        ],
    }
    for way in ("state_dict", "checkpoint", "named_parameters names"):
        plain, plain_opt = build(wrappers=False)
        plain.load_state_dict({k.replace("_checkpoint_wrapped_module.", ""): v
                               for k, v in inner.state_dict().items()})  # fmt: skip
        plain_opt = zero_shard.wrap(plain_opt, plain, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        if way == "checkpoint":
            zero_shard.checkpoint.load(path, model=plain, optimizer=plain_opt)
        else:
            plain_opt.load_state_dict(saved if way == "state_dict" else by_hand)
        mirror = copy.deepcopy(ref)
        mirror_opt = torch.optim.AdamW(mirror.parameters(), lr=LR, weight_decay=0.1)
        mirror_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (torch aliases it)
        for step in range(2, 4):
            train(plain, plain_opt, step)
            x, y = global_batch(step)
            step_reference(mirror, mirror_opt, x, y)
        plain_opt.finish_param_sync()
        assert_params_close(plain, mirror, f"{way}, step 3")
    # A model's own children named as wrappers name theirs keep their names, and round-trip.
    odd = nn.Module()
    odd._orig_mod, odd.module = nn.Linear(3, 2), nn.Linear(2, 2)
    odd_opt = zero_shard.wrap(torch.optim.AdamW(odd.parameters()), odd, overlap_param_gather=False)
    odd.module(odd._orig_mod(torch.ones(2, 3))).sum().backward()
    odd_opt.step()
    state = odd_opt.state_dict()
    assert sorted(state["state"]) == [
        "_orig_mod.bias", "_orig_mod.weight", "module.bias", "module.weight"
    ], sorted(state["state"])  # fmt: skip
    odd_opt.load_state_dict(state)


@case
def a_loaded_state_dicts_options_are_copies_in_force_from_the_first_step(
    rank: int, world: int
) -> None:
    # torch's load deep-copies the saved groups and steps with their options: a tensor lr (which
    # schedulers fill in place) loaded into two optimizers, each with its own scheduler, stays
    # the state dict's own and each decays once a step; SGD state saved with dampening before any
    # step, loaded into one built without it, steps with dampening. And the torch optimizer that
    # was wrapped, stepped by mistake, is refused before anything changes.
    def sgd(net: nn.Module, **options: Any) -> torch.optim.SGD:
        return torch.optim.SGD(net.parameters(), lr=torch.tensor(0.05), momentum=0.9, **options)

    def train(net: nn.Module, opt: Any, steps: range, sched: Any = None) -> None:
        train_either(net, opt, steps, rank, world, sched)

    saved_model = make_model()
    saved_opt = zero_shard.wrap(sgd(saved_model, dampening=0.5), saved_model, offload=offload(0.5))
    saved = copy.deepcopy(saved_opt.state_dict())
    saved["param_groups"][0]["lr"] = torch.tensor(0.1)
    ref = make_model()
    ref_opt = sgd(ref, dampening=0.5)
    ref_opt.param_groups[0]["lr"] = torch.tensor(0.1)
    ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref_opt, gamma=0.5)
    train(ref, ref_opt, range(3), ref_sched)
    for fraction in (0.0, 0.5):
        models = [make_model(), make_model()]
        opts = [zero_shard.wrap(sgd(net), net, offload=offload(fraction)) for net in models]
        for opt in opts:
            opt.load_state_dict(saved)
        scheds = [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5) for opt in opts]
        for net, opt, sched in zip(models, opts, scheds, strict=True):
            train(net, opt, range(3), sched)
            opt.finish_param_sync()
            assert float(opt.param_groups[0]["lr"]) == float(ref_opt.param_groups[0]["lr"])
            assert_params_close(net, ref, f"fraction {fraction}")
        assert saved["param_groups"][0]["lr"] == torch.tensor(0.1), "the state dict's lr changed"
    net = make_model()
    torch_opt = sgd(net)
    opt = zero_shard.wrap(torch_opt, net, offload=offload(0.5))
    train(net, opt, range(1))
    x, y = global_batch(1)
    mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="the SGD that a ZeroShardOptimizer wraps"):
        torch_opt.step()
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    opt.zero_grad()
    # Its state_dict() too (the wrapper holds the state: a checkpoint through the kept
    # reference would hold none), also through torch's get_optimizer_state_dict; its state-dict
    # hooks run around the wrapper's, as its step hooks do.
    refused = "state_dict\\(\\) was called on the SGD that a ZeroShardOptimizer wraps"
    with pytest.raises(RuntimeError, match=refused):
        torch_opt.state_dict()
    with pytest.raises(RuntimeError, match="was called on the SGD that a ZeroShardOptimizer"):
        get_optimizer_state_dict(net, torch_opt)  # (torch steps it first to make its state)
    torch_opt.register_state_dict_post_hook(lambda _, state: {**state, "noted": rank})
    assert opt.state_dict()["noted"] == rank


@case
def a_state_dict_of_other_param_groups_set_through_torch_is_refused(rank: int, world: int) -> None:
    # Saved with {matrices, biases}, set with torch's set_optimizer_state_dict into an optimizer
    # whose groups split the same params otherwise: torch hands a group over without its options
    # (torch's AdamW then fails at its step); zero-shard refuses the load on every rank, where
    # keeping its own options would train at another lr.
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt)
    other = make_model()
    params = list(other.parameters())
    split = [{"params": params[:3]}, {"params": params[3:], "lr": LR / 2}]
    other_opt = zero_shard.wrap(torch.optim.AdamW(split, lr=LR), other, bucket_mb=TINY_BUCKETS)
    with pytest.raises(ValueError, match=r"param group 0 .* holds no options .*other param"):
        set_optimizer_state_dict(other, other_opt, saved)


@case
def torchs_get_and_set_optimizer_state_dict_take_the_wrapper(rank: int, world: int) -> None:
    ref, ref_opt = make_model(), None
    ref_opt = adamw(ref)
    for step in range(SAVE_AT):
        step_reference(ref, ref_opt, *global_batch(step))
    ref_weights = copy.deepcopy(ref.state_dict())
    ref_state = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt, options=FULL))
    trajectory = []
    for step in range(SAVE_AT, SAVE_AT + GO_ON):
        step_reference(ref, ref_opt, *global_batch(step))
        trajectory.append([param.detach().clone() for param in ref.parameters()])
    fsdp = fsdp2(make_model(), world)
    fsdp_opt = adamw(fsdp)
    for step in range(SAVE_AT):
        x, y = global_batch(step)
        mse(fsdp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad()
    fsdp_weights = get_model_state_dict(fsdp, options=FULL)
    from_fsdp2 = get_optimizer_state_dict(fsdp, fsdp_opt)  # DTensors of FSDP2's layout
    from_fsdp2_full = get_optimizer_state_dict(fsdp, fsdp_opt, options=FULL)
    for fraction in (0.0, 0.5, 1.0):
        model, opt, _, _ = wrapped_and_torch(fraction=fraction)
        for step in range(SAVE_AT):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        opt.finish_param_sync()
        weights = copy.deepcopy(model.state_dict())
        own = opt.state_dict()
        got = get_optimizer_state_dict(model, opt)
        assert_same_state(got, own, "get_optimizer_state_dict")
        forwarded = get_optimizer_state_dict(model, ForwardingOptimizer(opt))
        assert_same_state(forwarded, own, "get_optimizer_state_dict through a wrapper")
        full = get_optimizer_state_dict(model, opt, options=FULL)
        on_host = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        gathered = zero_shard.full_state_dict(opt)
        if rank == 0:
            assert_same_state(full, gathered, "full_state_dict=True")
            assert_same_state(on_host, gathered, "full_state_dict=True, cpu_offload=True")
            assert_same_state(full, ref_state, "against torch's", **PARAM_TOL)
            # Into a torch AdamW, one process: it goes on as the uninterrupted run.
            alone = make_model(seed=1)
            alone.load_state_dict(weights)
            alone_opt = adamw(alone)
            # A copy: torch's load keeps the step tensors it is given (the wrapper's, here).
            set_optimizer_state_dict(alone, alone_opt, copy.deepcopy(on_host), options=FULL)
            go_on(alone, alone_opt, 0, 1, trajectory, f"f={fraction} into torch AdamW")
        else:
            assert on_host == {}
        other = {0.0: 1.0, 0.5: 0.0, 1.0: 0.5}[fraction]  # loaded at another fraction
        sources = {
            "get_optimizer_state_dict": (got, None, weights),
            "full_state_dict=True": (full, FULL, weights),
            "torch AdamW's, full_state_dict=True": (ref_state, FULL, ref_weights),
            "torch AdamW's, default options": (ref_state, None, ref_weights),
            "FSDP2 + AdamW's": (from_fsdp2, None, fsdp_weights),
            "FSDP2 + AdamW's, full_state_dict=True": (from_fsdp2_full, FULL, fsdp_weights),
        }
        for name, (source, options, loaded_weights) in sources.items():
            where = f"f={fraction}, {name} at f={other}"
            resumed, direct = make_model(seed=1), make_model(seed=1)
            resumed.load_state_dict(loaded_weights)
            direct.load_state_dict(loaded_weights)
            resumed_opt = zero_shard.wrap(adamw(resumed), resumed, offload=offload(other),
                                          bucket_mb=TINY_BUCKETS)  # fmt: skip
            set_optimizer_state_dict(resumed, resumed_opt, source, options=options)
            direct_opt = zero_shard.wrap(adamw(direct), direct, offload=offload(other),
                                         bucket_mb=TINY_BUCKETS)  # fmt: skip
            direct_opt.load_state_dict(source)
            assert_same_state(resumed_opt.state_dict(), direct_opt.state_dict(), where)
            del direct_opt
            go_on(resumed, resumed_opt, rank, world, trajectory, where)


@case
def a_bf16_state_broadcast_from_rank_0_loads_the_fp32_main_weights_everywhere(
    rank: int, world: int
) -> None:
    # torch's documented full-state load: the state dicts on rank 0 alone, {} elsewhere,
    # broadcast_from_rank0=True. Every rank's main weights are the saved fp32 ones (torch fills
    # only the layout's keys on the other ranks); from a state dict without main_param (torch
    # AdamW's), they are the loaded params, as a direct load makes them.
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    on_host = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = make_model().to(torch.bfloat16)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    for step in range(2):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world).bfloat16()), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    weights = get_model_state_dict(model, options=on_host)
    saved = get_optimizer_state_dict(model, opt, options=on_host)
    expected = zero_shard.full_state_dict(opt)
    ref = make_model(seed=2)
    ref_opt = adamw(ref)
    step_reference(ref, ref_opt, *global_batch(0))
    ref_weights = {k: v.bfloat16() for k, v in ref.state_dict().items()}
    ref_saved = get_optimizer_state_dict(ref, ref_opt, options=on_host)
    for name, (model_state, optim_state) in {
        "zero-shard's": (weights, saved),
        "torch AdamW's": (ref_weights, ref_saved),
    }.items():
        for fraction in (0.0, 1.0):
            other = make_model(seed=1).to(torch.bfloat16)
            other_opt = zero_shard.wrap(
                adamw(other), other, offload=offload(fraction), bucket_mb=TINY_BUCKETS
            )
            set_model_state_dict(other, model_state if rank == 0 else {}, options=bcast)
            set_optimizer_state_dict(
                other, other_opt, optim_state if rank == 0 else {}, options=bcast
            )
            got = zero_shard.full_state_dict(other_opt)
            if rank > 0:
                continue
            for fqn, param_state in got["state"].items():
                main = param_state["main_param"]
                if name == "zero-shard's":
                    want = expected["state"][fqn]["main_param"]
                else:
                    want = ref_weights[fqn].float()
                assert torch.equal(main, want), (name, fraction, fqn, (main - want).abs().max())


@case
def torchs_clip_of_grads_no_backward_reduced_is_refused_at_the_step(rank: int, world: int) -> None:
    # Every micro-batch's backward inside no_sync() leaves each rank's own grads, which the step
    # reduces. torch's clip there scales each rank's grads by its own factor, which no average
    # of them undoes: the step refuses, on every rank, params unchanged. opt.clip_grad_norm_
    # there, and torch's clip after a last backward outside no_sync(), give torch's result on
    # the whole batch.
    def torch_norm(model: nn.Module, _: Any) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    def torch_value(model: nn.Module, _: Any) -> None:
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)

    def wrappers_norm(_: nn.Module, opt: zero_shard.ZeroShardOptimizer) -> None:
        opt.clip_grad_norm_(0.1)

    x, y = global_batch(0)
    x_here, y_here = local_slice(x, rank, world), local_slice(y, rank, world)
    half = x_here.shape[0] // 2
    # (clip of ours, clip of the reference, whether the step refuses with every backward inside)
    for clip, ref_clip, refused in ((torch_norm, torch_norm, True),
                                    (torch_value, torch_value, True),
                                    (wrappers_norm, torch_norm, False)):  # fmt: skip
        for last_outside in (False, True):
            where = f"{clip.__name__}, last backward outside no_sync: {last_outside}"
            model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
            for index, part in enumerate((slice(None, half), slice(half, None))):
                inside = not (last_outside and index == 1)
                with opt.no_sync() if inside else contextlib.nullcontext():
                    (mse(model(x_here[part]), y_here[part]) / 2).backward()
            clip(model, opt)
            if refused and not last_outside:
                before = [p.detach().clone() for p in model.parameters()]
                with pytest.raises(RuntimeError, match=r"written in place .* inside no_sync"):
                    opt.step()
                unchanged = zip(model.parameters(), before, strict=True)
                assert all(torch.equal(p, b) for p, b in unchanged), where
                continue
            opt.step()
            opt.finish_param_sync()
            mse(ref(x), y).backward()
            ref_clip(ref, None)
            ref_opt.step()
            assert_params_close(model, ref, where)
    # opt.zero_grad(set_to_none=False) after them zeroes the grads in place, as torch's does:
    # the step takes zeros, not an edit.
    model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
    with opt.no_sync():
        mse(model(x_here), y_here).backward()
    opt.zero_grad(set_to_none=False)
    opt.step()
    opt.finish_param_sync()
    mse(ref(x), y).backward()
    ref_opt.zero_grad(set_to_none=False)
    ref_opt.step()
    assert_params_close(model, ref, "zero grads after no_sync()")
    # Uneven data: a micro-batch inside no_sync() on rank 0 alone; every rank reduces at the
    # step, and its check of the grads is collective on all of them.
    model, opt, _, _ = wrapped_and_torch(fraction=0.5)
    if rank == 0:
        with opt.no_sync():
            mse(model(x_here), y_here).backward()
    opt.step()
    opt.finish_param_sync()
    for param in model.parameters():
        rank_0s = param.detach().clone()
        dist.broadcast(rank_0s, src=0)
        assert torch.equal(rank_0s, param), "the ranks' params differ"


@case
def a_rewrap_while_one_rank_still_holds_the_old_wrapper(rank: int, world: int) -> None:
    # Whether a dropped wrapper is collected yet differs by rank (pytest.raises, a traceback or
    # a scheduler may hold it on one): the new wrap must make the same collectives everywhere,
    # and train as torch (reference: one process, whole batch).
    model, ref = make_model(), make_model()
    old = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    kept = [old] if rank == 0 else []
    del old
    gc.collect()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    train_with_torch(model, opt, ref, rank, world, where="re-wrapped, rank 0 kept the old one")
    assert len(kept) == (rank == 0)


@case
def ddp_wrapped_after_wrap_trains_as_ddp(rank: int, world: int) -> None:
    # HF Trainer and accelerate wrap the model in DDP after the optimizer is built: zero-shard
    # already reduces the grads, so that DDP's sync is turned off ([Note: DDP around a wrapped
    # model]); the run is DDP's (reference: one process, torch AdamW, whole batch), with
    # torch's clip, DDP's no_sync accumulation and model.zero_grad() as Trainer uses them, and
    # with static_graph too. Once the optimizer is gone, DDP reduces again for the next one.
    for static_graph in (False, True):
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        ddp = nn.parallel.DistributedDataParallel(model, static_graph=static_graph)
        ref_opt = adamw(ref)
        for step in range(STEPS):
            x, y = global_batch(step)
            x_local, y_local = local_slice(x, rank, world), local_slice(y, rank, world)
            half = x_local.shape[0] // 2  # two micro-batches, the first under no_sync
            with ddp.no_sync():
                (mse(ddp(x_local[:half]), y_local[:half]) / 2).backward()
            (mse(ddp(x_local[half:]), y_local[half:]) / 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
            opt.step()
            ddp.zero_grad()
            mse(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(norm, ref_norm, **LOSS_TOL)
        assert ddp.require_backward_grad_sync  # between forwards, the value the user set
        opt.finish_param_sync()
        assert_params_close(model, ref, f"DDP (static_graph={static_graph}) after wrap")
    del opt
    gc.collect()
    assert ddp.require_backward_grad_sync  # the next optimizer is a plain one: DDP reduces
    plain, ref_plain = (
        torch.optim.SGD(model.parameters(), lr=LR),
        torch.optim.SGD(ref.parameters(), lr=LR),
    )
    x, y = global_batch(STEPS)
    mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    plain.step()
    mse(ref(x), y).backward()
    ref_plain.step()
    assert_params_close(model, ref, "DDP after the optimizer was collected")


@case
def copies_and_pickles_of_the_wrapper_are_refused_naming_its_state_dict(
    rank: int, world: int
) -> None:
    # torch's optimizers copy and pickle; the wrapper holds hooks, groups and shards: a clear
    # refusal naming the state dict, and training goes on as torch's.
    model, ref = make_model(), make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    for trained in (False, True):
        for copier in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict"):
                copier(opt)
        if not trained:
            train_with_torch(model, opt, ref, rank, world, where="copies refused")


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


@case
def an_embedding_resized_in_place_then_wrapped_again_trains_as_torch(rank: int, world: int) -> None:
    # HF's resize_token_embeddings gives the embedding's param new data of another shape
    # (weight.data = ...), then the user wraps a new optimizer while the old one is alive: the
    # old wrapper's grad accumulator (kept with the param's old shape, which autograd reuses
    # while it lives) goes with its hooks, so backward runs with the new shape, as in torch.
    model, ref = Embedded(), Embedded()
    opt = zero_shard.wrap(torch.optim.AdamW(model.parameters(), lr=LR), model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        if step == 2:
            opt.finish_param_sync()
            extra = torch.randn(2, 6, generator=torch.Generator().manual_seed(5))
            for net in (model, ref):
                net.emb.weight.data = torch.cat([net.emb.weight.data, extra])
            opt = zero_shard.wrap(torch.optim.AdamW(model.parameters(), lr=LR), model)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 13 if step >= 2 else 11, (12, 3), generator=gen)
        y = torch.randn(12, 2, generator=gen)
        mse(model(local_slice(ids, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        mse(ref(ids), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"resized at step 2, step {step}")


@case
def ddps_join_for_uneven_inputs_is_refused_on_every_rank(rank: int, world: int) -> None:
    # DDP built after wrap (as accelerate and Trainer do), then `with Join([ddp])` over a
    # different number of micro-batches per rank: joined ranks would shadow DDP's collectives,
    # not zero-shard's (a gloo abort). Every rank's first forward under Join raises.
    from torch.distributed.algorithms.join import Join

    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    ddp = nn.parallel.DistributedDataParallel(model)
    x, y = global_batch(0)
    with pytest.raises(RuntimeError, match=r"Join \(uneven inputs.*not supported.*no_sync"):
        with Join([ddp]):
            for _ in range(2 + rank):
                mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                opt.step()
                opt.zero_grad()
    # Join leaves its setting on the DDP: the forwards after its block run as without it.
    mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()


@case
def ddp_wrapped_after_two_wrappers_over_disjoint_params_trains_as_ddp(
    rank: int, world: int
) -> None:
    # A policy's and a value head's optimizers (two classes) over one model, then a DDP around
    # it, as accelerate.prepare(model, opt_a, opt_b) makes: every param is zero-shard's, so DDP's
    # sync is turned off by the hook of the wrapper holding its first param.
    model, ref = make_model(), make_model()
    optimizers, refs = [], []
    for net, out in ((model, optimizers), (ref, refs)):
        body = [p for name, p in net.named_parameters() if not name.startswith("out.")]
        out.append(torch.optim.AdamW(body, lr=LR, weight_decay=0.1))
        out.append(torch.optim.SGD(net.out.parameters(), lr=0.1, momentum=0.5))
    optimizers = [zero_shard.wrap(o, model, bucket_mb=TINY_BUCKETS) for o in optimizers]
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        mse(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, **LOSS_TOL)
        for optimizer in (*optimizers, *refs):
            optimizer.step()
            optimizer.zero_grad()
        for optimizer in optimizers:
            optimizer.finish_param_sync()
        assert_params_close(model, ref, f"two wrappers, then DDP, step {step}")


@case
def ddp_wrapped_after_wrap_refuses_reads_of_grads_inside_its_no_sync(rank: int, world: int) -> None:
    # Inside DDP's no_sync() DDP's grads are each rank's own until the backward that syncs;
    # zero-shard's are reduced already ([Note: DDP around a wrapped model]): a clip there
    # (accelerate's clip inside accumulate() without checking sync_gradients) raises on every
    # rank, and a clip after the last micro-batch trains as DDP + torch AdamW on the same ranks.
    # A forward that raises on DDP's first call leaves nothing behind; the DDP pickles.
    for fraction, stage in ((0.5, 2), (0.0, 1)):
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(adamw(model), model, stage=stage, offload=offload(fraction),
                              bucket_mb=TINY_BUCKETS)  # fmt: skip
        nets = (DDP(model), DDP(ref))
        opts = (opt, adamw(ref))
        norms: list[torch.Tensor] = []
        failing = model.register_forward_hook(lambda *args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            nets[0](local_slice(global_batch(0)[0], rank, world))
        failing.remove()
        for step in range(STEPS):
            x, y = global_batch(step)
            x_local, y_local = local_slice(x, rank, world), local_slice(y, rank, world)
            third = x_local.shape[0] // 3  # three micro-batches, two under no_sync
            for net, net_opt in zip(nets, opts, strict=True):
                for start in (0, third, 2 * third):
                    rows = slice(start, None if start == 2 * third else start + third)
                    last = start == 2 * third
                    with contextlib.nullcontext() if last else net.no_sync():
                        (mse(net(x_local[rows]), y_local[rows]) / 3).backward()
                    if net is nets[0] and step == 1 and not last:
                        with pytest.raises(RuntimeError, match="inside the no_sync"):
                            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.02)
                norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.02))
                net_opt.step()
                net.zero_grad()
            torch.testing.assert_close(norms[-2], norms[-1], **LOSS_TOL)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"clipped after micro-batches, {fraction}, stage {stage}")
        pickle.dumps(nets[0])  # its hook pickles as one that does nothing


@case
def grads_held_across_a_clear_read_raise_and_writes_change_nothing(rank: int, world: int) -> None:
    # torch makes a new .grad after a clear to None, and a grad kept from before keeps its
    # values; zero-shard holds one reduced grad a param ([Note: placeholders held across
    # steps]): a kept placeholder reads as the grads until they are cleared, then reading it
    # raises and writing it changes nothing, on every rank alike. Zeroed in place
    # (set_to_none=False), the kept grad is .grad itself, in torch as here: it reads the next.
    stale = "held here stood for a reduced grad that zero-shard has since freed"
    clears = ("opt.zero_grad", "model.zero_grad", "set_to_none=False")
    for fraction, clear in zip((0.5, 0.0, 0.5), clears, strict=True):
        model, opt, ref, ref_opt = wrapped_and_torch(fraction=fraction)
        params, ref_params = list(model.parameters()), list(ref.parameters())
        held: list[torch.Tensor] = []
        for step in range(STEPS):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            mse(ref(x), y).backward()
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_params])
            if step == 1:  # kept: the grads, their .data and .detach()
                held = [p.grad for p in params[:2]] + [params[2].grad.data]
                held += [p.grad.detach() for p in params[3:]]
            if held:
                torch.testing.assert_close(
                    torch.nn.utils.get_total_norm(held), ref_norm, **LOSS_TOL
                )
            opt.step()
            ref_opt.step()
            if clear == "opt.zero_grad":
                opt.zero_grad()
            elif clear == "model.zero_grad":
                model.zero_grad()
            else:
                opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad(set_to_none=clear != "set_to_none=False")
            if held and clear != "set_to_none=False":
                with pytest.raises(RuntimeError, match=stale):
                    torch.nn.utils.get_total_norm(held)
                torch._foreach_mul_(held, 0.0)  # as on torch's kept grads: no effect
                held[0].zero_()
                held = []
        opt.finish_param_sync()
        assert_params_close(model, ref, f"grads held, then {clear}")


@case
def a_grad_kept_then_replaced_by_hand_reads_as_kept_until_the_next_backward(
    rank: int, world: int
) -> None:
    # torch: `.grad` set to another tensor by hand leaves the kept one with its values, and the
    # next backward accumulates into the new one. zero-shard: the kept placeholder reads the
    # reduced grads until that backward writes them afresh, then raises; the training is torch's.
    model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    mse(ref(x), y).backward()
    held = [p.grad for p in params]
    kept_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_params])
    for net_params in (params, ref_params):
        for param in net_params:
            param.grad = torch.full_like(param, 0.01)
    torch.testing.assert_close(torch.nn.utils.get_total_norm(held), kept_norm, **LOSS_TOL)
    x, y = global_batch(1)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    mse(ref(x), y).backward()
    with pytest.raises(RuntimeError, match="held here stood for a reduced grad"):
        torch.nn.utils.get_total_norm(held)
    opt.step()
    ref_opt.step()
    opt.finish_param_sync()
    assert_params_close(model, ref, "grads set by hand between two backwards")


@case
def grads_saved_and_put_back_after_another_backward_are_refused(rank: int, world: int) -> None:
    # Grads saved, cleared, a diagnostic backward, grads put back: zero-shard holds the reduced
    # grads of the last backward only, so the step refuses, on every rank, params unchanged;
    # copies of the reduced grads (main_grad) put back train as torch.
    model, opt, ref, ref_opt = wrapped_and_torch(fraction=0.5)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    x, y = global_batch(0)
    other_x, other_y = global_batch(1)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    saved = [p.grad for p in params]
    opt.zero_grad()
    mse(model(local_slice(other_x, rank, world)), local_slice(other_y, rank, world)).backward()
    for param, grad in zip(params, saved, strict=True):
        param.grad = grad
    opt.finish_param_sync()
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="set to a grad held from an earlier backward"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.zero_grad()
    for _ in range(2):
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        copies = [opt.main_grad(p).clone() for p in params]
        opt.zero_grad()
        mse(model(local_slice(other_x, rank, world)), local_slice(other_y, rank, world)).backward()
        for param, values in zip(params, copies, strict=True):
            opt.main_grad(param).copy_(values)
        opt.step()
        opt.zero_grad()
        mse(ref(x), y).backward()
        ref_saved = [p.grad.clone() for p in ref_params]
        ref_opt.zero_grad()
        mse(ref(other_x), other_y).backward()
        for param, grad in zip(ref_params, ref_saved, strict=True):
            param.grad = grad
        ref_opt.step()
        ref_opt.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "grads copied through main_grad and put back")


@case
def ddp_params_ddp_ignores_and_local_sgd_hooks_are_refused(rank: int, world: int) -> None:
    # DDP leaves params it ignores, and grads once local SGD starts, to each rank: zero-shard,
    # which steps each rank's rows of grads alike on every rank, refuses both on every rank.
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local_sgd

    model = make_model()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["out.weight", "out.bias"])
    with pytest.raises(ValueError, match=r"'out\.weight' is one that DDP was told to ignore"):
        zero_shard.wrap(adamw(model), DDP(model))
    for after_wrap in (False, True):
        ddp = DDP(make_model())
        state = local_sgd.PostLocalSGDState(process_group=None, subgroup=None,
                                            start_localSGD_iter=1)  # fmt: skip
        if not after_wrap:
            ddp.register_comm_hook(state, local_sgd.post_localSGD_hook)
            with pytest.raises(ValueError, match="post_localSGD_hook"):
                zero_shard.wrap(adamw(ddp.module), ddp)
            continue
        opt = zero_shard.wrap(adamw(ddp.module), ddp)
        ddp.register_comm_hook(state, local_sgd.post_localSGD_hook)
        x, y = global_batch(0)
        mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        before = [p.detach().clone() for p in ddp.parameters()]
        with pytest.raises(ValueError, match="post_localSGD_hook"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), before, strict=True))


@case
def ddp_wrapped_after_wrap_keeps_its_sync_for_params_zero_shard_does_not_own(
    rank: int, world: int
) -> None:
    # A param another optimizer steps needs DDP's reduction: DDP keeps it, and its reduction
    # then meets zero-shard's placeholders, with an error that names DDP, on every rank.
    model = make_model()
    owned = [p for name, p in model.named_parameters() if not name.startswith("out.")]
    opt = zero_shard.wrap(torch.optim.AdamW(owned, lr=LR), model, bucket_mb=TINY_BUCKETS)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel wrapped around the model"):
        for step in range(2):
            x, y = global_batch(step)
            mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    assert ddp.require_backward_grad_sync


# -- params that share memory, and params given other memory after wrap -------------------------


class Slice(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


class ViewsOfOneTensor(nn.Module):
    """Params made of views of one tensor, which share its memory and its version counter:
    experts made as ``nn.Parameter(t) for t in w.unbind(0)`` (7 rows each), and two slices of one
    matrix (7 rows and 1: empty shards at 2 and 3 ranks) in blocks of their own (units: one runs
    its forward while the other's gather may still be copying)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        w = torch.randn(3, 7, 15) * 0.3
        self.experts = nn.ParameterList([nn.Parameter(t) for t in w.unbind(0)])
        base = torch.randn(8, 7) * 0.3
        self.slices = nn.ModuleList([Slice(base[:7]), Slice(base[7:])])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(sum(x @ expert.t() for expert in self.experts))
        h = torch.cat([block(h) for block in self.slices], -1)
        return self.out(torch.tanh(h))


@case
def params_that_are_views_of_one_tensor_train_as_torch(rank: int, world: int) -> None:
    # zero-shard's own copies into one view must not look like a user's write to the others
    # (stale_params="error" raises on any it took for one); a user's write to one view is
    # reloaded from, as torch steps on from it. Plain and DDP models, tiny buckets (the views in
    # several), the gathers overlapped with the forward or not.
    for kind, fraction, overlap in [
        ("plain", 0.0, True), ("plain", 0.5, False), ("ddp", 0.0, False), ("ddp", 0.5, True),
    ]:  # fmt: skip
        model, ref = ViewsOfOneTensor(), ViewsOfOneTensor()
        net = model if kind == "plain" else nn.parallel.DistributedDataParallel(model)
        opt = zero_shard.wrap(
            torch.optim.AdamW(model.parameters(), lr=LR), net, offload=offload(fraction),
            bucket_mb=TINY_BUCKETS, overlap_param_gather=overlap, stale_params="error",
        )  # fmt: skip
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        where = f"{kind} at fraction {fraction}, overlap {overlap}"
        for step in range(STEPS):
            if step == 2:  # a user's write into one view: the next step steps on from it
                opt.finish_param_sync()
                opt.stale_params = "reload"
                with torch.no_grad():
                    for m in (model, ref):
                        m.experts[1].mul_(0.5)
            x, y = global_batch(step)
            mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            mse(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, where)
        storages = {p.untyped_storage().data_ptr() for p in model.experts}
        assert len(storages) == 1, f"{where}: the experts no longer share their memory"


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 2, 3, padding=1)  # weight (2, 3, 3, 3): an empty shard at 3
        self.out = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = x[:, :12].reshape(-1, 3, 2, 2)
        return self.out(torch.cat([self.conv(image).flatten(1), x[:, 12:14]], -1))


@case
def params_converted_or_tied_after_wrap_are_refused_before_the_step(rank: int, world: int) -> None:
    # model.to(memory_format=torch.channels_last) after wrap gives the params memory the gathers
    # cannot write by rows; param.data = another param's memory (an old way to tie weights)
    # shares elements that two main weights cannot both hold. The step refuses both on every
    # rank before anything changes: undone, the same step then gives torch's result.
    x, y = global_batch(0)
    for fraction in (0.0, 0.5):
        model, ref = ConvNet(), ConvNet()
        opt = zero_shard.wrap(torch.optim.AdamW(model.parameters(), lr=LR), model,
                              offload=offload(fraction), bucket_mb=TINY_BUCKETS)  # fmt: skip
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        model.to(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match=r"param 'conv.weight' is not contiguous now.*"
                           r"convert the inputs instead"):  # fmt: skip
            opt.step()
        model.to(memory_format=torch.contiguous_format)
        weight = model.out.weight.data
        model.out.weight.data = model.conv.weight.data.view(-1)[:20].view(2, 10)
        with pytest.raises(RuntimeError, match=r"params 'out.weight' \(elements 0-19 of their "
                           r"storage\) and 'conv.weight' .* share elements since the optimizer"):  # fmt: skip
            opt.step()
        model.out.weight.data = weight
        for param, value in zip(model.parameters(), before, strict=True):
            assert torch.equal(param, value), "a refused step changed a param"
        opt.step()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        mse(ref(x), y).backward()
        ref_opt.step()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"undone, then stepped, at fraction {fraction}")
        # Memory of its own given with .data (a load the old way) is a write: trained from.
        loaded = torch.randn(model.out.weight.shape, generator=torch.Generator().manual_seed(5))
        model.out.weight.data = loaded.clone()
        ref.out.weight.data = loaded.clone()
        for step in (1, 2):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
            opt.finish_param_sync()
            assert_params_close(model, ref, f".data given at fraction {fraction}, step {step}")


@case
def step_hooks_run_once_around_the_step_as_torch_runs_them(rank: int, world: int) -> None:
    # An lr-halving pre-hook on the torch optimizer before wrap, a post-hook on it after wrap,
    # and global hooks: torch runs each once around the step of the optimizer the user holds.
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    seen: collections.Counter[str] = collections.Counter()

    def halve_lr(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * 0.5

    handles = [
        register_optimizer_step_pre_hook(lambda o, *_: seen.update([f"pre {type(o).__name__}"])),
        register_optimizer_step_post_hook(lambda o, *_: seen.update([f"post {type(o).__name__}"])),
    ]
    try:
        for fraction in (0.0, 0.5, 1.0):
            model, ref = make_model(), make_model()
            torch_opt, ref_opt = adamw(model), adamw(ref)
            for each in (torch_opt, ref_opt):
                each.register_step_pre_hook(halve_lr)
            opt = zero_shard.wrap(
                torch_opt, model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
            )
            torch_opt.register_step_post_hook(
                lambda o, *_: seen.update([f"mine {type(o).__name__}"])
            )
            seen.clear()
            for step in range(3):
                x, y = global_batch(step)
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                opt.step()
                opt.zero_grad()
                step_reference(ref, ref_opt, x, y)
            opt.finish_param_sync()
            assert_params_close(model, ref, f"fraction {fraction}")
            # The reference's (AdamW) and the wrapper's; none of zero-shard's own optimizers.
            expected = {"pre AdamW": 3, "post AdamW": 3, "pre ZeroShardOptimizer": 3,
                        "post ZeroShardOptimizer": 3, "mine ZeroShardOptimizer": 3}  # fmt: skip
            assert seen == expected, (fraction, seen)
    finally:
        for handle in handles:
            handle.remove()


@case
def step_post_hooks_read_the_params_the_step_wrote(rank: int, world: int) -> None:
    # An EMA kept by a step post-hook (on the torch optimizer, on the wrapper, or global), read
    # from the model's params: torch runs the hook once the step is done, so it reads the
    # step's weights. The CPU's share and the gathers would otherwise still be in flight.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def ema_of(net: nn.Module, emas: dict[Any, torch.Tensor]) -> Callable[..., None]:
        def update(*_: Any) -> None:
            for name, param in net.named_parameters():
                value = param.detach().float().clone()
                previous = emas.get((net, name))
                emas[net, name] = value if previous is None else 0.9 * previous + 0.1 * value

        return update

    def for_optimizer(opt: Any, hook: Callable[..., None]) -> Callable[..., None]:
        return lambda optimizer, *args: hook() if optimizer is opt else None

    for fraction, where in itertools.product((0.0, 0.5, 1.0), ("torch_opt", "wrapper", "global")):
        model, ref = make_model(), make_model()
        torch_opt, ref_opt = adamw(model), adamw(ref)
        emas: dict[Any, torch.Tensor] = {}
        opt = zero_shard.wrap(torch_opt, model, offload=offload(fraction), bucket_mb=TINY_BUCKETS)
        ref_opt.register_step_post_hook(ema_of(ref, emas))
        handle = None
        if where == "global":
            handle = register_optimizer_step_post_hook(for_optimizer(opt, ema_of(model, emas)))
        else:
            (torch_opt if where == "torch_opt" else opt).register_step_post_hook(
                ema_of(model, emas)
            )
        try:
            for step in range(3):
                x, y = global_batch(step)
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                opt.step()
                opt.zero_grad()
                step_reference(ref, ref_opt, x, y)
                for name, _ in model.named_parameters():
                    torch.testing.assert_close(
                        emas[model, name], emas[ref, name], **PARAM_TOL,
                        msg=f"fraction {fraction}, hook on {where}, step {step}: {name}",
                    )  # fmt: skip
        finally:
            if handle is not None:
                handle.remove()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_distributed(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
