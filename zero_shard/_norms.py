"""Grad norms and non-finite checks over shards held by many ranks, on the accelerator.

Each rank holds disjoint shards of the grads (before any copy to the host), so a global norm is
a local partial result reduced over the groups across which the grads are sharded.

[Note: uncounted copies in the verdict]
Where a param is replicated over a mesh dim the norms sum over (tensor parallelism's replicated
norms and biases, an FSDP2 param on the ``dp`` dim alone), each rank holds a copy of its shard's
grad, and only the dim's first rank counts it (``ShardedParam.counted``). The step reads its
non-finite verdict from the clip's norm when there is one, so a copy that holds an inf or a NaN
where the counted one does not must still make the norm non-finite: otherwise that rank would
step its copy with the inf and the others would not. The copies are screened for non-finite
values (``copies`` / ``counted``), which then make the norm (or the param's norm) non-finite on
every rank, in the same all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from offload import phase
from optimizers import scale_grads_  # (re-exported: the clip's and the unscale's multiply)

__all__ = ["clip_coefficient", "global_norm", "nonfinite_flag", "param_norms", "scale_grads_"]


# Host tensors of HOST_ROWS_FROM elements or more are reduced by rows of HOST_ROW elements.
# torch reduces a whole CPU tensor to one value on one thread whatever the thread count, and in
# fp32 with an error that grows with its length: measured on 64M normal values, 0.5% off, at the
# speed of one core (1B fp32 host grads took 0.55 s with 16 threads or 1 on an H100 host). Rows
# reduce in parallel (one output each) and every sum stays short. Smaller tensors go to one
# foreach call together: a few ops per tensor would cost more than their reduction.
HOST_ROW = 4096
HOST_ROWS_FROM = 1 << 20


def _accumulate_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """fp32, or fp64 where a tensor is: sums of powers of fp16 grads would overflow in fp16, and
    fp64 ones must not be narrowed."""
    return torch.float64 if any([t.dtype == torch.float64 for t in tensors]) else torch.float32


def _host_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A contiguous host tensor as (rows, HOST_ROW) and the 1-D tail, each present if nonempty."""
    flat = tensor.view(-1)
    body = flat.numel() - flat.numel() % HOST_ROW
    parts = [flat[:body].view(-1, HOST_ROW)] if body else []
    return [*parts, flat[body:].view(1, -1)] if body < flat.numel() else parts


