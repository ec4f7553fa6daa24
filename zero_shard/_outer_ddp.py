"""A ``DistributedDataParallel`` wrapped around a plain model after ``zero_shard.wrap``.

[Note: DDP around a wrapped model]
HF Trainer and accelerate build the optimizer first and wrap the model in DDP afterwards
(``accelerator.prepare``) whenever they run on more than one process. zero-shard already
reduces a plain model's grads over the ranks; DDP's reducer would reduce them a second time,
reading the placeholders zero-shard leaves in ``.grad``. When such a DDP runs the model, the
model's forward hook turns DDP's gradient sync off (``require_backward_grad_sync``: what
``DDP.no_sync()`` sets, and restores to the value it found), before DDP's forward ends and
arms its reducer for backward: the grads then reach zero-shard alone, as they would without
DDP. A hook on DDP itself, run when its forward ends (raised or not), puts the flag back, so the
user's ``no_sync()`` finds and restores its own value; DDP's first forward runs without it (a
module with no hooks when its call starts runs none), so in that one the flag is turned off and
back on around DDP's ``_post_forward`` alone, shadowed on the instance until it has run once
(a forward that raises before it leaves the flag as it was). What the flag said is DDP's
decision for this forward's backward: inside the user's ``no_sync()`` (accelerate's
``accumulate()``, Trainer's accumulation) it was off. zero-shard reduces that backward's grads
all the same, so that they are held as shards (the memory zero-shard saves), and the step is
DDP's; but until a forward outside ``no_sync()``, DDP's ``.grad`` would hold each rank's own
grads, which zero-shard no longer has: reads of the placeholders (torch's clip, a norm) raise
there instead of giving other numbers. A copy of the DDP (pickled) gets a hook that does
nothing. DDP still broadcast the params from its first rank when it was built, as zero-shard did
at wrap; with its sync off it broadcasts no buffers either, as zero-shard alone does. A DDP
built with ``static_graph=True`` is told its first backward's reduction of every grad was
queued already. Only a DDP whose reduced params are all zero-shard's is quieted: a param
another optimizer steps needs DDP's reduction, and keeps it (the placeholders then raise a
clear error if DDP reads them). Where two wrappers share the model's params out, the hook of
the one holding DDP's first param quiets it. When the hook goes (the optimizer retired by a
later wrap, or collected), the DDPs it quieted get their sync back. Compiled code leaves the check out: a
compiled root under such a DDP meets that error.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import _JoinConfig

from ._copies import mark_hook
from ._owners import is_claimed

__all__ = ["register_outer_ddp_check"]

logger = logging.getLogger("zero_shard")


class _QuietOuterDDP:
    """The model's forward hook of [Note: DDP around a wrapped model]."""

    _model: weakref.ref[nn.Module]
    _param_ids: frozenset[int]  # the params zero-shard reduces
    _seen: weakref.WeakKeyDictionary[nn.Module, bool]  # per DDP: whether zero-shard owns it
    _quieted: weakref.WeakKeyDictionary[nn.Module, bool]  # the DDPs this hook turned off, and
    #                                                       whether a static graph's first
    #                                                       reduction was queued before
    _ends: weakref.WeakKeyDictionary[nn.Module, Any]  # per quieted DDP: its forward hook's handle
    _flags: weakref.WeakKeyDictionary[nn.Module, bool]  # per DDP in its forward: the flag found
    _on_forward: Callable[[bool], None]  # told, at each forward under an owned DDP, whether DDP
    #                                      would sync its backward (False inside its no_sync)

    def __init__(
        self, model: nn.Module, params: Iterable[torch.Tensor], on_forward: Callable[[bool], None]
    ) -> None:
        self._model = weakref.ref(model)
        self._param_ids = frozenset(id(p) for p in params)
        self._seen = weakref.WeakKeyDictionary()
        self._quieted = weakref.WeakKeyDictionary()
        self._ends = weakref.WeakKeyDictionary()
        self._flags = weakref.WeakKeyDictionary()
        self._on_forward = on_forward
        mark_hook(self)

    def restore(self) -> None:
        """Gives the DDPs quieted so far their gradient sync back."""
        for ddp, queued in list(self._quieted.items()):
            ddp.require_backward_grad_sync = True
            if ddp.static_graph:
                ddp._static_graph_delay_allreduce_enqueued = queued
        for ddp, handle in self._ends.items():
            handle.remove()
            ddp.__dict__.pop("_post_forward", None)
        self._quieted.clear()
        self._ends.clear()
        self._flags.clear()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        ddp = nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is None:
            return
        owned = self._seen.get(ddp)
        if owned is None:
            owned = self._seen[ddp] = self._owns(ddp)
        if not owned:
            return
        if ddp._join_config.enable:
            # Joined ranks shadow DDP's all-reduces, not zero-shard's reductions: the ranks'
            # collectives would not match (a gloo abort, a hang on NCCL). Every rank's first
            # forward under Join gets here, so every rank raises. Join leaves its setting on the
            # DDP when its block ends: it is turned off here, so that forwards after it run.
            ddp._join_config = _JoinConfig.construct_disabled_join_config()
            raise RuntimeError(
                "DistributedDataParallel's Join (uneven inputs: `with Join([ddp])` or "
                "ddp.join()) is not supported on a model zero-shard reduces: ranks that ran out "
                "of inputs would shadow DDP's collectives, not zero-shard's. Give every rank the "
                "same number of batches (DistributedSampler(drop_last=True), or pad), or "
                "accumulate the extra micro-batches inside opt.no_sync()"
            )
        if ddp not in self._quieted:
            self._quieted[ddp] = ddp.static_graph and ddp._static_graph_delay_allreduce_enqueued
            if not ddp._use_python_reducer:  # (that one reads the flag in backward: left off)
                end = _EndOfForward(self)
                self._ends[ddp] = ddp.register_forward_hook(end, always_call=True)
                ddp._post_forward = _FirstPostForward(ddp)
        if ddp.static_graph:  # else its first backward would reduce every grad, even in no_sync
            ddp._static_graph_delay_allreduce_enqueued = True
        if not torch.is_grad_enabled():  # no backward follows: DDP does not read the flag
            return
        sync = ddp.require_backward_grad_sync
        if sync and "_post_forward" not in vars(ddp):  # (else _FirstPostForward turns it off)
            ddp.require_backward_grad_sync = False
            if ddp in self._ends:
                self._flags[ddp] = True
        self._on_forward(sync or ddp not in self._ends)

    def end_forward(self, ddp: nn.Module) -> None:
        """DDP's forward is over: its flag goes back to what the user set."""
        if self._flags.pop(ddp, False):
            ddp.require_backward_grad_sync = True

    def _owns(self, ddp: nn.parallel.DistributedDataParallel) -> bool:
        """Whether ``ddp`` runs this model and every param it reduces is zero-shard's."""
        inner = ddp.module
        if self._model() not in (inner, getattr(inner, "_orig_mod", None)):
            return False
        ignored = ddp.parameters_to_ignore
        reduced = [p for n, p in inner.named_parameters() if p.requires_grad and n not in ignored]
        # Several wrappers over disjoint params of the model (a policy's and a value head's
        # optimizers): every param is zero-shard's, and the hook of the one holding DDP's first
        # param quiets DDP for all of them.
        owned = all(map(is_claimed, reduced)) and (not reduced or id(reduced[0]) in self._param_ids)
        if owned:
            logger.info(
                "zero-shard: a DistributedDataParallel wraps the model after zero_shard.wrap "
                "(as HF Trainer and accelerate do); zero-shard reduces the grads, so DDP's "
                "gradient sync is turned off"
            )
        return owned


