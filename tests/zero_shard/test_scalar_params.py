"""0-dim params (CLIP's ``logit_scale``) on 1, 2 and 3 CPU processes (gloo): parity with plain
torch AdamW on the unsharded model every step (outputs, params, state, the clip norm), every
rank's copy equal bit for bit, at stage 1 and 2, offload fractions 0, 0.5 and 1, in a plain, a
DDP and a tensor-parallel model; checkpoints (DCP at another world size and fraction,
``full_state_dict``) and their interchange with FSDP2 + torch AdamW, which trains a 0-dim param
only as an ignored param ([Note: 0-dim params] in ``zero_shard/_bucket_layout.py``).

The phases share a folder through ZERO_SHARD_TEST_DIR, set before the processes are spawned.
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
from _models import GLOBAL_BATCH, LR, PARAM_TOL, global_batch, local_slice, mse
from torch import nn
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy

TINY_BUCKETS = 0.0008  # MiB: several buckets, some holding a 0-dim param beside others
STEPS = 4
SAVE_AT, CONTINUE = 2, 3
# Grads averaged over ranks differ from the reference's one mean by a few ulps; AdamW carries
# that into params and state at O(lr) a step (as _models.PARAM_TOL says). Outputs get the same.
TOL = PARAM_TOL


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-dim, inside a unit (a repeated block)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate * torch.tanh(self.lin(h))


class ScaledNet(nn.Module):
    """Odd shapes (some shards empty at 3 ranks) and 0-dim params: the root's first param, and
    one per block."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))  # CLIP's
        self.inp = nn.Linear(15, 7)
        self.blocks = nn.ModuleList([Block(7), Block(7)])
        self.out = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h) * (self.logit_scale.exp() / 10)


def make_model(seed: int = 0) -> ScaledNet:
    torch.manual_seed(seed)
    return ScaledNet()


def adamw(model: nn.Module) -> torch.optim.AdamW:
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            # The 0-dim params are decayed too, with their own lr: their group's options apply.
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.05, "lr": LR / 2},
        ],
        lr=LR,
    )


def offload(fraction: float) -> OffloadPolicy | None:
    return None if fraction == 0 else OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=4)


def build(fraction: float, *, stage: int = 2, seed: int = 0) -> tuple[ScaledNet, Any]:
    model = make_model(seed)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(fraction), stage=stage,
                          bucket_mb=TINY_BUCKETS)  # fmt: skip
    return model, opt


def folder() -> Path:
    return Path(os.environ["ZERO_SHARD_TEST_DIR"])


def full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_close(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda text: f"{where}: {text}")


def assert_like_reference(
    model: nn.Module, opt: Any, ref: nn.Module, ref_opt: Any, where: str
) -> None:
    """Params and every state entry, against torch; a 0-dim param's state is 0-dim, as torch's."""
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(full(param.detach()), ref_param.detach(), f"{where}: {name}")
        state, ref_state = opt.state[param], ref_opt.state[ref_param]
        assert set(state) == set(ref_state), (where, name, set(state))
        for key, ref_value in ref_state.items():
            value = full(state[key])
            assert value.shape == ref_value.shape, (where, name, key, value.shape)
            assert_close(value.to(ref_value.dtype), ref_value, f"{where}: {name} {key}")


def assert_every_rank_alike(model: nn.Module, opt: Any, where: str) -> None:
    """Every rank steps the 0-dim params: their values and state must be the same bits."""
    mine = []
    for param in model.parameters():
        if param.dim() == 0:
            state = opt.state[param]
            mine += [param.detach(), state["exp_avg"], state["exp_avg_sq"]]
    mine = torch.stack(mine)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    for rank, theirs in enumerate(everyone):
        assert torch.equal(theirs, mine), f"{where}: rank {rank} holds {theirs}, this one {mine}"