def _host_norm(tensor: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """A large contiguous host tensor's ``norm_type``-norm, reduced by rows (see HOST_ROW): the
    norm of its rows' norms."""
    rows = [
        torch.linalg.vector_norm(part, norm_type, dim=1, dtype=dtype) for part in _host_rows(tensor)
    ]
    return torch.linalg.vector_norm(torch.cat(rows), norm_type)


def _by_rows(tensor: torch.Tensor, rows_from: int) -> bool:
    return tensor.device.type == "cpu" and tensor.numel() >= rows_from and tensor.is_contiguous()


def _norms(
    tensors: Sequence[torch.Tensor], norm_type: float, rows_from: int = HOST_ROWS_FROM
) -> list[torch.Tensor]:
    """Each tensor's ``norm_type``-norm, accumulated in fp32 (fp64 where a tensor is fp64);
    host tensors of ``rows_from`` elements or more by rows."""
    dtype = _accumulate_dtype(tensors)
    if all([tensor.device.type != "cpu" for tensor in tensors]):  # the accelerator's: one call
        return list(torch._foreach_norm(tensors, norm_type, dtype=dtype))
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    rest = []
    large = [tensor.numel() >= rows_from for tensor in tensors]  # few: ask only these
    for index, (tensor, maybe) in enumerate(zip(tensors, large, strict=True)):
        if maybe and _by_rows(tensor, rows_from):
            norms[index] = _host_norm(tensor, norm_type, dtype)
        else:
            rest.append(index)
    if rest:
        found = torch._foreach_norm([tensors[i] for i in rest], norm_type, dtype=dtype)
        for index, norm in zip(rest, found, strict=True):
            norms[index] = norm
    return norms  # type: ignore[return-value]


def _local_term(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device, rows_from: int
) -> torch.Tensor:
    """max |g| for the inf-norm, else sum |g|^p, over this rank's grads, in fp32."""
    grads = [grad for grad in grads if grad.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(_norms(grads, norm_type, rows_from))
    if math.isinf(norm_type):
        return norms.amax().float()  # max |g| is exact: no accumulation to widen
    return norms.pow(norm_type).sum().float()


def global_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    groups: Sequence[dist.ProcessGroup],
    device: torch.device,
    *,
    copies: Sequence[torch.Tensor] = (),
    rows_from: int = HOST_ROWS_FROM,
) -> torch.Tensor:
    """The ``norm_type``-norm of all ranks' ``grads`` together, as a 0-dim fp32 tensor on
    ``device`` (the same value on every rank); ``groups`` are those the grads are sharded over.
    ``copies``: grads this rank holds that another rank counts; they add nothing, but an inf or
    a NaN in one makes the norm inf (see [Note: uncounted copies in the verdict]). Host grads of
    ``rows_from`` elements or more are reduced by rows (``HOST_ROW``): pass ``HOST_ROW`` for a
    few long pieces of many grads (a bucket's), whose one reduction would be less accurate than
    the grads' own."""
    with phase("zero_shard::norm"):
        term = _local_term(grads, norm_type, device, rows_from)
        term = term.to(device)  # host grads: on the mesh's
        copies = [copy for copy in copies if copy.numel()]
        if copies:
            finite = _all_finite(copies).to(device)
            term = torch.where(finite, term, torch.full_like(term, math.inf))
        if math.isinf(norm_type):
            # A MAX reduction may drop a NaN (gloo keeps the other rank's value); inf survives.
            # (nan_to_num's defaults would turn an inf itself into the largest finite float.)
            term = torch.nan_to_num(term, nan=math.inf, posinf=math.inf)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        for group in groups:
            dist.all_reduce(term, op=op, group=group)
        if math.isinf(norm_type):
            return term
        return term.pow(1.0 / norm_type)


def _local_terms(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """What a rank's piece of a tensor adds to the tensor's ``norm_type``-norm, from the piece's
    norm: itself where pieces combine by max, min or count (inf, -inf, 0), else its p-th power,
    which the pieces sum."""
    if norm_type in (math.inf, -math.inf, 0.0):
        return norms
    return norms.pow(norm_type)


def param_norms(
    grads: Sequence[torch.Tensor | None],
    norm_type: float,
    groups: Sequence[dist.ProcessGroup],
    device: torch.device,
    *,
    counted: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Each entry's ``norm_type``-norm over the pieces all ranks hold of it (``None``: this rank
    holds no piece), as a 1-D tensor on ``device``, the same on every rank: one all-reduce per
    group for all of them. Accumulated in fp32 (fp64 where a grad is fp64), as torch's per-grad
    norms; any ``norm_type`` ``torch.linalg.vector_norm`` takes. A NaN survives the max and min
    reductions (gloo's MAX may drop it): its flag travels beside the values. ``counted[i]``
    false: this rank's piece is a copy another rank counts; it adds nothing, but an inf or a NaN
    in it makes the entry's norm NaN (see [Note: uncounted copies in the verdict])."""
    counts = [True] * len(grads) if counted is None else list(counted)
    held = [(index, grad) for index, grad in enumerate(grads) if grad is not None and grad.numel()]
    present = [(index, grad) for index, grad in held if counts[index]]
    copies = [(index, grad) for index, grad in held if not counts[index]]
    dtype = _accumulate_dtype([grad for _, grad in present])
    # An absent piece: nothing to a sum or a count, 0 to a max, inf to a min.
    empty = math.inf if norm_type == -math.inf else 0.0
    with phase("zero_shard::norm"):
        terms = torch.full((len(grads),), empty, dtype=dtype, device=device)
        if present:
            pieces = [grad for _, grad in present]
            if norm_type == 0.0:  # counts of nonzeros (a norm of row norms would count rows)
                norms = torch.stack([torch.count_nonzero(grad) for grad in pieces]).to(dtype)
            else:
                norms = torch.stack(_norms(pieces, norm_type)).to(dtype)
            where = torch.tensor([index for index, _ in present], device=device)
            terms.index_copy_(0, where, _local_terms(norms, norm_type).to(device))
        if copies:  # no host wait: the flags stay on the device
            where = torch.tensor([index for index, _ in copies], device=device)
            finite = torch.stack([torch.isfinite(copy).all().to(device) for _, copy in copies])
            nan = torch.full_like(finite, math.nan, dtype=dtype)
            terms.index_copy_(0, where, torch.where(finite, terms[where], nan))
        if math.isinf(norm_type):
            op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
            sign = (
                1.0 if norm_type > 0 else -1.0
            )  # a flag the reduction keeps: 1 to a max, -1 to a min
            # (nan_to_num's defaults would turn an inf into the largest finite float.)
            values = terms.nan_to_num(nan=empty, posinf=math.inf, neginf=-math.inf)
            both = torch.cat([values, terms.isnan().to(dtype) * sign])
            for group in groups:
                dist.all_reduce(both, op=op, group=group)
            values, flags = both.split(len(grads))
            return torch.where(flags * sign > 0, math.nan, values)
        for group in groups:
            dist.all_reduce(terms, op=dist.ReduceOp.SUM, group=group)
        if norm_type == 0.0:
            return terms
        return terms.pow(1.0 / norm_type)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s factor: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def _all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether every element of every tensor is finite (a 0-dim bool tensor). Host tensors are
    screened by their norms first (an inf or a NaN makes a norm non-finite, and ``_norms`` runs
    in parallel where ``isfinite().all()`` costs ~8 ns an element on one core); only a non-finite
    norm, which finite values beyond ~1e19 can also give, is checked element by element."""
    host = [t for t in tensors if t.device.type == "cpu"]
    device = [t for t in tensors if t.device.type != "cpu"]
    if host and not bool(torch.isfinite(torch.stack(_norms(host, 2.0))).all()):
        if not all(bool(torch.isfinite(t).all()) for t in host):
            return torch.zeros((), dtype=torch.bool)
    if not device:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(t).all() for t in device]).all()  # no host wait


def nonfinite_flag(
    tensors: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup], device: torch.device
) -> torch.Tensor:
    """1.0 on every rank if any rank's ``tensors`` hold an inf or a NaN, else 0.0 (0-dim fp32).

    Pass few large tensors where possible (a bucket's whole grad buffer rather than its views):
    each costs two small kernels.
    """
    with phase("zero_shard::nonfinite_check"):
        tensors = [t for t in tensors if t.numel()]
        flag = torch.zeros((), dtype=torch.float32, device=device)
        if tensors:
            flag = (~_all_finite(tensors)).float().to(device)
        for group in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return flag
