"""zero_shard.wrap on the GPUs there are (up to 4) with NCCL: parity with single-process torch
AdamW, bf16 and fp16 runs, and a race test of the overlapped reduce-scatter and all-gather. Run
on the GPU machines (docs/gpu-tests.md);
skipped without a GPU."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _clip_at_step import check_clip_at_step
from _harness import check_outcome, delayed, run_cases
from _models import (
    adamw,
    global_batch,
    local_slice,
    make_model,
    mean_over_ranks,
    mse,
)
from _packing import check_back_to_back_packing
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy, _gather, _reduce

pytestmark = pytest.mark.cuda

CASES = {}
WORLD = min(torch.cuda.device_count(), 4)
# The reference runs the same math on one GPU over the whole batch; cuBLAS may pick other
# kernels for a 6-row and a 12-row batch (another summation order), so grads differ by ~1e-6
# relative rather than a few ulps; AdamW turns that into O(lr * 1e-6) per step.
CUDA_TOL = {"rtol": 2e-5, "atol": 2e-6}


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def policy(fraction: float, chunk_numel: int = 64) -> OffloadPolicy | None:
    """Small chunks for the small test model (several per param); 4M for big layers."""
    return None if fraction == 0 else OffloadPolicy(fraction=fraction, chunk_numel=chunk_numel)


@case
def parity_on_nccl(rank: int, world: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    for fraction, stage in ((0.0, 2), (0.5, 2), (1.0, 2), (0.5, 1)):
        model, ref = make_model().to(device), make_model().to(device)
        opt = zero_shard.wrap(
            adamw(model), model, offload=policy(fraction), stage=stage, bucket_mb=0.0008
        )
        ref_opt = torch.optim.AdamW(
            [{**g, "params": list(g["params"])} for g in adamw(ref).param_groups], fused=True
        )
        for step in range(10):
            x, y = (t.to(device) for t in global_batch(step))
            output = model(local_slice(x, rank, world))
            for (name, param), ref_param in zip(
                model.named_parameters(), ref.parameters(), strict=True
            ):
                torch.testing.assert_close(
                    param, ref_param, **CUDA_TOL, msg=f"{fraction}/{stage} step {step}: {name}"
                )
            loss = mse(output, local_slice(y, rank, world))
            loss.backward()
            clip = stage == 1  # without clipping, the step checks the grads for infs itself
            if clip and step % 2:
                opt.clip_grad_norm_(1.0)
            elif clip:  # torch's own clip on the released grads' placeholders
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            # Each way of clearing grads clears them (the reference's zero_grad is the same).
            clearer = (opt, model, model)[step % 3]
            clearer.zero_grad(set_to_none=step % 3 != 2)
            ref_loss = mse(ref(x), y)
            ref_loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(mean_over_ranks(loss), ref_loss.detach(), **CUDA_TOL)
        if fraction > 0:
            assert opt.memory_report().pinned
        assert opt.num_skipped_steps == 0


@case
def bf16_and_fp16_runs_keep_params_equal_to_main_weights(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    for dtype in (torch.bfloat16, torch.float16):
        model = make_model().to(device, dtype)
        opt = zero_shard.wrap(adamw(model), model, offload=policy(0.5), bucket_mb=0.0008)
        scaler = zero_shard.GradScaler("cuda", enabled=dtype == torch.float16)
        losses = []
        for step in range(20):
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            x, y = (t.to(device, dtype) for t in global_batch(step % 4))
            loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(mean_over_ranks(loss)))
            opt.finish_param_sync()
            for name, param in model.named_parameters():
                main = opt.state[param]["main_param"].full_tensor().to(dtype)
                differs = param.detach() != main
                assert not differs.any(), (
                    f"{dtype} step {step} {name}: {int(differs.sum())} of {main.numel()} elements "
                    f"differ (at {differs.nonzero()[:4].tolist()}), by up to "
                    f"{(param.detach().float() - main.float()).abs().max():.3g}; those hold the "
                    f"weights before the step: {torch.equal(param[differs], before[name][differs])}"
                )
        assert losses[-1] < losses[0], (dtype, losses)
        assert opt.num_skipped_steps == 0


def _late_once(seconds: float) -> Callable[[], None]:
    """A delay of ``seconds`` at its first call only."""
    calls = []

    def delay() -> None:
        if not calls:
            time.sleep(seconds)
        calls.append(None)

    return delay


@case
def memory_dropped_with_its_gather_in_flight_is_not_written_after(rank: int, world: int) -> None:
    # Rank 0's first all-gather comes late, so rank 1's gathers wait in NCCL on their stream
    # while rank 1 drops the model and optimizer right after step() and fills new tensors of the
    # params' sizes: memory the gathers still write must not be handed out ([Note: memory the
    # job uses]). Without the recording the fills took the old params' memory and read the
    # gathered weights afterwards.
    device = torch.device("cuda", rank)
    fill = 7.0
    for fraction in (0.0, 0.5):
        model = make_model().to(device, torch.bfloat16)
        opt = zero_shard.wrap(adamw(model), model, offload=policy(fraction), bucket_mb=0.0008)
        for step in range(2):  # the first makes the gathers' NCCL communicator (a blocking call)
            x, y = (t.to(device, torch.bfloat16) for t in global_batch(step))
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            if step == 0:
                opt.step()
                opt.zero_grad()
        with delayed(_gather, "_all_gather", _late_once(1.0 if rank == 0 else 0.0)):
            opt.step()
            sizes = [p.numel() for p in model.parameters()] * 4
            del model, opt
            gc.collect()
            fills = [torch.full((n,), fill, dtype=torch.bfloat16, device=device) for n in sizes]
            torch.cuda.synchronize(device)
        overwritten = [index for index, f in enumerate(fills) if not bool((f == fill).all())]
        dist.barrier()  # before the check: a rank that fails it leaves no other one waiting
        assert not overwritten, f"fraction {fraction}: fills {overwritten} were overwritten"


@case
def optimizer_state_edits_reach_host_state(rank: int, world: int) -> None:
    # On a GPU, host state reads as a DTensor copied to the GPU (and a param in several pieces
    # as a copy anyway): edits of those are written back ([Note: state edits]).
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    for fraction in (0.5, 1.0):
        model, ref = make_model().to(device), make_model().to(device)
        opt = zero_shard.wrap(adamw(model), model, offload=policy(fraction), bucket_mb=0.0008)
        ref_opt = torch.optim.AdamW(
            [{**g, "params": list(g["params"])} for g in adamw(ref).param_groups], fused=True
        )
        for step in range(6):
            if step == 2:
                for state, net in ((opt.state, model), (ref_opt.state, ref)):
                    state[net.inp.weight]["exp_avg"].zero_()
                    state[net.mid.weight]["exp_avg_sq"].mul_(4.0)
                    state[net.out.bias]["step"].zero_()
                    del state[net.out.weight]
            x, y = (t.to(device) for t in global_batch(step))
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            mse(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.finish_param_sync()
            for (name, param), ref_param in zip(
                model.named_parameters(), ref.parameters(), strict=True
            ):
                torch.testing.assert_close(
                    param, ref_param, **CUDA_TOL, msg=f"{fraction} step {step}: {name}"
                )


def _local(value: object) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else torch.as_tensor(value)


def with_main(state: dict[str, Any]) -> dict[str, Any]:
    """A param's state with its fp32 main weight, which ``opt.state[param]`` gives by name only."""
    try:
        return {**state, "main_param": state["main_param"]}
    except KeyError:
        return dict(state)


