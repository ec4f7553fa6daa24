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
to amsgrad gets the state torch would give it, or is refused before anything changes
(``prepare_amsgrad_state``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._cpu_kernel import unmet_option
from ._records import HostChunk, ParamRecord

__all__ = [
    "check_impl_flags",
    "check_wrapped_groups",
    "leave_kernel_where_unmet",
    "prepare_amsgrad_state",
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


def check_wrapped_groups(
    wrapped: torch.optim.Optimizer | None, groups: Sequence[dict[str, Any]]
) -> None:
    """Raises unless ``wrapped`` (the optimizer ``HybridDeviceOptimizer.wrap`` took over, if any
    and alive) still holds exactly ``groups``, the dicts it was wrapped with: a group added to it
    or a dict replaced there would never be stepped."""
    if wrapped is None:
        return
    theirs = wrapped.param_groups
    if len(theirs) == len(groups) and all(a is b for a, b in zip(theirs, groups, strict=True)):
        return
    raise RuntimeError(
        f"the param_groups of the {type(wrapped).__name__} that HybridDeviceOptimizer.wrap took "
        f"over changed after wrapping ({len(groups)} groups wrapped, {len(theirs)} now, or a "
        "group dict replaced: torch_opt.add_param_group(...) or torch_opt.load_state_dict(...)"
        "?), and this optimizer would not step them: it lays out its buffers at wrap. Add every "
        "param group before wrapping, or wrap again after adding it: opt = "
        "HybridDeviceOptimizer.wrap(torch_opt, ...) (its optimizer state starts afresh); load "
        "state into the wrapper, opt.load_state_dict(...), not into torch_opt"
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


def prepare_amsgrad_state(records: Iterable[ParamRecord]) -> None:
    """For the params about to step whose group asks for ``amsgrad`` while their state has no
    running maximum (switched on after construction): creates it (zeros) where they never
    stepped, as torch's first step would (their other state was made at construction); raises,
    before anything changes, where they did (torch's own step raises KeyError there)."""
    missing = [
        (record, piece)
        for record in records
        for piece in record.pieces
        if piece.group.get("amsgrad")
        and "exp_avg_sq" in piece.state
        and "max_exp_avg_sq" not in piece.state
    ]
    stepped = [
        (record.group_index, float(piece.state["step"]))
        for record, piece in missing
        if float(piece.state.get("step", 0.0)) > 0
    ]
    if stepped:
        group_index, num_steps = stepped[0]
        raise RuntimeError(
            f"amsgrad=True in param group {group_index}, switched on after its params stepped "
            f"({num_steps:.0f} steps): Adam keeps the running maximum of exp_avg_sq "
            "(max_exp_avg_sq) from the first step on, so it cannot start mid-run (torch's own "
            "step raises KeyError 'max_exp_avg_sq' here). Build the optimizer with amsgrad=True "
            "when training starts, or set it back to False"
        )
    for _, piece in missing:
        piece.state["max_exp_avg_sq"] = torch.zeros_like(piece.state["exp_avg_sq"])
