"""Reading a checkpoint whole before anything live is written.

[Note: loads read before they write]
A checkpoint that cannot be read whole (a data file cut short or damaged) must leave the model and
the optimizer as they were, but DCP reads into the tensors it is handed, entry by entry, and a
failure midway leaves the entries before it written. So the read goes into host memory first:
into empty tensors of the entries' local shapes (``staged``), copied into the live model and
optimizer once every rank has read its part. That costs this rank's part of the state in host
memory, and the optimizer's load makes its own copy beside the live state too: twice the state,
which a full offload cannot always spare (its optimizer state already fills the host, 12 bytes
a param). Where those would leave less than a quarter of the host's memory available on some
rank, the checkpoint is instead read twice: first in batches of entries of at
most ``_BATCH_BYTES`` (global) into small staged tensors, dropped after each batch, which proves
every entry readable; then in place into the live state. What is checked against the live
optimizer after the read (its param groups, by FQN) is checked first there, on the checkpoint's
param groups read alone. The ranks agree on the route (each batch is a collective read), and the
batches are cut from the checkpoint's own index, the same on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from offload import available_after

from ._state_dict import staged
from ._verdict import on_any_rank

__all__ = ["DamagedCheckpointError", "find_damage", "read_metadata", "read_whole", "save_id"]

_BATCH_BYTES = 1 << 30  # global bytes of the entries one verifying read takes


class DamagedCheckpointError(RuntimeError):
    """The checkpoint's save finished, but its files cannot be read whole (one is missing or
    truncated, or its ``.metadata`` is damaged); ``load`` changed nothing."""

    __module__ = "zero_shard.checkpoint"  # its public home, which re-exports it


def read_metadata(path: Path) -> Metadata:
    """The index of the checkpoint at ``path``; raises ``DamagedCheckpointError`` where it
    cannot be read, or a data file it names is missing or shorter than the entries it places
    there (DCP would fail midway through its reads)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # truncated or garbled: UnpicklingError, EOFError, OSError, ...
        raise DamagedCheckpointError(
            f"the checkpoint at {path} is damaged: its index {path / '.metadata'} cannot be read "
            f"({type(err).__name__}: {err}); nothing was loaded. Load an earlier checkpoint"
        ) from err
    damage = find_damage(path, metadata)
    if damage is not None:
        raise DamagedCheckpointError(
            f"the checkpoint at {path} is damaged: {damage}; nothing was loaded. Load an "
            "earlier checkpoint"
        )
    return metadata


def find_damage(path: Path, metadata: Metadata) -> str | None:
    """What keeps the checkpoint at ``path`` from being read whole: the first data file that
    ``metadata`` names and that is missing or shorter than the entries it places there, with
    the entries lost; ``None`` where every file is whole."""
    entries: dict[str, list[tuple[int, str]]] = {}  # file -> (end, FQN) of each entry in it
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        name = getattr(info, "relative_path", None)
        if name is not None:
            entries.setdefault(name, []).append((info.offset + info.length, index.fqn))
    for name, ends in sorted(entries.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        lost = sorted({fqn for end, fqn in ends if size is None or end > size})
        if not lost:
            continue
        match = re.match(r"__(\d+)_", name)  # DCP names a rank's files __<rank>_<n>.distcp
        file = f"data file {name}" + (f", written by rank {match.group(1)}," if match else "")
        damage = "missing" if size is None else f"truncated ({size} bytes of {max(ends)[0]})"
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
        return f"its {file} is {damage}, so {lost[:3]}{more} cannot be read"
    return None


def save_id(metadata: Metadata) -> str | None:
    """The id DCP's file-system writer gave the save that wrote ``metadata`` (one per save, kept
    by copies of the checkpoint); ``None`` where it recorded none."""
    return getattr(getattr(metadata, "storage_meta", None), "save_id", None)


def _local_bytes(value: Any) -> int:
    if isinstance(value, DTensor):
        value = value.to_local()
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_local_bytes(item) for item in value.values())
    if isinstance(value, list):
        return sum(_local_bytes(item) for item in value)
    return 0


def _staging_fits(num_bytes: int) -> bool:
    report = available_after(num_bytes)
    return report is None or report[0] >= report[1] // 4


