"""torch's clipping over a plain model's released grads, done on the reduced shards.

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
  after the grads changed, and kept until they change again (``_grad_edits``, the comm's marker):
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

All three first finalize the grads (``finish``: at most the reductions no backward made) and,
but for a deferred multiply, apply the factors pending. fp16 grads that still carry the loss
scale (``zero_shard.GradScaler``'s unscale) give their unscaled norms. Anything else on a
placeholder (reading values, elementwise math with it) raises, as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._norms import param_norms, scale_grads_

if TYPE_CHECKING:
    from ._buckets import ShardedParam
    from ._optimizer import ZeroShardOptimizer

__all__ = ["ReleasedGradOps"]


@dataclass
class _Norms:
    """The global norms of every reduced grad, as of ``key``."""

    key: tuple[float, Any, int]  # (norm_type, the comm's grads marker, the optimizer's edits)
    norms: torch.Tensor  # 1-D, one per sharded param (in the optimizer's order), fp32 or fp64


class ReleasedGradOps:
    """The optimizer's side of [Note: torch's clip on released grads]: a
    :class:`~zero_shard._released.ReducedGrads` over its sharded params, by index."""

    _optimizer: weakref.ref[ZeroShardOptimizer]
    _cached: _Norms | None

    def __init__(self, optimizer: ZeroShardOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._cached = None

    def _live(self) -> ZeroShardOptimizer:
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError("the optimizer that reduced these grads is gone")
        return optimizer

    def _records(self, optimizer: ZeroShardOptimizer, indices: list[int]) -> list[ShardedParam]:
        """The records of ``indices`` that hold a reduced grad (others: no rank had one)."""
        records = [optimizer._sharded[index] for index in indices]
        return [sharded for sharded in records if sharded.shard.grad is not None]

    @torch.no_grad()
    def norms(self, indices: list[int], norm_type: float) -> list[torch.Tensor]:
        optimizer = self._live()
        optimizer._finalize_grads()
        optimizer._apply_grad_factor()
        key = (norm_type, optimizer._comm.grads_marker(), optimizer._grad_edits)
        if self._cached is None or self._cached.key != key:
            grads = [s.shard.grad for s in optimizer._sharded]
            counted = [s.counted for s in optimizer._sharded]
            with optimizer._host_threads():
                norms = param_norms(
                    grads, norm_type, optimizer._groups, optimizer._reduce_device, counted=counted
                )
            if optimizer._grad_scale is not None and norm_type != 0:  # fp16: still scaled
                norms = norms * optimizer._grad_scale
            self._cached = _Norms(key, norms)
            if norm_type > 0:  # the step's verdict (a count or a min would miss an inf)
                optimizer._window_norm = torch.linalg.vector_norm(norms, norm_type).float()
                optimizer._clipped_marker = optimizer._comm.grads_marker()
        return list(self._cached.norms[indices].unbind())

    @torch.no_grad()
    def scale_(self, indices: list[int], factor: torch.Tensor | float) -> None:
        optimizer = self._live()
        optimizer._finalize_grads()
        records = self._records(optimizer, indices)
        if isinstance(factor, torch.Tensor):
            factor = factor.detach().reshape(())
        if isinstance(factor, torch.Tensor) and optimizer._clips_at_step:
            optimizer._defer_grad_factor(records, factor)
        else:
            optimizer._apply_grad_factor()
            grads = [sharded.shard.grad for sharded in records]
            if isinstance(factor, torch.Tensor):
                scale_grads_(grads, factor)
            elif grads:
                torch._foreach_mul_(grads, factor)  # a Python number: torch's own op
            optimizer._grad_edits += 1
        window = optimizer._window_norm
        if window is not None:
            bound = torch.as_tensor(factor, dtype=torch.float32).to(window.device).abs()
            optimizer._window_norm = window * bound.clamp(min=1.0)

    @torch.no_grad()
    def clamp_(self, indices: list[int], low: float | None, high: float | None) -> None:
        optimizer = self._live()
        optimizer._finalize_grads()
        optimizer._apply_grad_factor()
        for sharded in self._records(optimizer, indices):
            sharded.shard.grad.clamp_(min=low, max=high)
        optimizer._grad_edits += 1
        optimizer._window_norm = None  # a clamp makes infs finite: the step checks again
