"""Checks and choices made once, when a ZeroShardOptimizer is built."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from optimizers import OffloadPolicy, check_param_kind, check_wrappable, constructor_defaults

from ._aliases import check_disjoint
from ._fsdp import (
    FSDPHostKind,
    FSDPKind,
    check_fsdp_managed,
    fsdp_meshes,
    has_fsdp,
    params_on_host,
)
from ._gather import DelayedUpdate
from ._kind import Kind, Trainable
from ._names import canonical_names
from ._replicas import DDPKind, ReplicatedKind, one_process_mesh_supported
from ._tp import local_tensor, tp_spec
from ._units import Units
from ._verdict import Summary, on_every_rank

__all__ = [
    "NONFINITE_POLICIES",
    "STALE_POLICIES",
    "CheckedInputs",
    "Nonfinite",
    "StaleParams",
    "check_dense_grads",
    "check_inputs",
    "check_options",
    "choose_kind",
    "ensure_process_group",
    "first_device",
    "reduce_device",
    "trainable_params",
]

logger = logging.getLogger("zero_shard")

# What a step does with inf/NaN grads, and with params written since zero-shard last set them.
Nonfinite = Literal["skip", "raise"]
StaleParams = Literal["reload", "error"]
NONFINITE_POLICIES: tuple[Nonfinite, ...] = get_args(Nonfinite)
STALE_POLICIES: tuple[StaleParams, ...] = get_args(StaleParams)


def check_options(
    optimizer: torch.optim.Optimizer,
    offload: Any,
    stage: Any,
    bucket_mb: Any,
    nonfinite: Any,
    stale_params: Any,
) -> OffloadPolicy:
    check_wrappable(optimizer)
    constructor_defaults(optimizer)  # refuses a class it cannot build again, before any change
    if offload is None:
        offload = OffloadPolicy(fraction=0.0)
    elif not isinstance(offload, OffloadPolicy):
        raise TypeError(
            f"offload must be a zero_shard.OffloadPolicy or None, got {offload!r}; pass "
            "offload=zero_shard.OffloadPolicy(fraction=...)"
        )
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
    if bucket_mb * (1 << 20) < 1:  # buckets are sized in bytes
        raise ValueError(
            f"bucket_mb must be at least {2.0**-20!r} MiB (one byte a bucket), got {bucket_mb!r}; "
            "a param larger than a bucket gets a bucket of its own"
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    if stale_params not in STALE_POLICIES:
        raise ValueError(f"stale_params must be one of {STALE_POLICIES}, got {stale_params!r}")
    return offload


# What launchers set to the number of processes (torchrun, Slurm, Open MPI, MPICH / Intel MPI).
_LAUNCHER_SIZES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                   "PMI_SIZE")  # fmt: skip


def ensure_process_group(device: torch.device) -> None:
    """Refuses a process with no process group where a launcher's environment says there are
    more processes (each would train alone). One process alone needs no group: zero-shard runs
    no collective there and leaves ``torch.distributed`` uninitialized, for a later
    ``init_process_group`` and for libraries that read it as a distributed run (see
    ``one_process_mesh``). A torch whose ``DeviceMesh`` cannot be built without a group gets a
    group of one instead (a later ``init_process_group`` then raises: call it first)."""
    if not dist.is_available():
        raise RuntimeError(
            "zero_shard.wrap needs torch.distributed, which this build of torch lacks; for one "
            "process without it, use optimizers.HybridDeviceOptimizer"
        )
    if dist.is_initialized():
        return
    for name in _LAUNCHER_SIZES:
        size = os.environ.get(name, "1")
        if size.isdigit() and int(size) > 1:
            raise RuntimeError(
                f"{name}={size} but no process group is initialized: call "
                "torch.distributed.init_process_group() on every rank before zero_shard.wrap "
                "(a group of one here would train each process alone)"
            )
    if one_process_mesh_supported():
        return
    backend = "gloo"
    if device.type != "cpu":
        backend = f"cpu:gloo,{device.type}:{dist.Backend.default_device_backend_map[device.type]}"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.info(
        "zero-shard: no process group was initialized; made a one-process group (%s)", backend
    )


def first_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """The device of the optimizer's first param (the checks then find any other), or the CPU if
    it has none (they then say so)."""
    param = next((p for group in optimizer.param_groups for p in group["params"]), None)
    return torch.device("cpu") if param is None else param.device


def reduce_device(mesh: DeviceMesh, device: torch.device) -> torch.device:
    """Where this rank's small collectives (norms, non-finite flags, verdicts) run: the params'
    device, or the mesh's accelerator where the params live on the host while the mesh does not
    (FSDP2's ``CPUOffloadPolicy``: a group of NCCL alone reduces no host tensor)."""
    if mesh.device_type == device.type:
        return device
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def choose_kind(model: nn.Module, mesh: Any, optimizer: torch.optim.Optimizer) -> Kind:
    """The kind of ``model`` (see ``_kind.py``), made with its meshes: the module whose params
    the optimizer holds, and who communicates. DTensor params are FSDP2's inside an FSDP2 model,
    tensor parallelism's otherwise (sharded over ``dp`` by zero-shard); DDP keeps its
    tensor-parallel params as local tensors marked ``_st_info``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device = first_device(optimizer)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPKind(model, mesh, device)
    if not has_fsdp(model):
        return ReplicatedKind(model, mesh, device)
    check_fsdp_managed(model)
    meshes = fsdp_meshes(model, mesh)
    groups = optimizer.param_groups
    trained = next((p for g in groups for p in g["params"] if p.requires_grad), None)
    return (FSDPHostKind if params_on_host(meshes, trained) else FSDPKind)(model, meshes)


def trainable_params(
    param_groups: list[dict[str, Any]],
    fqns: dict[int, str],
    check_param: Callable[[torch.Tensor, str], None],
) -> list[Trainable]:
    """(param, fqn, group index) of each trainable param, checked against the model (and by
    ``check_param``, the kind's)."""
    trainable = []
    group_of: dict[int, int] = {}
    for group_index, group in enumerate(param_groups):
        for param in group["params"]:
            fqn = fqns.get(id(param))
            if fqn is None:
                raise ValueError(
                    f"the optimizer holds a param of shape {tuple(param.shape)} that is not a "
                    f"param of the model; wrap the optimizer with the model it optimizes"
                )
            if id(param) in group_of:
                first = group_of[id(param)]
                where = (
                    f"appears twice in param group {first}; pass each param once"
                    if first == group_index
                    else f"is in param groups {first} and {group_index}; put each param in one "
                    "group"
                )
                raise ValueError(f"param {fqn!r} {where}")
            group_of[id(param)] = group_index
            if not param.requires_grad:
                continue
            check_param_kind(param, f"param {fqn!r}")
            check_param(param, fqn)
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


def check_dense_grads(module: nn.Module, trainable: list[Trainable]) -> None:
    """Refuses embeddings with ``sparse=True`` among the trained params: their grads are sparse."""
    trained = {id(param) for param, _, _ in trainable}
    for name, child in module.named_modules():
        sparse = isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
        if sparse and id(child.weight) in trained:
            raise TypeError(
                f"module {name!r} ({type(child).__name__}) has sparse=True: its grads are "
                "sparse, and zero-shard reduces and steps dense grads only; build it with "
                "sparse=False"
            )


def _global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A param's shape over all ranks: a tensor-parallel part's (DDP's local tensor) is its whole
    param's, the same on every rank."""
    spec = tp_spec(param)
    return tuple(param.shape if spec is None else spec.shape)


class CheckedInputs(NamedTuple):
    policy: OffloadPolicy  # the kind's (Kind.offload_policy)
    delay: DelayedUpdate | None
    trainable: list[Trainable]
    units: list[tuple[str, nn.Module]]  # the units other than the root (none under FSDP2)


def _check_gather_options(
    policy: OffloadPolicy, kind: Kind, all_gather: Any
) -> DelayedUpdate | None:
    """Checks ``all_gather`` and the delayed update against the kind and the world size;
    returns the delayed update, if any."""
    if all_gather is not None and not callable(all_gather):
        raise TypeError(
            f"all_gather must be callable as all_gather(shard, out, group), got "
            f"{type(all_gather).__name__}"
        )
    delay = DelayedUpdate.of(policy)
    kind.check_options(delay, all_gather)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if delay is not None and world_size > 1:
        raise ValueError(
            f"OffloadPolicy(delayed_update=True) runs on one process only, got "
            f"{world_size}: at more ranks the update in flight would have to be "
            "gathered by calls that some ranks make alone (finish_param_sync, a module's "
            "state_dict). Use delayed_update=False, or one process"
        )
    return delay


def check_inputs(
    optimizer: torch.optim.Optimizer,
    kind: Kind,
    device: torch.device,
    options: dict[str, Any],
    units: Units = None,
    *,
    all_gather: Any = None,
) -> CheckedInputs:
    """Checks ``wrap``'s options (``offload``, ``stage``, ``bucket_mb``, ``nonfinite``,
    ``stale_params``), ``units`` and params with one verdict for every rank of the kind's mesh:
    each rank checks the params it holds (none sharded by another live wrapper), and a failure
    on any rank raises on all (see ``_verdict``). The ranks must also hold the same trainable
    params (FQN, shape, dtype, group), units, buffers and the options that decide the
    collectives: the bucket layout, and thus every collective, derives from them. The policy
    returned is the kind's (``Kind.offload_policy``)."""
    module = kind.module

    def check() -> CheckedInputs:
        policy = check_options(optimizer, **options)
        delay = _check_gather_options(policy, kind, all_gather)
        fqns = canonical_names(module)
        trainable = trainable_params(optimizer.param_groups, fqns, kind.check_param)
        policy = kind.offload_policy(policy)
        check_dense_grads(module, trainable)
        check_disjoint([local_tensor(p) for p, _, _ in trainable], [f for _, f, _ in trainable])
        return CheckedInputs(policy, delay, trainable, kind.units(trainable, units))

    def summarize(checked: CheckedInputs) -> Summary:
        shared = [
            f"{key}={options[key]!r}" for key in ("stage", "bucket_mb", "nonfinite", "stale_params")
        ]
        shared.append(f"delayed_update={checked.delay is not None!r}")
        shared.append(f"offload fraction={checked.policy.fraction!r}")  # (buckets start at it)
        shared.append(f"all_gather given: {all_gather is not None}")
        return (
            shared
            + [
                f"param {fqn!r} of shape {_global_shape(param)}, {param.dtype}, in param group "
                f"{group}"
                for param, fqn, group in checked.trainable
            ]
            + [f"unit {name!r}" for name, _ in checked.units]
            + [
                f"buffer {name!r} of shape {tuple(buffer.shape)}, {buffer.dtype}"
                for name, buffer in module.named_buffers()
            ]
        )

    mesh = kind.meshes.verdict_mesh
    return on_every_rank(check, mesh=mesh, device=device, summarize=summarize)
