"""The model hooks that wait for gathered params: they wait, and never issue a collective.

- Each unit's forward pre-hook waits for every bucket holding a param its subtree may read
  ([Note: units] in ``_units.py``), and notes that the unit runs. It runs before the module's
  own pre-hooks (``prepend``), so a hook that computes a weight from params
  (``torch.nn.utils.weight_norm``) reads gathered ones.
- Every other module that runs waits, before its forward, for the params of its subtree that no
  unit below it holds: the unit's wait has covered them when the module runs inside its unit;
  this covers a module reading a child's weight itself inside a unit that never runs, and a
  submodule called on its own (``model.head(h)`` outside ``model(...)``).
- A module above units (the root, a model's stack of blocks) also waits for the params of each
  unit below it that has not run yet: a unit that never runs (its parent calls its children,
  or reads its weights) is waited for by the nearest module above it that does.
- Every module's ``state_dict`` and ``load_state_dict`` wait for all buckets: a save reads the
  latest weights (on rank 0 alone, too), and a load lands on top of them. A delayed update still
  deferred is applied first (it runs on one process: that communicates nothing).
- The root's forward hook waits for all buckets when its forward ends, also those of modules it
  did not run: the next backward writes grads that the last step's CPU share may still be
  copying to the host until its step is complete ([Note: deferred host step]).

Every hook is marked as zero-shard's: copies of the model leave them out ([Note: plain copies]).

[Note: params registered after wrap]
The waits are planned at wrap from where each param is registered. A param of the optimizer's
set on another module afterwards (weights tied after wrap: ``blocks[0].fc.weight =
blocks[2].fc.weight``) is read there, in a unit whose waits need not cover its bucket, and the
forward would read it before its update lands. torch's global hook on param registrations
(installed once) tells the model's gatherer; from then on the forwards wait for every bucket
before they start (the gathers no longer overlap the forward), with a warning once. A param set
where it was, or one the optimizer does not hold (no gather writes it), changes nothing.
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._buckets import Bucket
from ._compiled import CompileAwareHook
from ._copies import PlainCopies, is_marked, mark_hook
from ._gather import ParamGatherer
from ._units import UnitPlan, runs

__all__ = ["register_forward_method", "register_param_waits"]


_WARN_AFTER = 3  # forwards after a step with units not run yet, before saying it costs overlap


@dataclass
class _UnitsNotRun:
    """The units whose forward has not run yet (places in the plan), shared by a model's hooks;
    while some remain, forwards after a step wait for them early (the root's counts them)."""

    places: set[int]
    names: dict[int, str]  # every unit's, by place
    num_early_waits: int = 0

    def note_early_wait(self) -> None:
        self.num_early_waits += 1
        if self.num_early_waits == _WARN_AFTER:
            shown = [self.names[place] for place in sorted(self.places)][:5]
            warnings.warn(
                f"zero-shard: units {shown} ({len(self.places)} in all) have not run in "
                f"{_WARN_AFTER} forwards after a step (their parent calls their children or "
                "reads their params itself, or they are idle): the modules above them wait for "
                "their params, so the gathers no longer overlap the forward before them. Pass "
                "wrap(units=...) modules that run, as one picks fully_shard targets",
                RuntimeWarning,
                stacklevel=3,
            )


class _WaitHook(CompileAwareHook):
    """A forward pre-hook: waits for the buckets ``own``, then for those of each unit below the
    module that has not run yet; a unit's (``unit``: its place in the plan) notes that it ran.
    Compiled code waits at a graph break, or not at all ([Note: compiled models])."""

    _gatherer: weakref.ref[ParamGatherer]  # weakly: the hooks must not keep the optimizer alive
    _own: list[int]  # buckets of the params of its subtree outside the units below it
    _below: list[tuple[int, list[int]]]  # (unit, its buckets) for each unit in its subtree
    _not_run: _UnitsNotRun  # shared by all hooks of the model
    _unit: int | None  # its place in the plan, where the module is a unit

    def __init__(
        self,
        gatherer: ParamGatherer,
        own: list[int],
        below: list[tuple[int, list[int]]],
        not_run: _UnitsNotRun,
        unit: int | None,
    ) -> None:
        super().__init__(gatherer)
        self._gatherer = weakref.ref(gatherer)
        self._own = own
        self._below = below
        self._not_run = not_run
        self._unit = unit

    def run(self, module: nn.Module, args: Any) -> None:
        not_run = self._not_run.places
        if not_run and self._unit is not None:
            not_run.discard(self._unit)
        gatherer = self._gatherer()
        if gatherer is None or not gatherer.pending:
            return
        if gatherer.wait_everything:  # [Note: params registered after wrap]
            gatherer.finish()
            return
        gatherer.wait_for(self._own)
        if not_run:
            if self._unit == 0:
                self._not_run.note_early_wait()
            for unit, indices in self._below:
                if unit in not_run:
                    gatherer.wait_for(indices)


@dataclass
class _Registrations:
    """What a wrapped model's param registrations are checked against: the optimizer's params,
    and each module's params at wrap, by name ([Note: params registered after wrap])."""

    gatherer: weakref.ref[ParamGatherer]
    held: set[int]  # ids of the params the optimizer gathers into
    at_wrap: dict[str, int]  # the module's params at wrap: name -> id
    model_name: str


_REGISTRATIONS: weakref.WeakKeyDictionary[nn.Module, list[_Registrations]] = (
    weakref.WeakKeyDictionary()
)  # one a wrapper over the module's model (two wrappers may hold disjoint params of one model)
_hook_installed = False


def _on_param_registered(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """torch's global hook on every param registration (``module.name = param``)."""
    for watched in _REGISTRATIONS.get(module, ()):
        if watched.at_wrap.get(name) == id(param) or id(param) not in watched.held:
            continue
        gatherer = watched.gatherer()
        if gatherer is None or gatherer.wait_everything:
            continue
        gatherer.wait_everything = True
        warnings.warn(
            f"zero-shard: a param of the optimizer was set as {name!r} of a "
            f"{type(module).__name__} in {watched.model_name} after wrap (weights tied after "
            "wrap?): the waits for gathered params were planned at wrap, so from now on each "
            "forward waits for every param's gather before it starts, and the gathers no longer "
            "overlap it. Tie or set params before wrap to keep the overlap",
            RuntimeWarning,
            stacklevel=4,
        )


def _watch_registrations(model: nn.Module, gatherer: ParamGatherer, held: set[int]) -> None:
    global _hook_installed
    if not _hook_installed:
        nn.modules.module.register_module_parameter_registration_hook(_on_param_registered)
        _hook_installed = True
    for module in model.modules():
        at_wrap = {name: id(p) for name, p in module._parameters.items() if p is not None}
        live = [w for w in _REGISTRATIONS.get(module, ()) if w.gatherer() is not None]
        live.append(_Registrations(weakref.ref(gatherer), held, at_wrap, type(model).__name__))
        _REGISTRATIONS[module] = live


def _while_pending(gatherer: ParamGatherer, action: Callable[[ParamGatherer], None]) -> Any:
    """A hook (any signature) that runs ``action`` on the gatherer while an update is pending."""
    this = weakref.ref(gatherer)

    def hook(module: nn.Module, *args: Any) -> None:
        gatherer = this()
        if gatherer is not None and gatherer.pending:
            action(gatherer)

    return mark_hook(hook)


def _subtree_waits(
    model: nn.Module, unit_of: dict[int, int]
) -> dict[int, tuple[set[int], list[int]]]:
    """Per module id: the ids of the params of its subtree outside the units below it, and
    those units (places in the plan), in module order."""
    found: dict[int, tuple[set[int], list[int]]] = {}

    def visit(module: nn.Module) -> tuple[set[int], list[int]]:
        if id(module) in found:
            return found[id(module)]
        params = {id(p) for p in module._parameters.values() if p is not None}
        units: list[int] = []
        for child in module.children():
            if id(child) in unit_of:
                units.append(unit_of[id(child)])
                continue
            child_params, child_units = visit(child)
            params |= child_params
            units += [u for u in child_units if u not in units]
        found[id(module)] = (params, units)
        return found[id(module)]

    for module in model.modules():  # the modules inside units too
        visit(module)
    return found


def register_param_waits(
    model: nn.Module,
    plan: UnitPlan,
    buckets: Sequence[Bucket],
    gatherer: ParamGatherer,
    *,
    overlap: bool,
) -> list[Any]:
    """Registers the hooks of the module docstring on ``model``; returns their handles."""
    bucket_of = {id(s.param): index for index, b in enumerate(buckets) for s in b.params}

    def indices_of(param_ids: Any) -> list[int]:
        return sorted({bucket_of[pid] for pid in param_ids if pid in bucket_of})

    unit_indices = [indices_of(unit.param_ids) for unit in plan.units]
    unit_of = {id(unit.module): place for place, unit in enumerate(plan.units) if place}
    names = {place: unit.name for place, unit in enumerate(plan.units)}
    not_run = _UnitsNotRun(set(range(1, len(plan.units))), names)
    waits = _subtree_waits(model, unit_of)
    registered = any(isinstance(v, types.MethodType) and isinstance(v.__func__, _ForwardMethod)
                     for v in vars(model).values())  # fmt: skip
    if overlap and unit_indices[0] and not runs(model) and not registered:
        warnings.warn(
            f"zero-shard: {type(model).__name__} has no forward of its own and holds params "
            "outside its repeated blocks: with the gathers overlapped, nothing waits for those "
            "before the methods the training loop calls read them. Register each such method "
            "(zero_shard.register_forward_method(model, 'loss')), or pass "
            "overlap_param_gather=False",
            RuntimeWarning,
            stacklevel=4,
        )
    _watch_registrations(model, gatherer, set(bucket_of))
    handles = []
    for module in model.modules():
        place = 0 if module is model else unit_of.get(id(module))
        if place is not None and place > 0:
            own, below = unit_indices[place], []
        else:
            param_ids, units = waits[id(module)]
            own = unit_indices[0] if module is model else indices_of(param_ids)
            below = [(u, unit_indices[u]) for u in units if unit_indices[u]]
        # The root's, even without a forward: a registered method runs it.
        if (own or below) and (runs(module) or module is model):
            hook = _WaitHook(gatherer, own, below, not_run, place)
            handles.append(module.register_forward_pre_hook(hook, prepend=True))
    finish = _while_pending(gatherer, ParamGatherer.finish)
    handles.append(model.register_forward_hook(CompileAwareHook.of(finish, gatherer)))
    before_state_dict = _while_pending(gatherer, ParamGatherer.flush)
    for module in model.modules():
        handles.append(module.register_state_dict_pre_hook(before_state_dict))
        handles.append(module.register_load_state_dict_pre_hook(before_state_dict))
    handles.append(PlainCopies(model.modules(), before=before_state_dict))
    return handles


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` wait, before it runs, for the params ``module``'s forward
    waits for, and after it as its forward does, as torch's ``register_fsdp_forward_method`` does
    for FSDP2.

    With the gathers overlapped (the default), the params are waited for by the modules' forward
    pre-hooks. A model entered through another method (``model.encode_text(...)``,
    ``model.loss(x, y)``) runs no hook of its own: params it reads itself before any submodule
    runs (CLIP's ``self.logit_scale``, an input scale) would be read before their update lands.
    Register such methods, before or after ``wrap``; on a module without zero-shard's hooks the
    method runs as it is.

    Args:
        module: the module whose method it is (the model, usually).
        method_name: the method's name.

    Raises:
        ValueError: if ``module`` has no method ``method_name``.

    Example::

        zero_shard.register_forward_method(model, "encode_text")
    """
    method = getattr(type(module), method_name, None)
    if not callable(method):
        raise ValueError(
            f"{type(module).__name__} has no method {method_name!r} to register (got "
            f"{type(method).__name__}): pass the name of a method the training loop calls"
        )
    # Bound to the module, so that a deep copy (an EMA model) calls its own copy's method.
    setattr(module, method_name, types.MethodType(_ForwardMethod(method), module))


class _ForwardMethod:
    """A module's method that runs zero-shard's forward pre-hooks of the module before it and
    its forward hooks after it, as ``module(...)`` would; marked as zero-shard's, so that copies
    of the model (which leave zero-shard's hooks out) call the class's method."""

    _method: Callable[..., Any]  # the class's function

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method
        functools.update_wrapper(self, method)
        mark_hook(self)

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with_kwargs = module._forward_pre_hooks_with_kwargs
        for key, hook in list(module._forward_pre_hooks.items()):
            if is_marked(hook):
                hook(module, args, kwargs) if key in with_kwargs else hook(module, args)
        out = self._method(module, *args, **kwargs)
        with_kwargs = module._forward_hooks_with_kwargs
        for key, hook in list(module._forward_hooks.items()):
            if is_marked(hook):
                hook(module, args, kwargs, out) if key in with_kwargs else hook(module, args, out)
        return out
