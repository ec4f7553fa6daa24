"""Tensor parallelism on 2-D meshes (data x tensor parallel), on CPU processes (gloo).

A tensor-parallel model (``parallelize_module`` over ``mesh["tp"]``) replicated over
``mesh["dp"]`` three ways: under FSDP2 (``fully_shard`` over ``dp``), plain (zero-shard shards it
over ``dp``), and under DDP (``device_mesh=mesh["dp"]``). Each is compared with torch AdamW on the
same model under FSDP2 + TP, whose clip is the global norm over both mesh dims, every step (loss,
clip norm, params), at offload fractions 0, 0.5 and 1 (stages 1 and 2 where zero-shard reduces);
a non-finite grad on one rank skips the step on all; the state dict has the keys and layouts of
``get_optimizer_state_dict`` for FSDP2 + TP; checkpoints saved at dp 2 x tp 2 resume at dp 4 x
tp 1, dp 1 x tp 2 and dp 2 x tp 1 on the uninterrupted trajectory, and interchange with FSDP2 +
TP + torch AdamW both ways. Meshes: 2 x 2 on 4 ranks, 1 x 2 and 2 x 1 on 2.

The Llama without sequence parallelism ("llama_plain_norms": its norms are plain params, which
FSDP2 shards on the 1-D ``dp`` mesh while the planned ones lie on the 2-D mesh) goes the same way
under FSDP2: parity at the three fractions, the skip (an inf in a copy of a norm's grad that the
norm does not count), checkpoints both ways; and every ``tp`` rank's copy of those params and
their state stays bit-identical. torch's ``clip_grad_norm_`` refuses that model (it stacks norms
of two meshes), so the reference clips by the norm of the per-mesh norms (``torch_clip``).

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
from _tp_models import batch, fsdp_tp, loss_of, mesh_2d, param_groups, tp_model
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


def grid(dp: int, tp: int) -> DeviceMesh:
    """The checkpoint phases' mesh: on the CPU, or on the GPUs where ZERO_SHARD_TEST_MESH says
    cuda (``test_checkpoints_on_gpus``)."""
    return mesh_2d(dp, tp, os.environ.get("ZERO_SHARD_TEST_MESH", "cpu"))


def policy(fraction: float) -> OffloadPolicy | None:
    if fraction == 0:
        return None
    return OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)


def full(value: Any) -> Any:
    """A DTensor's whole tensor (a collective); anything else as it is."""
    if not isinstance(value, DTensor):
        return value
    mesh = value.device_mesh
    if value.to_local().device.type != mesh.device_type:  # an offloaded shard's host state
        value = DTensor.from_local(value.to_local().to(mesh.device_type), mesh, value.placements,
                                   shape=value.shape, stride=value.stride())  # fmt: skip
    return value.full_tensor()


def torch_opt(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=LR)


COMPOSITIONS = ("fsdp2", "replicated", "ddp")


