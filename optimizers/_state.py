"""Optimizer state across pieces: eager creation, and the per-parameter view of it.

A parameter cut into pieces has one state dict per piece, kept by the sub-optimizer that steps
the piece. Outwards (``state_dict``) each parameter shows one dict shaped like torch's: tensors
with the parameter's shape, scalars such as ``step`` once. A parameter in one piece shows views of
its live state; one cut in several (the piece straddling the accelerator/CPU split, or a param
longer than a chunk) shows a CPU copy of the concatenation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from ._elementwise import StateKeys
from ._records import ParamRecord, Piece, flat_param

__all__ = [
    "StateView",
    "check_saved_state",
    "gather_main",
    "gather_state",
    "init_state",
    "load_main",
    "match_saved",
    "record_state",
    "scatter_state",
    "state_step_count",
]

# Optimizers whose state at creation is zeros for every elementwise tensor and 0 for `step`; it
# can be created at construction with no step taken (the others create theirs at the first step).
_ZERO_INITIAL_STATE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _step_tensor(value: Any, piece: Piece, group: dict[str, Any]) -> torch.Tensor:
    """``step`` the way torch keeps it: on the param's device for fused/capturable, else CPU."""
    value = torch.as_tensor(value).detach()
    if group.get("fused") or group.get("capturable"):
        return value.to(dtype=torch.float32, device=piece.main.device, copy=True)
    return value.to(dtype=_scalar_dtype(), device="cpu", copy=True)


def _keeps_state_of(optimizer: torch.optim.Optimizer, cls: type) -> bool:
    """Whether ``optimizer`` keeps ``cls``'s per-param state: an instance of ``cls``, or an adapter
    that declares the class it keeps the state of as ``optimizer_cls`` (FusedAdamAdapter)."""
    return issubclass(getattr(optimizer, "optimizer_cls", type(optimizer)), cls)


def _starts_zero(cls: type, group: dict[str, Any]) -> bool:
    if issubclass(cls, _ZERO_INITIAL_STATE):
        return True
    # SGD's first step copies the grad into the buffer; zeros give the same only without dampening.
    return issubclass(cls, torch.optim.SGD) and group.get("dampening", 0) == 0


def init_state(records: Iterable[ParamRecord], cls: type, state_keys: Sequence[StateKeys]) -> None:
    """Creates, for every piece without state, the state its optimizer would create at its first
    step, where that state is known to start at zero (``_ZERO_INITIAL_STATE``; SGD without
    dampening). Other optimizers create their state at the first step, as in torch.

    ``state_keys[g]`` is the state kept per param in the user's param group ``g``.
    """
    for record in records:
        keys = state_keys[record.group_index]
        if any(key != "step" for key in keys.scalar_keys):
            continue  # a scalar other than the step count starts non-zero: stay lazy
        for piece in record.pieces:
            if piece.state or not _keeps_state_of(piece.optimizer, cls):
                continue
            group = piece.group
            if not _starts_zero(cls, group):
                continue
            state: dict[str, Any] = {}
            if "step" in keys.scalar_keys:
                state["step"] = _step_tensor(0.0, piece, group)
            for key in keys.elementwise_keys:
                state[key] = torch.zeros_like(piece.main, memory_format=torch.contiguous_format)
            piece.optimizer.state[piece.main] = state


def _is_elementwise(value: Any, piece: Piece) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == piece.spec.numel


def _join(parts: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0].view(shape)
    return torch.cat([part.detach().cpu() for part in parts]).view(shape)


def gather_state(record: ParamRecord) -> dict[str, Any] | None:
    """The parameter's state as one torch-shaped dict, or ``None`` if it has none yet."""
    states = [piece.state for piece in record.pieces]
    if not any(states):
        return None
    if not all(states):
        raise AssertionError(f"expected state on every piece of param {record.index}, got some")
    merged: dict[str, Any] = {}
    for key, value in states[0].items():
        if _is_elementwise(value, record.pieces[0]):
            merged[key] = _join([state[key] for state in states], record.param.shape)
        else:
            merged[key] = value
    return merged


def gather_main(record: ParamRecord) -> torch.Tensor:
    """The parameter's fp32 main weight, in the parameter's shape."""
    return _join([piece.main for piece in record.pieces], record.param.shape)


def record_state(record: ParamRecord) -> dict[str, Any]:
    """The parameter's state as ``state_dict()`` shows it, ``{}`` if it has none (a frozen param,
    or one not stepped yet by an optimizer that creates its state at the first step); plus
    ``main_param`` (fp32) for low-precision params. The caller settles any step in flight."""
    state = gather_state(record)
    if state is None:
        return {}
    if record.param.dtype != torch.float32:
        state["main_param"] = gather_main(record)
    return state


