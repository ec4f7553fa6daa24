"""Which live ZeroShardOptimizer shards each param: a param sharded by two would be trained by
neither (the first one's hooks take its grads away from the second), so a new wrap over a param
takes it over, retiring the wrapper that held it (as a new torch optimizer replaces an old one)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["claim", "is_claimed", "live_owners"]

# id(param) -> (the param, the wrapper that shards it), both weakly: a dropped wrapper or param
# frees its entries. A registry across wrappers, not one wrapper's state, so keyed by identity
# (a WeakKeyDictionary would compare tensors with ==, elementwise).
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}


def _owner(param: torch.Tensor) -> Any:
    entry = _OWNERS.get(id(param))
    if entry is None:
        return None
    held, owner = entry[0](), entry[1]()
    if held is not param or owner is None:
        del _OWNERS[id(param)]
        return None
    return owner


def is_claimed(param: torch.Tensor) -> bool:
    """Whether a live ZeroShardOptimizer shards ``param``."""
    return _owner(param) is not None


def live_owners(params: Sequence[torch.Tensor]) -> list[Any]:
    """The live ZeroShardOptimizers that shard any of ``params``, in the order first met."""
    owners: list[Any] = []
    for param in params:
        owner = _owner(param)
        if owner is not None and all(owner is not known for known in owners):
            owners.append(owner)
    return owners


def claim(params: Iterable[torch.Tensor], owner: Any) -> None:
    """Records ``owner`` as the wrapper that shards ``params``."""
    owner_ref = weakref.ref(owner)
    for param in params:
        _OWNERS[id(param)] = (weakref.ref(param), owner_ref)
