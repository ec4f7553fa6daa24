"""Units: the modules whose forward pre-hooks wait for the gathered params they may read.

[Note: units]
A module's forward may read params it does not own: ``nn.MultiheadAttention`` reads
``out_proj.weight`` itself, a parent may call ``F.linear(h, self.head.weight)``, and a
parametrized ``weight`` is computed from ``parametrizations.weight.original``. So, as FSDP2 does,
the wait is by *unit*, not by owner: before a unit's forward, every param of its whole subtree is
made current. The root is the unit of every param that no other unit holds (embeddings, final
norm, head), and waits for those before anything runs.

Default units are the repeated blocks: children of an ``nn.ModuleList`` or ``nn.Sequential``
that hold params, share their class with a sibling (the transformer layers; a parametrized
module counts as its original class; a ``ParametrizationList`` is no such container) and have a
forward of their own, the outermost ones where such blocks nest. A module without a forward
(``nn.ModuleList``, ``nn.ModuleDict``, a bare ``nn.Module`` holding a stage's blocks) is never
called, so its pre-hook would never fire: the blocks inside it are chosen instead.
``wrap(..., units=...)`` takes module classes or modules instead, as one picks ``fully_shard``
targets; a module given there that has no forward is refused.

A unit is trusted to run before anything outside it reads its params. Until a unit has run once
(the forwards before the first step count), the modules above it wait for its params as well
(see ``_hooks.py``): a unit that is never called, or not yet, costs overlap, never a stale read.
Every other module waits for the params of its own subtree that no unit below it holds, so a
module reading a child's weight itself (``nn.MultiheadAttention`` and ``out_proj.weight``)
is covered whatever the units are.

Each param is placed with the first unit that waits for it, in the order root, then units in
module order (about forward order); buckets are filled in that order and never hold the tail of
one unit with the head of the next (``plan_buckets``). So no unit waits for a bucket placed after
its own, the gathers can run ahead of the forward in bucket order, and the root's wait (first
in every forward) covers only the first buckets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList, is_parametrized

__all__ = [
    "Unit",
    "UnitPlan",
    "Units",
    "default_units",
    "direct_params",
    "plan_units",
    "resolve_units",
    "runs",
]

# ``wrap``'s ``units``: module classes and modules of the model; None for the default.
Units = Iterable[type[nn.Module] | nn.Module] | type[nn.Module] | nn.Module | None


@dataclass(frozen=True)
class Unit:
    """A module whose forward pre-hook waits for ``param_ids`` (the root: ``name == ""``)."""

    module: nn.Module
    name: str
    param_ids: frozenset[int]  # ids of the params it waits for


@dataclass(frozen=True)
class UnitPlan:
    """The units, root first, and where each param goes in gather order."""

    units: list[Unit]
    owner: dict[int, int]  # param id -> index in ``units`` of the first unit waiting for it


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_class(module: nn.Module) -> type:
    # A parametrized module's class is made for it alone (ParametrizedLinear): use its base.
    return type(module).__bases__[0] if is_parametrized(module) else type(module)


def runs(module: nn.Module) -> bool:
    """Whether the module has a forward of its own (``nn.ModuleList`` and a bare ``nn.Module``
    have none: they are never called); ``torch.compile(model)``'s module sets its forward on
    itself."""
    own = getattr(type(module), "forward", None) is not nn.Module.forward
    return own or callable(vars(module).get("forward"))


def _is_repeated_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and not isinstance(
        module, ParametrizationList
    )


def _outermost(model: nn.Module, chosen: set[int]) -> list[tuple[str, nn.Module]]:
    """The modules of ``chosen`` (ids) that no other chosen module contains, in module order."""
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if id(child) in chosen:
                if all(child is not seen for _, seen in found):
                    found.append((full, child))
                continue  # nested units are covered by this one's wait
            visit(child, full)

    visit(model, "")
    return found


def default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` (see [Note: units]), outermost, in module order."""
    chosen: set[int] = set()
    for module in model.modules():
        if not _is_repeated_container(module):
            continue
        children = [c for c in module.children() if _holds_params(c) and runs(c)]
        counts = Counter(_block_class(child) for child in children)
        chosen.update(id(child) for child in children if counts[_block_class(child)] > 1)
    return _outermost(model, chosen)


def resolve_units(model: nn.Module, units: Units) -> list[tuple[str, nn.Module]]:
    """The units other than the root, from ``wrap``'s ``units`` argument (``None``: default)."""
    if units is None:
        return default_units(model)
    if isinstance(units, (nn.Module, type)):
        units = [units]
    if not isinstance(units, Iterable):
        raise TypeError(
            f"units must be module classes or modules of the model, got {type(units).__name__}; "
            "pass e.g. units=[TransformerBlock] or units=list(model.layers)"
        )
    modules = dict(model.named_modules())
    in_model = {id(module) for module in modules.values()}
    chosen: set[int] = set()
    for item in units:
        if isinstance(item, type) and issubclass(item, nn.Module):
            matched = [m for m in modules.values() if isinstance(m, item) and m is not model]
            if not matched:
                raise ValueError(
                    f"units names the class {item.__name__}, but the model has no submodule of "
                    "that class; pass classes the model uses, or modules of the model"
                )
            _check_runs(item.__name__, matched[0])
            chosen.update(id(m) for m in matched)
        elif isinstance(item, nn.Module):
            if id(item) not in in_model:
                raise ValueError(
                    f"units holds a {type(item).__name__} that is not a submodule of the model; "
                    "pass modules of the wrapped model (e.g. list(model.layers))"
                )
            _check_runs(type(item).__name__, item)
            if item is not model:  # the root is always a unit
                chosen.add(id(item))
        else:
            raise TypeError(
                f"units must hold nn.Module classes or modules, got {item!r}; pass e.g. "
                "units=[TransformerBlock]"
            )
    return _outermost(model, chosen)


def _check_runs(name: str, module: nn.Module) -> None:
    if not runs(module):
        raise ValueError(
            f"units holds a {name}, which has no forward of its own: it is never called, so "
            "a wait before its forward would never run. Pass the modules it holds that run "
            "(units=list(model.layers) for an nn.ModuleList of blocks), or their class"
        )


def _root_param_ids(model: nn.Module, unit_ids: set[int]) -> set[int]:
    """Params reachable from the root without entering a unit (shared ones included)."""
    found: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        found.update(id(p) for p in module._parameters.values() if p is not None)
        stack.extend(child for child in module.children() if id(child) not in unit_ids)
    return found


def plan_units(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> UnitPlan:
    """Each unit's wait set and each param's place; see [Note: units]."""
    unit_ids = {id(module) for _, module in units}
    plan = [Unit(model, "", frozenset(_root_param_ids(model, unit_ids)))]
    for name, module in units:
        ids = frozenset(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        plan.append(Unit(module, name, ids))
    owner: dict[int, int] = {}
    for index, unit in enumerate(plan):
        for param_id in unit.param_ids:
            owner.setdefault(param_id, index)
    return UnitPlan(plan, owner)


def direct_params(module: nn.Module) -> list[torch.Tensor]:
    """The params a module's own forward reads directly: its own, and the originals of its
    parametrized tensors (``module.parametrizations.weight.original``)."""
    params = [p for p in module._parameters.values() if p is not None]
    parametrizations = getattr(module, "parametrizations", None)
    if isinstance(parametrizations, nn.ModuleDict):
        for listing in parametrizations.values():
            params += list(listing.parameters(recurse=False))
    return params
