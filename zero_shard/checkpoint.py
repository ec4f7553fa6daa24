"""Checkpoints of a model and its ZeroShardOptimizer through torch.distributed.checkpoint (DCP).

[Note: atomic checkpoints]
``save`` writes into ``<path>.partial`` (cleared first), and only when every rank's data and
DCP's metadata are written does rank 0 add a completion marker and move it into place:
``<path>`` becomes ``<path>.previous``, ``<path>.partial`` becomes ``<path>``, and
``<path>.previous`` is removed. No complete checkpoint is removed before a newer one is at
``<path>``, so a crash or a failed rename at any point leaves the last complete checkpoint
loadable: at ``<path>``, or, where ``<path>`` is missing, at ``<path>.partial`` (marked complete,
not moved into place) or ``<path>.previous`` (moved aside), the newer first; ``load`` falls back
to it, and the next ``save`` moves a complete ``<path>.partial`` into place before it writes. A
directory without the marker is refused: its save did not finish.
A save that fails (a write on any rank, or the commit on rank 0) fails on every rank alike, and
an ``async_save``'s failure is raised again, on every rank, by the next ``save``, ``async_save``
or ``load``: no rank is left waiting for another in a collective. Each call first waits for every
rank to enter it, for at most the process group's timeout: one called on some ranks only (under
``if rank == 0:``, a DDP habit) raises there, naming the fix, instead of waiting forever.

``load`` reads the checkpoint into host memory and only then copies it into the model and the
optimizer: a checkpoint that cannot be read whole (a data file missing or truncated, a damaged
``.metadata``) raises ``DamagedCheckpointError`` on every rank and changes nothing.

The optimizer's state dict holds DTensors with the params' global shapes, so a checkpoint loads
at any world size and offload fraction, and its keys are those of FSDP2 + ``torch.optim`` (an
FSDP2 checkpoint loads here, and one written here loads into FSDP2 with
``torch.distributed.checkpoint.state_dict.set_state_dict``). A plain torch optimizer's state is
saved keyed by param FQN too, as ``get_optimizer_state_dict`` keys it, so the checkpoint of a
torch run loads into a zero-shard one and back; state keyed by position (a torch optimizer's own
``state_dict()``) loads as well. Params are matched by FQN, whatever order the model registers
them in. Without ``main_param`` in the checkpoint (one written by FSDP2, or from fp32 params), the
fp32 main weights come from the loaded model's weights, read at the precision they were saved at;
with it, into a model of fp32 params, the params are the saved main weights ([Note: main weights
across dtypes]).

Example::

    zero_shard.checkpoint.save("ckpt/latest", model=model, optimizer=opt, extra={"step": step})
    extra = zero_shard.checkpoint.load("ckpt/latest", model=model, optimizer=opt)
    step = extra["step"]
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from ._host_group import default_timeout
from ._names import canonical_names, is_compiled, module_state_key
from ._optimizer import ZeroShardOptimizer
from ._reading import DamagedCheckpointError, find_damage, read_metadata, read_whole, save_id
from ._snapshots import Snapshotter
from ._state_dict import (
    add_state_saved_beyond,
    check_saved_groups,
    check_saved_model,
    check_saved_optimizer,
    create_missing_state,
    dtensor_on,
    full_state_dict,
    keyed_by_fqn,
    keyed_by_position,
    load_full_state_dict,
    numbers_params,
    param_fqns,
    to_dtensor,
)
from ._tp import as_dtensor
from ._verdict import on_every_rank

__all__ = [
    "DamagedCheckpointError",
    "IncompleteCheckpointError",
    "async_save",
    "full_state_dict",
    "load",
    "load_full_state_dict",
    "save",
]

_MARKER = ".zero_shard_complete"
T = TypeVar("T")


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint's save did not finish (no completion marker)."""


def _paths(path: str | os.PathLike) -> tuple[Path, Path, Path]:
    final = Path(os.path.realpath(path))  # a link's target: a save moves a folder into place
    return (
        final,
        final.with_name(final.name + ".partial"),
        final.with_name(final.name + ".previous"),
    )


