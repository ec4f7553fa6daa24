"""Grads copied to the host while backward runs, before the step that steps them.

[Note: early grad copies]
With a staging buffer per chunk (not the ring: its buffers are taken in turn as chunks step), a
chunk's grads may go to the host as soon as backward has made all of them, instead of when the
step starts: the copies then run beside backward's kernels, when the host's memory and the copy
engine are otherwise idle, and the CPU step finds the first chunks' grads already there. The
caller says which grads are final (``HybridDeviceOptimizer.grads_ready``: zero-shard calls it
after each bucket's reduction); a chunk is copied once every param with a piece in it was given.

A copy is only a guess that the grads will not change before the step: accumulation by another
backward, an in-place clip or unscale, a grad set to ``None`` may still come. So each copy keeps
what it read: per param, the grad's memory (its base tensor, weakly, and its address) and its
version counter, which every in-place torch op on the grad or a view of it advances. At the step,
a chunk's copy is used only where the step's grads are exactly those, unchanged; otherwise the
chunk is copied again as without early copies, behind the earlier copy on the same stream. Writes
that bypass the version counter (through ``.data``, or by raw pointers) cannot be seen: give only
grads that nothing writes that way, as zero-shard's reduced grads are (nobody else holds them).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["EarlyCopy", "GradIdentity"]


class GradIdentity(NamedTuple):
    """What a grad was when it was copied: its memory and its version."""

    base: weakref.ref  # the tensor owning the memory (the grad, or the tensor it is a view of)
    data_ptr: int
    numel: int
    dtype: torch.dtype
    version: int

    @classmethod
    def of(cls, grad: torch.Tensor) -> GradIdentity:
        base = grad if grad._base is None else grad._base
        return cls(weakref.ref(base), grad.data_ptr(), grad.numel(), grad.dtype, grad._version)

    def holds(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the same memory, not written in place since."""
        base = grad if grad._base is None else grad._base
        return (
            self.base() is base
            and self.data_ptr == grad.data_ptr()
            and self.numel == grad.numel()
            and self.dtype == grad.dtype
            and self.version == grad._version
        )


@dataclass
class EarlyCopy:
    """One chunk's grads copied into its staging buffer before the step."""

    grads: dict[int, GradIdentity]  # record index -> the grad the copy read
    done: Any  # event after the D2H (None: it ran synchronously)

    def serves(self, indices: Sequence[int], grads: Mapping[int, torch.Tensor]) -> bool:
        """Whether the copy holds exactly the grads of ``indices`` (the records with a piece in
        the chunk that have a grad this step) as ``grads`` holds them now."""
        return set(indices) == self.grads.keys() and all(
            self.grads[index].holds(grads[index]) for index in indices
        )