class _FirstPostForward:
    """DDP's ``_post_forward`` for its first forward, which runs no forward hook: the class's,
    with the flag off ([Note: DDP around a wrapped model]); it takes itself off at once."""

    def __init__(self, ddp: nn.Module) -> None:
        self._ddp = weakref.ref(ddp)

    def __call__(self, output: Any) -> Any:
        ddp = self._ddp()
        if ddp is None:
            raise AssertionError("expected DDP alive in its own forward")
        del ddp._post_forward
        sync = ddp.require_backward_grad_sync
        ddp.require_backward_grad_sync = False
        try:
            return ddp._post_forward(output)
        finally:
            ddp.require_backward_grad_sync = sync


class _EndOfForward:
    """DDP's forward hook of [Note: DDP around a wrapped model]; pickled, a hook that does
    nothing (what it points to lives in this process only)."""

    def __init__(self, hook: _QuietOuterDDP) -> None:
        self._hook = weakref.ref(hook)

    def __call__(self, ddp: nn.Module, args: Any, output: Any) -> None:
        hook = self._hook()
        if hook is not None:
            hook.end_forward(ddp)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_Inert, ())


class _Inert:
    """A forward hook that does nothing."""

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        return None


class _Handle:
    """The hook's handle: removing it also gives the quieted DDPs their sync back."""

    def __init__(self, model: nn.Module, hook: _QuietOuterDDP) -> None:
        self._hook = hook
        self._handle = model.register_forward_hook(hook)

    def remove(self) -> None:
        self._handle.remove()
        self._hook.restore()


def register_outer_ddp_check(
    model: nn.Module, params: Iterable[torch.Tensor], on_forward: Callable[[bool], None]
) -> Any:
    """Registers the hook of [Note: DDP around a wrapped model] on ``model``, for the ``params``
    zero-shard reduces; ``on_forward`` is told at each forward under such a DDP whether DDP
    would sync the backward that follows (False inside its ``no_sync()``). Returns the hook's
    handle."""
    return _Handle(model, _QuietOuterDDP(model, params, on_forward))
