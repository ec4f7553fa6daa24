"""Param-group options over a run: checked at construction, and followed at each step as torch
follows them (a scheduler's lr, an option switched on mid-run, groups added after ``wrap``).

[Note: group options at launch]
torch reads a group's options inside ``step()``: a scheduler stepped, or a group edited, after it
returns applies to the next step. The CPU's share of a step reads its sub-optimizers' groups on the
worker thread, possibly after ``step()`` returned (``launch_step``, a delayed update, zero-shard's
overlapped step). The sub-groups are set from the user's groups at launch (``_sync_hyperparams``),
so a new number the user assigns later is not seen; but a tensor is shared, and a scheduler writes
a tensor lr in place (``fill_``). So at launch, on the caller's thread, ``HostPart.start`` gives
the sub-groups copies of their tensor options (``snapshot_hyperparams``) before any chunk goes to
the worker. At launch too, chunks whose group now asks for what the single-pass kernel does not
implement leave it for torch's CPU kernel (``leave_kernel_where_unmet``), and a group switched
to amsgrad (RMSprop: to centered or momentum) gets the state torch would give it, or is refused
before anything changes (``prepare_switched_on_state``).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ._cpu_kernel import unmet_option
from ._records import HostChunk, ParamRecord

__all__ = [
    "GroupsAtBuild",
    "check_first_momentum",
    "check_impl_flags",
    "check_number_options",
    "check_wrapped_groups",
    "leave_kernel_where_unmet",
    "number_options",
    "prepare_switched_on_state",
    "snapshot_hyperparams",
]


def check_impl_flags(groups: Sequence[dict[str, Any]]) -> None:
    """Refuses ``differentiable=True`` and warns that ``capturable=True`` is not honoured; the
    other implementation flags (``foreach``, ``fused``) only choose a kernel, chosen per device."""
    if any(group.get("differentiable") for group in groups):
        raise NotImplementedError(
            "differentiable=True is not supported: HybridDeviceOptimizer steps fp32 copies of the "
            "params under torch.no_grad(), so autograd cannot follow the update; leave "
            "differentiable=False, or differentiate through the plain torch optimizer"
        )
    if any(group.get("capturable") for group in groups):
        warnings.warn(
            "capturable=True is ignored: HybridDeviceOptimizer's step cannot be captured in a "
            "CUDA graph (the CPU's share is stepped by the host); each device uses its fastest "
            "kernel. Pass capturable=False to silence this",
            UserWarning,
            stacklevel=3,
        )


def _is_number(value: Any) -> bool:
    """A number option's value (a flag's ``True`` is none)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Real) or torch.is_tensor(value)


def _is_numbers(value: Any, like: Any) -> bool:
    """Whether ``value`` is what an option whose default is ``like`` may hold: a number or a
    tensor for a number, as many for a tuple of numbers (``betas``)."""
    if isinstance(like, tuple):
        return (
            isinstance(value, (tuple, list))
            and len(value) == len(like)
            and all(isinstance(v, numbers.Real) or torch.is_tensor(v) for v in value)
        )
    return isinstance(value, numbers.Real) or torch.is_tensor(value)


