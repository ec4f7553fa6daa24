"""torch's optimizer state-dict hooks, run around an optimizer's own ``state_dict`` and
``load_state_dict`` as ``torch.optim.Optimizer``'s run them.

An optimizer that overrides those methods skips the hooks users register on it
(``register_state_dict_pre_hook``, ``register_state_dict_post_hook``,
``register_load_state_dict_pre_hook``, ``register_load_state_dict_post_hook``) unless it runs
them itself. The hook tables are private attributes of ``torch.optim.Optimizer`` (the same names
since torch 2.1; read here with a default, so a torch without them runs none).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["load_state_dict_with_hooks", "share_state_dict_hooks", "state_dict_with_hooks"]

_TABLES = (
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def _hooks(optimizer: torch.optim.Optimizer, table: str) -> list[Callable[..., Any]]:
    # A snapshot, as torch's loops see the table as it was when they started.
    return list(getattr(optimizer, table, {}).values())


def state_dict_with_hooks(
    optimizer: torch.optim.Optimizer, build: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``build()`` between the optimizer's state-dict hooks: each pre-hook gets the optimizer
    first; each post-hook gets (optimizer, state dict) and may return a new state dict.

    Args:
        optimizer: the optimizer whose state-dict hooks run (``register_state_dict_pre_hook``,
            ``register_state_dict_post_hook``); each hook is given it.
        build: called with no arguments, returns the state dict.
    """
    for pre_hook in _hooks(optimizer, "_optimizer_state_dict_pre_hooks"):
        pre_hook(optimizer)
    state_dict = build()
    for post_hook in _hooks(optimizer, "_optimizer_state_dict_post_hooks"):
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_state_dict_with_hooks(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """``load(state_dict)`` between the optimizer's load hooks: each pre-hook gets (optimizer,
    a shallow copy of ``state_dict``) and may return the state dict to load instead; each
    post-hook gets the optimizer once it is loaded.

    Args:
        optimizer: the optimizer whose load hooks run (``register_load_state_dict_pre_hook``,
            ``register_load_state_dict_post_hook``); each hook is given it.
        state_dict: the state dict to load; the pre-hooks get a shallow copy of it.
        load: called once with the state dict the pre-hooks leave; loads it.
    """
    loaded = dict(state_dict)  # shallow, as torch copies it
    for pre_hook in _hooks(optimizer, "_optimizer_load_state_dict_pre_hooks"):
        result = pre_hook(optimizer, loaded)
        if result is not None:
            loaded = result
    load(loaded)
    for post_hook in _hooks(optimizer, "_optimizer_load_state_dict_post_hooks"):
        post_hook(optimizer)


class _RefuseWrappedStateDict:
    """A state-dict pre-hook of a wrapped torch optimizer, first among its own: refuses its
    ``state_dict()`` while its latest wrapper lives. The wrapper holds the params' state, and
    this optimizer's is empty: its state dict would save no state, silently (a checkpoint
    written through a reference kept from before the wrap). The table is shared with the
    wrapper, whose own ``state_dict`` passes."""

    _wrapped: weakref.ref[torch.optim.Optimizer]
    _wrapper: weakref.ref[torch.optim.Optimizer]

    def __init__(self, wrapped: torch.optim.Optimizer, wrapper: torch.optim.Optimizer) -> None:
        self._wrapped = weakref.ref(wrapped)
        self._wrapper = weakref.ref(wrapper)

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        wrapper = self._wrapper()
        if optimizer is self._wrapped() and wrapper is not None:
            name = type(optimizer).__name__
            raise RuntimeError(
                f"state_dict() was called on the {name} that a {type(wrapper).__name__} wraps: "
                f"the wrapper holds the params' optimizer state, and this {name}'s is empty, so "
                "its state dict would hold no state. Call state_dict() on the optimizer that "
                "wrap returned (and hand that one to checkpoint.save and to the libraries that "
                "save it)"
            )


def share_state_dict_hooks(wrapper: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> None:
    """Makes ``wrapper`` run ``wrapped``'s state-dict and load hooks, those registered later
    included (the tables are shared: private attributes of ``torch.optim.Optimizer``), as it
    runs its step hooks; and refuses ``wrapped.state_dict()`` while ``wrapper`` lives.

    Args:
        wrapper: the optimizer that holds the state in ``wrapped``'s place (``zero_shard.wrap``'s,
            ``HybridDeviceOptimizer.wrap``'s); it takes ``wrapped``'s hook tables.
        wrapped: the user's torch optimizer that ``wrapper`` wraps.
    """
    table = getattr(wrapped, _TABLES[0], None)
    if table is None:  # a torch without the tables: no hooks to share
        return
    refusal = next((h for h in table.values() if isinstance(h, _RefuseWrappedStateDict)), None)
    if refusal is None:
        wrapped.register_state_dict_pre_hook(
            _RefuseWrappedStateDict(wrapped, wrapper), prepend=True
        )
    else:  # wrapped again: the new wrapper's life decides
        refusal._wrapper = weakref.ref(wrapper)
    for name in _TABLES:
        setattr(wrapper, name, getattr(wrapped, name))
