"""Checks whose verdict every rank shares, so that no rank is left waiting in a collective.

A check of rank-local inputs (the params each rank built, its host's memory, a checkpoint as each
rank reads it) may fail on some ranks only. Raising there alone would leave the other ranks in
their next collective until it times out. ``on_every_rank`` runs the check, then shares each
rank's outcome over the mesh (or the default group): if any rank failed, every rank raises (its
own error, or one of the type of the lowest failing rank's that names that rank); and what the
check says must be equal on every rank (the params, the options that decide the collectives) is
compared.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from offload import use_device

__all__ = ["Summary", "on_any_rank", "on_every_rank", "start_any_rank_each"]

T = TypeVar("T")
# What must be the same on every rank, one description per item: ["stage=2", "param 'w' ...", ...].
Summary = list[str]


class _Outcome(NamedTuple):
    """One rank's outcome, as sent to the others."""

    error_type: type[BaseException] | None
    message: str
    summary: Summary


def _groups(mesh: DeviceMesh | None) -> list[dist.ProcessGroup | None]:
    """The groups to share outcomes over: each dim of the mesh in turn (after one round per dim,
    every rank of the mesh knows every outcome; a dim of one rank has nothing to share), or
    the default group."""
    if mesh is None:
        return [None]
    return [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]


def _share(outcome: _Outcome, mesh: DeviceMesh | None, device: torch.device) -> dict[int, _Outcome]:
    known = {dist.get_rank(): outcome}
    with use_device(device):
        for group in _groups(mesh):
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, known, group=group)
            for other in gathered:
                known.update(other)
    return known


def _portable(error_type: type[BaseException]) -> type[BaseException]:
    """``error_type`` if it can be sent to the other ranks (pickled by reference), else
    RuntimeError."""
    try:
        pickle.dumps(error_type)
    except Exception:  # a class defined inside a function
        return RuntimeError
    return error_type


def _rebuilt(error_type: type[BaseException], message: str) -> BaseException:
    try:
        return error_type(message)
    except Exception:  # a type whose constructor takes other arguments
        return RuntimeError(message)


def _first_difference(ours: Summary, theirs: Summary) -> tuple[str, str] | None:
    """The first entries of ``ours`` and ``theirs`` that differ, or None."""
    for index in range(max(len(ours), len(theirs))):
        mine = ours[index] if index < len(ours) else "nothing more"
        other = theirs[index] if index < len(theirs) else "nothing more"
        if mine != other:
            return mine, other
    return None


def on_every_rank(
    check: Callable[[], T],
    *,
    mesh: DeviceMesh | None,
    device: torch.device,
    summarize: Callable[[T], Summary] | None = None,
) -> T:
    """Runs ``check`` and returns its result, raising on every rank of ``mesh`` (all its dims; the
    default group when ``None``) if it raised on any.

    A rank whose check failed raises its own error; the others raise one of the type of the
    lowest failing rank's, naming that rank. Without ``torch.distributed`` it is ``check()``.

    Args:
        check: the checks (and any work that may fail on some ranks only, before any collective).
        mesh: the ranks that must agree.
        device: this rank's device (object collectives over NCCL run on it).
        summarize: what must be equal on every rank, from ``check``'s result; ranks that differ
            raise a ``ValueError`` naming the first difference.
    """
    if not dist.is_available() or not dist.is_initialized():
        return check()
    result: Any = None
    error: BaseException | None = None
    try:
        result = check()
        outcome = _Outcome(None, "", summarize(result) if summarize is not None else [])
    except Exception as err:
        error = err
        outcome = _Outcome(_portable(type(err)), str(err), [])
    outcomes = _share(outcome, mesh, device)
    failed = sorted(rank for rank, other in outcomes.items() if other.error_type is not None)
    if error is not None:
        raise error
    if failed:
        first = failed[0]
        failure = outcomes[first]
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise _rebuilt(failure.error_type, f"on rank {first}{others}: {failure.message}")
    ranks = sorted(outcomes)
    for rank in ranks[1:]:
        difference = _first_difference(outcomes[ranks[0]].summary, outcomes[rank].summary)
        if difference is not None:
            raise ValueError(
                f"the ranks differ: {difference[0]} on rank {ranks[0]}, but {difference[1]} on "
                f"rank {rank}. Build the same model and optimizer, with the same options, on "
                "every rank"
            )
    return result


def on_any_rank(flag: bool, *, mesh: DeviceMesh | None, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of ``mesh`` (all its dims; the default group when
    ``None``): one small all-reduce per dim, read by the host."""
    if not dist.is_available() or not dist.is_initialized():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    for group in _groups(mesh):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def start_any_rank_each(
    flags: Sequence[bool],
    *,
    group: dist.ProcessGroup | None,
    mesh: DeviceMesh,
    device: torch.device,
) -> Callable[[], list[bool]]:
    """Starts finding, for each of ``flags`` (the same number on every rank), whether it holds on
    any rank of ``mesh`` (all its dims); the returned call waits and tells. One small all-reduce
    over ``group`` on the host, in the background, where given (every rank of the mesh, see
    ``_host_group``), else one per mesh dim on ``device``, read by the host at the call."""
    if not flags or not dist.is_available() or not dist.is_initialized():
        here = list(flags)
        return lambda: here
    if group is not None:
        value = torch.tensor(flags, dtype=torch.uint8)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group, async_op=True)
    else:
        value = torch.tensor(flags, dtype=torch.uint8, device=device)
        for dim_group in _groups(mesh):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=dim_group)
        work = None

    def result() -> list[bool]:
        if work is not None:
            work.wait()
        return [bool(flag) for flag in value.tolist()]

    return result
