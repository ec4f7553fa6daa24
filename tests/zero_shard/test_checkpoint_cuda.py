"""Checkpoints on 2 GPUs with NCCL: saved with half the optimizer state on the GPU and half in
host memory, loaded at other offload fractions, stages and world sizes and compared with
uninterrupted training; where the loaded state lives; async saves beside NCCL training. The CPU
(gloo) versions of these cases are in test_checkpoint.py. Run on a machine with 2 GPUs
(docs/gpu-tests.md); skipped with fewer than 2 GPUs.

Two spawns: the cases at 2 ranks (the save first), then one process loading the same checkpoint.
They share a folder through ZERO_SHARD_TEST_DIR, set before the processes are spawned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import check_outcome, run_cases
from _models import adamw, global_batch, local_slice, make_model, mse
from torch import nn
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy, ZeroShardOptimizer

pytestmark = pytest.mark.cuda

WORLD = 2
TINY_BUCKETS = 0.0008  # MiB: several buckets for the small model
SAVE_AT, CONTINUE = 3, 5
EXACT = {"rtol": 0.0, "atol": 0.0}
# Loaded at another fraction or stage, elements are stepped by the other device's AdamW kernel
# (torch's fused CUDA AdamW or the CPU kernel: the same formula, rounded apart by an ulp) and, at
# stage 1, the grads are all-reduced instead of reduce-scattered; on one GPU, cuBLAS may pick
# other kernels for a 12-row batch than for two 6-row ones, so grads differ by ~1e-6 relative
# (as in test_wrap_cuda.py). AdamW's update, lr * m / (sqrt(v) + eps), carries such relative
# differences into the params at O(lr) = 1e-2 a step, over 5 steps. Loaded in the saving run's
# layout the arithmetic is the same: bit for bit (EXACT).
RESHARD_TOL = {"rtol": 2e-5, "atol": 2e-6}


def folder() -> Path:
    return Path(os.environ["ZERO_SHARD_TEST_DIR"])


def gpu(rank: int) -> torch.device:
    return torch.device("cuda", rank)


def policy(fraction: float) -> OffloadPolicy | None:
    """16-element chunks: several per param, so some params straddle chunks and devices."""
    return None if fraction == 0 else OffloadPolicy(fraction=fraction, chunk_numel=16)


def build(
    device: torch.device, fraction: float, stage: int = 2, seed: int = 0
) -> tuple[nn.Module, ZeroShardOptimizer]:
    model = make_model(seed=seed).to(device)
    opt = zero_shard.wrap(
        adamw(model), model, offload=policy(fraction), stage=stage, bucket_mb=TINY_BUCKETS
    )
    return model, opt


def train(model: nn.Module, opt: ZeroShardOptimizer, rank: int, world: int, steps: range) -> None:
    param = next(model.parameters())
    for step in steps:
        x, y = (t.to(param.device, param.dtype) for t in global_batch(step))
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    opt.finish_param_sync()


def on_rank0(rank: int, check: Callable[[], None]) -> None:
    """Runs ``check`` on rank 0 and raises its failure on every rank, so that no rank goes on
    alone into the next case's collectives."""
    failure: list[str | None] = [None]
    if rank == 0:
        try:
            check()
        except AssertionError as err:
            failure[0] = str(err)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise AssertionError(failure[0])


def check_placement(opt: ZeroShardOptimizer, fraction: float, device: torch.device) -> None:
    """The live optimizer state sits where the policy puts it: ``fraction`` of this rank's
    elements (to the element) with their fp32 main weights and state in host memory and their
    staging buffers (what the copies to and from the GPU go through) pinned; the rest on the
    GPU. The host state itself is pageable by design: only the staging crosses PCIe."""
    report = opt.memory_report()
    num_elements = report.num_device_elements + report.num_host_elements
    assert report.device == str(device), report
    assert report.num_host_elements == math.floor(fraction * num_elements + 0.5), report
    assert report.pinned is (None if fraction == 0 else True), report
    # White-box: state_dict() shows a param cut between devices as a CPU copy, so only the
    # records say where each piece's main weight and state live.
    for record in opt._hybrid._records:
        for piece in record.pieces:
            on_host = piece.offset is not None
            where = "cpu" if on_host else device.type
            assert piece.main.device.type == where, (record.index, piece.spec)
            assert piece.state, f"param {record.index} has no state after the load"
            for key, value in piece.state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    assert value.device.type == where, (record.index, key, value.device)


