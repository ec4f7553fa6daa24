"""HybridDeviceOptimizer on a CUDA GPU: parity, a race test and GPU memory. Run on the GPU
machines (docs/gpu-tests.md); skipped without CUDA."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
from _parity import (
    OTHER_KERNEL,
    SAME_KERNEL,
    assert_matches,
    fp32_copies,
    groups_of,
    make_params,
    train_side_by_side,
)

from offload import _copy_engine, wait_for_event
from optimizers import HybridDeviceOptimizer, OffloadPolicy
from optimizers import _host_part as host_part
from optimizers._staging import STAGING_SLOTS  # how many buffers the chunks take in turn

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    ("name", "fraction", "dtype"),
    list(itertools.product(["adamw", "sgd"], [0.0, 0.5, 1.0], [torch.bfloat16, torch.float32])),
)
def test_parity_on_cuda(name: str, fraction: float, dtype: torch.dtype) -> None:
    cls, kwargs = {
        "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    }[name]
    params = make_params(dtype, "cuda")
    refs = fp32_copies(params)  # on CUDA, torch's fused kernel
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40)
    opt = HybridDeviceOptimizer(groups_of(params), cls, policy=policy, **kwargs)
    ref_opt = cls(groups_of(refs), **kwargs, fused=True)
    if fraction > 0:
        assert opt.memory_report().pinned
    # The CPU share runs the CPU kernel, the reference the CUDA one.
    tol = SAME_KERNEL if fraction == 0 else OTHER_KERNEL
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5):
        assert_matches(opt, params, refs, tol=tol, where=f"step {step}")


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width, bias=False) for _ in range(depth)]
    return torch.nn.Sequential(*layers).to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("fraction", "modify_grads", "micro_batches", "staging"),
    [
        (0.5, True, 1, "bounded"),
        (1.0, True, 1, "bounded"),
        (1.0, False, 1, "bounded"),
        (0.5, False, 2, "bounded"),
        (1.0, True, 1, "per_chunk"),
        (0.5, False, 2, "per_chunk"),
    ],
)
def test_no_race_between_copies_and_compute(
    fraction: float, modify_grads: bool, micro_batches: int, staging: str
) -> None:
    """Wide layers and a tiny batch: the copies take far longer than the compute around them.

    With ``modify_grads``, before each step the GPU is kept busy and the grads are rewritten in
    place behind that work: a D2H that does not wait for that work reads the old values. With two
    micro-batches the grads are accumulated twice before the step. Right after each step a
    forward runs with no synchronization; it must equal a forward run after a full synchronize
    (else it read params before their H2D landed: each chunk is a whole layer, and layer 0's copy
    is queued last). The main weights must follow a CPU AdamW fed with the same grads, run after
    the tested step.
    tests/optimizers/race_sensitivity.py shows that removing either wait makes this test fail.
    """
    width, depth = 4096, 4  # 67M params: 34 MB of bf16 per layer and direction
    model = _model(width, depth)
    params = list(model.parameters())
    policy = OffloadPolicy(fraction=fraction, chunk_numel=width * width, host_staging=staging)
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2)
    shadow = [p.detach().float().cpu().clone() for p in params]
    for tensor in shadow:
        tensor.requires_grad_(True)
    shadow_opt = torch.optim.AdamW(shadow, lr=1e-2, fused=True)
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    for step in range(20):
        for _ in range(micro_batches):
            model(x).float().square().mean().backward()
        if modify_grads:
            torch.cuda._sleep(50_000_000)  # tens of ms of queued work before the grads' last write
            for param in params:
                param.grad.mul_(0.5)
        grads = [p.grad.detach().clone() for p in params]  # on the current stream, no sync
        opt.step()
        fast = model(x)  # right after the step: must wait for the H2D, not read old params
        torch.cuda.synchronize()
        slow = model(x)
        assert torch.equal(fast, slow), f"step {step}: forward read params before the copy landed"
        opt.zero_grad(set_to_none=True)
        for tensor, grad in zip(shadow, grads, strict=True):
            tensor.grad = grad.float().cpu()
        shadow_opt.step()
        # The CPU share runs the same fused CPU kernel as the shadow; the GPU share the CUDA one.
        assert_matches(opt, params, shadow, tol=OTHER_KERNEL, where=f"step {step}")


@contextlib.contextmanager
def late_copies(to: str = "cuda", cycles: int = 20_000_000) -> Iterator[None]:
    """Every copy to device type ``to`` (``"cuda"``: H2D, ``"cpu"``: D2H) starts behind ~10 ms
    of sleep on its stream. Fault injection: no public input slows one copy engine's queue."""
    original = _copy_engine.copy_async

    def late(pairs, stream, *, after=()):  # type: ignore[no-untyped-def]
        if stream is not None and pairs and pairs[0].dst.device.type == to:
            for event in after:
                wait_for_event(stream, event)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
            after = ()
        return original(pairs, stream, after=after)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_copy_engine, "copy_async", late)
        yield


