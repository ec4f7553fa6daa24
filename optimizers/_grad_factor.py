"""A factor on the grads (a clip's coefficient, a loss scale's inverse) with the bits of
``torch._foreach_mul_`` by it, on the grads' device or emulated on the host."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["factor_as_multiplied", "scale_grads_"]


def _rounds_factor(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``_foreach_mul_`` of grads of ``dtype`` on ``device`` by an fp32 factor rounds the
    factor to ``dtype`` first: on CUDA for bf16 and fp16 grads; the CPU multiplies by the fp32
    factor itself."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def scale_grads_(grads: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiplies ``grads`` in place by ``factor`` (one element), with the bits of
    ``torch._foreach_mul_(grads, factor)`` (as ``torch.nn.utils.clip_grad_norm_`` scales): the
    clip's coefficient, and a loss scale's inverse where the grads are unscaled in place.

    On CUDA, ``_foreach_mul_`` takes its fused path only for a factor of the grads' dtype; for
    bf16 or fp16 grads and an fp32 factor it multiplies one grad at a time, each factor rounded
    to the grads' dtype as it is loaded, at about a third of the memory bandwidth: with many
    grads, most of the time between backward and the first grad's copy to the host
    (docs/benchmarks/e2e.md measures it). Handing it the factor rounded to the grads' dtype
    takes the fused path and gives the same bits (tests/zero_shard/test_norms.py, on CUDA).
    Elsewhere (the CPU multiplies by the fp32 factor itself) the factor goes as it is.

    Args:
        grads: the grads to multiply in place; of any devices and dtypes (grouped by both).
        factor: a one-element tensor, moved to each group's device (and rounded as above).
    """
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in by_kind.items():
        rounded = _rounds_factor(device, dtype)
        factor_of = factor.reshape(()).to(device=device, dtype=dtype if rounded else None)
        torch._foreach_mul_(group, factor_of)


def factor_as_multiplied(value: float, device: torch.device, dtype: torch.dtype) -> float:
    """The factor ``value`` (fp32) as ``scale_grads_`` multiplies grads of ``dtype`` on
    ``device`` by it: rounded to ``dtype`` where that device rounds it. The host multiplies the
    grads it copied from ``device`` by this, in fp32, and rounds each product to ``dtype``: the
    same bits (the CPU's multiply of a low-precision tensor by an fp32 scalar, and CUDA's fused
    one by a factor of the tensor's dtype, both compute the fp32 product and round it)."""
    if _rounds_factor(device, dtype):
        return torch.tensor(value, dtype=torch.float32).to(dtype).item()
    return value