def assert_full_states_equal(mine: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """Two ``full_state_dict``s hold the same values, bit for bit (``step`` may be kept in
    another dtype by another device's optimizer)."""
    assert mine["param_groups"] == saved["param_groups"], where
    assert mine["state"].keys() == saved["state"].keys(), where
    for fqn, state in saved["state"].items():
        assert mine["state"][fqn].keys() == state.keys(), (where, fqn)
        for key, value in state.items():
            torch.testing.assert_close(
                mine["state"][fqn][key], value, **EXACT, check_dtype=False,
                msg=f"{where}: {fqn} {key}",
            )  # fmt: skip


def check_loaded(
    rank: int, model: nn.Module, opt: ZeroShardOptimizer, saved: dict[str, Any], where: str
) -> None:
    """Right after a load, the model and the optimizer hold the saved values, bit for bit,
    whatever the layout: a load moves values and does no arithmetic."""
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.detach().cpu(), saved["model"][name], **EXACT, msg=f"{where}: {name}"
        )
    full = zero_shard.full_state_dict(opt)  # collective; the full tensors on rank 0
    on_rank0(rank, lambda: assert_full_states_equal(full, saved["optim"], where))


def compare_with_reference(
    rank: int, model: nn.Module, opt: ZeroShardOptimizer, where: str, tol: dict[str, float]
) -> None:
    reference = torch.load(folder() / "reference.pt", map_location="cpu")
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.detach().cpu(), reference["params"][name], **tol, msg=f"{where}: {name}"
        )
    full = zero_shard.full_state_dict(opt)

    def check() -> None:
        for fqn, state in reference["optim"]["state"].items():
            assert int(full["state"][fqn]["step"]) == SAVE_AT + CONTINUE, (where, fqn)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(full["state"][fqn][key], state[key], **tol,
                                           msg=f"{where}: {fqn} {key}")  # fmt: skip

    on_rank0(rank, check)


def save_half_offloaded_then_go_on(rank: int, world: int) -> None:
    """The run every other case compares with: fraction 0.5 (state on the GPU and in pinned-
    staged host memory), saved at step SAVE_AT, then trained CONTINUE steps more."""
    device = gpu(rank)
    model, opt = build(device, fraction=0.5)
    train(model, opt, rank, world, range(SAVE_AT))
    check_placement(opt, 0.5, device)
    zero_shard.checkpoint.save(
        folder() / "ckpt", model=model, optimizer=opt, extra={"step": SAVE_AT}
    )
    full = zero_shard.full_state_dict(opt)  # the torch.save path, and the values saved
    model_state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    if rank == 0:
        torch.save({"optim": full, "model": model_state}, folder() / "saved.pt")
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE))
    params = {name: param.detach().cpu() for name, param in model.named_parameters()}
    full = zero_shard.full_state_dict(opt)
    if rank == 0:
        torch.save({"params": params, "optim": full}, folder() / "reference.pt")
    dist.barrier()


def resume_and_go_on(
    rank: int, world: int, *, fraction: float, stage: int, tol: dict[str, float]
) -> None:
    device = gpu(rank)
    where = f"{world} rank(s), fraction {fraction}, stage {stage}"
    model, opt = build(device, fraction, stage, seed=1)  # other weights: the load replaces them
    extra = zero_shard.checkpoint.load(folder() / "ckpt", model=model, optimizer=opt)
    assert extra == {"step": SAVE_AT}
    check_placement(opt, fraction, device)
    saved = torch.load(folder() / "saved.pt", map_location="cpu")
    check_loaded(rank, model, opt, saved, where)
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE))
    compare_with_reference(rank, model, opt, where, tol)


def resume_all_offloaded(rank: int, world: int) -> None:
    resume_and_go_on(rank, world, fraction=1.0, stage=2, tol=RESHARD_TOL)


def resume_on_the_gpu_at_stage_1(rank: int, world: int) -> None:
    resume_and_go_on(rank, world, fraction=0.0, stage=1, tol=RESHARD_TOL)


def resume_in_the_saving_layout(rank: int, world: int) -> None:
    resume_and_go_on(rank, world, fraction=0.5, stage=2, tol=EXACT)


def resume_from_full_state_dict(rank: int, world: int) -> None:
    """The torch.save path: the state gathered by ``full_state_dict`` at the save, given on rank
    0 only, into another layout (all on the GPU, stage 1)."""
    device = gpu(rank)
    saved = torch.load(folder() / "saved.pt", map_location="cpu")
    model, opt = build(device, fraction=0.0, stage=1, seed=1)
    model.load_state_dict(saved["model"])  # the model first, then the optimizer
    zero_shard.load_full_state_dict(opt, saved["optim"] if rank == 0 else None)
    check_placement(opt, 0.0, device)
    check_loaded(rank, model, opt, saved, "load_full_state_dict")
    train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + CONTINUE))
    compare_with_reference(rank, model, opt, "load_full_state_dict", RESHARD_TOL)