class ShadowAdamW:
    """torch's fused CPU AdamW (lr 1e-2) over fp32 copies of the params, stepped with the grads
    the tested optimizer was given: the main weights it must follow."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p.detach().float().cpu().clone().requires_grad_(True) for p in params]
        self._opt = torch.optim.AdamW(self.params, lr=1e-2, fused=True)

    def step(self, grads: list[torch.Tensor]) -> None:
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad.float().cpu()
        self._opt.step()


def test_no_race_on_a_staging_buffer_taken_again() -> None:
    """Twice as many chunks as staging buffers (see [Note: staging ring]), and each H2D out of a
    buffer lands late: a D2H that refilled the buffer before that H2D was done would send the next
    chunk's grads into the params. After each step every param must be its main weight, and the
    main weights must follow a CPU AdamW fed the same grads.
    tests/optimizers/race_sensitivity.py shows that removing that wait makes this test fail.
    """
    width, depth = 2048, 2 * STAGING_SLOTS  # a chunk per layer: 8 MB of bf16 each way
    model = _model(width, depth)
    params = list(model.parameters())
    policy = OffloadPolicy(fraction=1.0, chunk_numel=width * width, host_staging="bounded")
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2)
    shadow = ShadowAdamW(params)
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    with late_copies("cuda"):
        for step in range(6):
            model(x).float().square().mean().backward()
            grads = [p.grad.detach().clone() for p in params]
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            shadow.step(grads)
            assert_matches(opt, params, shadow.params, tol=OTHER_KERNEL, where=f"step {step}")


def test_no_race_where_landed_chunks_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six layers, a chunk each, a buffer per chunk. Before each step the grads of every layer but
    layer 3 are given to ``grads_ready`` and their copies land; at the step, layer 3's are copied
    behind ~50 ms of sleep (the worker's decision to merge, long before that, may still take
    10 ms in a busy process). The worker must step the landed chunks around it together (see
    [Note: merged kernel calls]), but not layer 3's, whose staging holds the last step's weights
    until its copy lands: the main weights must follow a CPU AdamW fed the same grads.
    tests/optimizers/race_sensitivity.py shows that merging it anyway makes this test fail.
    """
    width, depth = 2048, 6
    model = _model(width, depth)
    params = list(model.parameters())
    # (speculative steps would step the early chunks before the step: not the merges here)
    policy = OffloadPolicy(
        fraction=1.0, chunk_numel=width * width, host_staging="per_chunk", speculative=False
    )
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2)
    shadow = ShadowAdamW(params)
    calls: list[list[int]] = []
    original = host_part._kernel_table

    def recorded(jobs):  # type: ignore[no-untyped-def]
        calls.append(sorted(job.chunk.index for job in jobs))
        return original(jobs)

    monkeypatch.setattr(host_part, "_kernel_table", recorded)
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    for step in range(6):
        model(x).float().square().mean().backward()
        opt.grads_ready({i: p.grad for i, p in enumerate(params) if i != 3})
        torch.cuda.synchronize()  # the early copies have landed
        grads = [p.grad.detach().clone() for p in params]
        calls.clear()
        with late_copies("cpu", cycles=100_000_000):
            opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        shadow.step(grads)
        assert_matches(opt, params, shadow.params, tol=OTHER_KERNEL, where=f"step {step}")
        # Last layers first, at most half of the chunks left a call: 5 and 4 (3's copy has not
        # landed), then 3 with 2 once it has, then 1 and 0 alone.
        assert calls == [[4, 5], [2, 3], [1], [0]], f"step {step}: {calls}"


