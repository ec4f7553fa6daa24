"""Where each element lives: the element-exact split between accelerator and CPU, in chunks.

Pure bookkeeping over numbers; no tensors are touched here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["ChunkSpec", "DeviceSplit", "ParamInfo", "PieceSpec", "plan_split"]


class ParamInfo(NamedTuple):
    """What the planner needs of one parameter."""

    numel: int
    group_index: int
    dtype: torch.dtype


class PieceSpec(NamedTuple):
    """Elements ``[start, start + numel)`` of the flattened parameter ``param_index``."""

    param_index: int
    start: int
    numel: int


@dataclass(frozen=True)
class ChunkSpec:
    """Host pieces stepped, copied and cast together: one param group, one model dtype."""

    group_index: int
    dtype: torch.dtype
    pieces: tuple[PieceSpec, ...]

    @property
    def numel(self) -> int:
        return sum(piece.numel for piece in self.pieces)


@dataclass(frozen=True)
class DeviceSplit:
    """The split of every parameter between the accelerator and the CPU."""

    device_pieces: tuple[PieceSpec, ...]  # the head of each param kept on the accelerator
    host_chunks: tuple[ChunkSpec, ...]  # the offloaded tails, in the order the forward needs them
    num_host_elements: int
    num_elements: int


def plan_split(
    params: Sequence[ParamInfo],
    fraction: float,
    chunk_numel: int,
    order: Sequence[int] | None = None,
) -> DeviceSplit:
    """Splits ``params`` so that ``fraction`` of all elements, to the element, go to the CPU.

    The CPU takes elements from the end of ``order`` (the params' indices in the order the
    forward needs them; default, their own order): the last parameters whole, then the tail of
    the one where the fraction falls (docs/design.md: the last layers' grads are ready first in
    backward and their params are needed last in forward). Params whose order is not the forward's
    (param groups list the norms of every layer after the weights) would otherwise put the first
    layers' norms on the CPU, and the forward would wait for the CPU step from its first layer.
    The offloaded elements are cut into pieces of at most ``chunk_numel`` and packed, in
    ``order``, into chunks of at most ``chunk_numel`` that never mix param groups or dtypes; the
    chunks come in ``order`` of their first piece. Zero-numel params stay on the accelerator.
    """
    if not 0.0 <= fraction <= 1.0:
        raise AssertionError(f"expected a fraction in [0, 1], got {fraction}")
    if order is None:
        order = range(len(params))
    elif sorted(order) != list(range(len(params))):
        raise AssertionError(f"expected an order of every index below {len(params)}, got {order}")
    num_elements = sum(param.numel for param in params)
    num_host = min(num_elements, math.floor(fraction * num_elements + 0.5))
    host_start = [param.numel for param in params]
    remaining = num_host
    for index in reversed(order):
        taken = min(remaining, params[index].numel)
        host_start[index] -= taken
        remaining -= taken

    device_pieces = tuple(
        PieceSpec(index, 0, host_start[index])
        for index, param in enumerate(params)
        if host_start[index] > 0 or param.numel == 0
    )
    # Each (group, dtype)'s pieces fill its chunks in order, whatever other groups' pieces lie
    # between them.
    pieces_of: dict[tuple[int, torch.dtype], list[PieceSpec]] = {}
    for index in order:
        key = (params[index].group_index, params[index].dtype)
        for start in range(host_start[index], params[index].numel, chunk_numel):
            numel = min(chunk_numel, params[index].numel - start)
            pieces_of.setdefault(key, []).append(PieceSpec(index, start, numel))
    chunks: list[ChunkSpec] = []
    for (group_index, dtype), pieces in pieces_of.items():
        pending: list[PieceSpec] = []
        pending_numel = 0
        for piece in pieces:
            if pending and pending_numel + piece.numel > chunk_numel:
                chunks.append(ChunkSpec(group_index, dtype, tuple(pending)))
                pending, pending_numel = [], 0
            pending.append(piece)
            pending_numel += piece.numel
        chunks.append(ChunkSpec(group_index, dtype, tuple(pending)))
    place = {index: position for position, index in enumerate(order)}
    chunks.sort(key=lambda chunk: place[chunk.pieces[0].param_index])
    return DeviceSplit(device_pieces, tuple(chunks), num_host, num_elements)
