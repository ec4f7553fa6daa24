"""The model hooks that wait for gathered params: they wait, and never issue a collective.

- Each unit's forward pre-hook waits for every bucket holding a param its subtree may read
  ([Note: units] in ``_units.py``). It runs before the module's own pre-hooks (``prepend``), so
  a hook that computes a weight from params (``torch.nn.utils.weight_norm``) reads gathered ones.
- Every other module that owns params waits for its own before its forward: the unit's wait has
  covered them when the module runs inside its unit; this catches a submodule called on its own
  (``model.head(h)`` outside ``model(...)``).
- Every module's ``state_dict`` and ``load_state_dict`` wait for all buckets: a save reads the
  latest weights (on rank 0 alone, too), and a load lands on top of them. A delayed update still
  deferred is applied first (it runs on one process: that communicates nothing).
- The root's forward hook waits for all buckets when its forward ends, also those of modules it
  did not run: the next backward writes grads that the last step's CPU share may still be
  copying to the host until its step is complete ([Note: deferred host step]).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ._buckets import Bucket
from ._gather import ParamGatherer
from ._units import UnitPlan, direct_params

__all__ = ["register_param_waits"]


def _wait_hook(gatherer: ParamGatherer, indices: list[int]) -> Any:
    this = weakref.ref(gatherer)  # the hooks must not keep the optimizer alive

    def before_forward(module: nn.Module, args: Any) -> None:
        gatherer = this()
        if gatherer is not None and gatherer.pending:
            gatherer.wait_for(indices)

    return before_forward


def _while_pending(gatherer: ParamGatherer, action: Callable[[ParamGatherer], None]) -> Any:
    """A hook (any signature) that runs ``action`` on the gatherer while an update is pending."""
    this = weakref.ref(gatherer)

    def hook(module: nn.Module, *args: Any) -> None:
        gatherer = this()
        if gatherer is not None and gatherer.pending:
            action(gatherer)

    return hook


def register_param_waits(
    model: nn.Module, plan: UnitPlan, buckets: Sequence[Bucket], gatherer: ParamGatherer
) -> list[Any]:
    """Registers the hooks of the module docstring on ``model``; returns their handles."""
    bucket_of = {id(s.param): index for index, b in enumerate(buckets) for s in b.params}

    def indices_of(param_ids: Any) -> list[int]:
        return sorted({bucket_of[pid] for pid in param_ids if pid in bucket_of})

    handles = []
    units = {id(unit.module) for unit in plan.units}
    for unit in plan.units:
        indices = indices_of(unit.param_ids)
        if indices:
            hook = _wait_hook(gatherer, indices)
            handles.append(unit.module.register_forward_pre_hook(hook, prepend=True))
    for module in model.modules():
        if id(module) in units:
            continue
        indices = indices_of(id(p) for p in direct_params(module))
        if indices:
            hook = _wait_hook(gatherer, indices)
            handles.append(module.register_forward_pre_hook(hook, prepend=True))
    handles.append(model.register_forward_hook(_while_pending(gatherer, ParamGatherer.finish)))
    before_state_dict = _while_pending(gatherer, ParamGatherer.flush)
    for module in model.modules():
        handles.append(module.register_state_dict_pre_hook(before_state_dict))
        handles.append(module.register_load_state_dict_pre_hook(before_state_dict))
    return handles