@case
def nonfinite_grad_skips_on_the_device(rank: int, world: int) -> None:
    # The verdict stays on the GPU (fused AdamW's found_inf, the CPU worker's copy of it): a NaN
    # in rank 0's grads leaves every rank's params and state bit-identical, and the host learns
    # of it at the next step.
    device = torch.device("cuda", rank)
    for fraction in (0.0, 0.5, 1.0):
        model = make_model().to(device, torch.bfloat16)
        opt = zero_shard.wrap(adamw(model), model, offload=policy(fraction), bucket_mb=0.0008)
        # White-box: where the verdict is read (device or host) shows in no public API, only in
        # timing; the outcome (params and state bit-identical on every rank) is checked below.
        assert opt._hybrid.skips_on_device
        x, y = (t.to(device, torch.bfloat16) for t in global_batch(0))
        for step in range(3):
            poisoned = step == 1
            loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
            if poisoned and rank == 0:
                loss = loss * float("nan")
            loss.backward()
            opt.finish_param_sync()
            before = [p.detach().clone() for p in model.parameters()]
            states = [
                {k: _local(v).clone() for k, v in with_main(opt.state[p]).items()}
                for p in model.parameters()
            ]
            opt.step()
            opt.zero_grad()
            opt.finish_param_sync()
            after = list(model.parameters())
            changed = any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
            assert changed != poisoned, (fraction, step)
            if poisoned:
                for param, state in zip(model.parameters(), states, strict=True):
                    for key, value in with_main(opt.state[param]).items():
                        assert torch.equal(_local(value), state[key]), (fraction, key)
        assert opt.num_skipped_steps == 1, fraction


