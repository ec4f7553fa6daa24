"""Grad norms and non-finite checks over shards held by many ranks, on the accelerator.

Each rank holds disjoint shards of the grads (before any copy to the host), so a global norm is
a local partial result reduced over the groups across which the grads are sharded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = ["clip_coefficient", "global_norm", "nonfinite_flag"]


def _local_term(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """max |g| for the inf-norm, else sum |g|^p, over this rank's grads, in fp32."""
    grads = [grad for grad in grads if grad.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        # max |g| is exact in the grad's own dtype; no accumulation to widen.
        return torch.stack([n.float() for n in torch._foreach_norm(grads, math.inf)]).amax()
    # Sums of powers accumulate in fp32 whatever the grads' dtype (fp16 ones would overflow).
    norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    return norms.pow(norm_type).sum()


@record_function("zero_shard::norm")
def global_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    groups: Sequence[dist.ProcessGroup],
    device: torch.device,
) -> torch.Tensor:
    """The ``norm_type``-norm of all ranks' ``grads`` together, as a 0-dim fp32 tensor on
    ``device`` (the same value on every rank); ``groups`` are those the grads are sharded over."""
    term = _local_term(grads, norm_type, device).to(device)  # host grads, reduced on the mesh's
    if math.isinf(norm_type):
        # A MAX reduction may drop a NaN (gloo keeps the other rank's value); inf survives it.
        term = torch.nan_to_num(term, nan=math.inf)
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for group in groups:
        dist.all_reduce(term, op=op, group=group)
    if math.isinf(norm_type):
        return term
    return term.pow(1.0 / norm_type)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s factor: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


@record_function("zero_shard::nonfinite_check")
def nonfinite_flag(
    tensors: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup], device: torch.device
) -> torch.Tensor:
    """1.0 on every rank if any rank's ``tensors`` hold an inf or a NaN, else 0.0 (0-dim fp32).

    Pass few large tensors where possible (a bucket's whole grad buffer rather than its views):
    each costs two small kernels.
    """
    tensors = [t for t in tensors if t.numel()]
    flag = torch.zeros((), dtype=torch.float32, device=device)
    if tensors:
        finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        flag = (~finite).float().to(device)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag
