"""zero-shard's forward hooks in code that ``torch.compile`` traces.

[Note: compiled models]
Dynamo traces a compiled module's forward hooks into its compiled code: those of the compiled
module and of every module inside it, for ``torch.compile(model)``, ``model.compile()`` and a
block's ``compile()`` alike (only hooks of modules outside the compiled one run eagerly around
it). Hooks added after a module's first compiled call may go unseen (Dynamo does not guard on
the hooks of the modules inside: ``torch._dynamo.config.skip_nnmodule_hook_guards``), so wrap
before the first call of a compiled model.

zero-shard's forward hooks wait on the host for params that another thread gathers after
``step()`` (``overlap_param_gather=True``): nothing a graph can hold. What the trace of such a
hook does depends on whether the compile allows graph breaks, which it asks at trace time
(``_trace_time_choice``, run for real while Dynamo traces, its answer a constant of the graph):

- Breaks allowed (the default ``fullgraph=False``): the hook is a call Dynamo skips. The graph
  breaks there, the hook runs eagerly at run time, and the code after it, which reads the
  params, is compiled on its own. The gathers and the CPU's share of the step still overlap the
  forward, but the compiled code is cut at every module zero-shard waits in: small graphs.
- No breaks (``fullgraph=True``, ``torch._dynamo.error_on_graph_break``): the trace itself waits
  for the gathers in flight, and turns the overlap off for good (``ParamGatherer.stop_overlap``):
  from then on ``step()`` returns with every param gathered, as with
  ``overlap_param_gather=False``, so the hooks have nothing to wait for and are left out of the
  graph. The first compiled call runs on current params because Dynamo traces before it runs
  the graph; every later one because ``step()`` no longer returns early. Whole graphs, torch's
  result; the price is the overlap of the gathers (and of the CPU's share) with the forward.

Without overlap the hooks are left out of the compiled code, breaks allowed or not. What the
root's pre-hook of a plain model does besides (freeing the reduced grads that
``model.zero_grad()`` cleared, forgetting a backward that raised midway) then does not run
before a compiled root's forward: the cleared grads stay until the next reduction rewrites
them, and after a backward that raised, call ``opt.zero_grad()`` before going on.

A compiled function that runs backward and ``step()`` itself (a whole train step) has Dynamo
trace what its eager parts call too: the backward's grad hooks, ``step()``. Those do bucket work
(copies into aliased buffers, the host's share) that inductor cannot trace; so ``step()``, a
bucket's reduction and the end of backward run eagerly (``torch.compiler.disable``), and the
per-param hooks, which only note a grad, stay traceable.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ._copies import mark_hook

__all__ = ["CompileAwareHook", "Overlapping"]

_BREAK_REASON = (
    "zero-shard's forward hooks wait here for the params that step() gathers in the background "
    "(overlap_param_gather=True): the graph breaks and the hook runs eagerly"
)


class Overlapping(Protocol):
    """What the hooks ask of the gatherer: whether gathers may be in flight when they run."""

    overlap: bool

    def stop_overlap(self) -> None:
        """Waits for the gathers in flight; later steps return with the params gathered."""


def _run_eagerly(hook: Callable[..., Any], *args: Any) -> Any:
    return hook(*args)


# Skipped by Dynamo: a graph break, and an eager call at run time ([Note: compiled models]).
_run_eagerly_skipped = torch.compiler.disable(_run_eagerly, reason=_BREAK_REASON)


def _breaks_allowed() -> bool:
    """Whether the compile being traced allows graph breaks; where torch does not say, no."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # a torch without this internal: the choice that is exact either way
        return False
    return not (getattr(tx, "one_graph", True) or getattr(tx, "error_on_graph_break", False))


def _trace_time_choice(gatherer: weakref.ref[Overlapping]) -> Callable[[], bool]:
    """A function that Dynamo runs while tracing (``assume_constant_result``): True where the
    hook must break the graph to wait; otherwise it stops the overlap if it was on, and the
    hook is left out. See [Note: compiled models]."""

    def must_break() -> bool:
        alive = gatherer()
        if alive is None or not alive.overlap:
            return False
        if _breaks_allowed():
            return True
        alive.stop_overlap()
        return False

    return torch.compiler.assume_constant_result(must_break)


class CompileAwareHook:
    """A forward hook (pre or post, any signature) run as [Note: compiled models] says: ``run``
    as it is in eager code; in compiled code through a graph break where the gathers overlap
    the forward and breaks are allowed, else not at all. Subclasses define ``run``; :meth:`of`
    wraps a function."""

    _must_break: Callable[[], bool]  # asked at trace time: a constant of the compiled code

    def __init__(self, gatherer: Overlapping) -> None:
        self._must_break = _trace_time_choice(weakref.ref(gatherer))
        mark_hook(self)

    def run(self, *args: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.run(*args)
        if self._must_break():
            return _run_eagerly_skipped(self.run, *args)
        return None

    @staticmethod
    def of(hook: Callable[..., Any], gatherer: Overlapping) -> CompileAwareHook:
        """``hook`` (a function) run as the class says."""
        return _FunctionHook(hook, gatherer)


class _FunctionHook(CompileAwareHook):
    _hook: Callable[..., Any]  # the eager hook

    def __init__(self, hook: Callable[..., Any], gatherer: Overlapping) -> None:
        super().__init__(gatherer)
        self._hook = hook

    def run(self, *args: Any) -> Any:
        return self._hook(*args)