def number_options(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The options that ``defaults`` (the constructor's values) give as numbers (``lr``, ``eps``)
    or tuples of numbers (``betas``), with those values: what ``check_number_options`` checks."""
    return {
        key: like
        for key, like in defaults.items()
        if _is_number(like) or (isinstance(like, tuple) and like and all(map(_is_number, like)))
    }


def check_number_options(groups: Sequence[dict[str, Any]], numeric: Mapping[str, Any]) -> None:
    """Raises ``TypeError`` before anything is stepped where a group's option among ``numeric``
    (see ``number_options``) holds something else.

    torch finds such a value (``lr`` read from a config as a string) inside its kernels, after
    some params' step counts moved (every param's, in a fused kernel): fixed, the run goes on a
    step count ahead. Checked at each step, as the groups are edited between steps."""
    for index, group in enumerate(groups):
        for key, like in numeric.items():
            value = group.get(key, like)
            if not _is_numbers(value, like):
                what = (
                    f"{len(like)} numbers or tensors"
                    if isinstance(like, tuple)
                    else "a number or a tensor"
                )
                raise TypeError(
                    f"param_groups[{index}][{key!r}] must be {what} (given {like!r} at "
                    f"construction), got {value!r}; set a number (float(...)); nothing was "
                    "stepped"
                )


class GroupsAtBuild:
    """The param groups an optimizer laid its buffers out for: the group dicts, and the params
    each held. Their ``params`` lists stay editable, as torch's are; an edit would go unstepped."""

    _groups: list[dict[str, Any]]
    _param_ids: list[tuple[int, ...]]  # id of each param, group by group (the dicts hold them)

    def __init__(self, groups: Sequence[dict[str, Any]]) -> None:
        self._groups = list(groups)
        self._param_ids = [tuple(map(id, group["params"])) for group in groups]

    def change(self, groups: Sequence[dict[str, Any]]) -> str | None:
        """What differs in ``groups`` from the groups at build, in words; ``None``: nothing."""
        if len(groups) != len(self._groups) or any(
            [a is not b for a, b in zip(groups, self._groups, strict=True)]
        ):
            return (
                f"{len(self._groups)} param groups then, {len(groups)} now, or a group dict "
                "replaced: add_param_group(...), param_groups.append(...) or load_state_dict(...)?"
            )
        for index, (group, ids) in enumerate(zip(groups, self._param_ids, strict=True)):
            if tuple(map(id, group["params"])) != ids:
                return (
                    f"param_groups[{index}]['params'] held {len(ids)} params then and holds "
                    f"{len(group['params'])} now, or one was replaced or moved to another group"
                )
        return None


def check_wrapped_groups(
    at_build: GroupsAtBuild,
    groups: Sequence[dict[str, Any]],
    wrapped: torch.optim.Optimizer | None,
) -> None:
    """Raises unless ``groups`` (a HybridDeviceOptimizer's) and those of ``wrapped`` (the
    optimizer ``HybridDeviceOptimizer.wrap`` took over, if any and alive) are still the groups
    it was built with, holding the same params: a group added or a param put in one would never
    be stepped, and a param moved to another group would step with the old group's options."""
    owners = [("HybridDeviceOptimizer", groups)]
    if wrapped is not None:
        owner = f"{type(wrapped).__name__} that HybridDeviceOptimizer.wrap took over"
        owners.append((owner, wrapped.param_groups))
    for owner, theirs in owners:
        change = at_build.change(theirs)
        if change is None:
            continue
        raise RuntimeError(
            f"the param_groups of the {owner} changed after it was built ({change}), and it "
            "would not step them so: it lays out its buffers at build. Put every param in its "
            "group before building, or build again after the change: opt = "
            "HybridDeviceOptimizer.wrap(torch_opt, ...) (its optimizer state starts afresh); "
            "load state into the optimizer with its load_state_dict(...)"
        )


def snapshot_hyperparams(groups: Iterable[dict[str, Any]]) -> None:
    """Replaces each tensor option of ``groups`` (also one inside a tuple or list, as in
    ``betas``) by a copy, one per tensor however many groups hold it: what the worker reads is
    then the value at launch (see [Note: group options at launch])."""
    copies: dict[int, torch.Tensor] = {}  # id of an option's tensor -> its copy, this call only

    def snapshot(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                copies[id(value)] = value.detach().clone()
            return copies[id(value)]
        if type(value) in (tuple, list):
            return type(value)(snapshot(item) for item in value)
        return value

    for group in groups:
        for key, value in list(group.items()):
            if key != "params":
                group[key] = snapshot(value)


def leave_kernel_where_unmet(chunks: Sequence[HostChunk]) -> list[torch.Tensor]:
    """Moves each chunk on the single-pass kernel whose group now asks for what the kernel does
    not implement (``maximize=True``, a tensor lr... set after construction) to its torch
    sub-optimizer for good, as ``OffloadPolicy(cpu_kernel='torch')`` would have built it, and
    warns once for those moved in this call. Its state is torch's already. Returns the fp32 grad
    buffers made for the low-precision chunks moved (torch's kernel steps fp32 grads)."""
    moved: dict[int, str] = {}  # group index -> the option the kernel lacks
    made: list[torch.Tensor] = []
    for chunk in chunks:
        if chunk.kernel is None:
            continue
        option = unmet_option(chunk.optimizer.param_groups[0])
        if option is None:
            continue
        moved.setdefault(chunk.spec.group_index, option)
        chunk.kernel = None
        chunk.tables.clear()
        if chunk.spec.dtype != torch.float32:  # fp32 grads are stepped where they land
            chunk.grad = torch.zeros(chunk.spec.numel, dtype=torch.float32)
            for _, piece in chunk.pieces:
                piece.grad = piece.in_chunk(chunk.grad)
            made.append(chunk.grad)
    if moved:
        named = ", ".join(f"param group {index} ({option})" for index, option in moved.items())
        warnings.warn(
            f"{named}: an option set after the optimizer was built that zero-shard's single-pass "
            "CPU Adam kernel does not implement; the CPU's share of those groups is stepped with "
            "torch's CPU kernel from now on (slower, and 4 bytes a param more host memory for "
            "bf16 params). Build the optimizer with OffloadPolicy(cpu_kernel='torch') to "
            "silence this",
            RuntimeWarning,
            stacklevel=2,
        )
    return made


class SwitchedOn(NamedTuple):
    """A state tensor that an option adds to a param's state, beside one that is always there."""

    option: str  # the group option that asks for it (on: true or a positive number)
    key: str  # the state it needs, zeros at a param's first step
    beside: str  # a state key present only in the optimizers that have this option


_SWITCHED_ON = (
    SwitchedOn("amsgrad", "max_exp_avg_sq", "exp_avg_sq"),  # Adam, AdamW
    SwitchedOn("centered", "grad_avg", "square_avg"),  # RMSprop
    SwitchedOn("momentum", "momentum_buffer", "square_avg"),  # RMSprop
)


def prepare_switched_on_state(
    records: Iterable[ParamRecord], groups: Sequence[dict[str, Any]]
) -> None:
    """For the params about to step whose group asks for state that their state lacks (an option
    switched on after construction: Adam's ``amsgrad``, RMSprop's ``centered`` or ``momentum``):
    creates it (zeros) where they never stepped, as torch's first step would (their other state
    was made at construction); raises, before anything changes, where they did (torch's own step
    raises KeyError there). ``groups``: the user's param groups, read first, so that a step
    where no group has such an option on reads nothing per param."""
    wanted_on = [wanted for wanted in _SWITCHED_ON if any(g.get(wanted.option) for g in groups)]
    if not wanted_on:
        return
    missing = [
        (record, piece, wanted)
        for record in records
        for piece in record.pieces
        for wanted in wanted_on
        if piece.group.get(wanted.option)
        and wanted.beside in piece.state
        and wanted.key not in piece.state
    ]
    stepped = [
        (record.group_index, piece, wanted)
        for record, piece, wanted in missing
        if float(piece.state.get("step", 0.0)) > 0
    ]
    if stepped:
        group_index, piece, wanted = stepped[0]
        raise RuntimeError(
            f"{wanted.option}={piece.group[wanted.option]!r} in param group {group_index}, "
            f"switched on after its params stepped ({float(piece.state['step']):.0f} steps): the "
            f"optimizer keeps {wanted.key} from the first step on, so it cannot start mid-run "
            f"(torch's own step raises KeyError {wanted.key!r} here). Build the optimizer with "
            f"{wanted.option}={piece.group[wanted.option]!r} when training starts, or switch "
            "it off again"
        )
    for _, piece, wanted in missing:
        piece.state[wanted.key] = torch.zeros_like(piece.state[wanted.beside])


def check_first_momentum(records: Iterable[ParamRecord], zero_buffers: set[int]) -> None:
    """For SGD params about to take their first step: torch copies the first grad into the
    momentum buffer undampened; the buffer made at zeros at construction (where ``dampening`` was
    0: ``zero_buffers``, their ids) gives the same only without dampening. A dampening set since
    is refused before anything changes; the stepped params' buffers leave ``zero_buffers``."""
    if not zero_buffers:  # no SGD buffer left unstepped: nothing to read per param
        return
    records = list(records)
    for record in records:
        for piece in record.pieces:
            buffer, group = piece.state.get("momentum_buffer"), piece.group
            if id(buffer) in zero_buffers and group.get("momentum") and group.get("dampening"):
                raise RuntimeError(
                    f"dampening={group['dampening']!r} in param group {record.group_index} was "
                    "set after the optimizer was built, before its params' first step: torch's "
                    "SGD copies a param's first grad into its momentum buffer undampened, and "
                    "this optimizer made the buffer at zeros when dampening was 0. Build the "
                    f"optimizer with dampening={group['dampening']!r}, or set it after the first "
                    "step; nothing was stepped"
                )
    for record in records:
        for piece in record.pieces:
            zero_buffers.discard(id(piece.state.get("momentum_buffer")))
