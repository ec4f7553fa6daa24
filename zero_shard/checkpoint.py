"""Checkpoints of a model and its ZeroShardOptimizer through torch.distributed.checkpoint (DCP).

[Note: atomic checkpoints]
``save`` writes into ``<path>.partial`` (cleared first), and only when every rank's data and
DCP's metadata are written does rank 0 add a completion marker and move it into place:
``<path>`` becomes ``<path>.previous``, ``<path>.partial`` becomes ``<path>``, and
``<path>.previous`` is removed. A crash at any point leaves the last complete checkpoint loadable:
at ``<path>``, or at ``<path>.previous`` during the instant between the two renames (``load``
falls back to it). A directory without the marker is refused: its save did not finish.
A save that fails (a write on any rank, or the commit on rank 0) fails on every rank alike, and
an ``async_save``'s failure is raised again, on every rank, by the next ``save``, ``async_save``
or ``load``: no rank is left waiting for another in a collective.

The optimizer's state dict holds DTensors with the params' global shapes, so a checkpoint loads
at any world size and offload fraction, and its keys are those of FSDP2 + ``torch.optim`` (an
FSDP2 checkpoint loads here, and one written here loads into FSDP2 with
``torch.distributed.checkpoint.state_dict.set_state_dict``). Without ``main_param`` in the
checkpoint (one written by FSDP2), the fp32 main weights come from the loaded model.

Example::

    zero_shard.checkpoint.save("ckpt/latest", model=model, optimizer=opt, extra={"step": step})
    extra = zero_shard.checkpoint.load("ckpt/latest", model=model, optimizer=opt)
    step = extra["step"]
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from ._optimizer import ZeroShardOptimizer
from ._staging import Snapshotter
from ._tp import as_dtensor
from ._verdict import on_every_rank

__all__ = [
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
    final = Path(path)
    return (
        final,
        final.with_name(final.name + ".partial"),
        final.with_name(final.name + ".previous"),
    )


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
    """Loads ``state`` (from ``_model_state``, filled by DCP) into ``model``; the params DDP
    localized were loaded in place (their entries are views of them)."""
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


def _state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None
) -> dict[str, Any]:
    state: dict[str, Any] = {"model": _model_state(model, optimizer)}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    # One pickled object: DCP would flatten nested dicts and lists into keys of their own, which
    # its load then cannot match against a state dict that does not know them yet.
    state["extra"] = pickle.dumps(dict(extra or {}))
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

    def prepare() -> T:
        _finish_pending()
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a save that crashed before
            partial.parent.mkdir(parents=True, exist_ok=True)
        return stage()

    # Sharing the verdict is also the barrier: no rank writes before rank 0 cleared the folder.
    staged = on_every_rank(prepare, mesh=None, device=device)
    return final, partial, previous, staged


def _commit(final: Path, partial: Path, previous: Path) -> None:
    """Rank 0: marks ``partial`` complete and moves it into place; see [Note: atomic checkpoints]."""
    if _rank() != 0:
        return
    info = {"world_size": dist.get_world_size() if dist.is_initialized() else 1}
    (partial / _MARKER).write_text(json.dumps(info))
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        os.replace(final, previous)
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
            f"rank 0 could not move the checkpoint into place at {final} ({failures[0]}); the "
            "last complete checkpoint is still there"
        )


def save(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Saves the model, the optimizer and ``extra`` (a step counter, ...) to the directory
    ``path``, atomically. Collective: call it on every rank.

    Args:
        path: the checkpoint directory; an earlier checkpoint there is replaced only once this
            one is complete.
        model: the model (plain, DDP-wrapped or FSDP2).
        optimizer: a ZeroShardOptimizer (or any optimizer whose state dict DCP can save).
        extra: picklable values saved from rank 0 (a step counter, a scheduler's state dict,
            a data-loader position), returned by ``load`` as they were.
            Each rank's random number generators are saved beside them and restored by ``load``.

    An ``async_save`` still writing is waited for first; if it failed, this raises its error
    instead (on every rank), and saves nothing.
    """
    group = _checkpoint_group()
    final, partial, previous, _ = _prepare(path, _device(model), lambda: None)
    dcp.save(_state(model, optimizer, extra), checkpoint_id=str(partial))
    _barrier()
    _commit_on_every_rank(final, partial, previous, group)


_checkpoint_groups: dict[int, dist.ProcessGroup] = {}


def _checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks for DCP's background collectives, made once (collectively):
    sharing the training's group, they would interleave with the training's own collectives
    from another thread; and DCP's background work needs a CPU backend, which an NCCL-only
    group lacks."""
    if not dist.is_initialized():
        return None
    key = id(dist.group.WORLD)
    if key not in _checkpoint_groups:
        _checkpoint_groups[key] = dist.new_group(backend="gloo")
    return _checkpoint_groups[key]


class _PendingSave(NamedTuple):
    """The last ``async_save``: its checkpoint's path and its background write."""

    path: Path
    future: Future


