"""zero_shard.wrap on 2 and 3 CPU processes (gloo): parity with single-process torch AdamW on the
same global batch, every step; accumulation, clipping, non-finite grads, DDP and FSDP2 models."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from _clip_at_step import check_clip_at_step
from _harness import check_outcome, delayed, run_cases
from _models import (
    LOSS_TOL,
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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import zero_shard
from optimizers import _host_part as host_part
from zero_shard import OffloadPolicy
from zero_shard._fsdp import FSDPKind

CASES = {}
STEPS = 10
TINY_BUCKETS = 0.0008  # MiB: about 800 bytes, so the 6 params of the test model fill 4 buckets


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def offload(fraction: float) -> OffloadPolicy | None:
    if fraction == 0:
        return None
    return OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)


def train_in_parity(rank: int, world: int, *, fraction: float, stage: int, overlap: bool) -> None:
    model, ref = make_model(), make_model()
    opt = zero_shard.wrap(
        adamw(model),
        model,
        offload=offload(fraction),
        stage=stage,
        overlap_param_gather=overlap,
        bucket_mb=TINY_BUCKETS,
    )
    ref_opt = adamw(ref)
    for step in range(STEPS):
        x, y = global_batch(step)
        output = model(local_slice(x, rank, world))
        # The forward made every param current (the pre-hooks waited for the gathers). White-box:
        # no public API says whether a gather is still in flight (reading the params races it).
        assert not opt.kind.pending
        assert_params_close(model, ref, f"before step {step}")
        loss = mse(output, local_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(mean_over_ranks(loss), ref_loss.detach(), **LOSS_TOL)
        assert opt.kind.pending == overlap  # with overlap, the gathers wait for forward (as above)
    opt.finish_param_sync()
    assert_params_close(model, ref, "after the last step")
    # Every state tensor is a DTensor with the param's global shape, equal to the reference's.
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        state = opt.state[param]
        assert int(state["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) and state[key].shape == param.shape
            torch.testing.assert_close(
                state[key].full_tensor(), ref_opt.state[ref_param][key], **PARAM_TOL
            )
        assert "main_param" not in state  # fp32 params are their own main weights


@case
def parity_stage2_all_on_accelerator(rank: int, world: int) -> None:
    train_in_parity(rank, world, fraction=0.0, stage=2, overlap=True)


@case
def parity_stage2_half_offloaded(rank: int, world: int) -> None:
    train_in_parity(rank, world, fraction=0.5, stage=2, overlap=True)


@case
def parity_stage2_all_offloaded(rank: int, world: int) -> None:
    train_in_parity(rank, world, fraction=1.0, stage=2, overlap=False)


@case
def parity_stage1(rank: int, world: int) -> None:
    for fraction in (0.0, 0.5, 1.0):
        train_in_parity(rank, world, fraction=fraction, stage=1, overlap=fraction != 0.5)


@case
def overlap_on_and_off_give_identical_params(rank: int, world: int) -> None:
    runs = []
    for overlap in (True, False):
        model = make_model()
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(0.5), overlap_param_gather=overlap,
            bucket_mb=TINY_BUCKETS,
        )  # fmt: skip
        for step in range(5):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        opt.finish_param_sync()
        runs.append([p.detach().clone() for p in model.parameters()])
    for with_overlap, without in zip(*runs, strict=True):
        assert torch.equal(with_overlap, without)


def slow_cpu_steps(seconds: float) -> contextlib.AbstractContextManager:
    """Every chunk's CPU step takes ``seconds`` longer: a forward that did not wait for it would
    read old weights."""
    # Private: the race test slows the worker's chunk step itself; no public hook reaches it.
    return delayed(host_part, "_step_chunk", lambda: time.sleep(seconds))


@case
def cpu_step_runs_on_during_the_next_forward(rank: int, world: int) -> None:
    # Race test of the deferred CPU step: step() returns while the worker still steps; the next
    # forward waits bucket by bucket. Rank 0 alone is slowed, so the ranks' CPU steps end at
    # different times, and a collective of the user's between step and forward (the loss mean)
    # must still meet the same collective on every rank.
    runs = []
    for overlap in (True, False):
        model = make_model()
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(1.0), overlap_param_gather=overlap,
            bucket_mb=TINY_BUCKETS / 8,  # one param per bucket
        )  # fmt: skip
        # White-box precondition: one bucket (one wait) per param; no public API counts buckets.
        assert len(opt.kind.buckets) == 6
        losses = []
        with slow_cpu_steps(0.01 if rank == 0 else 0.0):
            for step in range(4):
                x, y = global_batch(step)
                loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
                # White-box (here and below): no public API says whether the CPU step is still
                # running; the outcome (params and losses) is compared with overlap off below.
                assert opt._hybrid._host.pending is None  # the forward completed the CPU step
                loss.backward()
                opt.step()
                if overlap and rank == 0:
                    assert opt._hybrid._host.pending is not None  # still stepping on the CPU
                losses.append(mean_over_ranks(loss))
                opt.zero_grad()
        opt.finish_param_sync()
        runs.append([p.detach().clone() for p in [*model.parameters(), *losses]])
    for with_overlap, without in zip(*runs, strict=True):
        assert torch.equal(with_overlap, without)
    # The slowed steps did step: the params moved from their initial values.
    initial = [p.detach() for p in make_model().parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(initial, runs[0], strict=False))


@case
def accumulation_with_and_without_no_sync(rank: int, world: int) -> None:
    # no_sync on the first micro-batch (as with DDP), on none (each is reduced and the shards
    # accumulate), on both (the grads left on the params are reduced at the step).
    for no_sync_on in ({0}, set(), {0, 1}):
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        ref_opt = adamw(ref)
        for step in range(4):
            x, y = global_batch(step)
            xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
            half = xs.shape[0] // 2
            # Two equal micro-batches: the mean of their mean losses is the local mean loss.
            for index, micro in enumerate((slice(0, half), slice(half, None))):
                with opt.no_sync() if index in no_sync_on else contextlib.nullcontext():
                    (mse(model(xs[micro]), ys[micro]) / 2).backward()
                # Reduced grads leave the params (a placeholder without memory stands in).
                unreduced = all(type(p.grad) is torch.Tensor for p in model.parameters())
                assert unreduced == (index in no_sync_on)
            opt.step()
            opt.zero_grad()
            step_reference(ref, ref_opt, x, y)
        opt.finish_param_sync()
        assert_params_close(model, ref, f"no_sync on micro-batches {no_sync_on}")


@case
def clip_grad_norm_equals_torch_on_the_whole_model(rank: int, world: int) -> None:
    # A CPU share defers the clip's multiply to the step; without, it multiplies whole buckets.
    cases = [(0.5, 2.0), (0.5, float("inf")), (0.5, 1.0), (0.0, 2.0), (0.0, 0.5), (0.0, 3.0)]
    for fraction, norm_type in cases:
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        ref_opt = adamw(ref)
        for step in range(3):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            norm = opt.clip_grad_norm_(0.05, norm_type=norm_type)
            mse(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0.0)
            assert float(ref_norm) > 0.05  # the clip really scales the grads down
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"clipped, norm {norm_type}, fraction {fraction}")


def snapshot(opt: zero_shard.ZeroShardOptimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    """Every local tensor the optimizer and the model hold: the params, and this rank's rows of
    every state tensor its state dict shows (steps, moments, main weights)."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state_dict()["state"].values():
        for value in state.values():
            local = value.to_local() if isinstance(value, DTensor) else value
            if torch.is_tensor(local):
                tensors.append(local.detach().clone())
    return tensors