def build(
    kind: str,
    composition: str,
    mesh: DeviceMesh,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The tensor-parallel model ``kind`` replicated over ``mesh["dp"]`` as ``composition`` says:
    sharded by FSDP2, plain (zero-shard shards it), or under DDP."""
    if composition == "fsdp2":
        return fsdp_tp(kind, mesh, seed=seed, dtype=dtype)
    model = tp_model(kind, mesh, seed=seed, dtype=dtype)
    if composition == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
    return model


def ours(
    kind: str,
    mesh: DeviceMesh,
    fraction: float,
    composition: str = "fsdp2",
    *,
    seed: int = 0,
    stage: int = 2,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, Any]:
    model = build(kind, composition, mesh, seed=seed, dtype=dtype)
    # No mesh=: FSDP2's own, DDP's device_mesh, or the 2-D mesh's other dim (mesh["dp"]).
    opt = zero_shard.wrap(torch_opt(model), model, offload=policy(fraction), stage=stage)
    return model, opt


def unwrapped(model: nn.Module) -> nn.Module:
    """What to checkpoint: a DDP model's names start with "module.", FSDP2's do not."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def full_params(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """FQN -> the whole param. Under DDP + TP from the optimizer: torch's DDP swaps the module's
    tensor-parallel params for DTensors made from them at each forward."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return {name: full(param.detach()) for name, param in model.named_parameters()}
    fqns = [fqn for group in opt.state_dict()["param_groups"] for fqn in group["params"]]
    params = [param for group in opt.param_groups for param in group["params"]]
    whole = {}
    for fqn, param in zip(fqns, params, strict=True):
        # torch DDP's private record of a tensor-parallel param's layout: nothing public keeps it.
        spec = getattr(param, "_st_info", None)
        if spec is not None:
            param = DTensor.from_local(param.detach(), spec.mesh, spec.placements,
                                       shape=spec.shape, stride=spec.stride)  # fmt: skip
        whole[fqn] = full(param.detach())
    return whole


def full_state(model: nn.Module, opt: Any) -> dict[str, dict[str, Any]]:
    """FQN -> the param's optimizer state, whole (a collective)."""
    if isinstance(opt, zero_shard.ZeroShardOptimizer):
        state = opt.state_dict()["state"]
    else:
        state = get_optimizer_state_dict(model, opt)["state"]
    return {fqn: {k: full(v) for k, v in values.items()} for fqn, values in state.items()}


def assert_params_close(model: nn.Module, opt: Any, ref: nn.Module, where: str) -> None:
    expected = full_params(ref, None)
    got = full_params(model, opt)
    assert got.keys() == expected.keys(), where
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], **PARAM_TOL, msg=f"{where}: {name}")


