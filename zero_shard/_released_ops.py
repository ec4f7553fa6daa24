"""Clipping a plain model's released grads: torch's clip on the placeholders, done on the reduced
shards, and the factor deferred to the step.

[Note: torch's clip on released grads]
After backward a plain model's params hold placeholders ([Note: released grads]); the grads are
in the ranks' shards. torch's clipping (``clip_grad_norm_``, ``get_total_norm``,
``clip_grads_with_norm_``, ``clip_grad_value_``) reaches each placeholder as a few aten ops,
which the placeholder hands to the optimizer that reduced its grad (``link``):

- a norm (``linalg_vector_norm``, ``_foreach_norm``) returns the norm of the param's whole
  reduced grad, in the grad's dtype, as torch's norm of a DDP grad; torch then combines the
  per-grad norms itself, so its total, clip factor and checks (``error_if_nonfinite``) are its
  own. The norms of all of the optimizer's params are computed together, from each rank's shard
  slices (partial sums of ``|g|^p``; the max for inf) and one all-reduce, on the first request
  after the grads changed, and kept until they change again (``GradEdits``, the kind's marker):
  torch's one-by-one path (``foreach=False``, and the default for a tensor subclass) still makes
  one collective. Every rank must ask, as every rank calls torch's clip. The norm of the whole
  set, for a positive ``norm_type``, becomes the step's non-finite verdict, as
  ``opt.clip_grad_norm_``'s does ([Note: skip on the device]), so a clipped step makes no second
  collective.
- a multiply in place by one number (the clip factor) multiplies this rank's shard of the grad
  with ``scale_grads_``, whose bits are torch's ``mul_``; for a plain model with a CPU share a
  factor tensor waits for the step, as ``opt.clip_grad_norm_``'s does ([Note: clip at the
  step]). The verdict's norm is multiplied by ``max(|factor|, 1)``, which keeps it non-finite
  wherever an element may have become so.
- a clamp in place (``clip_grad_value_``) clamps the shard; the verdict is dropped, since a
  clamp makes infs finite, and the step checks again.

These run inside the placeholder's ``__torch_dispatch__``, below autograd, where an in-place op
does not advance the version counter of what it writes; each edit of a grad advances it itself
(``edited``), or an early copy of the grad to the host would be taken for current.

All three first finalize the grads (``finish``: at most the reductions no backward made), unless
no reduction ran since the last finalize and the grads asked for are as it left them, and, but
for a deferred multiply, apply the factors pending. fp16 grads that still carry the loss scale
(``zero_shard.GradScaler``'s unscale) give their unscaled norms, and a clamp's bounds are scaled
alike. ``p.grad.data`` and ``p.grad.detach()`` are placeholders for the same grad (logging's
``p.grad.data.norm(2)``; ``p.grad.data.zero_()`` zeroes ``p.grad``). Anything else on a
placeholder (reading values, elementwise math with it) raises (see [Note: released grads]).

[Note: clip at the step]
The grads of a plain model are zero-shard's own (the params hold placeholders, see [Note:
released grads]), so nobody sees them between the clip and the step. There the clip does not
multiply them: the step multiplies the accelerator's share on the device and the CPU's share on
the host as it steps each chunk, with the same bits as ``scale_grads_`` (the host rounds the
factor where the device would, and each fp32 product to the grads' dtype). The grads the host
needs then are those backward reduced, so each bucket's go to the host as soon as they are
reduced (``EarlyCopies``; with a staging buffer per chunk: ``host_staging="per_chunk"``, or the
default ``"auto"`` on a host with room; all but the one reduced last), and the CPU step starts as
backward ends.
A factor is pending per param (``ShardedParam.grad_factor``): torch's clip on the placeholders
multiplies them one by one ([Note: torch's clip on released grads]). The step takes a factor
pending alike on every grad it steps; factors that differ (a clip of some params only) are
applied to the grads first, in place.
A factor the step took stays pending on the grads held after it: torch's grads stay clipped
through the step, and grads kept (no ``zero_grad``) are what the next backward adds to or a
second step steps again. ``zero_grad`` drops the factors with the grads.
Anything that changes or reads the grads otherwise first applies the factors still pending: a
reduction (another backward), a second clip, a norm or a clamp of a placeholder, GradScaler's
unscale, ``main_grad``, and a step that does not take them. After a step that took them, that
multiply in place first waits until the step reads the grads no more
(``HostStep.wait_grads_read``). DDP's and FSDP2's grads are the model's own, which
users may read after the clip: there the clip multiplies them at once, as torch's does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._norms import param_norms, scale_grads_
from ._released import ReleasedGrad

if TYPE_CHECKING:
    from optimizers import HostStep, HybridDeviceOptimizer

    from ._buckets import Bucket, ShardedParam
    from ._optimizer import ZeroShardOptimizer

__all__ = ["DeferredClip", "EarlyCopies", "GradEdits", "ReleasedGradOps", "edited"]


@dataclass
class _Finalized:
    """The grads as the last finalize left them: unchanged, the next op need not finalize again
    (torch's one-by-one path makes an op per grad; a finalize per op would cost a pass over every
    param, and a read of the presence flags, each time)."""

    marker: Any  # the kind's grads marker after it
    grads: list[weakref.ref | None]  # each param's ``.grad`` after it (its placeholder, weakly:
    #                                  a reference held would retire it at the next clear,
    #                                  [Note: placeholders held across steps]; or None)


@dataclass
class _Norms:
    """The global norms of every reduced grad, as of ``key``."""

    key: tuple[float, Any, int]  # (norm_type, the kind's grads marker, the optimizer's edits)
    norms: torch.Tensor  # 1-D, one per sharded param (in the optimizer's order), fp32 or fp64


class ReleasedGradOps:
    """The optimizer's side of [Note: torch's clip on released grads]: a
    :class:`~zero_shard._released.ReducedGrads` over its sharded params, by index."""

    _optimizer: weakref.ref[ZeroShardOptimizer]
    _cached: _Norms | None
    _finalized: _Finalized | None
    _factor: tuple[torch.Tensor, torch.Tensor, int] | None  # the last factor given, its 0-dim
    #   form and its version then: torch's one-by-one path gives every grad the same factor,
    #   which the step must see as one ([Note: clip at the step])

    def __init__(self, optimizer: ZeroShardOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._cached = None
        self._finalized = None
        self._factor = None

    def _live(self) -> ZeroShardOptimizer:
        """The optimizer, where it can stand for the grads now: alive, and not between the
        micro-batches of an outer DDP's ``no_sync()`` ([Note: DDP around a wrapped model])."""
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError("the optimizer that reduced these grads is gone")
        if optimizer.kind.reducer.outer_unsynced:
            raise RuntimeError(
                "the model's grads were read (torch's clip_grad_norm_, a grad norm) between "
                "micro-batches inside the no_sync() of a DistributedDataParallel built around "
                "the model after zero_shard.wrap: under DDP they are each rank's own there, but "
                "zero-shard has reduced them over the ranks already. Clip or read them once the "
                "last micro-batch's backward ran (accelerate: if accelerator.sync_gradients:), or "
                "accumulate with opt.no_sync(), which keeps each rank's grads until then"
            )
        return optimizer

    def _finalize(self, optimizer: ZeroShardOptimizer, indices: list[int]) -> None:
        """Finalizes the grads, unless no reduction ran and the grads of ``indices`` are as the
        last finalize left them (a clear of others is seen when they are asked for, or at the
        step)."""
        last = self._finalized
        if (
            last is not None
            and last.marker == optimizer.kind.grads_marker()
            and all(_as_left(optimizer._sharded[i].param.grad, last.grads[i]) for i in indices)
        ):
            return
        optimizer._finalize_grads()
        grads = [sharded.param.grad for sharded in optimizer._sharded]
        left = [None if grad is None else weakref.ref(grad) for grad in grads]
        self._finalized = _Finalized(optimizer.kind.grads_marker(), left)

    def settle(self, indices: list[int]) -> None:
        self._finalize(self._live(), indices)

    def _records(self, optimizer: ZeroShardOptimizer, indices: list[int]) -> list[ShardedParam]:
        """The records of ``indices`` that hold a reduced grad (others: no rank had one)."""
        records = [optimizer._sharded[index] for index in indices]
        return [sharded for sharded in records if sharded.shard.grad is not None]

    @torch.no_grad()
    def norms(self, indices: list[int], norm_type: float) -> list[torch.Tensor]:
        optimizer = self._live()
        self._finalize(optimizer, indices)
        clip = optimizer.kind.clip
        if clip is not None:
            clip.apply()
        key = (norm_type, optimizer.kind.grads_marker(), optimizer._edits.count)
        if self._cached is None or self._cached.key != key:
            grads = [s.shard.grad for s in optimizer._sharded]
            counted = [s.counted for s in optimizer._sharded]
            with optimizer.kind.host_threads():
                norms = param_norms(
                    grads, norm_type, optimizer._groups, optimizer._reduce_device, counted=counted
                )
            if optimizer._grad_scale is not None and norm_type != 0:  # fp16: still scaled
                norms = norms * optimizer._grad_scale
            self._cached = _Norms(key, norms)
            if norm_type > 0:  # the step's verdict (a count or a min would miss an inf)
                optimizer._window_norm = torch.linalg.vector_norm(norms, norm_type).float()
                optimizer._clipped_marker = optimizer.kind.grads_marker()
        return list(self._cached.norms[indices].unbind())

    @torch.no_grad()
    def scale_(self, indices: list[int], factor: torch.Tensor | float) -> None:
        optimizer = self._live()
        self._finalize(optimizer, indices)
        records = self._records(optimizer, indices)
        if isinstance(factor, torch.Tensor):
            kept = self._factor
            if kept is None or kept[0] is not factor or kept[2] != factor._version:
                # In fp32 where low: a bf16/fp16 model's clip makes its coefficient in the grads'
                # dtype, and the step takes fp32 factors; the cast is exact, and a multiply by
                # it rounds as torch's multiply by the low-precision one does. (A copy, so a
                # factor updated in place since is taken anew: its version moved.)
                scalar = factor.detach().reshape(())
                if scalar.dtype in (torch.bfloat16, torch.float16):
                    scalar = scalar.float()
                self._factor = (factor, scalar, factor._version)
            factor = self._factor[1]
        clip = optimizer.kind.clip
        if isinstance(factor, torch.Tensor) and clip is not None:
            clip.defer(records, factor)
        else:
            if clip is not None:
                clip.apply()
            grads = [sharded.shard.grad for sharded in records]
            if isinstance(factor, torch.Tensor):
                scale_grads_(grads, factor)
            elif grads:
                torch._foreach_mul_(grads, factor)  # a Python number: torch's own op
            edited(grads)
            optimizer._edits.count += 1
        window = optimizer._window_norm
        if window is not None:
            bound = torch.as_tensor(factor, dtype=torch.float32).to(window.device).abs()
            optimizer._window_norm = window * bound.clamp(min=1.0)

    @torch.no_grad()
    def clamp_(self, indices: list[int], low: float | None, high: float | None) -> None:
        optimizer = self._live()
        self._finalize(optimizer, indices)
        if optimizer.kind.clip is not None:
            optimizer.kind.clip.apply()
        scale = optimizer._grad_scale  # fp16: the grads still carry the loss scale; so do bounds
        if scale is not None:
            low = None if low is None else low / scale
            high = None if high is None else high / scale
        grads = [sharded.shard.grad for sharded in self._records(optimizer, indices)]
        for grad in grads:
            grad.clamp_(min=low, max=high)
        edited(grads)
        optimizer._edits.count += 1
        optimizer._window_norm = None  # a clamp makes infs finite: the step checks again


