"""torch's own clipping (``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` +
``clip_grads_with_norm_``, ``clip_grad_value_``) on models under zero_shard.wrap, on 1, 2 and 3
CPU processes (gloo), against single-process torch AdamW with the same clipping on the whole
batch, every step: the norm it returns on every rank and the params after. A plain model's
params hold placeholders after backward ([Note: released grads]); their norms, scaling and
clamping are done on the reduced shards ([Note: torch's clip on released grads])."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import check_outcome, run_cases
from _models import (
    LOSS_TOL,
    LR,
    adamw,
    assert_params_close,
    global_batch,
    local_slice,
    make_model,
    mse,
)
from torch import nn

import zero_shard
from zero_shard import OffloadPolicy

CASES = {}
TINY_BUCKETS = 0.0001  # MiB: several buckets, so that grads reach the host during backward
MAX_NORM = 0.05  # below the grads' norms: every step clips
# Each step another norm type and torch code path (foreach None: one by one for a tensor
# subclass; True: multi-tensor ops; False: one by one), so that every one is met at every
# fraction and stage without multiplying the runs.
NORM_STEPS = [(2.0, None), (math.inf, True), (1.0, False), (3.0, None)]


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def offload(fraction: float) -> OffloadPolicy | None:
    """A CPU share with a staging buffer per chunk: grads copied early, as they are reduced."""
    if not fraction:
        return None
    return OffloadPolicy(fraction=fraction, num_threads=1, host_staging="per_chunk")


@contextlib.contextmanager
def counted_all_reduces() -> Iterator[list[int]]:
    """Counts ``dist.all_reduce`` calls inside the block."""
    count = [0]
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield count
    finally:
        dist.all_reduce = original


@case
def clip_grad_norm_equals_torch_at_every_fraction_stage_and_norm_type(
    rank: int, world: int
) -> None:
    for fraction in (0.0, 0.5, 1.0):
        for stage in (1, 2):
            model, ref = make_model(), make_model()
            opt = zero_shard.wrap(
                adamw(model), model, offload=offload(fraction), stage=stage, bucket_mb=TINY_BUCKETS
            )
            ref_opt = adamw(ref)
            where = f"fraction {fraction}, stage {stage}"
            for step, (norm_type, foreach) in enumerate(NORM_STEPS):
                x, y = global_batch(step)
                mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
                with counted_all_reduces() as count:
                    norm = torch.nn.utils.clip_grad_norm_(
                        model.parameters(), MAX_NORM, norm_type, error_if_nonfinite=True,
                        foreach=foreach,
                    )  # fmt: skip
                assert count[0] <= 1, f"{where}: {count[0]} all-reduces for one clip"
                opt.step()
                model.zero_grad()
                mse(ref(x), y).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)
                ref_opt.step()
                ref_opt.zero_grad()
                torch.testing.assert_close(norm, ref_norm, **LOSS_TOL, msg=f"{where} {step}")
                assert norm.dtype == ref_norm.dtype and norm.shape == ref_norm.shape
            assert opt.num_skipped_steps == 0
            opt.finish_param_sync()
            assert_params_close(model, ref, where)


@case
def a_low_precision_models_clip_steps_alike_at_every_fraction(rank: int, world: int) -> None:
    """A bf16 or fp16 model: torch's clip makes its coefficient in the grads' dtype; the CPU
    share's step takes it (as an exact fp32 factor) as the accelerator's share does: the same
    norms and the same params at fractions 0, 0.5 and 1."""
    for dtype in (torch.bfloat16, torch.float16):
        runs = {}
        for fraction in (0.0, 0.5, 1.0):
            model = make_model().to(dtype)
            opt = zero_shard.wrap(
                adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
            )
            norms = []
            for step, (norm_type, foreach) in enumerate(NORM_STEPS):
                x, y = global_batch(step)
                out = model(local_slice(x, rank, world).to(dtype)).float()
                mse(out, local_slice(y, rank, world)).backward()
                norms.append(
                    torch.nn.utils.clip_grad_norm_(
                        model.parameters(), MAX_NORM, norm_type, foreach=foreach
                    )
                )
                opt.step()
                opt.zero_grad()
            opt.finish_param_sync()
            assert opt.num_skipped_steps == 0
            runs[fraction] = (norms, [p.detach().clone() for p in model.parameters()])
        for fraction in (0.5, 1.0):
            where = f"{dtype}, fraction {fraction} against 0"
            for got, want in zip(runs[fraction][0], runs[0.0][0], strict=True):
                assert got.dtype == dtype and torch.equal(got, want), where
            for got, want in zip(runs[fraction][1], runs[0.0][1], strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)


@case
def a_factor_tensor_updated_in_place_between_steps_is_taken_anew(rank: int, world: int) -> None:
    """Grads multiplied by one 0-dim tensor kept across steps and refilled each step (a grad
    multiplier buffer), bf16 and fp32 models, fractions 0 and 0.5: each step multiplies by the
    value the tensor holds then, as with a new tensor each step."""
    for dtype in (torch.float32, torch.bfloat16):
        for fraction in (0.0, 0.5):
            runs = []
            for reuse in (False, True):
                model = make_model().to(dtype)
                opt = zero_shard.wrap(
                    adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
                )
                kept = torch.ones((), dtype=dtype)
                for step, value in enumerate((0.5, 0.25, 0.125)):
                    x, y = global_batch(step)
                    out = model(local_slice(x, rank, world).to(dtype)).float()
                    mse(out, local_slice(y, rank, world)).backward()
                    factor = kept.fill_(value) if reuse else torch.tensor(value, dtype=dtype)
                    for param in model.parameters():
                        param.grad.mul_(factor)
                    opt.step()
                    opt.zero_grad()
                opt.finish_param_sync()
                runs.append([p.detach().clone() for p in model.parameters()])
            for got, want in zip(*runs, strict=True):
                assert torch.equal(got, want), f"{dtype}, fraction {fraction}"


@case
def total_norm_then_clip_with_it_and_clips_of_some_params(rank: int, world: int) -> None:
    # get_total_norm + clip_grads_with_norm_; a clip of one layer's params (the norm of those
    # alone, the others unscaled: factors that differ between grads); max_norm=inf (the norm
    # only); and a param no rank had a grad for (None in torch: skipped by its clip).
    for fraction in (0.0, 0.5):
        model, ref = make_model(with_side=True), make_model(with_side=True)
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        ref_opt = adamw(ref)
        where = f"fraction {fraction}"
        for step in range(3):
            x, y = global_batch(step)
            first_rows = 2 if rank == 0 else 0
            local = model(local_slice(x, rank, world), first_rows=first_rows)
            mse(local, local_slice(y, rank, world)).backward()
            mse(ref(x, first_rows=2), y).backward()
            norms, ref_norms = [], []
            for net, out in ((model, norms), (ref, ref_norms)):
                total = torch.nn.utils.get_total_norm(
                    [p.grad for p in net.parameters() if p.grad is not None]
                )
                torch.nn.utils.clip_grads_with_norm_(net.mid.parameters(), MAX_NORM, total)
                out.append(total)
                out.append(torch.nn.utils.clip_grad_norm_(net.out.parameters(), MAX_NORM))
                out.append(torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf, math.inf))
            for got, expected in zip(norms, ref_norms, strict=True):
                torch.testing.assert_close(got, expected, **LOSS_TOL, msg=f"{where} {step}")
            opt.step()
            ref_opt.step()
            assert model.never.weight.grad is None  # as torch's: no rank had one
            model.zero_grad()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, where)


@case
def clip_grad_value_equals_torch(rank: int, world: int) -> None:
    # By value, then by norm over the clamped grads (the step checks the clamped grads for
    # infs itself: a clamp makes an inf finite). With a staging buffer per chunk the grads go to
    # the host early, as they are reduced: the clamp must be seen to change them.
    for fraction in (0.0, 0.5):
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        ref_opt = adamw(ref)
        for step, foreach in enumerate((None, True, False)):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            mse(ref(x), y).backward()
            norms = []
            for net in (model, ref):
                torch.nn.utils.clip_grad_value_(net.parameters(), 0.01, foreach=foreach)
                if net is model and step == 2:  # zero-shard's own clip over the clamped grads
                    norms.append(opt.clip_grad_norm_(0.02))
                else:  # one by one, then in one multi-tensor call
                    clip_foreach = None if step == 0 else True
                    norms.append(
                        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.02, foreach=clip_foreach)
                    )
            torch.testing.assert_close(*norms, **LOSS_TOL)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"clip_grad_value_ at fraction {fraction}")


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.half_layer = nn.Linear(15, 7).half()
        self.full_layer = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.full_layer(torch.tanh(self.half_layer(x.half())).float())


@case
def fp16_grads_give_their_unscaled_norm_after_grad_scaler_unscale(rank: int, world: int) -> None:
    # zero_shard.GradScaler leaves fp16 grads scaled until the step; torch's clip after
    # scaler.unscale_ sees the unscaled norms, and clips as opt.clip_grad_norm_ does.
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = Mixed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        models.append(model)
        opts.append(zero_shard.wrap(opt, model, offload=offload(0.5), bucket_mb=TINY_BUCKETS))
    scalers = [zero_shard.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    x, y = global_batch(0)
    xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
    norms = []
    for index, (model, opt, scaler) in enumerate(zip(models, opts, scalers, strict=True)):
        scaler.scale(mse(model(xs), ys)).backward()
        scaler.unscale_(opt)
        if index == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        else:
            norms.append(opt.clip_grad_norm_(0.05))
        scaler.step(opt)
        scaler.update()
        opt.finish_param_sync()
    # The per-grad norms are fp16 and fp32, as torch's of these grads: combined, they round.
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-3, atol=0.0)
    for name in ("weight", "bias"):
        torch.testing.assert_close(
            getattr(models[0].full_layer, name), getattr(models[1].full_layer, name),
            rtol=1e-3, atol=1e-5,
        )  # fmt: skip


@case
def fp16_value_clip_after_grad_scaler_unscale_clamps_the_unscaled_grads(
    rank: int, world: int
) -> None:
    # The clamp's bounds are the unscaled grads': scaled alike while the grads still carry the
    # loss scale (clamped at the raw bounds, every param would move 1/1024 of its due). torch's
    # GradScaler refuses fp16 grads, so the reference is the same run without loss scaling: a
    # scale of 2**10 is exact on these grads.
    models = []
    for scaler in (zero_shard.GradScaler("cpu", init_scale=2.0**10), None):
        torch.manual_seed(0)
        model = Mixed()
        opt = zero_shard.wrap(
            torch.optim.SGD(model.parameters(), lr=1.0), model, offload=offload(0.5),
            bucket_mb=TINY_BUCKETS,
        )  # fmt: skip
        for step in range(2):
            x, y = global_batch(step)
            loss = mse(model(local_slice(x, rank, world)), local_slice(y, rank, world))
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        opt.finish_param_sync()
        models.append(model)
    for (name, param), unscaled in zip(
        models[0].named_parameters(), models[1].parameters(), strict=True
    ):
        torch.testing.assert_close(param, unscaled, rtol=1e-3, atol=1e-4, msg=name)


@case
def torch_one_by_one_clip_finalizes_once_and_defers_one_factor(rank: int, world: int) -> None:
    # torch's path for a tensor subclass is one norm and one multiply per grad: the grads are
    # finalized once for all of them (not a pass over every param per grad), and the factor
    # they share is one pending factor, which the step applies (the grads' early host copies
    # stay valid).
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    calls = [0]
    finalize = opt._finalize_grads

    def counted(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        finalize(*args, **kwargs)

    opt._finalize_grads = counted  # type: ignore[method-assign]
    for step in range(2):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        calls[0] = 0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, foreach=False)
        assert calls[0] == 1, f"step {step}: {calls[0]} finalizes for one clip"
        pending = {id(s.grad_factor) for s in opt._sharded if s.grad_factor is not None}
        assert len(pending) == 1, f"step {step}: {len(pending)} pending factors"
        opt.step()
        opt.zero_grad()


class _Layers(nn.Module):
    """Params in two groups over several buckets and host chunks: a 0-dim scale, a layer never
    used, a layer without a bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.inp = nn.Linear(15, 7)
        self.never = nn.Linear(7, 1)
        self.mid = nn.Linear(7, 5)
        self.extra = nn.Linear(5, 5, bias=False)
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mid(torch.tanh(self.inp(x)))
        return self.out(y + self.extra(y)) * self.scale


