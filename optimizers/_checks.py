"""Checks of what an optimizer is given: its params and param groups, a step's device scalars."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["check_device_scalar", "check_param", "check_param_kind", "check_unique"]


def check_param_kind(param: torch.Tensor, name: str) -> None:
    """Raises unless ``param`` is a dense, real, floating-point tensor with memory (not on the meta
    device).

    Args:
        param: the param to check.
        name: which param, as the error messages name it (``"param 'fc.weight'"``).
    """
    if param.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device; materialize the model first "
            "(model.to_empty(device=...) and initialize it), then build the optimizer"
        )
    if param.layout != torch.strided:
        raise TypeError(
            f"{name} is sparse ({param.layout}); zero-shard steps dense params only: make it "
            "dense (param.data = param.data.to_dense())"
        )
    if param.is_complex():
        raise TypeError(
            f"{name} is complex ({param.dtype}); zero-shard does not support complex params: "
            "keep them as real tensors (torch.view_as_real) in the model"
        )
    if not param.is_floating_point():
        raise TypeError(f"{name} has dtype {param.dtype}; params must be floating point")
    if param.dtype == torch.float64 and param.requires_grad:  # a frozen one is never stepped
        raise TypeError(
            f"{name} is torch.float64; zero-shard keeps fp32 main weights and optimizer state, "
            "which would round it and lose updates below fp32's precision (torch steps it in "
            "float64). Train float64 params with a torch optimizer, or make them float32"
        )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # A DTensor exists only once its module was imported: no import (and its cost) otherwise.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def check_param(param: torch.Tensor, index: int, device: torch.device) -> None:
    name = f"param {index} (shape {tuple(param.shape)})"
    # Not in check_param_kind: zero_shard checks FSDP2's params with it, which are DTensors.
    if _is_dtensor(param):
        raise TypeError(
            f"{name} is a DTensor (placements {param.placements} on {param.device_mesh}): "
            "HybridDeviceOptimizer steps one process's plain tensors. For a model sharded or "
            "replicated over ranks (FSDP2's fully_shard, a DeviceMesh), build the torch "
            "optimizer and call zero_shard.wrap(optimizer, model), which shards the optimizer "
            "over the ranks"
        )
    check_param_kind(param, name)
    if param.device != device:
        raise ValueError(
            f"params are on different devices ({device} and {param.device} for {name}); move "
            "the model to one device before building the optimizer"
        )
    if not param.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous; make it contiguous "
            "(param.data = param.data.contiguous()) before building the optimizer"
        )


def check_unique(
    params: Iterable[torch.Tensor | tuple[str, torch.Tensor]],
    index: int,
    groups: Sequence[dict[str, Any]],
) -> None:
    """Raises if a param of the new group ``index`` is twice in it or in one of ``groups``."""
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    seen: set[int] = set()
    for param in params:
        if isinstance(param, tuple):  # (name, param), as from named_parameters()
            param = param[1]
        if id(param) in seen:
            raise ValueError(
                f"a param of shape {tuple(param.shape)} appears twice in param group {index}; "
                "pass each param once"
            )
        seen.add(id(param))
        if id(param) in group_of:
            raise ValueError(
                f"a param of shape {tuple(param.shape)} is in param groups "
                f"{group_of[id(param)]} and {index}; put each param in one group"
            )


def check_device_scalar(value: torch.Tensor, name: str, device: torch.device, example: str) -> None:
    """Raises unless ``value`` (a step's ``name``; ``example`` says what it usually is) is a
    one-element fp32 tensor on ``device``."""
    if (
        not isinstance(value, torch.Tensor)
        or value.numel() != 1
        or value.dtype != torch.float32
        or value.device != device
    ):
        described = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise TypeError(
            f"{name} must be a one-element float32 tensor on {device} ({example}), got {described}"
        )