_snapshotter = Snapshotter()
_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_shard_save")
_pending: _PendingSave | None = None


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
    collectives are not interleaved with the save's.
    """
    global _pending
    group = _checkpoint_group()
    # The snapshot reuses the last one's buffers: _prepare waits for its write first.
    final, partial, previous, snapshot = _prepare(
        path, _device(model), lambda: _snapshotter.snapshot(_state(model, optimizer, extra))
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
    if not final.exists() and (previous / _MARKER).exists():
        warnings.warn(
            f"{final} is missing but {previous} is complete (a save was interrupted between "
            "its two renames); loading that",
            RuntimeWarning,
            stacklevel=3,
        )
        return previous
    if final.exists():
        raise IncompleteCheckpointError(
            f"{final} has no completion marker ({_MARKER}): its save did not finish. Load an "
            "earlier checkpoint"
        )
    hint = f"; {partial} is an unfinished save" if partial.exists() else ""
    raise FileNotFoundError(f"no checkpoint at {final}{hint}")


def _names(keys: list[str], prefix: str) -> str:
    names = sorted(key.removeprefix(prefix) for key in keys)
    return f"{names[:5]}{' ...' if len(names) > 5 else ''} ({len(names)} in all)"


def _check_model(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the FQNs unless the checkpoint holds this model's entries,
    no others, with this model's shapes."""
    expected = {f"model.{fqn}": value for fqn, value in model_state.items()}
    # Entries that are not tensors (a module's extra state) may be saved as several keys.
    containers = tuple(f"{key}." for key, value in expected.items() if not torch.is_tensor(value))
    missing = [
        key
        for key, value in expected.items()
        if key not in saved
        and (torch.is_tensor(value) or not any(k.startswith(f"{key}.") for k in saved))
    ]
    if missing:
        raise ValueError(
            f"the checkpoint at {path} has no {_names(missing, 'model.')} of this model: it is "
            "of another model, or of this one under other names (a DDP model's names start with "
            "'module.'). Load it into the model it was saved from"
        )
    unknown = [
        key
        for key in saved
        if key.startswith("model.") and key not in expected and not key.startswith(containers)
    ]
    if unknown:
        raise ValueError(
            f"the checkpoint at {path} holds {_names(unknown, 'model.')} that this model lacks: "
            "it is of another model. Load it into the model it was saved from"
        )
    for key, value in expected.items():
        size = getattr(saved.get(key), "size", None)
        if torch.is_tensor(value) and size is not None and tuple(size) != tuple(value.shape):
            raise ValueError(
                f"the checkpoint at {path} holds {key.removeprefix('model.')!r} of shape "
                f"{tuple(size)}, but this model's has shape {tuple(value.shape)}: the checkpoint "
                "is of another model"
            )


