"""Optimizer state across pieces: eager creation, and the per-parameter view of it.

A parameter cut into pieces has one state dict per piece, kept by the sub-optimizer that steps
the piece. Outwards (``state_dict``) each parameter shows one dict shaped like torch's: tensors
with the parameter's shape, scalars such as ``step`` once. A parameter in one piece shows views of
its live state; one cut in several (the piece straddling the accelerator/CPU split, or a param
longer than a chunk) shows a CPU copy of the concatenation.

[Note: state edits]
torch users edit ``optimizer.state`` in place (``state[p]["exp_avg"].zero_()``), assign keys
(``state[p]["step"] = ...``), assign or delete a param's whole dict, or clear it; each must reach
the live state as in torch. A view of the live state takes in-place edits by itself. A copy
(a param in several pieces, or state on another device) is handed out through ``StateEdits``,
which keeps its version counter: before the state is next read or stepped, each copy whose
counter moved is written back into the pieces it came from (``apply``). A copy read before a step
and edited after it would undo that step if written back: it is refused instead. An assigned key
(``ParamState``) or dict (``StateView.__setitem__``) is written into the pieces at once; a
deleted dict or a cleared state makes the params start afresh at their next step, as torch's do.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._elementwise import OptimizerSpec, StateKeys, constructor_defaults, torch_class_run_as_is
from ._kept_lists import forget_step_lists
from ._records import ParamRecord, Piece, flat_param

__all__ = [
    "ParamState",
    "StateEdits",
    "StateOwner",
    "StateView",
    "assign_state",
    "check_saved_keys",
    "check_saved_state",
    "constructor_state",
    "gather_main",
    "gather_state",
    "init_state",
    "load_main",
    "match_saved",
    "record_state",
    "reset_state",
    "scatter_state",
    "state_step_count",
    "state_to_take_over",
    "torch_state",
    "write_state",
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
    # Only torch's own first step is known: a subclass that changes it (its `step`, or the state
    # `_init_group` makes) makes its state itself, at the first step.
    bases = (*_ZERO_INITIAL_STATE, torch.optim.SGD)
    base = torch_class_run_as_is(cls, bases, ("step", "_init_group"))
    if base is torch.optim.SGD:
        # SGD's first step copies the grad into the buffer: zeros give the same only without
        # dampening.
        return group.get("dampening", 0) == 0
    return base is not None


def momentum_buffers(records: Iterable[ParamRecord], cls: type) -> set[int]:
    """The ids of the SGD momentum buffers of ``records``' pieces (none for other classes): right
    after ``init_state`` or ``reset_state``, those made at zeros (see ``_starts_zero``)."""
    if not issubclass(cls, torch.optim.SGD):
        return set()
    return {
        id(piece.state["momentum_buffer"])
        for record in records
        for piece in record.pieces
        if "momentum_buffer" in piece.state
    }


def state_to_take_over(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a torch optimizer holds state that a wrap must take over: state of a step, or set
    by the user (Adagrad's ``sum`` filled with a value of theirs, moments loaded with their step
    counts reset to 0). State that its constructor alone makes (Adagrad's ``sum`` at
    ``initial_accumulator_value``, step 0, in the param's dtype) is not: the sub-optimizers' own
    constructors make it again, in fp32. That is told apart by building the class again over a
    one-element probe, with each group's options, and comparing each param's state with the
    probe's, element by element (in the param state's dtype)."""
    if not optimizer.state:
        return False
    spec = OptimizerSpec.of(type(optimizer), constructor_defaults(optimizer))
    for group in optimizer.param_groups:
        held = [torch_state(optimizer.state.get(p)) for p in group["params"]]
        held = [state for state in held if state]
        if not held:
            continue
        made = constructor_state(spec, group)
        if not all(_as_made(state, made) for state in held):
            return True
    return False