@case
def a_grad_zeroed_after_backward_then_clipped_steps_zeros(rank: int, world: int) -> None:
    # One layer's grad dropped for a step in place (p.grad.zero_(), p.grad.data.zero_()), then
    # torch's clip, a logged norm or another grad scaled by hand: the zero reaches the step. Its
    # grads were copied to the host as backward reduced them; those copies do not serve.
    for fraction, zero, then in (
        (0.5, "zero", "clip"),
        (1.0, "data", "norm"),
        (1.0, "zero", "mul"),
    ):
        model, ref = (_Layers() for _ in range(2))
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        ref_opt = adamw(ref)
        for step in range(3):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            mse(ref(x), y).backward()
            for net in (model, ref):
                grad = net.mid.weight.grad
                (grad.data if zero == "data" else grad).zero_()
                if then == "clip":
                    torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
                elif then == "norm":
                    float(sum(p.grad.norm() for p in net.parameters() if p.grad is not None))
                else:
                    net.out.weight.grad.mul_(0.5)
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"fraction {fraction}, {zero}, {then}, step {step}")


@case
def grads_read_and_scaled_through_data_and_detach_as_in_torch(rank: int, world: int) -> None:
    # Logging's p.grad.data.norm(2) and p.grad.detach().norm(), a hand-made clip through .data,
    # and the old way to zero grads, p.grad.data.zero_(): torch's numbers.
    for fraction in (0.0, 0.5):
        model, ref = make_model(), make_model()
        opt = zero_shard.wrap(
            adamw(model), model, offload=offload(fraction), bucket_mb=TINY_BUCKETS
        )
        ref_opt = adamw(ref)
        for step in range(3):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            mse(ref(x), y).backward()
            for net in (model, ref):
                norms = torch.stack([p.grad.data.norm(2) for p in net.parameters()])
                detached = torch.stack([p.grad.detach().norm() for p in net.parameters()])
                assert torch.equal(norms, detached)
                for param in net.parameters():
                    param.grad.data.mul_(0.5)
                if step == 1:
                    net.out.weight.grad.data.zero_()  # steps zeros (moments decay), as in torch
                if net is model:
                    got = norms
            torch.testing.assert_close(got, norms, **LOSS_TOL, msg=f"norms at step {step}")
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"fraction {fraction}")