def _unwrapped(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The ZeroShardOptimizer inside an optimizer that wraps one (accelerate's
    ``AcceleratedOptimizer``, which ``accelerator.prepare`` returns and a ``TrainerCallback`` is
    handed); any other optimizer as it is."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(optimizer, ZeroShardOptimizer) and isinstance(inner, ZeroShardOptimizer):
        return inner
    return optimizer


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` compiled, whose state dict names the params without
    ``_orig_mod.`` (as ``get_model_state_dict`` does): a checkpoint of a compiled model loads
    into it uncompiled, and the other way round ([Note: canonical names] in ``_names.py``)."""
    if is_compiled(model):
        return model._orig_mod
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rng_state() -> dict[str, Any]:
    """This rank's random number generators, as plain bytes (a tensor here would be taken by
    DCP as replicated and saved from rank 0 only)."""
    state = {"torch": bytes(torch.get_rng_state().numpy()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = bytes(torch.cuda.get_rng_state().numpy())
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


def _localized_params(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor]:
    """Key in ``model.state_dict()`` -> param, for the tensor-parallel params DDP turned into
    local tensors (``device_mesh=``; torch marks them ``_st_info``). ``model.state_dict()`` holds
    them as local tensors under global names before the first forward, and not at all after it
    (DDP swaps them for DTensors at each forward): a checkpoint takes them from here, as
    DTensors. The optimizer's list, where it has one, holds them after a forward too."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    prefix, module = ("module.", model.module) if ddp else ("", model)
    named = None
    if isinstance(optimizer, ZeroShardOptimizer):
        named = optimizer._named_params(module)
    if named is None:
        named = list(module.named_parameters())
    return {prefix + fqn: param for fqn, param in named if hasattr(param, "_st_info")}


def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if isinstance(optimizer, ZeroShardOptimizer):
        optimizer.finish_param_sync()  # a delayed update in flight first: every rank is here
    state = model.state_dict()
    for key, param in _localized_params(model, optimizer).items():
        state[key] = as_dtensor(param)
    return state


def _load_model(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Loads ``state`` (``_model_state``'s keys, as read by DCP) into ``model``; the
    params DDP localized are not in ``model.state_dict()``: they are copied one by one."""
    localized = _localized_params(model, optimizer)
    if not localized:
        model.load_state_dict(state)
        return
    rest = {key: value for key, value in state.items() if key not in localized}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    if unexpected or set(missing) - set(localized):
        raise RuntimeError(
            f"loading the model's state found unexpected keys {unexpected[:5]} and missing "
            f"keys {sorted(set(missing) - set(localized))[:5]}"
        )
    with torch.no_grad():
        for key, param in localized.items():
            param.copy_(state[key].to_local())


def _optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict keyed by param FQN: a ZeroShardOptimizer's own, a torch
    optimizer's rekeyed (it numbers its params)."""
    state = optimizer.state_dict()
    if isinstance(optimizer, ZeroShardOptimizer):
        return state
    return keyed_by_fqn(state, param_fqns(model, optimizer))


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None,
    scheduler: LRScheduler | None = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"model": _model_state(model, optimizer)}
    if optimizer is not None:
        state["optim"] = _optim_state(model, optimizer)
    # One pickled object: DCP would flatten nested dicts and lists into keys of their own, which
    # its load then cannot match against a state dict that does not know them yet. Rank 0's
    # alone: DCP writes a key that several ranks hold from any one of them.
    if _rank() == 0:
        state["extra"] = pickle.dumps(dict(extra or {}))
        if scheduler is not None:
            state["scheduler"] = pickle.dumps(scheduler.state_dict())
    state[f"rng_rank{_rank()}"] = _rng_state()
    return state


def _device(model: nn.Module) -> torch.device:
    """Where the model is: object collectives over NCCL run there."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _prepare(
    path: str | os.PathLike, device: torch.device, stage: Callable[[], T]
) -> tuple[Path, Path, Path, T]:
    """Waits for the last ``async_save``, clears what a crashed save left at ``<path>.partial``
    and runs ``stage`` (the snapshot of an async save); if any of it fails on any rank (the last
    save failed), every rank raises, and nothing is written."""
    final, partial, previous = _paths(path)
    # The path as given, made absolute (a relative one resolves against each rank's working
    # directory); not through links, which may differ between hosts that share one file system.
    given = os.path.abspath(os.fspath(path))
    _check_one_checkpoint(
        given,
        given,
        f"save() was given {str(path)!r}, which the ranks resolve to different directories",
        "every rank writes its part into one checkpoint: pass an absolute path on a file "
        "system all ranks share; nothing was written",
    )

    def prepare() -> T:
        _finish_pending()
        if _rank() == 0:
            _check_replaceable(final)
            if not final.exists() and (partial / _MARKER).exists():
                os.replace(partial, final)  # complete, not moved into place: the newest
            shutil.rmtree(partial, ignore_errors=True)  # a save that crashed before
            partial.parent.mkdir(parents=True, exist_ok=True)
        return stage()

    # Sharing the verdict is also the barrier: no rank writes before rank 0 cleared the folder.
    staged = on_every_rank(prepare, mesh=None, device=device)
    return final, partial, previous, staged


def _check_one_checkpoint(key: str, shown: str, what: str, fix: str) -> None:
    """Raises ``ValueError`` on every rank where the ranks' ``key`` differ (a relative path
    resolved against each rank's working directory, or node-local copies of other saves):
    each rank writes, or reads, its part of one checkpoint. ``shown``: this rank's view of it.
    A collective of the group ``_meet`` made."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (key, shown), group=_checkpoint_group())
    if len({each for each, _ in gathered}) > 1:
        views = "; ".join(f"rank {rank}: {view}" for rank, (_, view) in enumerate(gathered))
        raise ValueError(f"{what} ({views}): {fix}")


def _written_by_a_save(name: str) -> bool:
    """Whether a save writes an entry named ``name``: DCP's index and data files, the marker."""
    return name in (".metadata", _MARKER) or (name.startswith("__") and name.endswith(".distcp"))


def _check_replaceable(final: Path) -> None:
    """Raises ``ValueError`` where a save would replace what zero-shard did not write: a file at
    ``final``, or a directory with other entries than a checkpoint's (a Trainer's
    ``checkpoint-N`` folder, notes added to a checkpoint). A save moves a whole directory into
    place, so it never writes beside other files, and may not delete them."""
    if not final.exists():
        return
    if not final.is_dir():
        raise ValueError(
            f"checkpoint path {final} is a file: save() writes a directory there. Pass the "
            "path of a directory of its own"
        )
    complete = (final / _MARKER).exists()
    entries = sorted(
        e.name for e in final.iterdir() if not (complete and _written_by_a_save(e.name))
    )
    if entries:
        raise ValueError(
            f"checkpoint path {final} is a directory that holds files zero-shard did not write "
            f"({entries[:5]}{' ...' if len(entries) > 5 else ''}), and save() replaces the "
            "whole directory. Save into a directory of its own, e.g. "
            f"{final / 'zero_shard'}; nothing was written or removed"
        )


def _commit(final: Path, partial: Path, previous: Path) -> None:
    """Rank 0: marks ``partial`` complete and moves it into place ([Note: atomic checkpoints])."""
    if _rank() != 0:
        return
    # Every rank's data file must be here, whole, before the marker says so: ranks that write
    # to their own disks under one path leave rank 0 a checkpoint with parts missing.
    damage = find_damage(partial, dcp.FileSystemReader(str(partial)).read_metadata())
    if damage is not None:
        raise RuntimeError(
            f"the checkpoint written at {partial} is not whole: {damage}. Every rank writes its "
            "part under the path: save to a file system all ranks share. It was not marked "
            "complete"
        )
    info = {"world_size": dist.get_world_size() if dist.is_initialized() else 1}
    (partial / _MARKER).write_text(json.dumps(info))
    if (final / _MARKER).exists():  # the last complete one moves aside; an older one goes first
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(final, previous)
    else:  # none at `final`: `previous` (if complete) is the last one until `partial` is in place
        shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    shutil.rmtree(previous, ignore_errors=True)


def _commit_on_every_rank(
    final: Path, partial: Path, previous: Path, group: dist.ProcessGroup | None
) -> None:
    """``_commit`` on rank 0, then every rank raises if it failed there: the others would wait
    for rank 0 in their next collective. ``group``: the ranks, over a CPU backend."""
    error: Exception | None = None
    try:
        _commit(final, partial, previous)
    except Exception as err:
        error = err
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    failures: list[Any] = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(failures, mine, group=group)
    if error is not None:
        raise error
    if failures[0] is not None:
        raise RuntimeError(
            f"rank 0 could not move the checkpoint into place at {final} ({failures[0]}); no "
            "complete checkpoint was removed, and load() finds the newest"
        )


def save(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LRScheduler | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Saves the model, the optimizer, its LR scheduler and ``extra`` (a step counter, ...) to
    the directory ``path``, atomically. Collective: call it on every rank.

    Args:
        path: the checkpoint directory; an earlier checkpoint there is replaced only once this
            one is complete.
        model: the model (plain, DDP-wrapped or FSDP2).
        optimizer: a ZeroShardOptimizer, or an optimizer around one (accelerate's
            ``AcceleratedOptimizer``), or any optimizer whose state dict DCP can save.
        scheduler: the optimizer's LR scheduler (``torch.optim.lr_scheduler``): its state dict
            is saved, and ``load(..., scheduler=...)`` restores it.
        extra: picklable values saved from rank 0 (a step counter, a data-loader position),
            returned by ``load`` as they were.
            Each rank's random number generators are saved beside them and restored by ``load``.

    An ``async_save`` still writing is waited for first; if it failed, this raises its error
    instead (on every rank), and saves nothing. A rank that waits longer than the process
    group's timeout for the others to call ``save`` too raises ``RuntimeError`` saying so.
    """
    optimizer = _unwrapped(optimizer)
    model = _uncompiled(model)
    group = _meet("save")
    # The state is taken inside the shared verdict: a rank that cannot give it (a stale param
    # under stale_params="error") fails every rank at once, nothing written.
    final, partial, previous, state = _prepare(
        path, _device(model), lambda: _state(model, optimizer, extra, scheduler)
    )
    try:
        dcp.save(state, checkpoint_id=str(partial))
    except dcp.CheckpointException as err:  # (a BaseException, not an Exception)
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        if any(isinstance(failure, KeyboardInterrupt) for failure in failures):
            raise KeyboardInterrupt(
                f"the save was interrupted; nothing was marked complete, and the last complete "
                f"checkpoint at {final} (if any) is kept"
            ) from err
        raise
    _barrier()
    _commit_on_every_rank(final, partial, previous, group)


_checkpoint_groups: dict[int, dist.ProcessGroup] = {}


def _checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo group ``_meet`` made for this process group, if any yet; no collective."""
    if not dist.is_initialized():
        return None
    group = _checkpoint_groups.get(id(dist.group.WORLD))
    return group if group in distributed_c10d._world.pg_map else None


def _meet(call: str) -> dist.ProcessGroup | None:
    """Waits for every rank to enter ``call`` (a collective of this module), at most the process
    group's timeout, and returns a gloo group of all ranks for DCP's background collectives
    (sharing the training's group, they would interleave with the training's own collectives
    from another thread; and they need a CPU backend, which an NCCL-only group lacks).

    The group is made at the first call, collectively: making it is the meeting (each rank waits
    for the others' addresses); later calls meet in a barrier on it. Either is bounded by the
    timeout (``new_group``'s own default is 30 minutes), so a call on some ranks only raises."""
    if not dist.is_initialized():
        return None
    _wait_for_pending()  # the last async_save's write uses the group: one user at a time
    timeout = default_timeout()
    group = _checkpoint_group()
    try:
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timeout)
            _checkpoint_groups[id(dist.group.WORLD)] = group
        else:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:  # DistStoreError from new_group, gloo's from the barrier
        raise RuntimeError(
            f"zero_shard.checkpoint.{call} is collective, but rank {_rank()} waited {timeout} "
            "(the process group's timeout) for the other ranks to call it too "
            f"({type(err).__name__}: {err}). Call {call} on every rank, not under "
            "`if rank == 0:`: each rank holds its own part of the model and optimizer state"
        ) from err
    return group


class _PendingSave(NamedTuple):
    """The last ``async_save``: its checkpoint's path and its background write."""

    path: Path
    future: Future


_snapshotter = Snapshotter()
_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_shard_save")
_pending: _PendingSave | None = None


def _wait_for_pending() -> None:
    """Waits for the last ``async_save``'s write, without raising its failure."""
    if _pending is not None:
        wait([_pending.future])


def _report_pending_at_exit() -> None:
    """At interpreter exit: waits for the last ``async_save``, and says so if it failed, which
    no later save or load is left to raise (a write still in flight when the process group was
    destroyed fails)."""
    pending = _pending
    if pending is None or pending.future.cancelled():
        return
    error = pending.future.exception()  # waits for it
    if error is not None:
        warnings.warn(
            f"the last async_save, to {pending.path}, failed: {type(error).__name__}: {error}. "
            "That checkpoint was not written; the last complete one there (if any) is intact. "
            "Wait for async_save's future (future.result()) before "
            "torch.distributed.destroy_process_group()",
            RuntimeWarning,
            stacklevel=1,
        )


atexit.register(_report_pending_at_exit)


def _finish_pending() -> None:
    """Waits for the last ``async_save``; raises if it failed, once (the next save goes on)."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    error = pending.future.exception()  # waits for it
    if error is not None:
        raise RuntimeError(
            f"the last async_save, to {pending.path}, failed: {type(error).__name__}: {error}. "
            "The last complete checkpoint there (if any) is intact; save again"
        ) from error


def async_save(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LRScheduler | None = None,
    extra: dict[str, Any] | None = None,
) -> Future:
    """``save`` in the background: the state is copied to host memory now (pinned buffers, kept
    for the next save), training goes on, and a background thread writes the files and commits
    them. Returns a future; ``.result()`` waits for it and raises what the save raised.
    Collective: call it on every rank.

    A new ``async_save`` (or ``save``, or ``load``) waits for the previous one first; if that one
    failed, it raises the failure on every rank (once) and saves nothing. A failure in the
    background (a write, or the commit on rank 0) fails the save on every rank alike, leaving
    the last complete checkpoint in place.

    The background thread's collectives run on a gloo group of zero-shard's own (made at the
    first call, on every rank): the training's process group may be NCCL only, and its own
    collectives are not interleaved with the save's. Wait for the last save's future before
    ``torch.distributed.destroy_process_group()``, which ends that group: a write still in
    flight then fails, and with no later save to raise it, it is reported at exit.

    Args: as :func:`save` (``path``, ``model``, ``optimizer``, ``scheduler``, ``extra``).

    Returns:
        a ``concurrent.futures.Future`` whose ``result()`` is ``None`` once the checkpoint is
        complete.
    """
    global _pending
    optimizer = _unwrapped(optimizer)
    model = _uncompiled(model)
    group = _meet("async_save")
    # The snapshot reuses the last one's buffers: _prepare waits for its write first.
    final, partial, previous, snapshot = _prepare(
        path,
        _device(model),
        lambda: _snapshotter.snapshot(_state(model, optimizer, extra, scheduler)),
    )

    def write() -> None:
        dcp.save(snapshot, checkpoint_id=str(partial), process_group=group)
        _barrier(group)
        _commit_on_every_rank(final, partial, previous, group)

    _pending = _PendingSave(final, _writer.submit(write))
    return _pending.future


def _resolve(path: str | os.PathLike) -> Path:
    final, partial, previous = _paths(path)
    if (final / _MARKER).exists():
        return final
    fallbacks = (
        (partial, "marked complete but not moved into place"),
        (previous, "moved aside by a save interrupted before its last rename"),
    )
    for fallback, why in fallbacks if not final.exists() else ():
        if (fallback / _MARKER).exists():  # the newer first
            warnings.warn(
                f"{final} is missing but {fallback} is complete ({why}); loading that",
                RuntimeWarning,
                stacklevel=3,
            )
            return fallback
    if final.exists():
        raise IncompleteCheckpointError(
            f"{final} has no completion marker ({_MARKER}): its save did not finish. Load an "
            "earlier checkpoint"
        )
    hint = f"; {partial} is an unfinished save" if partial.exists() else ""
    raise FileNotFoundError(f"no checkpoint at {final}{hint}")


class _LoadPlan(NamedTuple):
    """What ``load`` reads, and into what."""

    path: Path  # the checkpoint
    metadata: Metadata  # its index
    state: dict[str, Any]  # the live state to load: DCP reads it ([Note: loads read before they
    #                        write] in _reading.py)
    group_fqns: list[list[str]]  # the optimizer's params, by param group ([] without one)
    numbered: bool  # the checkpoint numbers the optimizer's params (see _state_dict.numbers_params)
    mains_from_model: dict[str, str]  # param FQN -> the model key whose saved fp32
    #                                   values are the param's main weight ([Note: main weights
    #                                   across dtypes])
    params_from_mains: dict[str, str]  # model key -> the param FQN whose saved fp32 main
    #                                    weights the param is read from (a torch optimizer's)


def _load_plan(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
) -> _LoadPlan:
    """The checkpoint to load, checked against the model and optimizer, and where to read it."""
    resolved = _resolve(path)
    metadata = read_metadata(resolved)
    saved = metadata.state_dict_metadata
    state = _state(model, optimizer, None)
    check_saved_model(resolved, saved, state["model"])
    group_fqns: list[list[str]] = []
    numbered = False
    mains_from_model: dict[str, str] = {}
    params_from_mains: dict[str, str] = {}
    if "optim" in state:
        group_fqns = [list(group["params"]) for group in state["optim"]["param_groups"]]
        numbered = numbers_params(saved, state["optim"])
        if numbered:
            state["optim"] = keyed_by_position(state["optim"], group_fqns)
        # A checkpoint without fp32 main weights (FSDP2 + torch.optim): they come from the model.
        for key, param_state in state["optim"]["state"].items():
            if f"optim.state.{key}.main_param" not in saved:
                param_state.pop("main_param", None)
        if isinstance(optimizer, ZeroShardOptimizer):
            flat = [fqn for fqns in group_fqns for fqn in fqns]
            keys = {fqn: index if numbered else fqn for index, fqn in enumerate(flat)}
            mains_from_model = _mains_across_dtypes(saved, state, optimizer, model, keys)
        elif not numbered:
            params_from_mains = _params_from_saved_mains(saved, state, model)
        _leave_out_params_saved_without_state(saved, state["optim"])
        _leave_out_group_keys_saved_without(saved, state["optim"], optimizer.defaults)
        _leave_out_state_of_options_saved_off(saved, state["optim"])
        if isinstance(optimizer, ZeroShardOptimizer):
            records = optimizer._sharded
            position = {fqn: index for index, fqn in enumerate(f for g in group_fqns for f in g)}
            names = [position[r.fqn] if numbered else r.fqn for r in records]
            add_state_saved_beyond(resolved, saved, state["optim"], records, names)
        check_saved_optimizer(resolved, saved, state["optim"])
    # Only the generators the checkpoint has for this rank: none at a larger world size, and no
    # CUDA one when CUDA was not yet initialized at the save (the first DCP call initializes it).
    rng_key = f"rng_rank{_rank()}"
    rng = {name: value for name, value in state[rng_key].items() if f"{rng_key}.{name}" in saved}
    if rng:
        state[rng_key] = rng
    else:
        state.pop(rng_key)
    if "extra" in saved:
        state["extra"] = b""  # filled by DCP
    else:  # written by dcp.save, not by save
        state.pop("extra", None)
    if scheduler is not None:
        if "scheduler" not in saved:
            raise ValueError(
                f"load was given a scheduler, but the checkpoint at {resolved} holds no "
                "scheduler state (saved without scheduler=): load without it, or from a "
                "checkpoint saved with save(..., scheduler=...)"
            )
        state["scheduler"] = b""  # filled by DCP
    return _LoadPlan(
        resolved, metadata, state, group_fqns, numbered, mains_from_model, params_from_mains
    )


def _mains_across_dtypes(
    saved: Mapping[str, Any],
    state: dict[str, Any],
    optimizer: ZeroShardOptimizer,
    model: nn.Module,
    state_keys: Mapping[str, Any],
) -> dict[str, str]:
    """[Note: main weights across dtypes]
    A checkpoint of another param dtype than the model's keeps its full precision. Saved from
    bf16 params, it holds fp32 ``main_param``: loaded into an fp32 model, those are read (the
    model's saved weights are their rounding) and become the params. Saved from fp32 params (or
    by FSDP2 + torch.optim) it holds none: loaded into a bf16 model, the model's saved fp32
    weights are read as they are, and become the main weights (the params their rounding), where
    they would otherwise come from the rounded params. Adds the reads to ``state`` (the load's
    templates); ``state_keys``: FQN -> the key of the param's state there. Returns the FQN ->
    model key of the second kind."""
    model_keys = {id(p): module_state_key(name) for name, p in model.named_parameters()}
    mains_from_model = {}
    for record in optimizer._sharded:
        key = state_keys.get(record.fqn)
        param_state = state["optim"]["state"].get(key)
        model_key = model_keys.get(id(record.param))
        if model_key not in state["model"]:
            continue
        template = state["model"][model_key]
        main_saved = f"optim.state.{key}.main_param" in saved
        if param_state is None:
            if not main_saved or template.shape != record.layout.shape:
                continue
            # Saved with its main weight alone (its optimizer keeps no state: SGD without
            # momentum), into an fp32 param that holds no state either.
            param_state = state["optim"]["state"][key] = {}
        if "main_param" not in param_state and main_saved:
            if template.shape == record.layout.shape:
                local = torch.empty(record.shard.shape, dtype=torch.float32)
                param_state["main_param"] = to_dtensor(record, local, keep_device=True)
        elif "main_param" not in param_state and template.dtype != torch.float32:
            entry = saved.get(f"model.{model_key}")
            if getattr(getattr(entry, "properties", None), "dtype", None) == torch.float32:
                state["model"][model_key] = _as_float32(template)
                mains_from_model[record.fqn] = model_key
    return mains_from_model


def _params_from_saved_mains(
    saved: Mapping[str, Any], state: dict[str, Any], model: nn.Module
) -> dict[str, str]:
    """[Note: main weights across dtypes] for a torch optimizer: a checkpoint saved from bf16
    params by zero-shard holds their fp32 ``main_param``; loaded into an fp32 model, each such
    param is read from it (the model's saved weights are its rounding), into a template of the
    param's layout in the optimizer's state, which the load moves to the model. Returns the
    model key -> param FQN of each."""
    params_from_mains = {}
    optim_state = state["optim"]["state"]
    fqns = canonical_names(model)  # as the optimizer's state dict names them
    for name, param in model.named_parameters(remove_duplicate=False):  # tied: every key
        fqn, model_key = fqns[id(param)], module_state_key(name)
        template = state["model"].get(model_key)
        entry = saved.get(f"model.{model_key}")
        saved_dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if (
            f"optim.state.{fqn}.main_param" not in saved
            or not isinstance(template, torch.Tensor)
            or template.dtype != torch.float32
            or saved_dtype not in (torch.bfloat16, torch.float16)
        ):
            continue
        if "main_param" not in optim_state.setdefault(fqn, {}):
            optim_state[fqn]["main_param"] = _as_float32(template)
        params_from_mains[model_key] = fqn
    return params_from_mains


def _as_float32(template: torch.Tensor) -> torch.Tensor:
    """A float32 template of ``template``'s layout, to read a saved float32 tensor into."""
    if isinstance(template, DTensor):
        local = torch.empty(template.to_local().shape, dtype=torch.float32)
        return dtensor_on(template, local)
    return torch.empty(template.shape, dtype=torch.float32)


def _leave_out_params_saved_without_state(saved: Mapping[str, Any], optim: dict[str, Any]) -> None:
    """A param that had no optimizer state when the checkpoint was saved (frozen then, or given
    no grad yet) loads none: torch's ``load_state_dict`` leaves such a param without state, and
    its next step starts it afresh. Only where every param the checkpoint holds state for is one
    of this optimizer's: otherwise the checkpoint is of another model, which the checks say."""
    saved_keys: dict[str, set[str]] = {}
    for flat in saved:
        if flat.startswith("optim.state."):
            name, key = flat.removeprefix("optim.state.").rsplit(".", 1)
            saved_keys.setdefault(name, set()).add(key)
    held = {str(key) for key in optim["state"]}
    # A param saved with its fp32 main weight alone (of a group whose optimizer keeps no state,
    # SGD without momentum) holds no state that an optimizer must have for it.
    if not {name for name, keys in saved_keys.items() if keys - {"main_param"}} <= held:
        return
    for key in [key for key in optim["state"] if str(key) not in saved_keys]:
        del optim["state"][key]


def _leave_out_group_keys_saved_without(
    saved: Mapping[str, Any], optim: dict[str, Any], options: Mapping[str, Any]
) -> None:
    """A param group's keys that are no option of the optimizer's class (a scheduler's
    ``initial_lr``, a key of the user's) and that the checkpoint's groups lack are not read, not
    refused: the load sets the keys the checkpoint holds (a torch optimizer's ``load_state_dict``
    drops the others, zero-shard's keeps them). A lacking option of the class is left for the
    checks to refuse."""
    for index, group in enumerate(optim["param_groups"]):
        for key in [k for k in group if k != "params" and k not in options]:
            if f"optim.param_groups.{index}.{key}" not in saved:
                del group[key]


def _leave_out_state_of_options_saved_off(saved: Mapping[str, Any], optim: dict[str, Any]) -> None:
    """State that this optimizer makes under an option the checkpoint was saved without (AdamW's
    ``max_exp_avg_sq`` under ``amsgrad=True``) loads none: the saved param groups' options
    replace this optimizer's, as torch's ``load_state_dict`` does, and they make no such state.
    Only where the checkpoint holds that state for no param, every other state it holds is of
    this optimizer's kinds, and its param groups name every option this optimizer's do. As for
    torch, a class of the same options and state loads too (Adam's checkpoint into AdamW, whose
    groups then take Adam's ``decoupled_weight_decay=False``); others are refused."""
    options = {
        key.split(".", 3)[3]
        for key in saved
        if key.startswith("optim.param_groups.") and key.count(".") >= 3
    }
    if not {option for group in optim["param_groups"] for option in group} <= options:
        return
    saved_kinds = {
        flat.rsplit(".", 1)[1]
        for flat in saved
        if flat.startswith("optim.state.") and not flat.endswith(".main_param")
    }
    kinds = {key for entry in optim["state"].values() for key in entry if key != "main_param"}
    if not saved_kinds or not saved_kinds <= kinds:
        return
    for entry in optim["state"].values():
        for key in kinds - saved_kinds:
            entry.pop(key, None)


def _loaded_optim_state(
    plan: _LoadPlan, read: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer state DCP read, checked, keyed for ``optimizer.load_state_dict``."""
    state = read["optim"]
    if plan.numbered:  # as the params of the optimizer that saved it were: in this one's order
        state = keyed_by_fqn(state, [fqn for fqns in plan.group_fqns for fqn in fqns])
    check_saved_groups(state, plan.group_fqns)
    if plan.mains_from_model:  # keyed by FQN now; see [Note: main weights across dtypes]
        held = state["state"]
        mains = {key: read["model"][model_key] for key, model_key in plan.mains_from_model.items()}
        # A param saved with no state (SGD without momentum's, or one without a grad yet) takes
        # its main weight alone.
        state = {**state, "state": {key: {**held.get(key, {}), "main_param": main}
                                    for key, main in mains.items()}}  # fmt: skip
        state["state"].update({key: value for key, value in held.items() if key not in mains})
    if isinstance(optimizer, ZeroShardOptimizer):
        return state
    return keyed_by_position(state, plan.group_fqns)


def _read_checked(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``load``'s reading: the checkpoint's state read whole into host memory, and the
    optimizer's state dict made of it, both checked on every rank before anything is written.
    A torch optimizer's state created for the load is dropped again where that fails."""
    created: list[torch.Tensor] = []

    def plan() -> _LoadPlan:
        _finish_pending()  # an async save may be writing this very checkpoint
        if optimizer is not None and not isinstance(optimizer, ZeroShardOptimizer):
            created.extend(create_missing_state(optimizer))
        return _load_plan(path, model, optimizer, scheduler)

    device = _device(model)
    try:
        loading = on_every_rank(plan, mesh=None, device=device)
        saved_by = save_id(loading.metadata)
        _check_one_checkpoint(
            saved_by or str(loading.path),
            f"{loading.path} (save {saved_by})",
            f"load() was given {str(path)!r}, which the ranks resolve to different checkpoints",
            "every rank must read its part of one checkpoint: pass an absolute path on a file "
            "system all ranks share, or copies of one save; nothing was loaded",
        )

        def check(read: dict[str, Any]) -> None:  # on every rank, before anything is written
            if optimizer is not None:
                on_every_rank(
                    lambda: _loaded_optim_state(loading, read, optimizer), mesh=None, device=device
                )

        state = read_whole(loading.state, loading.path, loading.metadata, device, check)
        mains: dict[str, torch.Tensor] = {}  # (a torch optimizer's: it keeps no main_param)
        optim_held = {} if "optim" not in state else state["optim"]["state"]
        for model_key, fqn in loading.params_from_mains.items():  # a tied param's keys share one
            if fqn not in mains:
                mains[fqn] = optim_held[fqn].pop("main_param")
                if not optim_held[fqn]:  # saved with the main weight alone: no state in torch's
                    del optim_held[fqn]
            state["model"][model_key] = mains[fqn]
        # Checked above: it passes.
        optim_state = None if optimizer is None else _loaded_optim_state(loading, state, optimizer)
    except BaseException:  # DCP's CheckpointException is not an Exception
        for param in created:  # refused or failed: the optimizer has no state again
            optimizer.state.pop(param, None)  # type: ignore[union-attr]
        raise
    return state, optim_state


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LRScheduler | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Loads a checkpoint written by ``save`` (at any world size or offload fraction) into
    ``model``, ``optimizer`` and its LR ``scheduler`` (saved with ``save(..., scheduler=...)``;
    refused, before anything changes, where the checkpoint has none), in place; returns the
    ``extra`` dict. Collective. The extra is unpickled and the scheduler's state loaded before
    the model and the optimizer: where either fails (a class the extra holds does not import
    here, a scheduler of another class) every rank raises ``ValueError`` and the model and the
    optimizer are left as they were.

    Refuses a checkpoint whose save did not finish (``IncompleteCheckpointError``), and one of
    another model (``ValueError`` naming the FQNs: missing, unknown, or of other shapes) before
    anything is loaded, on every rank. Each rank's random number generators are restored when
    the checkpoint has this rank's (``restore_rng``).

    The checkpoint is read into host memory first (this rank's part of the model's and the
    optimizer's state), and copied into ``model`` and ``optimizer`` only once every rank has read
    its part whole; where the host lacks the memory, it is read twice instead, in batches, then in
    place ([Note: loads read before they write] in ``zero_shard/_reading.py``). A checkpoint
    that cannot be read whole raises ``DamagedCheckpointError`` naming the file on every rank,
    and the model and optimizer are left as they were.

    ``optimizer`` may also be a plain torch optimizer (the checkpoint saved from one over the same
    model, or from a ZeroShardOptimizer); one that has not stepped yet gets its state created
    first, as ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` does, and
    loaded. An ``async_save`` still writing is waited for first (its failure raises here).

    Args:
        path: the checkpoint directory ``save`` wrote (a symlink to it is followed).
        model: the model to load the weights into (plain, DDP-wrapped, FSDP2 or compiled).
        optimizer: the optimizer to load the state into, or ``None`` (default) for the model
            alone (fine-tuning: then ``opt.reload_model_params()`` if it was wrapped already).
        scheduler: the LR scheduler to restore, or ``None`` (default).
        restore_rng: restore this rank's random number generators; default ``True``.

    Returns:
        the ``extra`` dict given to ``save`` (``{}`` if none).
    """
    optimizer = _unwrapped(optimizer)
    model = _uncompiled(model)
    _meet("load")
    state, optim_state = _read_checked(path, model, optimizer, scheduler)
    # What may fail without touching the model or the optimizer goes first, failing on every
    # rank alike: the extra unpickled, the scheduler's state loaded.
    extra = on_every_rank(
        lambda: _load_extra_and_scheduler(state, scheduler), mesh=None, device=_device(model)
    )
    # The model next: the optimizer's load then takes the params as they are and sets them to
    # its main weights (loading the model after would mark every param as changed under it).
    _load_model(model, optimizer, state["model"])
    if optimizer is not None and optim_state is not None:
        optimizer.load_state_dict(optim_state)
    rng_key = f"rng_rank{_rank()}"
    if restore_rng and rng_key in state:
        _set_rng_state(state[rng_key])
    return extra


def _load_extra_and_scheduler(
    state: Mapping[str, Any], scheduler: LRScheduler | None
) -> dict[str, Any]:
    """The checkpoint's ``extra``, unpickled, with its scheduler state loaded into ``scheduler``;
    raises ``ValueError`` naming the cause where either fails."""
    try:
        extra = pickle.loads(state["extra"]) if "extra" in state else {}
    except Exception as err:
        raise ValueError(
            f"the checkpoint's extra does not unpickle here ({type(err).__name__}: {err}): "
            "load it where the classes it holds import (one defined in the saving script's "
            "__main__ does not), or save plain values in extra; nothing was loaded"
        ) from err
    if scheduler is not None:
        try:
            scheduler.load_state_dict(pickle.loads(state["scheduler"]))
        except Exception as err:
            raise ValueError(
                f"the checkpoint's scheduler state does not load into a "
                f"{type(scheduler).__name__} ({type(err).__name__}: {err}): pass a scheduler of "
                "the class it was saved from; the model and the optimizer were not loaded"
            ) from err
    return extra
