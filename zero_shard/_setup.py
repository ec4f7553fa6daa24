"""Checks and choices made once, when a ZeroShardOptimizer is built."""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from optimizers import OffloadPolicy, check_elementwise

__all__ = [
    "NONFINITE_POLICIES",
    "STALE_POLICIES",
    "ModelKind",
    "check_mesh",
    "check_options",
    "default_mesh",
    "fsdp_layout",
    "trainable_params",
    "unwrap_model",
]

NONFINITE_POLICIES = ("skip", "raise")
STALE_POLICIES = ("reload", "error")


class ModelKind(enum.Enum):
    """Who reduces the grads and who gathers the params."""

    REPLICATED = "replicated"  # a plain module: zero-shard reduces grads and gathers params
    DDP = "ddp"  # DistributedDataParallel reduces the grads; zero-shard gathers the params
    FSDP = "fsdp"  # FSDP2 (fully_shard): params are sharded DTensors; nothing to communicate


def unwrap_model(model: nn.Module) -> tuple[nn.Module, ModelKind]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, ModelKind.DDP
    dtensors = [isinstance(p, DTensor) for p in model.parameters() if p.requires_grad]
    if dtensors and all(dtensors):
        return model, ModelKind.FSDP
    if any(dtensors):
        raise ValueError(
            "some trainable params of the model are DTensors and some are not; under FSDP2 call "
            "fully_shard on the root module too, so that every param is sharded"
        )
    return model, ModelKind.REPLICATED


def check_options(
    optimizer: Any, offload: Any, stage: Any, bucket_mb: Any, nonfinite: Any, stale_params: Any
) -> OffloadPolicy:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_elementwise(type(optimizer))
    if offload is None:
        offload = OffloadPolicy(fraction=0.0)
    elif not isinstance(offload, OffloadPolicy):
        raise TypeError(
            f"offload must be a zero_shard.OffloadPolicy or None, got {type(offload).__name__}"
        )
    if offload.d2h_during_backward:
        warnings.warn(
            "OffloadPolicy(d2h_during_backward=True) is ignored by zero_shard.wrap: grads reach "
            "the optimizer only once reduced over the ranks, and are then sent at step()",
            UserWarning,
            stacklevel=3,
        )
        offload = dataclasses.replace(offload, d2h_during_backward=False)
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(
            f"stage must be 1 (all-reduce grads, keep the local shard) or 2 (reduce-scatter "
            f"grads), got {stage!r}"
        )
    if (
        isinstance(bucket_mb, bool)
        or not isinstance(bucket_mb, (int, float))
        or not math.isfinite(bucket_mb)
        or bucket_mb <= 0
    ):
        raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    if stale_params not in STALE_POLICIES:
        raise ValueError(f"stale_params must be one of {STALE_POLICIES}, got {stale_params!r}")
    return offload


def default_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),))


def check_mesh(mesh: Any, device: torch.device) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be the 1-D data-parallel mesh, got {mesh.ndim} dims "
            f"{mesh.mesh_dim_names or ''}; pass its data-parallel dim (mesh['dp'])"
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"mesh is a {mesh.device_type!r} mesh but the params are on {device}; build the mesh "
            f"with init_device_mesh({device.type!r}, ...)"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the mesh {mesh}")
    return mesh


def trainable_params(
    param_groups: list[dict[str, Any]], fqns: dict[int, str], kind: ModelKind
) -> list[tuple[torch.Tensor, str, int]]:
    """(param, fqn, group index) of each trainable param, checked against the model."""
    trainable = []
    for group_index, group in enumerate(param_groups):
        for param in group["params"]:
            fqn = fqns.get(id(param))
            if fqn is None:
                raise ValueError(
                    f"the optimizer holds a param of shape {tuple(param.shape)} that is not a "
                    f"param of the model; wrap the optimizer with the model it optimizes"
                )
            if not param.requires_grad:
                continue
            if kind is not ModelKind.FSDP and not param.is_contiguous():
                raise ValueError(
                    f"param {fqn!r} is not contiguous (stride {param.stride()}, e.g. "
                    "channels_last); zero-shard shards params by rows of their memory: make it "
                    "contiguous (param.data = param.data.contiguous()) before wrapping"
                )
            if param.dim() == 0 and kind is not ModelKind.FSDP:
                raise ValueError(
                    f"param {fqn!r} is 0-dim; zero-shard shards params along dim 0 (as FSDP2, "
                    "which refuses them too): make it shape (1,)"
                )
            trainable.append((param, fqn, group_index))
    if not trainable:
        raise ValueError("the optimizer has no param that requires grad: nothing to shard")
    devices = {param.device for param, _, _ in trainable}
    if len(devices) > 1:
        raise ValueError(
            f"the params are on different devices {sorted(map(str, devices))}; move the "
            "model to one device first"
        )
    return trainable


def fsdp_layout(
    trainable: list[tuple[torch.Tensor, str, int]], mesh: DeviceMesh | None
) -> tuple[DeviceMesh, list[dist.ProcessGroup]]:
    """The mesh of FSDP2 params (one for all, with one layout) and the groups they are sharded
    over (where global norms and checks are reduced)."""
    first = trainable[0][0]
    if mesh is not None and mesh != first.device_mesh:
        raise ValueError(
            "mesh differs from the mesh of the FSDP2 params; leave mesh=None under FSDP2"
        )
    for param, fqn, _ in trainable:
        if param.device_mesh != first.device_mesh or param.placements != first.placements:
            raise ValueError(
                f"param {fqn!r} is sharded on another mesh or with other placements than the "
                "first param; zero-shard expects one FSDP2 layout for all"
            )
    groups = [
        first.device_mesh.get_group(dim)
        for dim, placement in enumerate(first.placements)
        if placement.is_shard()
    ]
    return first.device_mesh, groups
