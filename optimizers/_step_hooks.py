"""torch's optimizer step hooks, run once around the step of the optimizer the user holds.

torch runs the hooks of ``register_optimizer_step_pre_hook`` / ``_post_hook`` (global) and of an
optimizer's ``register_step_pre_hook`` / ``_post_hook`` around every ``Optimizer.step``, through a
wrapper it puts once on each optimizer class's ``step`` (``Optimizer.profile_hook_step``, marked
``hooked``, the function it wraps in ``__wrapped__``). The hybrid steps sub-optimizers of its own:
their steps are parts of the one step the user called, and run without that wrapper. A wrapper
of a user's optimizer (``zero_shard.wrap``, ``HybridDeviceOptimizer.wrap``) takes over its step
hooks: registered on either, they run around the wrapper's step, given the wrapper.

An optimizer class whose ``step`` calls its parent's (``super().step()``) runs the parent's
wrapper too, as in torch, where its hooks run twice a step.

Once wrapped, the user's optimizer holds no state for its params (the wrapper took it over), and
its own ``step`` would update them a second time from empty state: a pre-hook put first in the
shared table refuses that step, before anything changes (``_RefuseWrappedStep``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer  # (its global hook tables are private)

__all__ = ["has_step_post_hooks", "share_step_hooks", "step_unhooked", "unhooked"]

# The code of torch's wrapper: every class's wrapped step runs it (a decorator that copied the
# ``hooked`` mark with functools.wraps has code of its own, and is run as it is).
_TORCH_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def unhooked(function: Any) -> Any:
    """``function`` without torch's step-hook wrapper: a class's ``step`` is wrapped when its
    first instance is built, so two classes run the same step where their unhooked ones are the
    same function, whichever of them was built first."""
    while getattr(function, "__code__", None) is _TORCH_WRAPPER and hasattr(
        function, "__wrapped__"
    ):
        function = function.__wrapped__
    return function


def step_unhooked(optimizer: torch.optim.Optimizer) -> None:
    """Steps one of the hybrid's own sub-optimizers without torch's step-hook wrapper."""
    step = type(optimizer).step
    if getattr(step, "__code__", None) is _TORCH_WRAPPER and hasattr(step, "__wrapped__"):
        step.__wrapped__(optimizer)
    else:
        optimizer.step()


class _RefuseWrappedStep:
    """A step pre-hook that refuses the step of the optimizer a wrapper took over (given that
    optimizer: torch hands a hook the optimizer whose ``step`` runs) while that wrapper lives,
    and lets the wrapper's step, which shares the hook, go on. Once the wrapper is gone, the
    optimizer steps as a torch optimizer again (from the state it holds: none, the wrapper took
    it over)."""

    _wrapped: weakref.ref[torch.optim.Optimizer]
    _wrapper: weakref.ref[torch.optim.Optimizer]  # the latest wrapper of ``_wrapped``

    def __init__(self, wrapped: torch.optim.Optimizer, wrapper: torch.optim.Optimizer) -> None:
        self._wrapped = weakref.ref(wrapped)
        self._wrapper = weakref.ref(wrapper)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        wrapper = self._wrapper()
        if optimizer is self._wrapped() and wrapper is not None:
            name = type(optimizer).__name__
            raise RuntimeError(
                f"step() was called on the {name} that a {type(wrapper).__name__} wraps: the "
                f"wrapper steps its params and holds their optimizer state now, and this {name}'s "
                "step would update them a second time from empty state. Call step() on the "
                "optimizer that wrap returned (hand that one to the training loop, the "
                "scheduler and the libraries that step it). Nothing was stepped"
            )


def share_step_hooks(wrapper: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> None:
    """Makes ``wrapper`` run ``wrapped``'s step hooks, those registered later included: the
    tables are shared (private attributes of ``torch.optim.Optimizer``, the same since torch
    2.0); and refuses ``wrapped.step()`` while ``wrapper`` lives, before its other hooks run.

    Args:
        wrapper: the optimizer that steps in ``wrapped``'s place (``zero_shard.wrap``'s,
            ``HybridDeviceOptimizer.wrap``'s); it takes ``wrapped``'s hook tables.
        wrapped: the user's torch optimizer that ``wrapper`` wraps.
    """
    table = wrapped._optimizer_step_pre_hooks
    refusal = next((h for h in table.values() if isinstance(h, _RefuseWrappedStep)), None)
    if refusal is None:
        handle = wrapped.register_step_pre_hook(_RefuseWrappedStep(wrapped, wrapper))
        table.move_to_end(handle.id, last=False)
    else:  # wrapped again: the new wrapper's life decides
        if refusal._wrapper() is None and not wrapped.state:
            warnings.warn(
                f"this {type(wrapped).__name__} was wrapped before, and its wrapper, which held "
                "its optimizer state, is gone: the new wrapper starts from no state, as a new "
                "torch optimizer would. To keep the state, wrap it again while the old wrapper "
                "is alive (the new wrapper takes the state over), or load the state into the "
                "new wrapper (load_state_dict)",
                RuntimeWarning,
                stacklevel=4,
            )
        refusal._wrapper = weakref.ref(wrapper)
    wrapper._optimizer_step_pre_hooks = table
    wrapper._optimizer_step_post_hooks = wrapped._optimizer_step_post_hooks


def has_step_post_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch runs post-hooks after ``optimizer``'s step: its own or global ones."""
    return bool(
        getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    )