def async_save_beside_nccl_training(rank: int, world: int) -> None:
    """async_save's collectives run on zero-shard's own gloo group in the background while the
    training's NCCL collectives go on; the checkpoint holds the state as of the call."""
    device = gpu(rank)
    assert dist.get_backend() == "nccl"
    model, opt = build(device, fraction=0.5)
    train(model, opt, rank, world, range(2))
    snapshot = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    snapshot_state = zero_shard.full_state_dict(opt)
    future = zero_shard.checkpoint.async_save(folder() / "async", model=model, optimizer=opt,
                                              extra={"step": 2})  # fmt: skip
    # White-box: the checkpoint's own group is private; the outcome (a correct checkpoint beside
    # NCCL training) is checked below.
    assert dist.get_backend(zero_shard.checkpoint._checkpoint_group()) == "gloo"
    train(model, opt, rank, world, range(2, 6))  # NCCL reduce-scatters and gathers meanwhile
    future.result(timeout=120)
    dist.barrier()
    loaded, loaded_opt = build(device, fraction=1.0, seed=1)
    extra = zero_shard.checkpoint.load(folder() / "async", model=loaded, optimizer=loaded_opt)
    assert extra == {"step": 2}
    check_placement(loaded_opt, 1.0, device)
    check_loaded(rank, loaded, loaded_opt, {"model": snapshot, "optim": snapshot_state}, "async")

    # A second async save replaces the first once complete.
    future = zero_shard.checkpoint.async_save(folder() / "async", model=model, optimizer=opt,
                                              extra={"step": 6})  # fmt: skip
    future.result(timeout=120)
    dist.barrier()
    extra = zero_shard.checkpoint.load(folder() / "async", model=loaded, optimizer=loaded_opt)
    assert extra == {"step": 6}
    for (name, param), other in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(param.detach(), other.detach()), name


def async_save_of_a_bf16_model(rank: int, world: int) -> None:
    """bf16 params: the state dict holds their fp32 main weights too, views into this rank's flat
    buffers (at offsets). Fraction 0 keeps several params in one flat buffer on the GPU."""
    device = gpu(rank)
    for fraction in (0.0, 0.5):
        model = make_model().to(device, torch.bfloat16)
        opt = zero_shard.wrap(adamw(model), model, offload=policy(fraction), bucket_mb=TINY_BUCKETS)
        train(model, opt, rank, world, range(2))
        params = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
        saved = {"model": params, "optim": zero_shard.full_state_dict(opt)}
        path = folder() / f"async_bf16_{fraction}"
        future = zero_shard.checkpoint.async_save(path, model=model, optimizer=opt)
        future.result(timeout=120)
        dist.barrier()
        loaded = make_model(seed=1).to(device, torch.bfloat16)
        loaded_opt = zero_shard.wrap(adamw(loaded), loaded, offload=policy(1.0),
                                     bucket_mb=TINY_BUCKETS)  # fmt: skip
        zero_shard.checkpoint.load(path, model=loaded, optimizer=loaded_opt)
        check_placement(loaded_opt, 1.0, device)
        check_loaded(rank, loaded, loaded_opt, saved, f"async, bf16, fraction {fraction}")


def state_dict_keeps_host_state_on_the_host(rank: int, world: int) -> None:
    """CPU-resident state saves without a GPU round trip (DCP writes CPU views directly). All of
    it is on the host here; the state dict must hand it to DCP there."""
    model, opt = build(gpu(rank), fraction=1.0)
    train(model, opt, rank, world, range(1))
    on_gpu = [
        f"{fqn}.{key}"
        for fqn, state in opt.state_dict()["state"].items()
        for key, value in state.items()
        if isinstance(value, DTensor) and value.to_local().device.type != "cpu"
    ]
    assert not on_gpu, f"host-resident state handed to DCP on the GPU (copied there): {on_gpu}"


CASES_AT_TWO = {
    function.__name__: function
    for function in (
        save_half_offloaded_then_go_on,  # first: the others load its files
        resume_all_offloaded,
        resume_on_the_gpu_at_stage_1,
        resume_in_the_saving_layout,
        resume_from_full_state_dict,
        async_save_beside_nccl_training,
        async_save_of_a_bf16_model,
        state_dict_keeps_host_state_on_the_host,
    )
}


def resume_on_one_gpu(rank: int, world: int) -> None:
    assert world == 1
    resume_and_go_on(rank, world, fraction=0.5, stage=2, tol=RESHARD_TOL)


CASES_AT_ONE = {"resume_on_one_gpu": resume_on_one_gpu}  # after the save at two ranks


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs; runs on a machine with 2 GPUs")
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("cuda_checkpoints"))
    results = run_cases(CASES_AT_TWO, WORLD, backend="nccl")
    results.update(run_cases(CASES_AT_ONE, 1, backend="nccl"))
    return results


@pytest.mark.parametrize("name", [*CASES_AT_TWO, *CASES_AT_ONE])
def test_checkpoints_on_two_gpus(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
