"""Params that share memory: views of one tensor (``nn.Parameter(base[:7])`` and
``nn.Parameter(base[7:])``, experts made as ``nn.Parameter(t) for t in w.unbind(0)``), at wrap and
when a param is given other memory after it (``param.data = t``, ``model.to(...)``).

[Note: shared version counters]
Views of one tensor share its version counter, and so do Parameters made of such views
(``nn.Parameter(view)`` detaches, which keeps the counter): an in-place write into one of them
moves the counter of all. Params whose elements are disjoint train as torch trains them, each
stepped as its own param; zero-shard only keeps its own writes off the counter they share. The
gather of a step's update ([Note: param gather] in ``_gather.py``) writes such a param through a
view of its memory with a counter of its own (``ShardedParam.own_counter``), so that it moves no
other param's counter: a bucket's copy would otherwise look, to the params it shares a counter
with, like a user's write (raising "written after step()"), and, from another bucket, would
bump params that a forward has already saved for backward. So every move of a shared counter is
someone else's write, which each param sharing it sees: all of them count as written (reloaded,
or refused by ``stale_params="error"``), since the counter cannot tell which was. The price is
autograd's check for these params alone: a step between a forward and its backward writes them
unseen (as at one rank, where every param is its own shard).

Params whose elements overlap (``base[:7]`` and ``base[5:]``) cannot be honoured: torch's
optimizer applies both params' updates to the shared elements, one after the other, whereas
zero-shard keeps one main weight per element of each param. They are refused at wrap
(``check_disjoint``), and at the next step where a param was given memory overlapping another's
after wrap (``check_moved``). Under FSDP2 the params are FSDP2's own sharded copies, which share
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._buckets import ShardedParam
from ._released import check_unconverted

__all__ = [
    "check_disjoint",
    "check_moved",
    "counter_sharing",
    "own_counter_targets",
    "own_counter_view",
]


def _first_overlap(
    tensors: Sequence[torch.Tensor],
) -> tuple[int, int] | None:
    """The indices of two of ``tensors`` whose elements overlap in memory, if any. Contiguous
    tensors only are compared (each spans its elements exactly); empty ones hold none."""
    spans: dict[tuple[torch.device, int], list[tuple[int, int, int]]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel() == 0 or not tensor.is_contiguous():
            continue
        start = tensor.storage_offset() * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        spans.setdefault(key, []).append((start, end, index))
    for found in spans.values():
        found.sort()
        reach, reaching = -1, -1  # the furthest end so far, and whose
        for start, end, index in found:
            if start < reach:
                return reaching, index
            if end > reach:
                reach, reaching = end, index
    return None


def _describe(tensor: torch.Tensor, fqn: str) -> str:
    start = tensor.storage_offset()
    return f"{fqn!r} (elements {start}-{start + tensor.numel() - 1} of their storage)"


def check_disjoint(params: Sequence[torch.Tensor], fqns: Sequence[str]) -> None:
    """Refuses params whose elements overlap (see [Note: shared version counters])."""
    overlap = _first_overlap(params)
    if overlap is None:
        return
    first, second = (_describe(params[i], fqns[i]) for i in overlap)
    raise ValueError(
        f"params {first} and {second} share elements (views of one tensor, such as "
        "nn.Parameter(base[:7]) and nn.Parameter(base[5:])): torch's optimizer would apply "
        "both params' updates to the shared elements, one after the other, and zero-shard, "
        "which keeps one fp32 main weight per element of each param, cannot. Make them one "
        "Parameter and take the views in forward, or give each param its own memory "
        "(nn.Parameter(base[5:].clone())); views that share no element train as torch's"
    )


def counter_sharing(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each of ``tensors`` shares its version counter with another of them. Only
    tensors of one storage may: each is bumped once (``increment_version``; a counter only
    grows, and nothing has recorded it yet) while the others' counters are watched."""
    by_storage: dict[tuple[torch.device, int], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel():
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(index)
    shares = [False] * len(tensors)
    for indices in by_storage.values():
        if len(indices) < 2:
            continue
        for index in indices:
            if shares[index]:  # its counter was bumped by another's already
                continue
            before = [tensors[other]._version for other in indices]
            torch.autograd.graph.increment_version(tensors[index])
            for other, version in zip(indices, before, strict=True):
                if other != index and tensors[other]._version != version:
                    shares[index] = shares[other] = True
    return shares


def own_counter_view(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor``'s memory with a version counter of its own: writes into it move
    no other tensor's counter."""
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    view.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return view


def own_counter_targets(
    records: Sequence[ShardedParam], locals_: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Where a bucket's gather writes each param: its local tensor, or, where it shares its
    version counter, its ``own_counter`` view (made anew where the param was given other memory
    since: ``param.data = t``)."""
    targets = []
    for sharded, local in zip(records, locals_, strict=True):
        view = sharded.own_counter
        if view is not None:
            if view.data_ptr() != local.data_ptr():
                view = sharded.own_counter = own_counter_view(local)
            local = view
        targets.append(local)
    return targets


def check_moved(moved: Sequence[ShardedParam], records: Sequence[ShardedParam]) -> None:
    """Checks the params given other memory since zero-shard last looked (``param.data = t``,
    ``model.to(...)``, ``model.half()``): each must keep its dtype, device and contiguous
    layout, and share no element with another param; then notes their memory, and that they
    were written (``.data =`` moves no version counter): the stale check reloads their main
    weights from them, or refuses them, as ``stale_params`` says."""
    for sharded in moved:
        check_unconverted(sharded.param, sharded.fqn, sharded.shard.dtype, sharded.shard.device)
    locals_ = [sharded.local for sharded in records]
    overlap = _first_overlap(locals_)
    if overlap is not None:
        first, second = (_describe(locals_[i], records[i].fqn) for i in overlap)
        raise RuntimeError(
            f"params {first} and {second} share elements since the optimizer was wrapped "
            "(param.data = another param's memory, an old way to tie weights): torch's "
            "optimizer would apply both params' updates to the shared elements, and zero-shard, "
            "which keeps one fp32 main weight per element of each param, cannot; nothing was "
            "stepped. Tie weights by assigning the Parameter itself (model.b.weight = "
            "model.a.weight) before zero_shard.wrap, or give each param its own memory"
        )
    for sharded in moved:
        sharded.note_memory()
        sharded.changed = True  # a write the version counter missed: reloaded, or refused