def torch_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, and where the params lie on several meshes (FSDP2 + TP with
    plain norms, which it refuses) torch's pieces: each mesh's ``get_total_norm`` made whole,
    their norm, and ``clip_grads_with_norm_`` by it."""
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
    if len(by_mesh) == 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = [full(torch.nn.utils.get_total_norm([p.grad for p in ps])) for ps in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def train_step(kind: str, model: nn.Module, opt: Any, step: int, mesh: DeviceMesh) -> torch.Tensor:
    """One step with clipping: zero-shard's clip on a ZeroShardOptimizer, torch's otherwise."""
    loss = loss_of(kind, model, *batch(kind, step, mesh))
    loss.backward()
    if isinstance(opt, zero_shard.ZeroShardOptimizer):
        norm = opt.clip_grad_norm_(CLIP)
    else:
        norm = torch_clip(model, CLIP)
    opt.step()
    opt.zero_grad()
    return torch.stack([loss.detach(), full(norm)])


def describe(kind: str, composition: str, mesh: DeviceMesh, fraction: float) -> str:
    return (
        f"{kind} {composition}, dp {mesh['dp'].size()} x tp {mesh['tp'].size()}, "
        f"fraction {fraction}"
    )


def parity(
    kind: str,
    mesh: DeviceMesh,
    fraction: float,
    composition: str = "fsdp2",
    stage: int = 2,
    steps: int = 4,
) -> None:
    """zero-shard on ``composition`` against torch AdamW on FSDP2 + TP, every step."""
    where = describe(kind, composition, mesh, fraction) + f", stage {stage}"
    ref = fsdp_tp(kind, mesh)
    ref_opt = torch_opt(ref)
    model, opt = ours(kind, mesh, fraction, composition, stage=stage)
    for step in range(steps):
        expected = train_step(kind, ref, ref_opt, step, mesh)
        got = train_step(kind, model, opt, step, mesh)
        assert expected[1] > CLIP, f"{where}: the step must clip to test the norm"
        torch.testing.assert_close(got, expected, **LOSS_TOL, msg=f"{where}, step {step}")
        opt.finish_param_sync()
        assert_params_close(model, opt, ref, f"{where}, step {step}")
    check_state_dict(opt, ref, ref_opt, where)
    assert_tp_copies_agree(model, opt, mesh, where)


def assert_tp_copies_agree(model: nn.Module, opt: Any, mesh: DeviceMesh, where: str) -> None:
    """Every tp rank's copy of an FSDP2 param on the 1-D dp mesh, and of its state, is the same
    to the bit."""
    state = opt.state_dict()["state"]
    group = mesh["tp"].get_group()
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names != ("dp",):
            continue
        pieces = [param.to_local(), *(v.to_local() for k, v in state[name].items() if k != "step")]
        for piece in pieces:
            copies = [torch.empty_like(piece) for _ in range(mesh["tp"].size())]
            dist.all_gather(copies, piece.contiguous(), group=group)
            assert all(torch.equal(c, copies[0]) for c in copies), f"{where}: {name}"


def check_state_dict(opt: Any, ref: nn.Module, ref_opt: Any, where: str) -> None:
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
                assert got.device_mesh.mesh.tolist() == value.device_mesh.mesh.tolist(), where
                assert got.device_mesh.mesh_dim_names == value.device_mesh.mesh_dim_names, where
                assert got.placements == value.placements, f"{where}: {fqn} {key}"
                assert got.shape == value.shape, f"{where}: {fqn} {key}"
            # On the host: where a scalar step lives differs (torch keeps it there).
            expected = full(value).cpu()  # a collective: every rank gathers
            torch.testing.assert_close(full(got).cpu(), expected, **PARAM_TOL,
                                       msg=f"{where}: {fqn} {key}")  # fmt: skip
            if dist.get_rank() == 0:
                torch.testing.assert_close(gathered["state"][fqn][key], expected, **PARAM_TOL,
                                           msg=f"{where}: full {fqn} {key}")  # fmt: skip


def poison_on_last_rank(model: nn.Module, opt: Any, copy: str | None, *, fsdp2: bool) -> Any:
    """An inf in one element of the last rank's grad of a tensor-parallel weight, or of the
    params named ``...{copy}``, which are replicated over tp (the last tp rank's copy: the norm
    does not count it). Put in as the grad is made (before any reduction; under FSDP2, after its
    reduce-scatter). Returns a hook handle, or None."""
    last = dist.get_rank() == dist.get_world_size() - 1
    params = [p for group in opt.param_groups for p in group["params"] if p.dim() == 2]
    if copy is not None:
        params = [p for name, p in model.named_parameters() if name.endswith(copy)]
    if fsdp2:
        if last:
            local = next(p.grad.to_local() for p in params if p.grad.to_local().numel())
            local.view(-1)[0] = float("inf")
        return None

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        return grad

    return params[0].register_hook(poison) if last else None


def non_finite_grad_on_one_rank_skips_everywhere(
    mesh: DeviceMesh, composition: str, kind: str = "mlp", copy: str | None = None
) -> None:
    """An inf in one rank's grad (``copy``: in the last tp rank's copy of the params named so,
    replicated over tp, which the norm does not count): every rank skips the step and keeps its
    params and state bit-identical; training then goes on with torch."""
    where = describe(kind, composition, mesh, 0.5) + (
        f", an inf in a copy of {copy}" if copy else ""
    )
    ref = fsdp_tp(kind, mesh)
    ref_opt = torch_opt(ref)
    model, opt = ours(kind, mesh, 0.5, composition)
    train_step(kind, ref, ref_opt, 0, mesh)
    train_step(kind, model, opt, 0, mesh)
    opt.finish_param_sync()
    params_before, state_before = full_params(model, opt), full_state(model, opt)
    fsdp2 = composition == "fsdp2"
    handle = None if fsdp2 else poison_on_last_rank(model, opt, copy, fsdp2=False)
    loss_of(kind, model, *batch(kind, 1, mesh)).backward()
    if fsdp2:
        poison_on_last_rank(model, opt, copy, fsdp2=True)
    if handle is not None:
        handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.clip_grad_norm_(CLIP)
        opt.step()
        assert opt.num_skipped_steps == 1, where
    opt.zero_grad()
    opt.finish_param_sync()
    for name, value in full_params(model, opt).items():
        assert torch.equal(value, params_before[name]), f"{where}: {name}"
    for name, state in full_state(model, opt).items():
        assert torch.equal(state["exp_avg"], state_before[name]["exp_avg"]), f"{where}: {name}"
        assert int(state["step"]) == 1, where
    for step in (2, 3):
        train_step(kind, ref, ref_opt, step, mesh)
        train_step(kind, model, opt, step, mesh)
        opt.finish_param_sync()
        assert_params_close(model, opt, ref, f"{where}, step {step} after the skip")
    assert_tp_copies_agree(model, opt, mesh, where)


# -- checkpoints ----------------------------------------------------------------------------------


def train_steps(kind: str, model: nn.Module, opt: Any, steps: range, mesh: DeviceMesh) -> None:
    for step in steps:
        train_step(kind, model, opt, step, mesh)
    if isinstance(opt, zero_shard.ZeroShardOptimizer):
        opt.finish_param_sync()


def saved(kind: str, name: str) -> Path:
    """Where the checkpoint phases of ``kind`` keep ``name``."""
    return folder() / (name if kind == "llama" else f"{kind}_{name}")


def save_at_2x2_then_go_on(rank: int, world: int, kind: str = "llama") -> None:
    """zero-shard (FSDP2 + TP, fraction 0.5) and FSDP2 + TP + torch AdamW each save at step
    SAVE_AT; zero-shard then goes on uninterrupted, and its params and state are the reference."""
    mesh = grid(2, 2)
    model, opt = ours(kind, mesh, 0.5)
    train_steps(kind, model, opt, range(SAVE_AT), mesh)
    zero_shard.checkpoint.save(saved(kind, "ours"), model=model, optimizer=opt)
    ref = fsdp_tp(kind, mesh)
    ref_opt = torch_opt(ref)
    train_steps(kind, ref, ref_opt, range(SAVE_AT), mesh)
    model_sd, optim_sd = get_state_dict(ref, ref_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(saved(kind, "torch")))
    train_steps(kind, model, opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    on_host = {name: value.cpu() for name, value in full_params(model, opt).items()}
    state = {
        fqn: {k: v.cpu() for k, v in values.items()}
        for fqn, values in full_state(model, opt).items()
    }
    reference = {"params": on_host, "state": state}
    if rank == 0:
        torch.save(reference, saved(kind, "reference.pt"))
    dist.barrier()


def assert_on_reference(model: nn.Module, opt: Any, where: str, kind: str = "llama") -> None:
    reference = torch.load(saved(kind, "reference.pt"))
    for name, value in full_params(model, opt).items():
        torch.testing.assert_close(value.cpu(), reference["params"][name], **PARAM_TOL,
                                   msg=f"{where}: {name}")  # fmt: skip
    for name, state in full_state(model, opt).items():
        assert int(state["step"]) == SAVE_AT + CONTINUE, where
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key].cpu(), reference["state"][name][key],
                                       **PARAM_TOL, msg=f"{where}: {name} {key}")  # fmt: skip


def resume(dp: int, tp: int, fraction: float, composition: str, kind: str = "llama") -> None:
    """Loads zero-shard's dp 2 x tp 2 checkpoint at dp x tp into ``composition`` and goes on to
    the reference."""
    mesh = grid(dp, tp)
    where = "zero-shard's checkpoint resumed: " + describe(kind, composition, mesh, fraction)
    model, opt = ours(kind, mesh, fraction, composition, seed=1)
    zero_shard.checkpoint.load(saved(kind, "ours"), model=unwrapped(model), optimizer=opt)
    train_steps(kind, model, opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    assert_on_reference(model, opt, where, kind)
    if composition == "ddp":  # saved after forwards, when DDP's module no longer lists its params
        zero_shard.checkpoint.save(folder() / "from_ddp", model=unwrapped(model), optimizer=opt)
        again, again_opt = ours("llama", mesh, 0.0, "replicated", seed=2)
        zero_shard.checkpoint.load(folder() / "from_ddp", model=again, optimizer=again_opt)
        assert_on_reference(again, again_opt, where + ", saved again, loaded into a plain model")


def interchange(
    dp: int, tp: int, composition: str, kind: str = "llama", fraction: float = 1.0
) -> None:
    """FSDP2 + TP + torch AdamW at dp x tp resumes zero-shard's checkpoint; zero-shard on
    ``composition`` resumes torch's (plain DCP): both go on to the reference. (Under DDP + TP
    ``model.state_dict()`` is torch's, wrong: zero_shard.checkpoint saves and loads it right.)"""
    mesh = grid(dp, tp)
    theirs = fsdp_tp(kind, mesh, seed=1)
    theirs_opt = torch_opt(theirs)
    model_sd, optim_sd = get_state_dict(theirs, theirs_opt)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(saved(kind, "ours")))
    set_state_dict(theirs, theirs_opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])  # fmt: skip
    train_steps(kind, theirs, theirs_opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    where = f"torch resumed zero-shard's at dp {dp} x tp {tp}"
    assert_on_reference(theirs, theirs_opt, where, kind)

    model, opt = ours(kind, mesh, fraction, composition, seed=1)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=str(saved(kind, "torch")))
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    train_steps(kind, model, opt, range(SAVE_AT, SAVE_AT + CONTINUE), mesh)
    where = "zero-shard resumed torch's: " + describe(kind, composition, mesh, fraction)
    assert_on_reference(model, opt, where, kind)


