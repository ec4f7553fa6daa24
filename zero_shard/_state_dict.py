"""The optimizer state as DTensors keyed by parameter FQN, and back to one rank's shards.

The state dict has the shape of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
for FSDP2 + a torch optimizer: ``{"state": {fqn: {"step", "exp_avg", ...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``; every param-shaped tensor is a DTensor with the param's global
shape and this rank's part (``Shard(0)``, the FSDP2 param's own placements, or a 2-D layout
under tensor parallelism: ``_tp.py``), plus
``main_param`` (fp32) where the model dtype is lower. DCP can then save and reshard it with no
metadata of ours. Scalars (``step``) are plain tensors, as torch keeps them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from optimizers import HybridDeviceOptimizer

from ._buckets import ShardedParam

__all__ = [
    "ShardedStateView",
    "check_origin",
    "check_saved_groups",
    "dtensor_on",
    "local_rows",
    "local_state_dict",
    "sharded_state",
    "tag_origin",
    "to_dtensor",
]

# The attribute naming the rank whose rows a state-dict DTensor holds, (rank, world size). It
# travels with the DTensor through torch.save / torch.load, not into DCP (which saves the rows).
_ORIGIN = "_zero_shard_origin"


def _dtensor_here(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Any, ...], shape: Any, stride: Any
) -> DTensor:
    """A DTensor of ``shape`` over ``local`` where ``local`` is: ``DTensor.from_local`` would copy
    a host tensor to the mesh's device, as FSDP2's CPU offload avoids the same way."""
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, placements, tensor_meta=meta), requires_grad=False)


def dtensor_on(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor of ``like``'s layout over ``local`` (a copy of its local tensor, anywhere)."""
    return _dtensor_here(local, like.device_mesh, tuple(like.placements), like.shape, like.stride())


def to_dtensor(sharded: ShardedParam, local: torch.Tensor, *, keep_device: bool = False) -> DTensor:
    """``local`` (this rank's part of a param-shaped tensor) as a DTensor of the param's global
    shape, laid out as ``sharded.layout`` says.

    With ``keep_device`` a host ``local`` stays on the host (state dicts: DCP writes it with no
    device round trip); else it is copied to the mesh's device, where DTensor ops can run.
    """
    layout = sharded.layout
    if keep_device:
        return _dtensor_here(local, layout.mesh, layout.placements, layout.shape, layout.stride)
    return DTensor.from_local(
        local,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=layout.shape,
        stride=layout.stride,
    )


def local_rows(sharded: ShardedParam, value: Any) -> Any:
    """This rank's part of a param-shaped ``value`` (a full tensor, or a DTensor of any layout):
    the part its shard holds; anything else is returned as it is."""
    layout = sharded.layout
    if isinstance(value, DTensor):
        if value.shape != layout.shape:
            return value
        if value.device_mesh == layout.mesh and tuple(value.placements) == layout.placements:
            return value.to_local()
        value = value.full_tensor()
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape != layout.shape:
        return value
    return value[layout.region()]


def sharded_state(
    sharded: ShardedParam, hybrid: HybridDeviceOptimizer, *, keep_device: bool = False
) -> dict[str, Any]:
    """The param's state from ``hybrid``, each param-shaped tensor as a DTensor (host state
    kept on the host with ``keep_device``; see ``to_dtensor``)."""
    local = hybrid.param_state(sharded.shard)
    shape = sharded.shard.shape
    return {
        key: to_dtensor(sharded, value, keep_device=keep_device)
        if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape
        else value
        for key, value in local.items()
    }