def train_both(model: nn.Module, opt: Any, ref: nn.Module, ref_opt: Any, rank: int, world: int,
               steps: range, where: str, *, clip: float | None = None) -> None:  # fmt: skip
    for step in steps:
        x, y = global_batch(step)
        output = model(local_slice(x, rank, world))
        ref_output = ref(x)
        expected = local_slice(ref_output, rank, world).detach()
        assert_close(output, expected, f"{where}: output at step {step}")
        mse(output, local_slice(y, rank, world)).backward()
        mse(ref_output, y).backward()
        main_grad = opt.main_grad(model.logit_scale)  # every rank's: replicated, of shape ()
        assert isinstance(main_grad, DTensor) and main_grad.shape == (), main_grad
        assert_close(main_grad.full_tensor(), ref.logit_scale.grad, f"{where}: grad at {step}")
        if clip is not None:
            norm = opt.clip_grad_norm_(clip)
            ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert_close(norm, ref_norm, f"{where}: clip norm at step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_like_reference(model, opt, ref, ref_opt, f"{where}, after step {step}")
        assert_every_rank_alike(model, opt, f"{where}, after step {step}")


def reference(steps: int) -> tuple[ScaledNet, torch.optim.AdamW]:
    ref = make_model()
    ref_opt = adamw(ref)
    for step in range(steps):
        x, y = global_batch(step)
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return ref, ref_opt


def trains_like_torch_at_each_stage_and_fraction(rank: int, world: int) -> None:
    for stage in (1, 2):
        for fraction in (0.0, 0.5, 1.0):
            model, opt = build(fraction, stage=stage)
            ref = make_model()
            ref_opt = adamw(ref)
            # A small max norm: every step clips, so the 0-dim params count once in the norm.
            clip = 0.05 if stage == 2 else None
            train_both(model, opt, ref, ref_opt, rank, world, range(STEPS),
                       f"{world} ranks, stage {stage}, fraction {fraction}", clip=clip)  # fmt: skip
            del opt


def ddp_model_trains_like_torch(rank: int, world: int) -> None:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = zero_shard.wrap(adamw(model), ddp, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    ref = make_model()
    ref_opt = adamw(ref)
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        mse(ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_like_reference(model, opt, ref, ref_opt, f"DDP, {world} ranks, after step {step}")
        assert_every_rank_alike(model, opt, f"DDP, {world} ranks, after step {step}")


def check_torch_shaped_state(state_dict: dict[str, Any], where: str) -> None:
    """A 0-dim param's state is torch's: plain 0-dim tensors, as get_optimizer_state_dict gives
    for a plain param beside FSDP2's DTensors (``fsdp2_interchange_both_ways``)."""
    for fqn in ("logit_scale", "blocks.0.gate", "blocks.1.gate"):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            value = state_dict["state"][fqn][key]
            assert type(value) is torch.Tensor and value.shape == (), (where, fqn, key, value)


def save_at_three_ranks(rank: int, world: int) -> None:
    assert world == 3
    model, opt = build(0.5)
    ref = make_model()
    ref_opt = adamw(ref)
    train_both(model, opt, ref, ref_opt, rank, world, range(SAVE_AT), "before the save")
    state_dict = opt.state_dict()
    check_torch_shaped_state(state_dict, "state_dict()")
    assert isinstance(state_dict["state"]["inp.weight"]["exp_avg"], DTensor)
    zero_shard.checkpoint.save(folder() / "ckpt", model=model, optimizer=opt)
    whole = zero_shard.full_state_dict(opt)
    if rank == 0:
        check_torch_shaped_state(whole, "full_state_dict")
        torch.save({"optim": whole, "model": model.state_dict()}, folder() / "full.pt")
    else:
        assert whole == {}
    # The saving run goes on as torch does.
    train_both(model, opt, ref, ref_opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE),
               "after the save")  # fmt: skip
    dist.barrier()


def resume(rank: int, world: int, *, fraction: float, stage: int) -> None:
    model, opt = build(fraction, stage=stage, seed=1)  # other weights: the checkpoint replaces them
    zero_shard.checkpoint.load(folder() / "ckpt", model=model, optimizer=opt)
    ref, ref_opt = reference(SAVE_AT)
    where = f"loaded at {world} ranks, fraction {fraction}"
    assert_like_reference(model, opt, ref, ref_opt, where)
    train_both(model, opt, ref, ref_opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE), where)
    del opt
    # The torch.save path: the full state dict, given on rank 0 only.
    model, opt = build(fraction, stage=stage, seed=1)
    saved = torch.load(folder() / "full.pt")
    model.load_state_dict(saved["model"])
    zero_shard.load_full_state_dict(opt, saved["optim"] if rank == 0 else None)
    ref, ref_opt = reference(SAVE_AT)
    where = f"full state dict at {world} ranks, fraction {fraction}"
    train_both(model, opt, ref, ref_opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE), where)


def resume_at_two_ranks_all_offloaded(rank: int, world: int) -> None:
    resume(rank, world, fraction=1.0, stage=2)


def resume_in_one_process_at_stage_1(rank: int, world: int) -> None:
    resume(rank, world, fraction=0.0, stage=1)