def bf16_resumes_bit_for_bit(rank: int, world: int) -> None:
    """bf16 params: the state dict holds fp32 ``main_param`` laid out as the rest of the param's
    state, and a checkpoint resumed in a fresh model at the same layout ends bit-identical to
    the uninterrupted run, in each composition."""
    mesh = mesh_2d(2, 2)
    for composition in COMPOSITIONS:
        where = describe("llama", composition, mesh, 0.5) + ", bf16"
        model, opt = ours("llama", mesh, 0.5, composition, dtype=torch.bfloat16)
        train_steps("llama", model, opt, range(2), mesh)
        path = folder() / f"bf16_{composition}"
        zero_shard.checkpoint.save(path, model=unwrapped(model), optimizer=opt)
        for fqn, state in opt.state_dict()["state"].items():
            main, exp_avg = state["main_param"], state["exp_avg"]
            assert main.dtype == torch.float32 and main.shape == exp_avg.shape, f"{where}: {fqn}"
            assert main.placements == exp_avg.placements, f"{where}: {fqn}"
        train_steps("llama", model, opt, range(2, 4), mesh)
        again, again_opt = ours("llama", mesh, 0.5, composition, seed=1, dtype=torch.bfloat16)
        zero_shard.checkpoint.load(path, model=unwrapped(again), optimizer=again_opt)
        train_steps("llama", again, again_opt, range(2, 4), mesh)
        expected = full_params(model, opt)
        for name, value in full_params(again, again_opt).items():
            assert torch.equal(value, expected[name]), f"{where}: {name}"