def clip_by_hand(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over FSDP2 grads that live on the host (CPU DTensors on a CUDA
    mesh, which DTensor's own norm would reduce over NCCL): the squares summed locally, then over
    the ranks on the GPU."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    total = sum(g.double().pow(2).sum() for g in grads).float().cuda()
    dist.all_reduce(total)
    norm = total.sqrt()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0).cpu()
    for grad in grads:
        grad.mul_(coefficient)
    return norm


@case
def fsdp2_cpu_offload_params_step_on_the_host(rank: int, world: int) -> None:
    # FSDP2's CPUOffloadPolicy keeps the sharded params (fp32) and their grads on the host:
    # zero-shard steps them there in place (torch's fused CPU AdamW, the rank's threads, no
    # copies), reduces norms and flags over the GPU mesh, and matches FSDP2 + torch AdamW.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def sharded() -> torch.nn.Module:
        model = make_model().to(device)
        for layer in (model.inp, model.mid, model.out, model):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(), mp_policy=bf16)
        return model

    model, ref = sharded(), sharded()
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    with pytest.raises(
        ValueError,
        match=r"live on the host \(CPUOffloadPolicy\).*got an "
        r"offload fraction of 0\.5.*OffloadPolicy\(fraction=1\.0\)",
    ):
        zero_shard.wrap(adamw(model), model, offload=policy(0.5))
    opt = zero_shard.wrap(adamw(model), model, offload=OffloadPolicy(fraction=1.0, num_threads=3))
    ref_opt = adamw(ref)
    report = opt.memory_report()  # stepped where the params are: no staging, no copies
    assert report.device == "cpu" and report.host_staging_bytes == 0, report
    threads = torch.get_num_threads()
    for step in range(6):
        poisoned = step == 3
        x, y = (t.to(device) for t in global_batch(step))
        before = [p.to_local().clone() for p in model.parameters()]
        for net, net_opt in ((model, opt), (ref, ref_opt)):
            loss = mse(net(local_slice(x, rank, world)), local_slice(y, rank, world))
            if poisoned and rank == 0:
                loss = loss * float("nan")
            loss.backward()
            if net is model:
                norm = opt.clip_grad_norm_(0.5)
            else:
                ref_norm = clip_by_hand(list(ref.parameters()), 0.5)
            if not (poisoned and net is ref):  # torch AdamW would step on NaNs; zero-shard skips
                net_opt.step()
            net_opt.zero_grad()
        assert torch.get_num_threads() == threads  # the step's threads were the step's only
        if poisoned:
            for param, old in zip(model.parameters(), before, strict=True):
                assert torch.equal(param.to_local(), old)
            continue
        torch.testing.assert_close(norm.cpu(), ref_norm.cpu(), **CUDA_TOL)
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            assert param.to_local().device.type == "cpu"
            torch.testing.assert_close(param.to_local(), ref_param.to_local(), **CUDA_TOL)
    assert opt.num_skipped_steps == 1


def slow_gather_copies(cycles: int = 2_000_000) -> contextlib.AbstractContextManager:
    """The gather job's copy into the params comes about a millisecond later on its stream (the
    current one where it runs): a forward that did not wait for it reads old params, even where
    the all-gather itself is quick (one GPU)."""
    # Private on both sides: the race test slows the gather's copy (no public hook reaches it),
    # and torch.cuda._sleep is the only way to hold a stream without a host sync.
    return delayed(_gather, "unpack_params", lambda: torch.cuda._sleep(cycles))