@case
def other_reads_of_released_grads_still_raise(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    grad = model.inp.weight.grad
    # (a row-wise norm, as adaptive gradient clipping takes it; a multiply by a mask)
    with pytest.raises(NotImplementedError, match=r"over dims \[1\] of .*'inp.weight'.*main_grad"):
        torch.linalg.vector_norm(grad, dim=1)
    with pytest.raises(NotImplementedError, match=r"'inp.weight' by .*shape \(7, 15\).*main_grad"):
        grad.mul_(torch.ones(7, 15))
    reads = (grad.sum, lambda: grad + 1, lambda: torch.ones(7, 15).mul_(grad), grad.clone,
             lambda: grad.data.clone(), lambda: grad.detach().div_(2))  # fmt: skip
    for read in reads:
        with pytest.raises(RuntimeError, match=r"clip_grad_norm_.*opt\.main_grad"):
            read()
    opt.zero_grad()


def fsdp2(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.inp, model.mid, model.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@case
def ddp_and_fsdp2_grads_take_torch_value_and_norm_clips(rank: int, world: int) -> None:
    # Their reduced grads are real tensors (FSDP2's DTensors) on the params: torch's clipping
    # works on them as it does without zero-shard. References: DDP's grads are the whole batch's
    # (one process); FSDP2 with torch AdamW on the same ranks.
    for kind in ("ddp", "fsdp2"):
        # torch's inf-norm of FSDP2 grads fails on a rank whose shard is empty (3 ranks here:
        # "_foreach_norm cannot compute the infinity norm on an empty tensor"), without zero-shard.
        norm_type = math.inf if kind == "ddp" else 2.0
        model, ref = make_model(), make_model()
        if kind == "ddp":
            net = nn.parallel.DistributedDataParallel(model)
        else:
            net, ref = fsdp2(model, world), fsdp2(ref, world)
        opt = zero_shard.wrap(adamw(model), net, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        ref_opt = adamw(ref)
        for step in range(2):
            x, y = global_batch(step)
            mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            ref_x, ref_y = (
                (x, y)
                if kind == "ddp"
                else (local_slice(x, rank, world), local_slice(y, rank, world))
            )
            mse(ref(ref_x), ref_y).backward()
            norms = []
            for each in (net, ref):
                torch.nn.utils.clip_grad_value_(each.parameters(), 0.01)
                norms.append(torch.nn.utils.clip_grad_norm_(each.parameters(), 0.02, norm_type))
            norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
            torch.testing.assert_close(*norms, **LOSS_TOL)
            opt.step()
            ref_opt.step()
            net.zero_grad()
            ref_opt.zero_grad()
        opt.finish_param_sync()
        assert_params_close(model, ref, f"{kind} with torch's value and norm clips")


@case
def ddp_and_fsdp2_grads_unscaled_by_the_scaler_then_clipped_by_torch(rank: int, world: int) -> None:
    # zero_shard.GradScaler's unscale_ then torch's clip, as with torch's scaler: fp32 grads are
    # unscaled whole on the params (DDP's were this rank's rows only: the clip read scaled grads),
    # against DDP or FSDP2 with torch's GradScaler. fp16 grads keep the scale until the step:
    # torch's clip of them is refused on every rank, opt.clip_grad_norm_ clips them.
    for kind in ("ddp", "fsdp2"):
        model, ref = make_model(), make_model()
        if kind == "ddp":
            net, ref_net = (
                nn.parallel.DistributedDataParallel(model),
                nn.parallel.DistributedDataParallel(ref),
            )
        else:
            net, ref_net = fsdp2(model, world), fsdp2(ref, world)
        opt = zero_shard.wrap(adamw(model), net, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
        ref_opt = adamw(ref)
        scalers = (
            zero_shard.GradScaler("cpu", init_scale=2.0**12),
            torch.amp.GradScaler("cpu", init_scale=2.0**12),
        )
        for step in range(2):
            x, y = (local_slice(t, rank, world) for t in global_batch(step))
            norms = []
            for each, optimizer, scaler in ((net, opt, scalers[0]), (ref_net, ref_opt, scalers[1])):
                scaler.scale(mse(each(x), y)).backward()
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(each.parameters(), 0.05)
                norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            torch.testing.assert_close(*norms, **LOSS_TOL, msg=f"{kind} step {step}")
        opt.finish_param_sync()
        assert_params_close(model, ref, f"{kind}: the scaler's unscale, then torch's clip")
        model = make_model().half()
        net = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else fsdp2(model, world)
        opt = zero_shard.wrap(adamw(model), net, bucket_mb=TINY_BUCKETS)
        scaler = zero_shard.GradScaler("cpu", init_scale=2.0**12)
        for clip in ("torch", "opt", "overflow"):
            x, y = (local_slice(t, rank, world).half() for t in global_batch(0))
            if clip == "overflow" and rank == 0:  # non-finite grads: skipped, not a change
                x[0, 0] = float("inf")
            scaler.scale(mse(net(x), y)).backward()
            scaler.unscale_(opt)
            if clip != "torch":
                opt.clip_grad_norm_(0.05)
                scaler.step(opt)
            else:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
                with pytest.raises(
                    RuntimeError, match=r"changed after scaler.unscale_.*opt\.clip_grad_norm_"
                ):
                    scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.get_scale() == 2.0**11, f"{kind}: the overflow was not skipped"


@case
def params_left_out_of_the_optimizer_get_ddps_averaged_grads(rank: int, world: int) -> None:
    # A trainable layer left out of the wrapped optimizer (fine-tuning the top layers without
    # freezing the rest), read by torch's clip over model.parameters() and stepped by a plain
    # torch SGD beside the wrapper: its grads are averaged over the ranks, as under DDP, so the
    # clip's norm is torch's on every rank and its replicas stay equal ([Note: params outside
    # the optimizer]). A second wrapper over it (it is claimed) is left to reduce it itself.
    for fraction, second_wrapper in ((0.0, False), (0.5, False), (0.0, True)):
        model, ref = make_model(), make_model()
        optimizers, refs = [], []
        for net, out in ((model, optimizers), (ref, refs)):
            top = [*net.mid.parameters(), *net.out.parameters()]
            out.append(torch.optim.AdamW(top, lr=LR, weight_decay=0.1))
            out.append(torch.optim.SGD(net.inp.parameters(), lr=0.1, momentum=0.5))
        optimizers[0] = zero_shard.wrap(optimizers[0], model, offload=offload(fraction))
        if second_wrapper:
            optimizers[1] = zero_shard.wrap(optimizers[1], model)
        for step in range(3):
            x, y = global_batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            mse(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            where = f"fraction {fraction}, second wrapper {second_wrapper}, step {step}"
            torch.testing.assert_close(norm, ref_norm, **LOSS_TOL, msg=where)
            for optimizer in (*optimizers, *refs):
                optimizer.step()
                optimizer.zero_grad()
            for optimizer in optimizers:
                if isinstance(optimizer, zero_shard.ZeroShardOptimizer):
                    optimizer.finish_param_sync()
            assert_params_close(model, ref, where)


@case
def torchs_grad_scaler_is_refused_naming_zero_shards(rank: int, world: int) -> None:
    # torch.amp.GradScaler, as users bring it, unscales the model's .grad: zero-shard holds the
    # reduced grads in its shards, so its unscale_ (and step, which unscales first) raises on
    # every rank, naming zero_shard.GradScaler, with nothing stepped.
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model, offload=offload(0.5), bucket_mb=TINY_BUCKETS)
    opt.finish_param_sync()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for call in ("unscale_", "step"):
        x, y = (local_slice(t, rank, world) for t in global_batch(0))
        scaler.scale(mse(model(x), y)).backward()
        with pytest.raises(RuntimeError, match=r"torch\.amp\.GradScaler.*zero_shard\.GradScaler"):
            getattr(scaler, call)(opt)
        opt.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt.finish_param_sync()
    for before_param, param in zip(before, model.parameters(), strict=True):
        assert torch.equal(before_param, param.detach()), "a step was taken"


@pytest.fixture(scope="module", params=[1, 3])
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_clip(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