def model_only_dcp_load_in_place(rank: int, world: int) -> None:
    """Weights loaded by DCP in place into ``model.state_dict()`` after wrap (fine-tuning) are
    trained from, as torch AdamW on FSDP2 + TP does: the entries' local tensors share the
    counters zero-shard watches."""
    mesh = mesh_2d(2, 2)
    path = str(folder() / "pretrained")
    dcp.save({"model": fsdp_tp("llama", mesh, seed=7).state_dict()}, checkpoint_id=path)
    for composition in ("fsdp2", "replicated"):
        where = describe("llama", composition, mesh, 0.5) + ", DCP model-only load"
        ref = fsdp_tp("llama", mesh)
        ref_opt = torch_opt(ref)
        model, opt = ours("llama", mesh, 0.5, composition)
        for m, o in ((ref, ref_opt), (model, opt)):
            train_steps("llama", m, o, range(1), mesh)
            dcp.load({"model": m.state_dict()}, checkpoint_id=path)
            train_steps("llama", m, o, range(1, 3), mesh)
        assert_params_close(model, opt, ref, where)


# -- cases ----------------------------------------------------------------------------------------


def fsdp2_at_2x2(rank: int, world: int) -> None:
    mesh = mesh_2d(2, 2)
    for fraction in (0.0, 0.5, 1.0):
        parity("llama", mesh, fraction)
    parity("mlp", mesh, 0.5)