def assert_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)  # bit for bit, NaN-free


@case
def nonfinite_grad_on_one_rank_skips_the_step_everywhere(rank: int, world: int) -> None:
    # AdamW (fused) skips on the device and the CPU worker, with no host sync; RMSprop (no fused
    # kernel) and nonfinite="raise" read the verdict on the host at step().
    rmsprop = lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9)  # noqa: E731
    for policy, make_opt in (("skip", adamw), ("skip", rmsprop), ("raise", adamw)):
        model = make_model()
        opt = zero_shard.wrap(
            make_opt(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS, nonfinite=policy
        )
        # White-box: where the verdict is read (device or host) shows in no public API, only in
        # timing; the outcome (nothing changes on any rank) is checked below.
        assert opt._hybrid.skips_on_device == (make_opt is adamw)
        x, y = global_batch(0)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        opt.finish_param_sync()
        before = snapshot(opt, model)

        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[0, 0] = float("nan")  # row 0: its shard is rank 0's
            return grad

        handle = model.inp.weight.register_hook(poison) if rank == 0 else None
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        if handle is not None:
            handle.remove()
        shard = opt.main_grad(model.inp.weight).to_local()
        assert shard.isnan().any() == (rank == 0)  # only rank 0's shard holds the NaN
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if policy == "raise":
                with pytest.raises(RuntimeError, match="inf or a NaN"):
                    opt.step()
            else:
                opt.step()
        if policy == "skip":
            assert opt.num_skipped_steps == 1
            assert any("skipped a step" in str(w.message) for w in caught)
        opt.finish_param_sync()
        assert_unchanged(before, snapshot(opt, model))
        # Training goes on: the next, finite step changes the params.
        opt.zero_grad()
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.finish_param_sync()
        assert not torch.equal(before[0], model.inp.weight.detach())


@case
def fp16_overflow_skips_on_every_rank_and_backs_off(rank: int, world: int) -> None:
    model = make_model().half()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    scaler = zero_shard.GradScaler("cpu", init_scale=2.0**10)

    def backward(step: int, poison: bool) -> None:
        x, y = global_batch(step, torch.float16)
        loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        if poison:
            loss = loss * float("inf")
        scaler.scale(loss).backward()

    backward(0, poison=False)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    opt.finish_param_sync()
    assert scaler.get_scale() == 2.0**10
    before = snapshot(opt, model)
    backward(1, poison=rank == world - 1)  # an overflow on the last rank only
    scaler.unscale_(opt)
    opt.clip_grad_norm_(1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    opt.finish_param_sync()
    assert scaler.get_scale() == 2.0**9  # every rank backed off
    assert_unchanged(before, snapshot(opt, model))
    backward(2, poison=False)
    scaler.step(opt)
    scaler.update()
    opt.finish_param_sync()
    assert not torch.equal(before[0], model.inp.weight.detach())
    # The fp16 params are their fp32 main weights rounded, on every rank: the gather is whole.
    for param in model.parameters():
        main = opt.state[param]["main_param"].full_tensor()
        assert torch.equal(param.detach(), main.half())


@case
def params_without_grads_are_stepped_only_if_some_rank_has_one(rank: int, world: int) -> None:
    model, ref = make_model(with_side=True), make_model(with_side=True)
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    ref_opt = adamw(ref)
    never_before = model.never.weight.detach().clone()
    for step in range(4):
        x, y = global_batch(step)
        # `side` sees the first two rows of the global batch: only rank 0 has them.
        first_rows = 2 if rank == 0 else 0
        local = model(local_slice(x, rank, world), first_rows=first_rows)
        mse(local, local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        step_reference(ref, ref_opt, x, y, first_rows=2)
    opt.finish_param_sync()
    assert_params_close(model, ref, "with a branch on rank 0 and an unused layer")
    assert torch.equal(model.never.weight.detach(), never_before)  # no rank had its grad
    assert int(opt.state[model.never.weight]["step"]) == 0
    assert int(opt.state[model.side.weight]["step"]) == 4


@case
def ddp_model_uses_its_reduced_grads(rank: int, world: int) -> None:
    model, ref = make_model(), make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = zero_shard.wrap(adamw(model), ddp, offload=offload(0.5), stage=1, bucket_mb=TINY_BUCKETS)
    ref_opt = adamw(ref)
    for step in range(STEPS):
        x, y = global_batch(step)
        mse(ddp(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        step_reference(ref, ref_opt, x, y)
    opt.finish_param_sync()
    assert_params_close(model, ref, "DDP")


def local_shards_report(
    opt: zero_shard.ZeroShardOptimizer, policy: OffloadPolicy | None
) -> zero_shard.MemoryReport:
    """The memory report of a one-rank HybridDeviceOptimizer over copies of this rank's local
    shards of an FSDP2 model's params, in the same groups and with the same policy."""
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [torch.nn.Parameter(p.to_local().detach().clone()) for p in group["params"]],
        }
        for group in opt.param_groups
    ]
    return zero_shard.HybridDeviceOptimizer(
        groups, torch.optim.AdamW, policy=policy
    ).memory_report()


@case
def fsdp2_model_matches_fsdp2_with_torch_adamw(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.fsdp import OffloadPolicy as FSDPOffload

    mesh = init_device_mesh("cpu", (world,))

    def sharded_model(policy: FSDPOffload) -> torch.nn.Module:
        model = make_model()
        for layer in (model.inp, model.mid, model.out):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        return fully_shard(model, mesh=mesh, offload_policy=policy)

    # FSDP2's CPUOffloadPolicy on a CPU mesh (pinning needs an accelerator): its own code paths
    # (params kept on the host, copied for each gather) under zero-shard's full offload.
    host = CPUOffloadPolicy(pin_memory=False)
    for fraction, policy in ((0.0, FSDPOffload()), (1.0, FSDPOffload()), (1.0, host)):
        model, ref = sharded_model(policy), sharded_model(policy)
        opt = zero_shard.wrap(adamw(model), model, offload=offload(fraction))
        ref_opt = adamw(ref)
        assert isinstance(opt.kind, FSDPKind)
        # FSDP2 communicates: zero-shard holds no buffers beside the optimizer of the local shards.
        assert opt.memory_report() == local_shards_report(opt, offload(fraction))
        for step in range(5):
            x, y = global_batch(step)
            for net, net_opt in ((model, opt), (ref, ref_opt)):
                mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                net_opt.step()
                net_opt.zero_grad()
            assert_params_close(model, ref, f"FSDP2, fraction {fraction}, step {step}")
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                ours, theirs = opt.state[param][key], ref_opt.state[ref_param][key]
                assert ours.placements == theirs.placements
                torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), **PARAM_TOL)


@case
def bf16_params_are_their_main_weights_rounded(rank: int, world: int) -> None:
    model = make_model().bfloat16()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    first = None
    for step in range(5):
        x, y = global_batch(step, torch.bfloat16)
        loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        first = first if first is not None else float(mean_over_ranks(loss))
        loss.backward()
        grad = opt.main_grad(model.inp.weight)
        assert isinstance(grad, DTensor) and grad.shape == model.inp.weight.shape
        opt.step()
        opt.zero_grad()
        opt.finish_param_sync()
        for param in model.parameters():
            main = opt.state[param]["main_param"]
            assert main.dtype == torch.float32 and main.shape == param.shape
            assert torch.equal(param.detach(), main.full_tensor().bfloat16())
    memory = opt.memory_report()
    assert memory.num_host_elements > 0 and memory.num_device_elements > 0
    dist.barrier()


def train_steps(model, opt, rank: int, world: int, steps: range) -> None:  # type: ignore[no-untyped-def]
    dtype = next(model.parameters()).dtype
    for step in steps:
        x, y = global_batch(step, dtype)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    opt.finish_param_sync()


@case
def state_dict_round_trip_through_dcp_into_another_fraction(rank: int, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    model = make_model().bfloat16()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    train_steps(model, opt, rank, world, range(3))
    state = opt.state_dict()
    assert set(state["state"]) == {name for name, _ in model.named_parameters()}
    assert state["param_groups"][0]["params"] == ["inp.weight", "mid.weight", "out.weight"]
    main = state["state"]["inp.weight"]["main_param"]
    assert isinstance(main, DTensor) and main.dtype == torch.float32 and main.shape == (7, 15)
    paths = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(paths)
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=paths[0])
    train_steps(model, opt, rank, world, range(3, 6))  # the uninterrupted run

    resumed = make_model(seed=1).bfloat16()  # other weights: the checkpoint must replace them
    resumed_opt = zero_shard.wrap(
        adamw(resumed), resumed, offload=offload(1.0), bucket_mb=TINY_BUCKETS
    )
    target = {"model": resumed.state_dict(), "optim": resumed_opt.state_dict()}
    dcp.load(target, checkpoint_id=paths[0])  # fills the DTensors in place
    resumed.load_state_dict(target["model"])
    resumed_opt.load_state_dict(target["optim"])
    train_steps(resumed, resumed_opt, rank, world, range(3, 6))
    # Same arithmetic on other devices (torch's fused AdamW and zero-shard's CPU kernel agree
    # bit for bit on whole vectors, within half an ulp at vector tails): SAME_KERNEL-like.
    for param, other in zip(model.parameters(), resumed.parameters(), strict=True):
        main = opt.state[param]["main_param"].full_tensor()
        resumed_main = resumed_opt.state[other]["main_param"].full_tensor()
        torch.testing.assert_close(resumed_main, main, rtol=1e-6, atol=2e-7)
        assert int(resumed_opt.state[other]["step"]) == 6
    dist.barrier()
    if rank == 0:
        shutil.rmtree(paths[0])


@case
def a_mesh_listing_its_ranks_in_another_order_trains_as_torch(rank: int, world: int) -> None:
    # DeviceMesh("cpu", [2, 1, 0]): a rank's coordinate is not its rank in the mesh's group, by
    # which the reductions and gathers place its rows.
    mesh = DeviceMesh("cpu", list(reversed(range(world))))
    model, ref = make_model(), make_model()
    opt = zero_shard.wrap(adamw(model), model, mesh=mesh, offload=offload(0.5),
                          bucket_mb=TINY_BUCKETS)  # fmt: skip
    ref_opt = adamw(ref)
    for step in range(3):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        mse(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "after 3 steps")


@case
def clip_at_the_step_is_a_clip_before_it_bit_for_bit(rank: int, world: int) -> None:
    check_clip_at_step(torch.device("cpu"), rank, world)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_distributed(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