class Worker(Protocol):
    """What ``StateView`` waits for before a read (the host part, whose worker steps state)."""

    def wait_for_worker(self) -> None:
        """Returns once no step in flight writes the state any more."""


class StateView(Mapping[torch.Tensor, dict[str, Any]]):
    """``optimizer.state`` as torch users read it: model param -> its state (``record_state``).

    As from torch's ``defaultdict``, a param without state reads as ``{}`` (a frozen param, one
    not stepped yet, a tensor not in the optimizer); only params with state are iterated, counted
    and ``in`` it. Each read builds the dict afresh (views of the live state where the param is in
    one piece, else copies), so it is read-only: state is changed through ``load_state_dict``.
    """

    def __init__(self, records: Sequence[ParamRecord], worker: Worker) -> None:
        self._records = {record.param: record for record in records}
        self._worker = worker  # may be writing state: each read waits for it

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        record = self._records.get(param)
        if record is None:
            return {}
        self._worker.wait_for_worker()
        return record_state(record)

    def __contains__(self, param: object) -> bool:
        record = self._records.get(param)  # type: ignore[call-overload]
        if record is None:
            return False
        self._worker.wait_for_worker()
        return any(piece.state for piece in record.pieces)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([param for param in self._records if param in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        raise TypeError(
            "HybridDeviceOptimizer.state is read-only (it is built from the state each device "
            "keeps); change state with load_state_dict(...)"
        )


def check_saved_state(record: ParamRecord, saved: dict[str, Any]) -> None:
    """Raises ``ValueError`` if a saved tensor does not fit the parameter."""
    shape = record.param.shape
    for key, value in saved.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape != shape:
            raise ValueError(
                f"saved state {key!r} of param {record.index} has shape {tuple(value.shape)}, "
                f"but the param has shape {tuple(record.param.shape)}: the checkpoint is of "
                "another model or another parameter order"
            )


def scatter_state(
    record: ParamRecord, saved: dict[str, Any] | None, elementwise_keys: tuple[str, ...]
) -> None:
    """Replaces each piece's state with its slice of ``saved`` (checked by check_saved_state),
    and the main weight with ``saved["main_param"]`` where given; ``None`` clears the state.
    ``elementwise_keys`` are shaped like the param: a 0-dim param's are 0-dim too, and become
    1-element tensors as its flat main weight is (the fused kernels want one layout)."""
    for piece in record.pieces:
        if saved is None:
            piece.optimizer.state.pop(piece.main, None)
            continue
        group = piece.group
        state: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "main_param":
                continue
            if torch.is_tensor(value) and (value.dim() > 0 or key in elementwise_keys):
                flat = piece.of_param(value.detach().reshape(-1))
                state[key] = flat.to(device=piece.main.device, dtype=torch.float32, copy=True)
            elif key == "step":
                state[key] = _step_tensor(value, piece, group)
            elif torch.is_tensor(value):
                state[key] = value.to(device=piece.main.device, dtype=torch.float32, copy=True)
            else:
                state[key] = value
        piece.optimizer.state[piece.main] = state
    main = None if saved is None else saved.get("main_param")
    if main is not None:
        load_main(record, main)


def match_saved(
    records: Sequence[ParamRecord], groups: Sequence[dict[str, Any]], state_dict: dict[str, Any]
) -> list[tuple[ParamRecord, Any]]:
    """Pairs each record with its saved param id, checking that ``state_dict``'s param groups
    line up with ``groups``."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, this optimizer has {len(groups)}"
        )
    pairs = []
    records_left = iter(records)
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {index} has {len(saved['params'])} params in the state dict "
                f"and {len(group['params'])} in this optimizer"
            )
        pairs.extend((next(records_left), saved_id) for saved_id in saved["params"])
    return pairs


def state_step_count(records: Iterable[ParamRecord]) -> int:
    """The most steps any param's state counts (0 where the state keeps no ``step``)."""
    counts = [
        float(record.pieces[0].state["step"])
        for record in records
        if record.pieces and "step" in record.pieces[0].state
    ]
    return int(max(counts, default=0))


def load_main(record: ParamRecord, main: torch.Tensor) -> None:
    """Loads a saved fp32 main weight into the record's pieces and its model param."""
    flat = main.detach().reshape(-1)
    for piece in record.pieces:
        piece.main.copy_(piece.of_param(flat))
    # The model param becomes the main weight in the model dtype, as after a step.
    flat_param(record.param).copy_(flat.to(record.param.device))
