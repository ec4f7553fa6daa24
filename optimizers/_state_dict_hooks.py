"""torch's optimizer state-dict hooks, run around an optimizer's own ``state_dict`` and
``load_state_dict`` as ``torch.optim.Optimizer``'s run them.

An optimizer that overrides those methods skips the hooks users register on it
(``register_state_dict_pre_hook``, ``register_state_dict_post_hook``,
``register_load_state_dict_pre_hook``, ``register_load_state_dict_post_hook``) unless it runs
them itself. The hook tables are private attributes of ``torch.optim.Optimizer`` (the same names
since torch 2.1; read here with a default, so a torch without them runs none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["load_state_dict_with_hooks", "state_dict_with_hooks"]


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