class _HeldWork:
    """A reduction's work whose wait also holds the waiting stream (the reduce stream) a while:
    what follows there (the add into the grad buffer) lands later."""

    def __init__(self, work: Any, cycles: int) -> None:
        self._work, self._cycles = work, cycles

    def wait(self) -> None:
        self._work.wait()
        torch.cuda._sleep(self._cycles)


@contextlib.contextmanager
def slow_reductions(cycles: int = 2_000_000) -> Iterator[None]:
    """Each bucket's reduced grads reach the grad buffer about a millisecond after the collective
    ends, on the reduce stream: a step that did not wait for that stream reads them unreduced.
    (A delay before the collective would not show it: the step's own collectives on the same
    NCCL communicator queue behind the reduction.)"""
    # Private: the race test delays the reduction's work itself; no public hook reaches it.
    launch = _reduce.launch_reduction
    _reduce.launch_reduction = lambda *args: _HeldWork(launch(*args), cycles)
    try:
        yield
    finally:
        _reduce.launch_reduction = launch


def race_case(rank: int, world: int, *, fraction: float, steps: int = 12) -> str | None:
    """Big layers and a batch of 2 rows, two micro-batches a step: the collectives and copies take
    far longer than the compute, so a missing wait lets forward read params before their gather
    landed, or the step read grads before their reduction was added up. The overlapped run goes first, all its steps with no
    host synchronization; then a reference run with overlap off and the device synchronized
    after every phase. They must agree bit for bit. Returns the first difference, or None."""
    device = torch.device("cuda", rank)
    gen = torch.Generator(device).manual_seed(rank)
    inputs = [
        torch.randn(2, 4096, device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(steps)
    ]

    def run(overlap: bool, synchronize: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)]
        model = torch.nn.Sequential(*layers).to(device, torch.bfloat16)
        opt = zero_shard.wrap(
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            model,
            offload=policy(fraction, chunk_numel=1 << 22),
            overlap_param_gather=overlap,
            bucket_mb=32,  # one layer per bucket
        )
        sync = torch.cuda.synchronize if synchronize else (lambda: None)
        outputs = []
        for x in inputs:
            out = model(x)
            outputs.append(out.detach().clone())
            sync()
            out.float().square().sum().backward()
            sync()
            # A second micro-batch: its reduction is added to the first on the reduce stream,
            # work the step must wait for (the first one's NCCL stream order alone would not do).
            model(x.flip(0)).float().square().sum().backward()
            sync()
            opt.step()
            sync()
            opt.zero_grad()
        opt.finish_param_sync()
        torch.cuda.synchronize()
        if opt.num_skipped_steps:  # a skipped step compares nothing
            raise AssertionError(f"{opt.num_skipped_steps} steps were skipped as non-finite")
        return outputs, [p.detach().clone() for p in model.parameters()]

    with slow_gather_copies(), slow_reductions():
        tested = run(overlap=True, synchronize=False)
    reference = run(overlap=False, synchronize=True)
    for step, (a, b) in enumerate(zip(tested[0], reference[0], strict=True)):
        if not torch.equal(a, b):
            return f"step {step}: the forward outputs differ"
    for a, b in zip(tested[1], reference[1], strict=True):
        if not torch.equal(a, b):
            return "params differ after the last step"
    return None


@case
def race_overlapped_collectives(rank: int, world: int) -> None:
    for fraction in (0.0, 0.5, 1.0):
        failure = race_case(rank, world, fraction=fraction)
        assert failure is None, f"fraction {fraction}: {failure}"
    dist.barrier()


@case
def clip_at_the_step_is_a_clip_before_it_bit_for_bit(rank: int, world: int) -> None:
    check_clip_at_step(torch.device("cuda", rank), rank, world)


@case
def back_to_back_shards_packed_in_one_copy_as_param_by_param(rank: int, world: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.float32, torch.bfloat16):  # torch's _chunk_cat kernel on CUDA
        check_back_to_back_packing(rank, world, torch.device("cuda", rank), dtype)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    if WORLD == 0:
        pytest.skip("needs a GPU; runs on the GPU machines")
    return run_cases(CASES, WORLD, backend="nccl")


@pytest.mark.parametrize("name", list(CASES))
def test_on_gpus(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