def replicated_at_2x2(rank: int, world: int) -> None:
    mesh = mesh_2d(2, 2)
    for fraction, stage in ((0.0, 2), (0.5, 1), (1.0, 2)):
        parity("llama", mesh, fraction, "replicated", stage=stage)
    parity("mlp", mesh, 0.5, "replicated")


def ddp_at_2x2(rank: int, world: int) -> None:
    mesh = mesh_2d(2, 2)
    for fraction in (0.0, 0.5, 1.0):
        parity("llama", mesh, fraction, "ddp")
    parity("mlp", mesh, 0.5, "ddp")


def skip_at_2x2(rank: int, world: int) -> None:
    for composition in COMPOSITIONS:
        non_finite_grad_on_one_rank_skips_everywhere(mesh_2d(2, 2), composition)
    # The row-parallel bias, replicated over tp: an inf in a copy the norm does not count.
    non_finite_grad_on_one_rank_skips_everywhere(mesh_2d(2, 2), "replicated", copy="down.bias")


def resume_at_4x1_and_2x2(rank: int, world: int) -> None:
    resume(4, 1, 0.0, "fsdp2")
    resume(2, 2, 0.5, "replicated")
    resume(2, 2, 1.0, "ddp")


def at_1x2_and_2x1(rank: int, world: int) -> None:
    for dp, tp in ((1, 2), (2, 1)):
        for composition in COMPOSITIONS:
            parity("llama", mesh_2d(dp, tp), 0.5, composition)
            parity("mlp", mesh_2d(dp, tp), 1.0, composition)


def skip_at_1x2_and_2x1(rank: int, world: int) -> None:
    for dp, tp in ((1, 2), (2, 1)):
        for composition in COMPOSITIONS:
            non_finite_grad_on_one_rank_skips_everywhere(mesh_2d(dp, tp), composition)


def resume_at_1x2_and_2x1(rank: int, world: int) -> None:
    resume(1, 2, 1.0, "fsdp2")
    resume(2, 1, 0.5, "fsdp2")
    resume(1, 2, 0.5, "replicated")
    resume(2, 1, 0.0, "ddp")


def interchange_at_1x2_and_2x1(rank: int, world: int) -> None:
    interchange(1, 2, "fsdp2")
    interchange(2, 1, "replicated")


PLAIN_NORMS = "llama_plain_norms"  # FSDP2 + TP without sequence parallelism


def plain_norms_fsdp2_at_2x2(rank: int, world: int) -> None:
    mesh = mesh_2d(2, 2)
    for fraction in (0.0, 0.5, 1.0):
        parity(PLAIN_NORMS, mesh, fraction)
    non_finite_grad_on_one_rank_skips_everywhere(mesh, "fsdp2", PLAIN_NORMS, copy="norm.weight")


def plain_norms_save_at_2x2_resume_at_2x2(rank: int, world: int) -> None:
    save_at_2x2_then_go_on(rank, world, PLAIN_NORMS)
    resume(2, 2, 1.0, "fsdp2", PLAIN_NORMS)
    interchange(2, 2, "fsdp2", PLAIN_NORMS, fraction=0.0)


