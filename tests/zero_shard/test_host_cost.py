"""The host's work per training step, counted: zero-shard's fixed cost stays per bucket.

On a GPU every Python call and every op dispatched is host time the kernels may wait for, and
at small models it is what sets zero-shard apart from torch's AdamW (docs/benchmarks/e2e.md).
Timing it here would be noise, so the work is counted instead: the Python calls into
zero-shard's packages (``zero_shard``, ``optimizers``, ``offload``: a profile function, on every
thread) and the aten ops dispatched on the main thread, per phase of an iteration, for a model
of ``L`` and of ``2 L`` blocks in one bucket, bf16. What grows with the params is held to its bounds:

- ``clip_grad_norm_``, ``step()`` and ``zero_grad()``: calls per bucket only (none per param),
  torch's Adam ``_init_group`` (Python per param) not run, and one aten op per param at most (the flat view of a fresh grad handed to torch's kernels);
  the clip's ops take the grads per bucket (a multi-tensor op's list does not grow);
- backward: the two autograd hooks of each param and the reduction's ``take`` / ``release``;
  beyond torch's own ops, one aten op per param at most (a grad's slot in the buffer): the
  reduction packs a bucket of real models' shapes with one chunked copy, not a cut per param;
- forward: the wait hook of each module;
- at fraction 0.5, the copies of the CPU's share to the host and back: a few a chunk (one param
  group), not one a param (at one rank, the new weights go into separate params: a copy each).

A per-param call or op added to a step makes the larger model's count exceed these.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import check_outcome, run_cases
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(str(ROOT / package) + "/" for package in ("zero_shard", "optimizers", "offload"))
TORCH_OPTIM = str(Path(torch.optim.__file__).parent) + "/"
PHASES = ("forward", "backward", "clip", "step", "zero_grad", "threads", "torch_init_group")
NUM_STEPS = 3  # counted, after 2 untimed steps
SLACK = 8  # calls a step may vary by: a wait finds its gather done or not (threads)
# The gather thread's calls count whatever the main thread does meanwhile (its phase is taken
# only for the main thread's calls): the counted steps start after the untimed steps' gathers
# are done, and end once their own are ("finish"), so that every counted gather is counted.

# Added calls per param (backward) and per module (forward) at most: see the module docstring.
BACKWARD_CALLS_PER_PARAM = 6  # before_accumulate, ready, after_accumulate, on_grad_ready,
#                               take, release
FORWARD_CALLS_PER_MODULE = 3  # the hook, its run, the gatherer's pending
STEP_OPS_PER_PARAM = 1  # in clip + step + zero_grad: a fresh 2-D grad's flat view
BACKWARD_OPS_PER_PARAM = 1  # beyond torch's own backward: a 2-D grad's slot in the buffer
# Shards of whole multiples of the alignment at 1 and 2 ranks (bf16: 64 elements), as in real
# models: a reduction packs the bucket with one chunked copy, no op per param.
WIDTH = 128


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.linear(x))


def _model(num_blocks: int) -> nn.Sequential:
    torch.manual_seed(0)  # bf16 params, as trained on GPUs: the step casts grads and weights
    return nn.Sequential(*(_Block() for _ in range(num_blocks))).to(torch.bfloat16)


class _Calls:
    """A profile function counting calls into zero-shard's packages by phase of the main
    thread; the other threads' (the param gathers') go to ``threads``, whatever the phase."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        self._main = threading.get_ident()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.phase:
            return
        code = frame.f_code
        if code.co_filename.startswith(OURS):
            main = threading.get_ident() == self._main
            self.counts[self.phase if main else "threads"] += 1
        elif code.co_name == "_init_group" and code.co_filename.startswith(TORCH_OPTIM):
            self.counts["torch_init_group"] += 1  # torch's Python per param


class _Ops(TorchDispatchMode):
    """The aten ops dispatched, and the tensors handed to them in lists (a multi-tensor op's
    inputs, a stack's), in the clip and elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.in_clip = False
        self.clip_listed = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        if self.in_clip:
            self.clip_listed += sum(len(arg) for arg in args if isinstance(arg, (list, tuple)))
        return func(*args, **(kwargs or {}))


@contextmanager
def _profiled(calls: _Calls) -> Iterator[None]:
    sys.setprofile(calls)
    threading.setprofile(calls)  # the gather thread, started at the first step
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def _input() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)


def _torch_backward_ops(num_blocks: int) -> int:
    """The aten ops of the plain model's backward, with no optimizer."""
    model, ops = _model(num_blocks), _Ops()
    out = model(_input())
    with ops:
        out.square().mean().backward()
    return ops.count


