"""Tensor parallelism on 2-D meshes (data x tensor parallel), on CPU processes (gloo).

FSDP2 + tensor parallelism (``parallelize_module``, then ``fully_shard`` over ``mesh["dp"]``):
zero-shard against the same parallelized model with torch AdamW, every step (loss, clip norm,
params), at offload fractions 0, 0.5 and 1; a non-finite grad on one rank skips the step on all;
the state dict has the keys and layouts of ``get_optimizer_state_dict``; checkpoints saved at
dp 2 x tp 2 resume at dp 4 x tp 1, dp 1 x tp 2 and dp 2 x tp 1 on the uninterrupted trajectory,
and interchange with FSDP2 + TP + torch AdamW both ways. Meshes: 2 x 2 on 4 ranks, 1 x 2 and
2 x 1 on 2.

The phases share a folder through ZERO_SHARD_TEST_DIR: the 4-rank spawn saves, the 2-rank one
loads.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _harness import check_outcome, run_cases
from _models import LOSS_TOL, PARAM_TOL
from _tp_models import batch, fsdp_tp, loss_of, mesh_2d, param_groups
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy

LR = 1e-2
CLIP = 0.05  # below the norms of these models' grads: every step clips
SAVE_AT, CONTINUE = 3, 3


def folder() -> Path:
    return Path(os.environ["ZERO_SHARD_TEST_DIR"])


def policy(fraction: float) -> OffloadPolicy | None:
    if fraction == 0:
        return None
    return OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)


def full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def torch_opt(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=LR)


def ours(kind: str, mesh: DeviceMesh, fraction: float, seed: int = 0) -> tuple[nn.Module, Any]:
    model = fsdp_tp(kind, mesh, seed=seed)
    return model, zero_shard.wrap(torch_opt(model), model, offload=policy(fraction))


def assert_params_close(model: nn.Module, ref: nn.Module, where: str, **tol: Any) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            full(param.detach()),
            full(ref_param.detach()),
            **(tol or PARAM_TOL),
            msg=f"{where}: {name}",
        )


def train_step(kind: str, model: nn.Module, opt: Any, step: int, mesh: DeviceMesh) -> torch.Tensor:
    """One step with clipping: zero-shard's clip on a ZeroShardOptimizer, torch's otherwise."""
    loss = loss_of(kind, model, *batch(kind, step, mesh))
    loss.backward()
    if isinstance(opt, zero_shard.ZeroShardOptimizer):
        norm = opt.clip_grad_norm_(CLIP)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad()
    return torch.stack([loss.detach(), full(norm)])


def parity(kind: str, mesh: DeviceMesh, fraction: float, steps: int = 4) -> None:
    """zero-shard against torch AdamW on the same FSDP2 + TP model, every step."""
    where = f"{kind}, dp {mesh['dp'].size()} x tp {mesh['tp'].size()}, fraction {fraction}"
    ref = fsdp_tp(kind, mesh)
    ref_opt = torch_opt(ref)
    model, opt = ours(kind, mesh, fraction)
    for step in range(steps):
        expected = train_step(kind, ref, ref_opt, step, mesh)
        got = train_step(kind, model, opt, step, mesh)
        assert expected[1] > CLIP, f"{where}: the step must clip to test the norm"
        torch.testing.assert_close(got, expected, **LOSS_TOL, msg=f"{where}, step {step}")
        assert_params_close(model, ref, f"{where}, step {step}")
    check_state_dict(model, opt, ref, ref_opt, where)


def check_state_dict(model: nn.Module, opt: Any, ref: nn.Module, ref_opt: Any, where: str) -> None:
    """The keys, layouts and values of get_optimizer_state_dict for FSDP2 + TP + torch AdamW;
    full_state_dict gathers over both mesh dims."""
    theirs = get_optimizer_state_dict(ref, ref_opt)
    mine = opt.state_dict()
    assert [g["params"] for g in mine["param_groups"]] == [
        g["params"] for g in theirs["param_groups"]
    ]
    assert mine["state"].keys() == theirs["state"].keys(), where
    gathered = zero_shard.checkpoint.full_state_dict(opt)
    for fqn, state in theirs["state"].items():
        assert mine["state"][fqn].keys() == state.keys(), f"{where}: {fqn}"
        for key, value in state.items():
            got = mine["state"][fqn][key]
            if isinstance(value, DTensor):
                assert isinstance(got, DTensor), f"{where}: {fqn} {key}"
                assert got.device_mesh == value.device_mesh, f"{where}: {fqn} {key}"
                assert got.placements == value.placements, f"{where}: {fqn} {key}"
                assert got.shape == value.shape, f"{where}: {fqn} {key}"
            expected = full(value)  # a collective: every rank gathers
            torch.testing.assert_close(full(got), expected, **PARAM_TOL, msg=f"{where}: {fqn}")
            if dist.get_rank() == 0:
                torch.testing.assert_close(gathered["state"][fqn][key], expected.cpu(),
                                           **PARAM_TOL, msg=f"{where}: full {fqn} {key}")  # fmt: skip


def non_finite_grad_on_one_rank_skips_everywhere(mesh: DeviceMesh) -> None:
    """An inf in one rank's local grad of a tensor-parallel shard: every rank skips the step and
    keeps its params and state bit-identical; training then goes on with torch."""
    where = f"mlp, dp {mesh['dp'].size()} x tp {mesh['tp'].size()}"
    ref = fsdp_tp("mlp", mesh)
    ref_opt = torch_opt(ref)
    model, opt = ours("mlp", mesh, 0.5)
    train_step("mlp", ref, ref_opt, 0, mesh)
    train_step("mlp", model, opt, 0, mesh)
    loss_of("mlp", model, *batch("mlp", 1, mesh)).backward()
    if dist.get_rank() == dist.get_world_size() - 1:
        local = model.up.weight.grad._local_tensor
        if not local.numel():  # this rank's shard is empty: the other tensor-parallel layer's
            local = model.down.weight.grad._local_tensor
        local.view(-1)[0] = float("inf")
    before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    state_before = {n: full(opt.state[p]["exp_avg"]).clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.clip_grad_norm_(CLIP)
        opt.step()
        assert opt.num_skipped_steps == 1, where
    opt.zero_grad()
    for name, param in model.named_parameters():
        assert torch.equal(full(param.detach()), before[name]), f"{where}: {name}"
        assert torch.equal(full(opt.state[param]["exp_avg"]), state_before[name]), where
        assert int(opt.state[param]["step"]) == 1, where
    for step in (2, 3):
        train_step("mlp", ref, ref_opt, step, mesh)
        train_step("mlp", model, opt, step, mesh)
        assert_params_close(model, ref, f"{where}, step {step} after the skip")


# -- checkpoints ----------------------------------------------------------------------------------


def train_steps(kind: str, model: nn.Module, opt: Any, steps: range, mesh: DeviceMesh) -> None:
    for step in steps:
        train_step(kind, model, opt, step, mesh)


def save_at_2x2_then_go_on(rank: int, world: int) -> None:
    """zero-shard (fraction 0.5) and FSDP2 + TP + torch AdamW each save at step SAVE_AT; zero-
    shard then goes on uninterrupted, and its params and state are the reference."""
    mesh = mesh_2d(2, 2)
    model, opt = ours("llama", mesh, 0.5)
    train_steps("llama", model, opt, range(SAVE_AT), mesh)
    zero_shard.checkpoint.save(folder() / "ours", model=model, optimizer=opt)
    ref = fsdp_tp("llama", mesh)
    ref_opt = torch_opt(ref)
    train_steps("llama", ref, ref_opt, range(SAVE_AT), mesh)
    model_sd, optim_sd = get_state_dict(ref, ref_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder() / "torch"))
    train_steps("llama", model, opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    reference = {
        "params": {n: full(p.detach()).clone() for n, p in model.named_parameters()},
        "state": {
            n: {k: full(opt.state[p][k]).clone() for k in ("exp_avg", "exp_avg_sq")}
            for n, p in model.named_parameters()
        },
    }
    if rank == 0:
        torch.save(reference, folder() / "reference.pt")
    dist.barrier()


def assert_on_reference(model: nn.Module, opt: Any, where: str) -> None:
    reference = torch.load(folder() / "reference.pt")
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            full(param.detach()), reference["params"][name], **PARAM_TOL, msg=f"{where}: {name}"
        )
        state = opt.state[param]
        assert int(state["step"]) == SAVE_AT + CONTINUE, where
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full(state[key]), reference["state"][name][key],
                                       **PARAM_TOL, msg=f"{where}: {name} {key}")  # fmt: skip


def resume(dp: int, tp: int, fraction: float) -> None:
    """Loads zero-shard's dp 2 x tp 2 checkpoint at dp x tp and goes on to the reference."""
    mesh = mesh_2d(dp, tp)
    where = f"zero-shard's checkpoint resumed at dp {dp} x tp {tp}, fraction {fraction}"
    model, opt = ours("llama", mesh, fraction, seed=1)
    zero_shard.checkpoint.load(folder() / "ours", model=model, optimizer=opt)
    train_steps("llama", model, opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    assert_on_reference(model, opt, where)


def interchange(dp: int, tp: int) -> None:
    """FSDP2 + TP + torch AdamW at dp x tp resumes zero-shard's checkpoint; zero-shard resumes
    torch's: both go on to the reference."""
    mesh = mesh_2d(dp, tp)
    theirs = fsdp_tp("llama", mesh, seed=1)
    theirs_opt = torch_opt(theirs)
    model_sd, optim_sd = get_state_dict(theirs, theirs_opt)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(folder() / "ours"))
    set_state_dict(theirs, theirs_opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])  # fmt: skip
    train_steps("llama", theirs, theirs_opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    assert_on_reference(theirs, theirs_opt, f"torch resumed zero-shard's at dp {dp} x tp {tp}")

    model, opt = ours("llama", mesh, 1.0, seed=1)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=str(folder() / "torch"))
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    train_steps("llama", model, opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    assert_on_reference(model, opt, f"zero-shard resumed torch's at dp {dp} x tp {tp}")


# -- cases ----------------------------------------------------------------------------------------


def at_2x2(rank: int, world: int) -> None:
    mesh = mesh_2d(2, 2)
    for fraction in (0.0, 0.5, 1.0):
        parity("llama", mesh, fraction)
    parity("mlp", mesh, 0.5)


def skip_at_2x2(rank: int, world: int) -> None:
    non_finite_grad_on_one_rank_skips_everywhere(mesh_2d(2, 2))


def resume_at_4x1(rank: int, world: int) -> None:
    resume(4, 1, 0.0)


def at_1x2_and_2x1(rank: int, world: int) -> None:
    for dp, tp in ((1, 2), (2, 1)):
        parity("llama", mesh_2d(dp, tp), 0.5)
        parity("mlp", mesh_2d(dp, tp), 1.0)


def skip_at_1x2_and_2x1(rank: int, world: int) -> None:
    for dp, tp in ((1, 2), (2, 1)):
        non_finite_grad_on_one_rank_skips_everywhere(mesh_2d(dp, tp))


def resume_at_1x2_and_2x1(rank: int, world: int) -> None:
    resume(1, 2, 1.0)
    resume(2, 1, 0.5)


def interchange_at_1x2_and_2x1(rank: int, world: int) -> None:
    interchange(1, 2)
    interchange(2, 1)


CASES_BY_WORLD = {
    4: {
        "at_2x2": at_2x2,
        "skip_at_2x2": skip_at_2x2,
        "save_at_2x2_then_go_on": save_at_2x2_then_go_on,
        "resume_at_4x1": resume_at_4x1,
    },
    2: {
        "at_1x2_and_2x1": at_1x2_and_2x1,
        "skip_at_1x2_and_2x1": skip_at_1x2_and_2x1,
        "resume_at_1x2_and_2x1": resume_at_1x2_and_2x1,
        "interchange_at_1x2_and_2x1": interchange_at_1x2_and_2x1,
    },
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("tensor_parallel"))
    results: dict[str, str | None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for world, cases in CASES_BY_WORLD.items():
            results.update(run_cases(cases, world))
    return results


@pytest.mark.parametrize("name", [name for cases in CASES_BY_WORLD.values() for name in cases])
def test_tensor_parallel(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