def _check_optimizer(path: Path, saved: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the FQNs unless the checkpoint holds state of the shapes this
    optimizer has, in as many param groups."""
    if not any(key.startswith("optim.") for key in saved):
        raise ValueError(
            f"the checkpoint at {path} holds no optimizer state (it was saved with "
            "optimizer=None); load it with optimizer=None, then call opt.reload_model_params()"
        )
    if not optim_state["state"] and any(key.startswith("optim.state.") for key in saved):
        raise ValueError(
            f"the checkpoint at {path} holds optimizer state, but this optimizer has none to load "
            "it into: it is of another optimizer class, or one whose state is created at its "
            "first step (SGD with dampening, NAdam, ASGD, ...): take one step, then load"
        )
    num_groups = len({key.split(".")[2] for key in saved if key.startswith("optim.param_groups.")})
    if num_groups != len(optim_state["param_groups"]):
        raise ValueError(
            f"the checkpoint at {path} has {num_groups} optimizer param groups, this optimizer "
            f"has {len(optim_state['param_groups'])}: it was saved from another model or another "
            "param-group setup"
        )
    for fqn, param_state in optim_state["state"].items():
        for key, value in param_state.items():
            flat = f"optim.state.{fqn}.{key}"
            if flat not in saved:
                raise ValueError(
                    f"the checkpoint at {path} has no optimizer state {key!r} for param {fqn!r}: "
                    "it is of another model, or of another optimizer class"
                )
            size = getattr(saved[flat], "size", None)
            if torch.is_tensor(value) and size is not None and tuple(size) != tuple(value.shape):
                raise ValueError(
                    f"the checkpoint at {path} holds optimizer state {key!r} of {fqn!r} of shape "
                    f"{tuple(size)}, but the param has shape {tuple(value.shape)}: the checkpoint "
                    "is of another model"
                )


def _load_plan(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to load and the state dict to load it into, checked against it."""
    resolved = _resolve(path)
    saved = dcp.FileSystemReader(str(resolved)).read_metadata().state_dict_metadata
    state = _state(model, optimizer, None)
    _check_model(resolved, saved, state["model"])
    if "optim" in state:
        # A checkpoint without fp32 main weights (FSDP2 + torch.optim): they come from the model.
        for fqn, param_state in state["optim"]["state"].items():
            if f"optim.state.{fqn}.main_param" not in saved:
                param_state.pop("main_param", None)
        _check_optimizer(resolved, saved, state["optim"])
    # Only the generators the checkpoint has for this rank: none at a larger world size, and no
    # CUDA one when CUDA was not yet initialized at the save (the first DCP call initializes it).
    rng_key = f"rng_rank{_rank()}"
    rng = {name: value for name, value in state[rng_key].items() if f"{rng_key}.{name}" in saved}
    if rng:
        state[rng_key] = rng
    else:
        state.pop(rng_key)
    state["extra"] = b""  # filled by DCP
    return resolved, state


def _create_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Creates the state of a torch optimizer's params that have none (it has not stepped yet),
    for a checkpoint to be loaded into, as torch's ``set_optimizer_state_dict`` does: one step
    with zero grads at lr 0, which leaves the params as they are. Returns those params."""
    if optimizer is None or isinstance(optimizer, ZeroShardOptimizer):
        return []  # its state is made at construction
    groups = optimizer.param_groups
    params = [param for group in groups for param in group["params"]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return []
    grads = [param.grad for param in params]
    lrs = [group.get("lr") for group in groups]
    try:
        for param in params:  # only the params without state step
            param.grad = None
        for param in missing:
            param.grad = torch.zeros_like(param)
        for group, lr in zip(groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = torch.zeros_like(lr) if torch.is_tensor(lr) else 0.0
        optimizer.step()
    except BaseException:
        for param in missing:  # as it was
            optimizer.state.pop(param, None)
        raise
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        for group, lr in zip(groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
    return [param for param in missing if optimizer.state.get(param)]


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Loads a checkpoint written by ``save`` (at any world size or offload fraction) into
    ``model`` and ``optimizer``, in place; returns the ``extra`` dict. Collective.

    Refuses a checkpoint whose save did not finish (``IncompleteCheckpointError``), and one of
    another model (``ValueError`` naming the FQNs: missing, unknown, or of other shapes) before
    anything is loaded, on every rank. Each rank's random number generators are restored when
    the checkpoint has this rank's (``restore_rng``).

    ``optimizer`` may also be a plain torch optimizer (the checkpoint saved from one over the same
    model); one that has not stepped yet gets its state created first, as
    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` does, and loaded. An
    ``async_save`` still writing is waited for first (its failure raises here).
    """
    created: list[torch.Tensor] = []

    def plan() -> tuple[Path, dict[str, Any]]:
        _finish_pending()  # an async save may be writing this very checkpoint
        created.extend(_create_state(optimizer))
        return _load_plan(path, model, optimizer)

    try:
        resolved, state = on_every_rank(plan, mesh=None, device=_device(model))
        dcp.load(state, checkpoint_id=str(resolved))
    except BaseException:  # DCP's CheckpointException is not an Exception
        for param in created:  # refused or failed: the optimizer has no state again
            optimizer.state.pop(param, None)  # type: ignore[union-attr]
        raise
    # The model first: the optimizer's load then takes the params as they are and sets them to
    # its main weights (loading the model after would mark every param as changed under it).
    _load_model(model, optimizer, state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    rng_key = f"rng_rank{_rank()}"
    if restore_rng and rng_key in state:
        _set_rng_state(state[rng_key])
    return pickle.loads(state["extra"])


def _full(value: Any, keep: bool) -> Any:
    if not isinstance(value, DTensor):
        return value.detach().cpu().clone() if torch.is_tensor(value) and keep else value
    mesh = value.device_mesh
    local = value.to_local().to(mesh.device_type)  # a CPU-resident shard on a GPU mesh
    whole = DTensor.from_local(
        local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    ).full_tensor()
    return whole.cpu() if keep else None


def full_state_dict(optimizer: torch.optim.Optimizer, *, rank: int = 0) -> dict[str, Any]:
    """The optimizer's state dict with every DTensor gathered into a full CPU tensor, on rank
    ``rank`` (``{}`` elsewhere): for ``torch.save``. Collective.

    Example::

        state = zero_shard.checkpoint.full_state_dict(opt)
        if dist.get_rank() == 0:
            torch.save(state, "optim.pt")
    """
    keep = _rank() == rank
    state = optimizer.state_dict()
    full = {
        fqn: {key: _full(value, keep) for key, value in param_state.items()}
        for fqn, param_state in state["state"].items()
    }
    if not keep:
        return {}
    return {"state": full, "param_groups": state["param_groups"]}


def load_full_state_dict(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None, *, rank: int = 0
) -> None:
    """Loads a state dict from ``full_state_dict`` (or a consolidated one of the same shape),
    given on rank ``rank`` only; it is broadcast to the others. Collective."""
    box = [state_dict if _rank() == rank else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=rank)
    if box[0] is None:
        raise ValueError(f"load_full_state_dict needs the state dict on rank {rank}, got None")
    optimizer.load_state_dict(box[0])
