"""zero-shard's forward hooks in code that ``torch.compile`` traces.

[Note: compiled models]
Dynamo traces a compiled module's forward hooks into its compiled code: those of the compiled
module and of every module inside it, for ``torch.compile(model)``, ``model.compile()`` and a
block's ``compile()`` alike (only hooks of modules outside the compiled one run eagerly around
it). Hooks added after a module's first compiled call may go unseen (Dynamo does not guard on
the hooks of the modules inside: ``torch._dynamo.config.skip_nnmodule_hook_guards``), so wrap
before the first call of a compiled model.

zero-shard's forward hooks wait on the host for params that another thread gathers after
``step()`` (``overlap_param_gather=True``): nothing a graph can hold. So where the gathers
overlap the forward, each hook is a call Dynamo skips: the graph breaks there, the hook runs
eagerly at run time, and the code after it, which reads the params, is compiled on its own. The
result is torch's, and the gathers and the CPU's share of the step still overlap the forward,
but the compiled code is cut at every module zero-shard waits in (each module holding params):
small graphs. ``fullgraph=True`` refuses the breaks, with an error that names the fix
(``_BREAK_REASON``).

Without overlap (``overlap_param_gather=False``) every param is current once ``step()`` has
returned, so the hooks have nothing to wait for and are left out of the compiled code: whole
graphs, and ``fullgraph=True`` works. What the root's pre-hook of a plain model does besides
(freeing the reduced grads that ``model.zero_grad()`` cleared, forgetting a backward that raised
midway) then does not run before a compiled root's forward: the cleared grads stay until the
next reduction rewrites them, and after a backward that raised, call ``opt.zero_grad()`` before
going on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._copies import mark_hook

__all__ = ["CompileAwareHook"]

_BREAK_REASON = (
    "zero-shard's forward hooks wait here for the params that step() gathers in the background "
    "(overlap_param_gather=True), which compiled code cannot do: the graph breaks and the hook "
    "runs eagerly. fullgraph=True allows no break: build the optimizer with "
    "zero_shard.wrap(..., overlap_param_gather=False) (step() then returns with the params "
    "gathered, and the hooks stay out of the compiled code), or compile with fullgraph=False"
)


def _run_eagerly(hook: Callable[..., Any], *args: Any) -> Any:
    return hook(*args)


# Skipped by Dynamo: a graph break, and an eager call at run time ([Note: compiled models]).
_run_eagerly_skipped = torch.compiler.disable(_run_eagerly, reason=_BREAK_REASON)


class CompileAwareHook:
    """A forward hook (pre or post, any signature) run as [Note: compiled models] says: ``run``
    as it is in eager code; in compiled code through a graph break where the gathers overlap
    the forward, else not at all. Subclasses define ``run``; :meth:`of` wraps a function."""

    _overlap: bool  # gathers may be in flight when it runs: compiled code must break to wait

    def __init__(self, *, overlap: bool) -> None:
        self._overlap = overlap
        mark_hook(self)

    def run(self, *args: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.run(*args)
        if self._overlap:
            return _run_eagerly_skipped(self.run, *args)
        return None

    @staticmethod
    def of(hook: Callable[..., Any], *, overlap: bool) -> CompileAwareHook:
        """``hook`` (a function) run as the class says."""
        return _FunctionHook(hook, overlap=overlap)


class _FunctionHook(CompileAwareHook):
    _hook: Callable[..., Any]  # the eager hook

    def __init__(self, hook: Callable[..., Any], *, overlap: bool) -> None:
        super().__init__(overlap=overlap)
        self._hook = hook

    def run(self, *args: Any) -> Any:
        return self._hook(*args)