def test_no_race_in_the_delayed_update() -> None:
    """``delayed_update=True``: step k's weights are copied into the params at step k+1, while
    the GPU may still run step k+1's backward, which reads them. Each backward is queued behind
    tens of ms of other work, so a copy that does not wait for it changes the params under it:
    the grads are checked against a second model that holds the expected params, run after a
    synchronize. After each step the params must be step k-1's weights (a CPU AdamW fed the same
    grads gives them), and a forward right after the step must equal one after a synchronize.
    tests/optimizers/race_sensitivity.py shows that removing the wait makes this test fail.
    """
    width, depth = 4096, 4
    model, check = _model(width, depth), _model(width, depth)
    params = list(model.parameters())
    policy = OffloadPolicy(fraction=1.0, chunk_numel=width * width, delayed_update=True)
    opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2)
    master = [p.detach().float().cpu().clone().requires_grad_(True) for p in params]
    master_opt = torch.optim.AdamW(master, lr=1e-2, fused=True)
    expected = [p.detach().clone() for p in params]  # the params the next backward must read
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    for step in range(10):
        torch.cuda._sleep(50_000_000)  # the backward runs tens of ms after it is queued
        model(x).float().square().mean().backward()
        opt.step()
        fast = model(x)
        torch.cuda.synchronize()
        assert torch.equal(fast, model(x)), f"step {step}: forward read params before the copy"
        with torch.no_grad():
            for target, value in zip(check.parameters(), expected, strict=True):
                target.copy_(value)
        check(x).float().square().mean().backward()
        for param, other in zip(params, check.parameters(), strict=True):
            # An Adam step moves these weights (about 0.01) by about lr = 0.01: grads taken at
            # new params differ by far more than the rounding of two equal computations.
            scale = other.grad.float().abs().max().item()
            torch.testing.assert_close(
                param.grad.float(), other.grad.float(), rtol=0.02, atol=0.02 * scale,
                msg=f"step {step}: the backward saw params the delayed update had changed",
            )  # fmt: skip
        # The params now hold the weights of step k-1: M before this step (rounded to bf16, as
        # the CPU kernel rounds its own fp32 weights, one bf16 ulp apart at most).
        for param, main in zip(params, master, strict=True):
            torch.testing.assert_close(
                param.detach().cpu().float(), main.detach().to(torch.bfloat16).float(),
                rtol=2**-7, atol=0.0, msg=f"step {step}",
            )  # fmt: skip
        for main, param in zip(master, params, strict=True):
            main.grad = param.grad.float().cpu()
        master_opt.step()
        expected = [p.detach().clone() for p in params]
        opt.zero_grad(set_to_none=True)
        check.zero_grad(set_to_none=True)


def test_full_offload_keeps_no_fp32_copies_on_the_gpu() -> None:
    model = _model(1024, 4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=1e-3)
    model(torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)).sum().backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    opt.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert opt.memory_report().device_bytes == 0
    # Only the model's own bf16 grads (and tiny activations) were added.
    assert after - before <= grads + (1 << 20)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the first is the default")
def test_the_cpu_worker_runs_on_the_params_gpu() -> None:
    # A new thread's current device is the first GPU: the worker's CUDA calls (its chunks'
    # event queries) would make a context there in every rank's process.
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    params = [torch.nn.Parameter(torch.randn(64, 64, device=device)) for _ in range(3)]
    opt = HybridDeviceOptimizer(params, offload_fraction=0.5, lr=1e-3)
    for param in params:
        param.grad = torch.randn_like(param)
    opt.step()
    opt.step()
    worker = opt._host._executor
    assert worker.submit(torch.cuda.current_device).result() == device.index
