"""Host snapshots of a state dict for background saves, in pinned blocks reused save after save.

``torch.distributed.checkpoint.async_save`` stages with its own copier, which fails on a DTensor
whose local tensor starts inside its storage ("Attempted to call copy_() on an invalid python
storage", torch 2.11-2.13) -- exactly what our state is: views into flat buffers. So the async
save snapshots the state itself: every tensor (a DTensor's local tensor) is copied into host
buffers, then DCP's plain ``save`` writes the snapshot from a background thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from offload import HostBufferRequest, HostBuffers

from ._state_dict import dtensor_on

__all__ = ["Snapshotter"]


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class Snapshotter:
    """Copies state dicts into host memory, reusing the buffers while the layout is the same.

    The buffers are pinned where an accelerator is in use (fast device-to-host copies), allocated
    once in a few large blocks. A snapshot stays valid until the next ``snapshot`` call: the
    caller waits for the previous write before taking a new one.
    """

    _buffers: HostBuffers | None
    _layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (shape, dtype) per tensor

    def __init__(self) -> None:
        self._buffers = None
        self._layout = ()

    def snapshot(self, state: Any) -> Any:
        """``state`` with every tensor replaced by a host copy (DTensors stay DTensors of the same
        layout, with host local tensors); returns once the copies are complete."""
        tensors: list[torch.Tensor] = []
        _map_tensors(state, lambda t: tensors.append(t) or t)
        locals_ = [_local(t).detach() for t in tensors]
        views = self._views(locals_)
        devices = set()
        for view, local in zip(views, locals_, strict=True):
            view.copy_(local, non_blocking=True)
            if local.device.type != "cpu":
                devices.add(local.device)
        for device in devices:  # non-blocking device-to-host copies: wait before they are read
            torch.get_device_module(device).synchronize(device)
        copies = iter(views)

        def replace(tensor: torch.Tensor) -> torch.Tensor:
            copy = next(copies)
            return dtensor_on(tensor, copy) if isinstance(tensor, DTensor) else copy

        return _map_tensors(state, replace)

    def _views(self, locals_: list[torch.Tensor]) -> list[torch.Tensor]:
        layout = tuple((tuple(t.shape), t.dtype) for t in locals_)
        if self._buffers is None or layout != self._layout:
            self._buffers = None  # free the old blocks before allocating new ones
            pin = any(t.device.type != "cpu" for t in locals_)
            requests = [HostBufferRequest(t.numel(), t.dtype) for t in locals_]
            self._buffers = HostBuffers(requests, pin=pin)
            self._layout = layout
        return [
            view.view(shape) for view, (shape, _) in zip(self._buffers.views, layout, strict=True)
        ]
