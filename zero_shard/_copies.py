"""Pickles and deep copies of a wrapped model are plain torch models.

[Note: plain copies]
Users copy models: ``copy.deepcopy(model)`` for an EMA or ``AveragedModel``, ``torch.save(model)``
for a whole-model checkpoint. zero-shard's hooks on the model's modules are not the copy's to
run (they wait for gathers into the original's params) and cannot be pickled (they hold the
optimizer weakly). So each module zero-shard hooks gets an instance attribute ``__reduce_ex__``,
which ``pickle`` and ``copy.deepcopy`` look up on the instance before the class: it reduces the
module as its class would, then drops from the state every hook marked as zero-shard's (and
itself). The copy is the module with the user's own hooks, and its pickle names nothing of
zero-shard's, so it loads where zero-shard is not installed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn

__all__ = ["PlainCopies", "is_marked", "mark_hook"]

_MARK = "_zero_shard_hook"
_REDUCE = "__reduce_ex__"

H = TypeVar("H")


def mark_hook(hook: H) -> H:
    """Marks ``hook`` (a function or callable object) as zero-shard's: copies leave it out."""
    setattr(hook, _MARK, True)
    return hook


def is_marked(value: Any) -> bool:
    """Whether ``value`` is marked as zero-shard's (``mark_hook``)."""
    try:
        return getattr(value, _MARK, False) is True
    except Exception:  # an object whose __getattr__ raises something else
        return False


def _without_marked(state: dict[str, Any]) -> dict[str, Any]:
    """The module state without zero-shard's hooks (hook dicts are keyed by handle id)."""
    plain = {}
    for key, value in state.items():
        if key == _REDUCE or is_marked(value):  # a hook, or a method registered to wait
            continue
        if isinstance(value, dict) and any(is_marked(v) for v in value.values()):
            value = type(value)((k, v) for k, v in value.items() if not is_marked(v))
        plain[key] = value
    return plain


class _PlainReduce:
    """A module's ``__reduce_ex__``: its class's, less zero-shard's hooks, once ``before(module)``
    made the params current."""

    _module: weakref.ref[nn.Module]  # weakly: the module holds this, no cycle keeps it alive
    _before: Callable[[nn.Module], None]  # waits for the gathers into the module's params

    def __init__(self, module: nn.Module, before: Callable[[nn.Module], None]) -> None:
        self._module = weakref.ref(module)
        self._before = before

    def __call__(self, protocol: int) -> Any:
        module = self._module()
        if module is None:
            raise AssertionError("expected the module this reduce belongs to, got a dead ref")
        self._before(module)
        reduced = type(module).__reduce_ex__(module, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 2 and isinstance(reduced[2], dict):
            reduced = (*reduced[:2], _without_marked(reduced[2]), *reduced[3:])
        return reduced


class PlainCopies:
    """Makes pickles and deep copies of ``modules`` plain ([Note: plain copies]), of their params
    once ``before(module)`` returns (it waits for the gathers in flight); a hook handle of sorts:
    ``remove()`` gives the modules their class's reduce back."""

    _reduces: list[tuple[weakref.ref[nn.Module], _PlainReduce]]  # each module's, set by this

    def __init__(
        self, modules: Iterable[nn.Module], *, before: Callable[[nn.Module], None]
    ) -> None:
        self._reduces = []
        for module in modules:
            # It leaves out every wrapper's hooks, not only this one's.
            reduce = _PlainReduce(module, before)
            module.__dict__[_REDUCE] = reduce
            self._reduces.append((weakref.ref(module), reduce))

    def remove(self) -> None:
        for ref, reduce in self._reduces:
            module = ref()
            if module is not None and module.__dict__.get(_REDUCE) is reduce:
                del module.__dict__[_REDUCE]