def _as_left(grad: Any, left: weakref.ref | None) -> bool:
    """Whether a ``.grad`` is what the last finalize left there, untouched."""
    if left is None:
        return grad is None
    return grad is left() and isinstance(grad, ReleasedGrad) and not grad.zeroed


def edited(grads: list[torch.Tensor]) -> None:
    """Advances the version counters of grads edited in place. Ops run inside a placeholder's
    ``__torch_dispatch__`` run below autograd, where in-place ops leave the counters as they
    are; but an early copy of a grad to the host is trusted only while its counter stands
    ([Note: early grad copies] in ``optimizers/_early.py``)."""
    for grad in grads:
        torch.autograd.graph.increment_version(grad)


@dataclass
class GradEdits:
    """In-place changes zero-shard made to the reduced grads (clips, unscales, clamps): norms
    computed before one are not theirs."""

    count: int = 0


class DeferredClip:
    """The factors of clips not yet applied to the grads, per param ([Note: clip at the step])."""

    _records: list[ShardedParam]  # every sharded param: each holds its pending grad_factor
    _edits: GradEdits  # the optimizer's, counting each multiply applied here
    _pending: bool  # some record's grad_factor is set
    _stepped: bool  # a step took the factors: its device share multiplied its grads in place,
    #                 and only the host share's grads wait for them
    _read_by: HostStep | None  # that step, which may still read the host share's grads
    _hybrid: HybridDeviceOptimizer  # where each param's host share lies (record i is its index i)

    def __init__(
        self, records: Sequence[ShardedParam], edits: GradEdits, hybrid: HybridDeviceOptimizer
    ) -> None:
        self._records = list(records)
        self._edits = edits
        self._hybrid = hybrid
        self._pending = False
        self._stepped = False
        self._read_by = None

    def apply(self) -> None:
        """Multiplies the grads in place by the factors still pending: one ``scale_grads_`` per
        factor, once a step that read them with the factors is done reading."""
        if not self._pending:
            return
        self._pending = False
        by_factor: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for index, sharded in enumerate(self._records):
            factor, sharded.grad_factor = sharded.grad_factor, None
            if factor is not None and sharded.shard.grad is not None:
                grads = by_factor.setdefault(id(factor), (factor, []))[1]
                grads += self._unscaled(index, sharded.shard.grad)
        by_factor = {key: value for key, value in by_factor.items() if value[1]}
        self._stepped = False
        read_by, self._read_by = self._read_by, None
        if by_factor and read_by is not None:  # (none where the grads were dropped since)
            read_by.wait_grads_read()
        for factor, grads in by_factor.values():
            scale_grads_(grads, factor)
            edited(grads)
            self._edits.count += 1

    def _unscaled(self, index: int, grad: torch.Tensor) -> list[torch.Tensor]:
        """The parts of param ``index``'s grad its pending factor is still to multiply: all of
        it, or after a step that took the factor, its host share's elements."""
        if not self._stepped:
            return [grad]
        flat = grad.view(-1)
        return [flat[start : start + numel] for start, numel in self._hybrid.host_ranges(index)]

    def defer(self, records: list[ShardedParam], factor: torch.Tensor) -> None:
        """Notes ``factor`` for the grads of ``records``, for the step to apply; a factor already
        pending on one of them is applied first."""
        if self._stepped:  # what a step left (apply() waits until it reads the grads no more)
            self.apply()
        for sharded in records:
            if sharded.grad_factor is not None:
                scale_grads_([sharded.shard.grad], sharded.grad_factor)
                edited([sharded.shard.grad])
                self._edits.count += 1
            sharded.grad_factor = factor
        self._pending = self._pending or bool(records)

    def take(self) -> torch.Tensor | None:
        """At the step: the factor pending on every grad alike, for the step to apply; factors
        that differ between grads (a clip of some params only) are applied here instead. A
        factor taken stays pending on the host share's grads held after the step (``read_by``;
        the device share multiplies its grads in place): torch's grads stay clipped, so what
        reads or adds to them next (another backward, a clip, a second step) applies it first."""
        if not self._pending:
            return None
        if self._stepped:  # a second step of the same grads: as torch's, clipped once
            self.apply()
            return None
        factors = {
            id(s.grad_factor): s.grad_factor for s in self._records if s.shard.grad is not None
        }
        if len(factors) != 1 or None in factors.values():
            self.apply()
            return None
        return next(iter(factors.values()))

    def read_by(self, step: HostStep | None) -> None:
        """``step`` took the factors and may read the grads until it is done: an in-place
        multiply waits for that (``HostStep.wait_grads_read``)."""
        self._stepped = True
        self._read_by = step

    def end(self) -> None:
        """The grads are gone (cleared): nothing is left to multiply."""
        if self._pending:
            for sharded in self._records:
                sharded.grad_factor = None
        self._pending = False
        self._stepped = False
        self._read_by = None