def plain_norms_resume_at_1x2_and_2x1(rank: int, world: int) -> None:
    resume(1, 2, 0.5, "fsdp2", PLAIN_NORMS)
    resume(2, 1, 0.0, "replicated", PLAIN_NORMS)


def resume_at_1x1(rank: int, world: int) -> None:
    resume(1, 1, 0.5, "fsdp2")
    resume(1, 1, 1.0, "replicated")


CASES_BY_WORLD = {
    4: {
        "fsdp2_at_2x2": fsdp2_at_2x2,
        "replicated_at_2x2": replicated_at_2x2,
        "ddp_at_2x2": ddp_at_2x2,
        "skip_at_2x2": skip_at_2x2,
        "save_at_2x2_then_go_on": save_at_2x2_then_go_on,
        "bf16_resumes_bit_for_bit": bf16_resumes_bit_for_bit,
        "model_only_dcp_load_in_place": model_only_dcp_load_in_place,
        "resume_at_4x1_and_2x2": resume_at_4x1_and_2x2,
        "plain_norms_fsdp2_at_2x2": plain_norms_fsdp2_at_2x2,
        "plain_norms_save_at_2x2_resume_at_2x2": plain_norms_save_at_2x2_resume_at_2x2,
    },
    2: {
        "at_1x2_and_2x1": at_1x2_and_2x1,
        "skip_at_1x2_and_2x1": skip_at_1x2_and_2x1,
        "resume_at_1x2_and_2x1": resume_at_1x2_and_2x1,
        "interchange_at_1x2_and_2x1": interchange_at_1x2_and_2x1,
        "plain_norms_resume_at_1x2_and_2x1": plain_norms_resume_at_1x2_and_2x1,
    },
    1: {"resume_at_1x1": resume_at_1x1},
}


def on_gpus(rank: int, world: int) -> None:
    """The three compositions on the GPUs there are (NCCL, CUDA streams, pinned host memory)."""
    shapes = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(4, 1), (2, 2), (1, 4)]}[world]
    for dp, tp in shapes:
        mesh = mesh_2d(dp, tp, "cuda")
        for composition in COMPOSITIONS:
            parity("llama", mesh, 0.5, composition)
            if tp < 4:  # the MLP's 2 rows over 4 ranks: torch's own matmul refuses the shards
                parity("mlp", mesh, 1.0, composition)
        if tp < 4:
            non_finite_grad_on_one_rank_skips_everywhere(mesh, "replicated")


@pytest.mark.cuda
def test_on_gpus() -> None:
    world = {1: 1, 2: 2, 3: 2}.get(torch.cuda.device_count(), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_outcome(run_cases({"on_gpus": on_gpus}, world, backend="nccl"), "on_gpus")


@pytest.mark.cuda
def test_checkpoints_on_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU phases' checkpoints on NCCL: saved at dp 2 x tp 2, resumed at dp 4 x tp 1 and
    dp 2 x tp 2 on four GPUs, at dp 1 x tp 2 and dp 2 x tp 1 on two, and on one."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs; runs on a machine with 4 GPUs")
    monkeypatch.setenv("ZERO_SHARD_TEST_DIR", str(tmp_path))
    monkeypatch.setenv("ZERO_SHARD_TEST_MESH", "cuda")  # the spawned ranks inherit both
    phases = {
        4: {"save": save_at_2x2_then_go_on, "resume_at_4x1_and_2x2": resume_at_4x1_and_2x2},
        2: {"resume_at_1x2_and_2x1": resume_at_1x2_and_2x1},
        1: {"resume_at_1x1": resume_at_1x1},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for world, cases in phases.items():
            outcomes = run_cases(cases, world, backend="nccl")
            for name in cases:
                check_outcome(outcomes, name)


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