def fsdp2_model(world: int) -> tuple[ScaledNet, list[nn.Parameter]]:
    """FSDP2 refuses 0-dim params: they are left to the user as ignored params, plain tensors
    whose grads the training averages itself (``train_fsdp2``), in model order on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    scalars = [p for p in model.parameters() if p.dim() == 0]
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=set(scalars))
    fully_shard(model, mesh=mesh, ignored_params=set(scalars))
    return model, scalars


def train_fsdp2(model: nn.Module, opt: torch.optim.Optimizer, scalars: list[nn.Parameter],
                rank: int, world: int, steps: range) -> None:  # fmt: skip
    for step in steps:
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        for param in scalars:
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        opt.zero_grad()


def fsdp2_interchange_both_ways(rank: int, world: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    theirs, scalars = fsdp2_model(world)
    their_opt = adamw(theirs)
    train_fsdp2(theirs, their_opt, scalars, rank, world, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(theirs, their_opt)
    for key in ("exp_avg", "exp_avg_sq"):  # what torch gives for a 0-dim param: plain, 0-dim
        value = optim_sd["state"]["logit_scale"][key]
        assert type(value) is torch.Tensor and value.shape == (), (key, value)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder() / "from_fsdp2"))
    model, opt = build(0.5, seed=1)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=str(folder() / "from_fsdp2"))
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    ref, ref_opt = reference(SAVE_AT)
    train_both(model, opt, ref, ref_opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE),
               "FSDP2 -> zero-shard")  # fmt: skip

    zero_shard.checkpoint.save(folder() / "to_fsdp2", model=model, optimizer=opt)
    fresh, fresh_scalars = fsdp2_model(world)
    fresh_opt = adamw(fresh)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(folder() / "to_fsdp2"))
    set_state_dict(fresh, fresh_opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])  # fmt: skip
    end = SAVE_AT + CONTINUE
    train_fsdp2(fresh, fresh_opt, fresh_scalars, rank, world, range(end, end + 2))
    train_both(model, opt, ref, ref_opt, rank, world, range(end, end + 2), "zero-shard -> FSDP2")
    for (name, param), their_param in zip(
        model.named_parameters(), fresh.parameters(), strict=True
    ):
        where = f"zero-shard -> FSDP2: {name}"
        assert_close(param.detach(), full(their_param).detach(), where)
        for key in ("exp_avg", "exp_avg_sq"):
            theirs = full(fresh_opt.state[their_param][key])
            assert_close(full(opt.state[param][key]), theirs, f"{where} {key}")


def fsdp2_with_an_ignored_0_dim_param_is_refused(rank: int, world: int) -> None:
    model, _ = fsdp2_model(world)
    with pytest.raises(ValueError, match="'logit_scale' is 0-dim, which fully_shard refuses"):
        zero_shard.wrap(adamw(model), model)


class TensorParallelNet(nn.Module):
    """A column- then a row-parallel layer, and a 0-dim param the plan leaves plain."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.7))
        self.up = nn.Linear(15, 6)
        self.down = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) * self.logit_scale


def tensor_parallel_model_with_a_0_dim_param(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # (1, 2): one data-parallel rank, whose buckets mix plain and tensor-parallel params.
    for shape in ((1, world), (world, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = TensorParallelNet()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        opt = zero_shard.wrap(adamw(model), model, mesh=mesh["dp"], offload=offload(0.5))
        torch.manual_seed(0)
        ref = TensorParallelNet()
        ref_opt = adamw(ref)
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        where = f"mesh {shape}"
        for step in range(STEPS):
            x, y = global_batch(step)
            mse(
                model(local_slice(x, dp_rank, dp_size)), local_slice(y, dp_rank, dp_size)
            ).backward()
            mse(ref(x), y).backward()
            norm, ref_norm = (
                opt.clip_grad_norm_(0.05),
                nn.utils.clip_grad_norm_(ref.parameters(), 0.05),
            )
            assert_close(norm, ref_norm, f"{where}: clip norm at step {step}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            opt.finish_param_sync()
            assert_like_reference(model, opt, ref, ref_opt, f"{where}, after step {step}")
        del opt


assert GLOBAL_BATCH % 3 == 0 and GLOBAL_BATCH % 2 == 0
CASES_BY_WORLD = {
    3: {
        "trains_like_torch_at_3_ranks": trains_like_torch_at_each_stage_and_fraction,
        "ddp_model_at_3_ranks": ddp_model_trains_like_torch,
        "save_at_three_ranks": save_at_three_ranks,
    },
    2: {
        "trains_like_torch_at_2_ranks": trains_like_torch_at_each_stage_and_fraction,
        "resume_at_two_ranks_all_offloaded": resume_at_two_ranks_all_offloaded,
        "fsdp2_interchange_both_ways": fsdp2_interchange_both_ways,
        "fsdp2_with_an_ignored_0_dim_param_is_refused": fsdp2_with_an_ignored_0_dim_param_is_refused,
        "tensor_parallel_model_with_a_0_dim_param": tensor_parallel_model_with_a_0_dim_param,
    },
    1: {
        "trains_like_torch_at_1_rank": trains_like_torch_at_each_stage_and_fraction,
        "resume_in_one_process_at_stage_1": resume_in_one_process_at_stage_1,
    },
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("scalar_params"))
    results: dict[str, str | None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for world, cases in CASES_BY_WORLD.items():  # 3 first: it writes the checkpoints
            results.update(run_cases(cases, world))
    return results


@pytest.mark.parametrize("name", [name for cases in CASES_BY_WORLD.values() for name in cases])
def test_scalar_params(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