def _count(num_blocks: int) -> tuple[dict[str, int], int, int, int, int, int]:
    """Per step: the calls by phase, the aten ops of clip + step + zero_grad, the tensors listed
    to the clip's ops, the aten ops of backward beyond the plain model's; the params and modules
    of the model."""
    import zero_shard

    model = _model(num_blocks)
    opt = zero_shard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    x = _input()
    calls, ops, backward_ops = _Calls(), _Ops(), _Ops()

    def phase(name: str, action: Callable[[], Any], counted: bool) -> Any:
        calls.phase = name if counted else None
        if counted and name in ("clip", "step", "zero_grad"):
            ops.in_clip = name == "clip"
            with ops:
                return action()
        if counted and name == "backward":
            with backward_ops:
                return action()
        return action()

    with _profiled(calls):
        for step in range(2 + NUM_STEPS):
            counted = step >= 2
            if step == 2:
                opt.finish_param_sync()
            out = phase("forward", lambda: model(x), counted)
            phase("backward", lambda: out.square().mean().backward(), counted)  # noqa: B023
            phase("clip", lambda: opt.clip_grad_norm_(1.0), counted)
            phase("step", opt.step, counted)
            phase("zero_grad", opt.zero_grad, counted)
        phase("finish", opt.finish_param_sync, True)
        calls.phase = None
    if len(opt.kind.buckets) != 1:
        raise AssertionError(f"expected one bucket, got {len(opt.kind.buckets)}")
    per_step = {name: calls.counts[name] // NUM_STEPS for name in PHASES}
    num_params = len(list(model.parameters()))
    num_modules = len(list(model.modules()))
    added_ops = backward_ops.count // NUM_STEPS - _torch_backward_ops(num_blocks)
    listed = ops.clip_listed // NUM_STEPS
    return per_step, ops.count // NUM_STEPS, listed, added_ops, num_params, num_modules


def _copies(num_blocks: int) -> tuple[int, int]:
    """Per step at fraction 0.5, weight decay on the matrices only (two param groups, as users
    train): the copies of grads to the host and of new weights back, as issued (one a run of
    pieces back to back)."""
    import zero_shard
    from optimizers import _host_step, _staging

    model = _model(num_blocks)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = zero_shard.wrap(
        torch.optim.AdamW(groups, lr=1e-2),
        model,
        offload=zero_shard.OffloadPolicy(fraction=0.5, num_threads=1, host_staging="per_chunk"),
    )
    counts = collections.Counter()

    def counted(function: Callable[..., Any], name: str) -> Callable[..., Any]:
        def count(*args: Any) -> Any:
            pairs = function(*args)
            counts[name] += len(pairs) if counts["on"] else 0
            return pairs

        return count

    grad_copies, weight_copies = _host_step.grad_copies, _host_step.weight_copies
    _host_step.grad_copies = _staging.grad_copies = counted(grad_copies, "to host")
    _host_step.weight_copies = counted(weight_copies, "from host")
    try:
        x = _input()
        for step in range(2 + NUM_STEPS):
            counts["on"] = step >= 2
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.finish_param_sync()
    finally:
        _host_step.grad_copies = _staging.grad_copies = grad_copies
        _host_step.weight_copies = weight_copies
    return counts["to host"] // NUM_STEPS, counts["from host"] // NUM_STEPS


def _case_per_bucket(rank: int, world_size: int) -> None:
    small, small_ops, small_listed, small_backward, small_params, small_modules = _count(6)
    large, large_ops, large_listed, large_backward, large_params, large_modules = _count(12)
    added_params, added_modules = large_params - small_params, large_modules - small_modules
    shown = f"{small} -> {large} calls per step, +{added_params} params"
    for name in ("clip", "step", "zero_grad", "threads"):
        assert large[name] <= small[name] + SLACK, f"{name}: {shown}"
    # The sub-optimizers' lists are kept from step to step ([Note: kept step lists]).
    assert large["torch_init_group"] == small["torch_init_group"] == 0, shown
    bound = BACKWARD_CALLS_PER_PARAM * added_params + SLACK
    assert large["backward"] - small["backward"] <= bound, f"backward: {shown}"
    bound = FORWARD_CALLS_PER_MODULE * added_modules + SLACK
    assert large["forward"] - small["forward"] <= bound, f"forward: {shown}"
    ops_bound = STEP_OPS_PER_PARAM * added_params + SLACK
    shown = f"{small_ops} -> {large_ops}, +{added_params} params"
    assert large_ops - small_ops <= ops_bound, f"aten ops of clip + step + zero_grad: {shown}"
    # The clip's norm and multiply take each bucket's grads in a few pieces, not one a param.
    shown = f"{small_listed} -> {large_listed}, +{added_params} params"
    assert large_listed == small_listed, f"tensors listed to the clip's ops: {shown}"
    # Backward's ops beyond torch's own: no cut of each grad by rank for the reduction.
    shown = f"{small_backward} -> {large_backward} beyond torch's, +{added_params} params"
    bound = BACKWARD_OPS_PER_PARAM * added_params + SLACK
    assert large_backward - small_backward <= bound, f"aten ops of backward: {shown}"
    # The CPU's share: a few copies a chunk each way, however many params it holds (the new
    # weights into one rank's params, separate tensors, go a copy each).
    small_copies, large_copies = _copies(6), _copies(12)
    shown = f"{small_copies} -> {large_copies} copies to and from the host per step"
    assert large_copies[0] == small_copies[0] <= 4, shown
    if world_size > 1:
        assert large_copies[1] == small_copies[1] <= 4, shown


CASES = {"per_bucket": _case_per_bucket}


@pytest.fixture(scope="module", params=[1, 2])
def outcomes(request: pytest.FixtureRequest) -> tuple[int, dict[str, str | None]]:
    return request.param, run_cases(CASES, request.param)


def test_host_work_per_step_grows_with_buckets_not_params(
    outcomes: tuple[int, dict[str, str | None]],
) -> None:
    check_outcome(outcomes[1], "per_bucket")
