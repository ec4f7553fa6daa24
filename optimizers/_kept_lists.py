"""torch's Adam and AdamW steps with their per-param lists kept from one step to the next.

[Note: kept step lists]
torch's ``Adam.step`` builds, for each param group, the lists its kernel takes (params with a
grad, their grads, moments, step counts) in ``_init_group``: Python per param at every step,
where the fused kernel is a few launches for the whole group; at small models the GPU waits for it.
A sub-optimizer of the hybrid steps the same tensors every step: its params are the fp32 main
weights, its state is made at construction and written in place. So ``KeptLists`` takes the
place of ``_init_group`` on the sub-optimizer (an instance attribute: torch's ``step`` is run as
it is, calling ``self._init_group``) and hands out the lists the last full pass made, where every
one of them still holds: the group has the same params, each has a grad, and each param's state
is the same dict holding the same tensors (a load or an edit that replaced a tensor, a cleared
state, fail that). Anything else, and a group with ``differentiable`` or a tensor ``lr`` under
``foreach`` (torch's checks), goes through torch's own ``_init_group``, whose lists are then kept.
The check is identity only: the lists are those torch would build, so the step is torch's.
A load replaces state tensors: it calls ``forget_step_lists``, so that the kept lists do not
hold the replaced tensors (their memory) until the next step.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any

import torch

__all__ = ["forget_step_lists", "keep_step_lists"]

_GRAD = attrgetter("grad")


def keep_step_lists(optimizer: torch.optim.Optimizer) -> None:
    """Gives ``optimizer`` a ``KeptLists`` in place of ``_init_group`` where its class runs torch's
    Adam step (Adam, AdamW, a subclass keeping both methods); else leaves it as it is."""
    # Read now, not at import: Dynamo's first compile replaces every torch optimizer class's
    # _init_group with a wrapper of it.
    torchs = (torch.optim.Adam._init_group, torch.optim.AdamW._init_group)
    if not isinstance(optimizer, torch.optim.Adam) or type(optimizer)._init_group not in torchs:
        return
    optimizer._init_group = KeptLists(optimizer)  # type: ignore[method-assign]


def forget_step_lists(optimizer: torch.optim.Optimizer) -> None:
    """Drops the lists ``optimizer`` kept (its state tensors were replaced), if any."""
    kept = optimizer.__dict__.get("_init_group")
    if isinstance(kept, KeptLists):
        kept.forget()


class _Lists:
    """One group's lists from a full pass, every param of the group with a grad."""

    params: list[torch.Tensor]
    states: list[dict[str, Any]]  # each param's state dict, as the pass found it
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]  # empty without amsgrad
    state_steps: list[torch.Tensor]
    amsgrad: bool

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: dict[str, Any],
        lists: tuple[list[torch.Tensor], ...],
    ) -> None:
        params, _, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = lists
        self.params = list(params)
        self.states = [optimizer.state[p] for p in params]
        self.exp_avgs, self.exp_avg_sqs = list(exp_avgs), list(exp_avg_sqs)
        self.max_exp_avg_sqs, self.state_steps = list(max_exp_avg_sqs), list(state_steps)
        self.amsgrad = bool(group["amsgrad"])

    def grads_if_held(
        self, group: dict[str, Any], state: dict[torch.Tensor, Any]
    ) -> list[torch.Tensor] | None:
        """The params' grads, if every list still holds for ``group``; else ``None``. (Compared
        by ``map`` over ``operator.is_``: no Python frame per param.)"""
        params = group["params"]
        if len(params) != len(self.params) or bool(group["amsgrad"]) != self.amsgrad:
            return None
        grads = list(map(_GRAD, params))
        states = self.states
        held = (
            all(map(is_, params, self.params))
            and all(map(is_not, grads, repeat(None)))
            and all(map(is_, map(state.get, params), states))
            and all(map(is_, map(dict.get, states, repeat("exp_avg")), self.exp_avgs))
            and all(map(is_, map(dict.get, states, repeat("exp_avg_sq")), self.exp_avg_sqs))
            and all(map(is_, map(dict.get, states, repeat("step")), self.state_steps))
            and (
                not self.amsgrad
                or all(
                    map(is_, map(dict.get, states, repeat("max_exp_avg_sq")), self.max_exp_avg_sqs)
                )
            )
        )
        return grads if held else None


class KeptLists:
    """``_init_group`` for one Adam or AdamW sub-optimizer; see [Note: kept step lists]."""

    _optimizer: torch.optim.Optimizer
    _lists: dict[int, _Lists]  # by id() of the param group

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._lists = {}

    def forget(self) -> None:
        self._lists.clear()

    def __call__(
        self,
        group: dict[str, Any],
        params_with_grad: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_exp_avg_sqs: list[torch.Tensor],
        state_steps: list[torch.Tensor],
    ) -> bool:
        kept = self._lists.get(id(group))
        plain = not group["differentiable"] and not (
            group["foreach"] and torch.is_tensor(group["lr"]) and not group["capturable"]
        )
        held = None
        if kept is not None and plain:
            held = kept.grads_if_held(group, self._optimizer.state)
        if held is not None:
            params_with_grad += kept.params
            grads += held
            exp_avgs += kept.exp_avgs
            exp_avg_sqs += kept.exp_avg_sqs
            max_exp_avg_sqs += kept.max_exp_avg_sqs
            state_steps += kept.state_steps
            return False  # only a pass that found no complex param is kept
        lists = (params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        has_complex = type(self._optimizer)._init_group(self._optimizer, group, *lists)
        self._lists.pop(id(group), None)
        if plain and not has_complex and len(params_with_grad) == len(group["params"]):
            self._lists[id(group)] = _Lists(self._optimizer, group, lists)
        groups = {id(g) for g in self._optimizer.param_groups}
        for gone in [key for key in self._lists if key not in groups]:
            del self._lists[gone]  # a group replaced (torch's load_state_dict): its old state
        return has_complex