def torch_state(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """A param's state in a torch optimizer, less a ``main_param`` that a zero-shard state dict
    loaded into it left there: torch's steps do not keep it, so it is not taken over."""
    return {key: value for key, value in (state or {}).items() if key != "main_param"}


def constructor_state(spec: OptimizerSpec, group: Mapping[str, Any]) -> Mapping[str, Any]:
    """The state ``spec``'s class makes at construction for a one-element param of ``group``'s
    options (Adagrad's ``sum`` and ``step``; nothing for most classes)."""
    probe = torch.zeros(1)
    options = {key: value for key, value in group.items() if key != "params"}
    return spec.build([{**options, "params": [probe]}], {}).state.get(probe, {})


def _as_made(state: Mapping[str, Any], made: Mapping[str, Any]) -> bool:
    """Whether ``state`` is ``made`` (a one-element probe's state) at every element."""
    if set(state) != set(made):
        return False
    for key, value in state.items():
        expected = made[key]
        if torch.is_tensor(value) and torch.is_tensor(expected):
            if expected.numel() != 1:
                return False
            like = expected.reshape(()).to(device=value.device, dtype=value.dtype)
            if not bool((value == like).all()):
                return False
        elif torch.is_tensor(value) or torch.is_tensor(expected) or value != expected:
            return False
    return True


def init_state(records: Iterable[ParamRecord], cls: type, state_keys: Sequence[StateKeys]) -> None:
    """Creates, for every piece without state, the state its optimizer would create at its first
    step, where that state is known to start at zero (torch's own first step of a class of
    ``_ZERO_INITIAL_STATE``, or of SGD without dampening: see ``_starts_zero``). Other optimizers
    create their state at the first step, as in torch.

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


class StateOwner(Protocol):
    """What ``StateView`` reads and writes the state through (the hybrid optimizer)."""

    state_started: bool  # a torch optimizer in its place would hold state (see StateView)

    def wait_for_worker(self) -> None:
        """Returns once no step in flight writes the state any more."""

    def read_state(self, record: ParamRecord) -> dict[str, Any]:
        """The param's state as ``record_state`` shows it, copies handed out for edits."""

    def write_state(self, record: ParamRecord, key: str, value: Any) -> None:
        """Writes ``value`` into the param's state ``key`` (see ``write_state``)."""

    def reset_state(self, records: Sequence[ParamRecord]) -> None:
        """The params' state as before their first step (see ``reset_state``)."""


class ParamState(dict):
    """One param's state as ``optimizer.state[param]`` shows it: a key assigned is written into
    the live state ([Note: state edits]). Keys cannot be removed one by one (torch's step would
    fail on the rest): ``del optimizer.state[param]`` drops the param's whole state.

    A low-precision param's fp32 main weight is read by name (``state["main_param"]``, edited
    in place as the rest) but is not one of the keys: torch's state has no such key, and a loop
    over the keys (a reset that zeroes every state tensor) must not reach the main weights.

    Args:
        values: the param's state as read (state key -> tensor or scalar), ``main_param`` (fp32)
            included where the param has one: the dict's contents, ``main_param`` aside.
        write: called as ``write(key, value)`` at each key assigned, before the dict takes it:
            writes it into the live state.
    """

    def __init__(self, values: Mapping[str, Any], write: Callable[[str, Any], None]) -> None:
        super().__init__({key: value for key, value in values.items() if key != "main_param"})
        self._main = values.get("main_param")
        self._write = write

    def __missing__(self, key: str) -> Any:
        if key == "main_param" and self._main is not None:
            return self._main
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        held = key in self or (key == "main_param" and self._main is not None)
        return self[key] if held else default

    def __setitem__(self, key: str, value: Any) -> None:
        self._write(key, value)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def _refuse(self, *args: Any) -> Any:
        raise TypeError(
            "the keys of one param's state cannot be removed one by one (the optimizer needs "
            "them all); del optimizer.state[param] drops its whole state, as torch's next step "
            "then starts it afresh"
        )

    __delitem__ = pop = popitem = clear = _refuse

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return dict, (dict(self),)  # copies and pickles are plain dicts


@dataclass
class _Copy:
    tensor: weakref.ref  # a copy of live state handed out (dead once the user dropped it)
    held: torch.Tensor | None  # the copy itself, while others hold it (see StateEdits)
    version: int  # its version counter when handed out or last written back
    write: Callable[[torch.Tensor], None]  # writes it into the live state
    owner: object  # whose state it copies (forget() by owner)
    token: object  # shared by copies of one read that alias each other (a DTensor, its local)

    def alive(self) -> torch.Tensor | None:
        return self.held if self.held is not None else self.tensor()


class StateEdits:
    """Copies of the state handed out by reads, written back where edited ([Note: state
    edits]). A copy is held while anyone else holds it and until an ``apply`` saw it last:
    ``optimizer.state[p]["exp_avg"].zero_()`` edits a copy that nothing else holds once the
    statement ends."""

    _fresh: list[_Copy]  # handed out since the last step
    _stale: list[_Copy]  # handed out before it: an edit now would undo the step

    def __init__(self) -> None:
        self._fresh, self._stale = [], []

    def hand_out(
        self,
        tensor: torch.Tensor,
        write: Callable[[torch.Tensor], None],
        owner: object,
        token: object = None,
    ) -> None:
        """Watches ``tensor``, a copy of ``owner``'s live state that ``write`` writes back;
        ``token``: the same for tensors that alias it (default: its own)."""
        token = object() if token is None else token
        self._fresh.append(_Copy(weakref.ref(tensor), tensor, tensor._version, write, owner, token))

    @property
    def pending(self) -> bool:
        """Whether some copy handed out may have been edited (``apply`` has work to do)."""
        return bool(self._fresh or self._stale)

    def apply(self) -> None:
        """Writes back the copies edited since they were handed out; raises (once per copy)
        where a copy handed out before the last step was edited after it."""
        if not self._fresh and not self._stale:
            return
        edited = [c for c in self._stale if _edited(c)]
        self._stale = [c for c in self._stale if not any(c is e for e in edited)]
        if edited:
            raise RuntimeError(
                f"{len(edited)} tensor(s) read from optimizer.state before the last step were "
                "edited after it. They are copies (a param kept in several pieces, across the "
                "accelerator/CPU split or longer than a chunk, or state on another device), and "
                "writing them back would undo that step; the edit was not applied. Read "
                "optimizer.state[param] again after the step and edit what it gives"
            )
        for copy in self._fresh:
            if _edited(copy):
                tensor = copy.alive()
                copy.write(tensor)
                copy.version = tensor._version
                del tensor
        self._fresh = _referenced(self._fresh)
        self._stale = _referenced(self._stale)

    def stale_copies(self) -> set[int]:
        """The ids of the copies handed out before the last step that someone still holds and
        nobody edited since (through them or what aliases them): torch's would be the live
        state. An edited one (a ``dcp.load`` into a kept state dict) is left out: it holds what
        was written."""
        edited = {copy.token for copy in self._stale if _edited(copy)}
        alive = [copy.alive() for copy in self._stale if copy.token not in edited]
        return {id(tensor) for tensor in alive if tensor is not None}

    def expire(self) -> None:
        """A step is about to change the state (after ``apply``): the copies handed out so far
        become stale."""
        self._stale.extend(self._fresh)
        self._fresh = []

    def forget(self, owners: Sequence[object] | None = None) -> None:
        """The state of ``owners`` (default: all) was replaced (a loaded state dict, a reset):
        none of their copies is written back, as edits of tensors torch no longer holds reach
        nothing."""
        if owners is None:
            self._fresh, self._stale = [], []
            return
        self._fresh = [c for c in self._fresh if all(c.owner is not o for o in owners)]
        self._stale = [c for c in self._stale if all(c.owner is not o for o in owners)]


def _edited(copy: _Copy) -> bool:
    tensor = copy.alive()
    return tensor is not None and tensor._version != copy.version


def _referenced(copies: list[_Copy]) -> list[_Copy]:
    """The copies someone other than ``StateEdits`` still holds. A copy is held until nobody
    else does (its last edits are then seen), as a statement that edits a copy read in the same
    statement may drop every other reference at its end."""
    for copy in copies:
        if copy.held is not None and sys.getrefcount(copy.held) <= 2:  # the field, the argument
            copy.held = None
    return [copy for copy in copies if copy.alive() is not None]


class StateView(MutableMapping[torch.Tensor, dict[str, Any]]):
    """``optimizer.state`` as torch users read and edit it: model param -> its state.

    As from torch's ``defaultdict``, a param without state reads as ``{}`` (a frozen param, one
    not stepped yet, a tensor not in the optimizer); only params with state are iterated, counted
    and ``in`` it. Each read builds the dict afresh (``record_state``); edits in place, assigned
    keys, a dict assigned to a param and ``del``/``pop``/``clear`` reach the live state as in
    torch ([Note: state edits]).

    Its truth value is a torch optimizer's: false until a step was launched or state was loaded
    or written, though the state of torch's own step is made at construction. torch's
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` read it to decide whether to
    make a fresh optimizer's state by a step with zero grads at lr 0 (``_init_optim_state``);
    without it, the state a first step makes (SGD with dampening, a user's class) would be
    missing from the layout a checkpoint is loaded into, and not loaded.
    """

    def __init__(self, records: Sequence[ParamRecord], owner: StateOwner) -> None:
        self._records = {record.param: record for record in records}
        self._owner = owner

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        record = self._records.get(param)
        if record is None:
            return {}
        return ParamState(
            self._owner.read_state(record),
            lambda key, value: self._owner.write_state(record, key, value),
        )

    def __bool__(self) -> bool:
        return self._owner.state_started

    def get(self, param: Any, default: Any = None) -> Any:
        """As torch's ``defaultdict.get``: ``default`` for a param without state."""
        return self[param] if param in self else default

    def __contains__(self, param: object) -> bool:
        record = self._records.get(param)  # type: ignore[call-overload]
        if record is None:
            return False
        self._owner.wait_for_worker()
        return any(piece.state for piece in record.pieces)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([param for param in self._records if param in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, param: torch.Tensor, value: Mapping[str, Any]) -> None:
        record = self._records.get(param)
        assign_state(
            record,
            value,
            reset=lambda: self._owner.reset_state([record]),
            write=lambda key, item: self._owner.write_state(record, key, item),
        )

    def __delitem__(self, param: torch.Tensor) -> None:
        if param not in self:
            raise KeyError("the param has no optimizer state to drop")
        self._owner.reset_state([self._records[param]])

    def clear(self) -> None:
        self._owner.reset_state([self._records[param] for param in self])

    def replace(self, value: Mapping[Any, Any]) -> None:
        """``optimizer.state = value``: an empty mapping drops every param's state, as torch's
        next step then starts it afresh; anything else is refused."""
        if not isinstance(value, Mapping) or value:
            raise TypeError(
                "optimizer.state can only be replaced by an empty dict (which drops every "
                "param's state: the next step starts it afresh, as in torch); edit "
                "optimizer.state[param] instead, or load a state dict with load_state_dict(...)"
            )
        self.clear()


def assign_state(
    record: ParamRecord | None,
    value: Mapping[str, Any],
    *,
    reset: Callable[[], None],
    write: Callable[[str, Any], None],
) -> None:
    """``optimizer.state[param] = value``: ``{}`` drops the state (``reset``); a dict with the
    keys the state has (``main_param`` may be left out) writes each (``write``)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"optimizer.state[param] must be a dict, got {type(value).__name__}")
    if record is None or record.ignored:
        if value:
            raise KeyError(
                "the param is not stepped by this optimizer (frozen at construction, or not in "
                "its param groups): it keeps no state"
            )
        return
    if not value:
        reset()
        return
    keys = set(record_state(record)) - {"main_param"}
    if not keys or set(value) - {"main_param"} != keys:
        raise ValueError(
            f"optimizer.state[param] = dict with keys {sorted(value)}: the param's state has "
            f"{sorted(keys) or 'none yet'}; assign every key, or assign keys one by one "
            "(optimizer.state[param][key] = value), or {} to drop it"
        )
    for key in sorted(keys):
        write(key, value[key])


def write_state(record: ParamRecord, key: str, value: Any) -> None:
    """Writes ``value`` into every piece's state ``key``, in place (the kernel's tables point into
    the state): a param-shaped tensor cut by piece, a scalar whole. Checked before any write."""
    states = [piece.state for piece in record.pieces]
    if not states or not all(key in state for state in states):
        known = sorted(states[0]) if states and states[0] else "none yet"
        raise KeyError(f"the param's state has no {key!r} (it has {known}); keys cannot be added")
    numel = record.param.numel()
    for piece, state in zip(record.pieces, states, strict=True):
        target = state[key]
        if _is_elementwise(target, piece):
            if not torch.is_tensor(value) or value.numel() != numel:
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(
                    f"state {key!r} holds a tensor of the param's shape "
                    f"{tuple(record.param.shape)}, got {shape}"
                )
        elif torch.is_tensor(target) and torch.as_tensor(value).numel() != target.numel():
            raise ValueError(f"state {key!r} holds {target.numel()} element(s), got {value!r}")
    for piece, state in zip(record.pieces, states, strict=True):
        target = state[key]
        if _is_elementwise(target, piece):
            target.copy_(piece.of_param(value.detach().reshape(-1)))
        elif torch.is_tensor(target):
            target.copy_(torch.as_tensor(value).detach().reshape(target.shape))
        else:
            state[key] = value


def reset_state(record: ParamRecord, cls: type, keys: StateKeys) -> None:
    """The param's state as before its first step, as torch's next step makes it after ``del
    optimizer.state[param]``: zeros in place where the optimizer's state starts at zero (see
    ``init_state``), else none, so that the next step creates it."""
    zeros = all(key == "step" for key in keys.scalar_keys)
    for piece in record.pieces:
        if not piece.state:
            continue
        if zeros and _keeps_state_of(piece.optimizer, cls) and _starts_zero(cls, piece.group):
            for value in piece.state.values():
                if torch.is_tensor(value):
                    value.zero_()
        else:
            forget_step_lists(piece.optimizer)
            piece.optimizer.state.pop(piece.main, None)


def check_saved_state(record: ParamRecord, saved: dict[str, Any]) -> None:
    """Raises ``ValueError`` if a saved tensor does not fit the parameter, ``TypeError`` if it
    is a tensor subclass (a DTensor of a sharded state dict): the state is kept in plain
    tensors, which the CPU kernel reads by address."""
    shape = record.param.shape
    for key, value in saved.items():
        if torch.is_tensor(value) and type(value) is not torch.Tensor:
            raise TypeError(
                f"saved state {key!r} of param {record.index} is a {type(value).__name__}, not a "
                "plain tensor (the state dict of zero_shard.wrap's optimizer holds each rank's "
                "shards as DTensors): load plain tensors, such as zero_shard.full_state_dict(opt) "
                "gives on rank 0"
            )
        if torch.is_tensor(value) and value.dim() > 0 and value.shape != shape:
            raise ValueError(
                f"saved state {key!r} of param {record.index} has shape {tuple(value.shape)}, "
                f"but the param has shape {tuple(record.param.shape)}: the checkpoint is of "
                "another model or another parameter order"
            )


def check_saved_keys(
    saved_state: Mapping[Any, Mapping[str, Any]], groups: Sequence[Sequence[Any]]
) -> None:
    """Raises ``ValueError`` where params of one group were saved with different state keys
    (``main_param`` aside): one lacks a key the others have (a state dict cut or edited by hand),
    which the step would find missing only after stepping the others.

    Args:
        saved_state: a state dict's ``"state"``: saved param id -> that param's saved state (key
            -> value). Ids with no state, or a ``main_param`` alone (a param that had no state,
            as one that got no grad since momentum was switched on), are not compared.
        groups: each param group's saved param ids (its ``"params"`` in ``"param_groups"``).
    """
    for index, ids in enumerate(groups):
        keys = {
            pid: frozenset(key for key in saved_state[pid] if key != "main_param")
            for pid in ids
            if set(saved_state.get(pid) or ()) - {"main_param"}
        }
        if len(set(keys.values())) <= 1:
            continue
        every = frozenset().union(*keys.values())
        pid, held = next((pid, held) for pid, held in keys.items() if held != every)
        raise ValueError(
            f"the saved state of param {pid!r} (param group {index}) lacks {sorted(every - held)}, "
            "which other params of its group have: the state dict is incomplete. Load a whole "
            "one; nothing was loaded"
        )


def scatter_state(
    record: ParamRecord, saved: dict[str, Any] | None, elementwise_keys: tuple[str, ...]
) -> None:
    """Replaces each piece's state with its slice of ``saved`` (checked by check_saved_state),
    and the main weight with ``saved["main_param"]`` where given; ``None`` clears the state.
    ``elementwise_keys`` are shaped like the param: a 0-dim param's are 0-dim too, and become
    1-element tensors as its flat main weight is (the fused kernels want one layout)."""
    for piece in record.pieces:
        forget_step_lists(piece.optimizer)  # they would hold the replaced tensors
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
