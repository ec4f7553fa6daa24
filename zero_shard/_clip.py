"""A plain model's clip, applied at the step instead of to the grads.

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
Anything that changes or reads the grads otherwise first applies the factors still pending: a
reduction (another backward), a second clip, a norm or a clamp of a placeholder, GradScaler's
unscale, and a step that does not take them. DDP's and FSDP2's grads are the model's own, which
users may read after the clip: there the clip multiplies them at once, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from optimizers import HybridDeviceOptimizer

from ._buckets import Bucket, ShardedParam
from ._norms import scale_grads_
from ._released_ops import edited

__all__ = ["DeferredClip", "EarlyCopies", "GradEdits"]


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

    def __init__(self, records: Sequence[ShardedParam], edits: GradEdits) -> None:
        self._records = list(records)
        self._edits = edits
        self._pending = False

    def apply(self) -> None:
        """Multiplies the grads in place by the factors still pending: one ``scale_grads_`` per
        factor."""
        if not self._pending:
            return
        self._pending = False
        by_factor: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for sharded in self._records:
            factor, sharded.grad_factor = sharded.grad_factor, None
            if factor is not None and sharded.shard.grad is not None:
                by_factor.setdefault(id(factor), (factor, []))[1].append(sharded.shard.grad)
        for factor, grads in by_factor.values():
            scale_grads_(grads, factor)
            edited(grads)
            self._edits.count += 1

    def defer(self, records: list[ShardedParam], factor: torch.Tensor) -> None:
        """Notes ``factor`` for the grads of ``records``, for the step to apply; a factor already
        pending on one of them is applied first."""
        for sharded in records:
            if sharded.grad_factor is not None:
                scale_grads_([sharded.shard.grad], sharded.grad_factor)
                edited([sharded.shard.grad])
                self._edits.count += 1
            sharded.grad_factor = factor
        self._pending = self._pending or bool(records)

    def take(self) -> torch.Tensor | None:
        """At the step: the factor pending on every grad alike, for the step to apply; factors
        that differ between grads (a clip of some params only) are applied here instead."""
        if not self._pending:
            return None
        factors = {
            id(s.grad_factor): s.grad_factor for s in self._records if s.shard.grad is not None
        }
        if len(factors) != 1 or None in factors.values():
            self.apply()
            return None
        self.end()
        return next(iter(factors.values()))

    def end(self) -> None:
        """The factors are applied, or the grads are gone."""
        if self._pending:
            for sharded in self._records:
                sharded.grad_factor = None
        self._pending = False


class EarlyCopies:
    """Hands each bucket's reduced grads to the hybrid optimizer as backward reduces them, so
    that the CPU share's copies to the host start then ([Note: early grad copies] in
    ``optimizers/_early.py``)."""

    _hybrid: HybridDeviceOptimizer
    _reduced_last: Bucket  # the first bucket: backward reduces it last
    _bucket_indices: list[list[int]]  # per bucket, its shards' param indices in the hybrid

    def __init__(
        self,
        hybrid: HybridDeviceOptimizer,
        buckets: Sequence[Bucket],
        bucket_indices: list[list[int]],
    ) -> None:
        self._hybrid = hybrid
        self._reduced_last = buckets[0]
        self._bucket_indices = bucket_indices

    def grads_reduced(self, bucket: Bucket) -> None:
        """On the side stream, where the bucket's reduced grads are final. The first bucket is
        reduced last, as backward ends: the step copies it, behind the step's flags where those
        are copied too (not on CUDA, where the device writes them: [Note: flags written by the
        device] in offload/_flag.py); the worker reads the flags before any chunk."""
        if bucket is not self._reduced_last:
            self._hybrid.grads_ready(self.reduced_grads(bucket))

    def reduced_grads(self, bucket: Bucket) -> dict[int, torch.Tensor]:
        """The bucket's reduced grads by the hybrid optimizer's param index (1-D views of its
        grad buffer; a param no rank had a grad for has zeros there)."""
        indices = self._bucket_indices[bucket.params[0].bucket]
        return {
            index: sharded.grad_slot.view(-1)
            for index, sharded in zip(indices, bucket.params, strict=True)
        }