class EarlyCopies:
    """Hands each bucket's reduced grads to the hybrid optimizer as backward reduces them, for
    the CPU share's early copies to the host ([Note: early grad copies] in optimizers/_early.py)."""

    _hybrid: HybridDeviceOptimizer
    _reduced_last: Bucket  # the first bucket: backward reduces it last
    _bucket_indices: list[list[int]]  # per bucket, its shards' param indices in the hybrid
    _sync_groups: Callable[[], None] | None  # gives the hybrid the wrapper's group options
    #                                          (its steps speculated from these grads take
    #                                          them); None: the hybrid does not speculate

    def __init__(
        self,
        hybrid: HybridDeviceOptimizer,
        buckets: Sequence[Bucket],
        bucket_indices: list[list[int]],
        sync_groups: Callable[[], None] | None,
    ) -> None:
        self._hybrid = hybrid
        self._reduced_last = buckets[0]
        self._bucket_indices = bucket_indices
        self._sync_groups = sync_groups

    def grads_reduced(self, bucket: Bucket) -> None:
        """On the side stream, where the bucket's reduced grads are final (1-D views of its grad
        buffer; zeros for a param no rank had a grad for). The first bucket is reduced last, as
        backward ends: the step copies it, behind the step's flags where those are copied too
        (not on CUDA, where the device writes them: [Note: flags written by the device] in
        offload/_flag.py); the worker reads the flags before any chunk."""
        if bucket is not self._reduced_last:
            if self._sync_groups is not None and self._hybrid.speculates:
                self._sync_groups()  # (no step in flight: the speculation runs now)
            indices = self._bucket_indices[bucket.params[0].bucket]
            params = zip(indices, bucket.params, strict=True)
            self._hybrid.grads_ready({index: s.grad_slot.view(-1) for index, s in params})