def local_state_dict(
    saved_state: Mapping[str, dict[str, Any]],
    sharded: Sequence[ShardedParam],
    group_sizes: Sequence[int],
    hyperparams: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """A state dict for the rank's HybridDeviceOptimizer (params numbered in ``sharded`` order)
    from ``saved_state`` keyed by FQN, each tensor cut to this rank's rows."""
    state: dict[int, dict[str, Any]] = {}
    for index, record in enumerate(sharded):
        saved = saved_state.get(record.fqn)
        if not saved:
            continue
        for key, value in saved.items():
            shape = getattr(value, "shape", None)
            if torch.is_tensor(value) and value.dim() > 0 and shape != record.layout.shape:
                raise ValueError(
                    f"saved state {key!r} of {record.fqn!r} has shape {tuple(shape)}, but the "
                    f"param has shape {tuple(record.layout.shape)}: the checkpoint is of another "
                    "model"
                )
        state[index] = {key: local_rows(record, value) for key, value in saved.items()}
    groups, start = [], 0
    for size, hyper in zip(group_sizes, hyperparams, strict=True):
        groups.append({**hyper, "params": list(range(start, start + size))})
        start += size
    return {"state": state, "param_groups": groups}


def tag_origin(state: Mapping[str, dict[str, Any]], origin: tuple[int, int]) -> None:
    """Marks every DTensor of ``state`` (FQN -> param state) as holding rank ``origin[0]``'s rows
    of ``origin[1]`` ranks."""
    for param_state in state.values():
        for value in param_state.values():
            if isinstance(value, DTensor):
                setattr(value, _ORIGIN, origin)


def check_origin(state: Mapping[str, Any], origin: tuple[int, int]) -> None:
    """Refuses DTensors that another rank's ``state_dict()`` made (a state dict saved with
    ``torch.save`` on rank 0 and loaded on every rank): they hold that rank's rows."""
    for fqn, param_state in state.items():
        for key, value in param_state.items():
            made_by = getattr(value, _ORIGIN, origin) if isinstance(value, DTensor) else origin
            if tuple(made_by) != tuple(origin):
                raise ValueError(
                    f"state {key!r} of {fqn!r} holds the rows of rank {made_by[0]} (of "
                    f"{made_by[1]}), but this is rank {origin[0]} (of {origin[1]}): "
                    "opt.state_dict() holds each rank's own shards, so one saved on one rank "
                    "cannot be loaded on the others. Save and load on every rank with "
                    "zero_shard.checkpoint.save / load (or torch.distributed.checkpoint), or "
                    "gather a whole one with zero_shard.full_state_dict(opt) and load it with "
                    "zero_shard.load_full_state_dict(opt, state)"
                )


def check_saved_groups(state_dict: Any, group_fqns: Sequence[Sequence[str]]) -> None:
    """Raises ``ValueError`` unless ``state_dict`` has this optimizer's param groups (by FQN, in
    order) and state for its params only."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if any(isinstance(fqn, int) for group in saved_groups for fqn in group["params"]):
        raise ValueError(
            "the state dict keys its params by index, as torch.optim.Optimizer.state_dict() "
            "does; zero-shard keys them by FQN. Load it into the torch optimizer before "
            "wrapping it (wrap takes the state over), or key it by FQN first with "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, torch_opt, "
            "options=StateDictOptions(full_state_dict=True))"
        )
    if len(saved_groups) != len(group_fqns):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, this optimizer has "
            f"{len(group_fqns)}: it was saved from another model or another param-group setup"
        )
    for index, (saved, fqns) in enumerate(zip(saved_groups, group_fqns, strict=True)):
        if list(saved["params"]) != list(fqns):
            missing = sorted(set(fqns) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(fqns))
            raise ValueError(
                f"param group {index} of the state dict does not hold this optimizer's params: "
                f"missing {missing[:5]}, unknown {extra[:5]} (another model, or the params in "
                "another order)"
            )
    known = {fqn for fqns in group_fqns for fqn in fqns}
    unknown = sorted(set(state_dict["state"]) - known)
    if unknown:
        raise ValueError(f"the state dict has state for params this model lacks: {unknown[:5]}")


class ShardedStateView(Mapping):
    """``optimizer.state`` of a ZeroShardOptimizer: model param -> its state as DTensors, built
    on access (views of the live state where a shard is in one piece, else copies)."""

    def __init__(self, sharded: Sequence[ShardedParam], hybrid: HybridDeviceOptimizer) -> None:
        self._sharded = list(sharded)
        self._hybrid = weakref.ref(hybrid)

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        for record in self._sharded:
            if record.param is param:
                return sharded_state(record, self._hybrid())
        return {}  # a frozen param (or another tensor): no state, as torch's defaultdict shows

    def __contains__(self, param: object) -> bool:
        hybrid = self._hybrid()
        return any(r.param is param and r.shard in hybrid.state for r in self._sharded)

    def __iter__(self) -> Iterator[torch.Tensor]:
        hybrid = self._hybrid()  # whether a shard has state, without building it
        return iter([r.param for r in self._sharded if r.shard in hybrid.state])

    def __len__(self) -> int:
        return sum(1 for _ in self)