def _entries(state: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(DCP key, value) of the nested state's entries, as DCP flattens them (lists stay whole:
    the optimizer's param groups)."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _entries(value, f"{name}.")
        else:
            yield name, value


def _subset(state: dict[str, Any], keys: set[str], prefix: str = "") -> dict[str, Any]:
    """The nested state restricted to the DCP keys ``keys`` (staged: fresh empty tensors)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            inner = _subset(value, keys, f"{name}.")
            if inner:
                out[key] = inner
        elif name in keys:
            out[key] = staged(value)
    return out


def _batches(metadata: Metadata, keys: list[str]) -> list[set[str]]:
    """``keys`` cut into batches of at most ``_BATCH_BYTES`` by their global sizes in the
    checkpoint's index: the same cut on every rank."""
    batches: list[set[str]] = [set()]
    filled = 0
    for key in sorted(keys):
        entry = metadata.state_dict_metadata.get(key)
        size = 0
        if isinstance(entry, TensorStorageMetadata):
            size = entry.size.numel() * torch.empty((), dtype=entry.properties.dtype).element_size()
        if batches[-1] and filled + size > _BATCH_BYTES:
            batches.append(set())
            filled = 0
        batches[-1].add(key)
        filled += size
    return batches


def _overlaid(state: dict[str, Any], read: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the entries of ``read`` (a subset of its nested keys) in their place."""
    out = dict(state)
    for key, value in read.items():
        out[key] = _overlaid(state[key], value) if isinstance(value, dict) else value
    return out


def read_whole(
    state: dict[str, Any],
    path: Path,
    metadata: Metadata,
    device: torch.device,
    check: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Reads the checkpoint at ``path`` for ``state`` (the live state: model, optimizer, RNG)
    and returns what to load from: a staged copy, or ``state`` itself once every entry was
    read whole in batches ([Note: loads read before they write]). ``check`` (collective) sees
    what was read before anything live is written: the whole staged copy, or the live state
    with the checkpoint's values of its entries other than tensors (param groups, pickled
    extras) in their place. A read that fails on any rank fails on every rank (DCP shares the
    failures): it raises ``DamagedCheckpointError`` there, before anything live is written
    (``KeyboardInterrupt`` where a rank's read was interrupted)."""
    try:
        return _read_whole(state, path, metadata, device, check)
    except dcp.CheckpointException as err:
        errors = {rank: f[0] if isinstance(f, tuple) else f for rank, f in err.failures.items()}
        interrupted = [e for e in errors.values() if isinstance(e, KeyboardInterrupt)]
        if interrupted:  # Ctrl-C: not a damaged checkpoint (nothing was loaded either way)
            raise KeyboardInterrupt(
                "the load was interrupted; nothing was loaded: the model and optimizer are as "
                "they were"
            ) from err
        failures = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}"
            for rank, error in sorted(errors.items())
        )
        raise DamagedCheckpointError(
            f"the checkpoint at {path} could not be read whole ({failures}); nothing was "
            "loaded: the model and optimizer are as they were. Load an earlier checkpoint"
        ) from err


def _read_whole(
    state: dict[str, Any],
    path: Path,
    metadata: Metadata,
    device: torch.device,
    check: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    # The staged copy, then the load's own copy of the optimizer state beside the live one.
    fits = _staging_fits(2 * _local_bytes(state))
    if dist.is_initialized():
        fits = not on_any_rank(not fits, mesh=None, device=device)
    if fits:
        copy = staged(state)
        dcp.load(copy, checkpoint_id=str(path))
        check(copy)
        return copy
    entries = list(_entries(state))
    light = _subset(state, {key for key, value in entries if not torch.is_tensor(value)})
    dcp.load(light, checkpoint_id=str(path))
    check(_overlaid(state, light))
    # Every rank's keys but its generators' (its own rng_rank<N>): those go in the first batch.
    shared = [key for key, _ in entries if not key.startswith("rng_rank")]
    own = {key for key, _ in entries if key.startswith("rng_rank")}
    for index, batch in enumerate(_batches(metadata, shared)):
        dcp.load(_subset(state, batch | (own if index == 0 else set())), checkpoint_id=str(path))
    dcp.load(state, checkpoint_id=str(path))
    return state
