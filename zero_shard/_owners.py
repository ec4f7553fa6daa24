"""Which live ZeroShardOptimizer shards each param: a param sharded by two is trained by neither
(the first one's hooks take its grads away from the second), so the second wrap is refused."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["check_unclaimed", "claim", "is_claimed"]

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


def check_unclaimed(named_params: Sequence[tuple[torch.Tensor, str]]) -> None:
    """Raises if a live ZeroShardOptimizer shards one of the params already."""
    if not any(_owner(param) is not None for param, _ in named_params):
        return
    gc.collect()  # a wrapper the user dropped may live on in a reference cycle until collected
    for param, fqn in named_params:
        if _owner(param) is not None:
            raise RuntimeError(
                f"param {fqn!r} is already sharded by a live ZeroShardOptimizer (the same "
                "optimizer or model wrapped twice?): one wrapper per param, or neither trains "
                "it. Keep using the first wrapper, or drop every reference to it (del opt) "
                "before wrapping again"
            )


def claim(params: Iterable[torch.Tensor], owner: Any) -> None:
    """Records ``owner`` as the wrapper that shards ``params``."""
    owner_ref = weakref.ref(owner)
    for param in params:
        _OWNERS[id(param)] = (weakref.ref(param), owner_ref)
