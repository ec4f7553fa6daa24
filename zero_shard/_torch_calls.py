"""Calls of ``ZeroShardOptimizer.state_dict()`` made by torch's optimizer state-dict functions
(``torch.distributed.checkpoint.state_dict``), told apart from the user's own.

[Note: torch's optimizer state-dict functions]
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (and ``get_state_dict`` /
``set_state_dict``) take an optimizer's ``state_dict()`` to be torch's: params numbered by their
position over the param groups. They rename the numbers to FQNs through a table that maps both
ways (FQN <-> position), so FQN keys in the wrapper's state dict would be renamed back to
numbers, and such a result would load nowhere. Called from there, the wrapper numbers its params as torch does
(``keyed_by_position``); torch then names them by FQN, so that its result is the wrapper's own
state dict (``full_state_dict=True``: that one gathered), and loads into either optimizer.

A full-state load (``set_optimizer_state_dict(..., options=StateDictOptions(
full_state_dict=True))``) first reads the optimizer's state dict as a layout: torch cuts the
full tensors by its DTensors' placements, keeps its values for keys the loaded state dict lacks,
and then calls ``load_state_dict``. There the wrapper gives copies on the host (torch refuses a
layout on two devices, and the host costs no accelerator memory), without the stale-params check
(the load replaces the main weights). The layout holds ``main_param`` too: with
``broadcast_from_rank0=True`` torch fills only the layout's keys on the ranks that were handed no
state dict, so without it their main weights would come from the rounded params. Where the
loaded state dict has none (an FSDP2 + torch AdamW one), torch leaves the layout's own tensor in
place, or drops it; torch may also load into that very tensor (a broadcast copies into it). So
the layout's ``main_param`` holds a NaN of a payload no arithmetic makes (``_UNLOADED``), and the
wrapper takes the main weights from the params where a ``main_param`` still holds nothing else
(``without_unloaded_mains``), as a direct ``load_state_dict`` without ``main_param`` does.

The functions pass nothing that says who calls, so the caller is told by its frame: torch's
private ``_get_optim_state_dict`` calls ``state_dict()``, from ``_load_optim_state_dict`` for the
layout of a load. Checked on torch 2.13 only; the two names are the same in torch's source from
2.2 on. Under a torch that renames them the frames match nothing and the wrapper gives its own
state dict, keyed by FQN, which torch's functions then renumber and which loads nowhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._state_dict import dtensor_on

__all__ = ["TorchCall", "host_layout", "torch_call", "without_unloaded_mains"]

_MODULE = "torch.distributed.checkpoint.state_dict"
_GET = "_get_optim_state_dict"
_LOAD = "_load_optim_state_dict"
# Frames between _get_optim_state_dict's and _load_optim_state_dict's: torch.no_grad's wrapper
# around the first (one frame; a spare for another decorator).
_MAX_FRAMES_UP = 3
# Frames between torch's _get_optim_state_dict and state_dict() where an optimizer wrapper's own
# state_dict() calls the wrapped one's (accelerate's AcceleratedOptimizer: one).
_MAX_WRAPPER_FRAMES = 3


class TorchCall(enum.Enum):
    NONE = "none"  # the user's call (or zero_shard.checkpoint's): keys by FQN
    GET = "get"  # get_optimizer_state_dict: keys by position, torch names them
    LOAD_LAYOUT = "load_layout"  # a full-state load reads the layout to cut by


def _is(frame: FrameType, name: str) -> bool:
    return frame.f_code.co_name == name and frame.f_globals.get("__name__") == _MODULE


def torch_call(caller: FrameType | None) -> TorchCall:
    """Which call ``caller`` (the frame that called ``state_dict()``) is: torch's, directly or
    through an optimizer wrapper of a few frames (accelerate's ``AcceleratedOptimizer``)."""
    for _ in range(_MAX_WRAPPER_FRAMES + 1):
        if caller is None or _is(caller, _GET):
            break
        caller = caller.f_back
    if caller is None or not _is(caller, _GET):
        return TorchCall.NONE
    frame = caller.f_back
    for _ in range(_MAX_FRAMES_UP):
        if frame is None:
            break
        if _is(frame, _LOAD):
            return TorchCall.LOAD_LAYOUT
        frame = frame.f_back
    return TorchCall.GET


# A float32 NaN whose payload no arithmetic gives (a NaN made by an op has payload 0x400000):
# the layout's main weights, until a load writes them.
_UNLOADED = 0x7FA5A5A5


def host_layout(param_state: dict[str, Any]) -> dict[str, Any]:
    """A param's state (``sharded_state``) as the layout of a full-state load: its DTensors
    copied to the host (never views: torch may write into the layout); ``main_param`` holds
    ``_UNLOADED``."""
    layout = {}
    for key, value in param_state.items():
        if isinstance(value, DTensor) and key == "main_param":
            unloaded = torch.full(value.to_local().shape, _UNLOADED, dtype=torch.int32)
            layout[key] = dtensor_on(value, unloaded.view(torch.float32))
        elif isinstance(value, DTensor):
            layout[key] = dtensor_on(value, value.to_local().to("cpu", copy=True))
        else:
            layout[key] = value
    return layout


def _left_unloaded(main: Any) -> bool:
    """Whether ``main``, a ``main_param``, is a layout's that no load wrote: every element
    ``_UNLOADED`` (or none)."""
    local = main.to_local() if isinstance(main, DTensor) else main
    if not torch.is_tensor(local) or local.dtype != torch.float32:
        return False
    bits = local.reshape(-1).view(torch.int32)
    if bits.numel() and int(bits[0]) != _UNLOADED:  # the usual answer, without a pass
        return False
    return bool(bits.eq(_UNLOADED).all())


def without_unloaded_mains(state_dict: Any) -> Any:
    """``state_dict`` without the ``main_param`` entries a full-state load left as the layout
    had them (it loaded none there); as it is where there are none."""
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping):
        return state_dict

    def unloaded(param_state: Any) -> bool:
        return isinstance(param_state, Mapping) and _left_unloaded(param_state.get("main_param"))

    if not any(unloaded(param_state) for param_state in state.values()):
        return state_dict
    loaded = {
        key: {k: v for k, v in param_state.items() if k != "main_param"}
        if unloaded(param_state)
        else param_state
        for key, param_state in state.items()
    }
    return {**state_dict, "state": loaded}
