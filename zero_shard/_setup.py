"""Checks and choices made once, when a ZeroShardOptimizer is built."""

from __future__ import annotations

import enum
import logging
import math
import os
import warnings
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from optimizers import OffloadPolicy, check_elementwise, check_param_kind

from ._tp import (
    dtensor_layout,
    joint_mesh,
    local_tensor,
    placements_over,
    tp_mesh_of,
    tp_spec,
)
from ._units import Units, resolve_units
from ._verdict import Summary, on_every_rank

__all__ = [
    "NONFINITE_POLICIES",
    "STALE_POLICIES",
    "CheckedInputs",
    "Meshes",
    "ModelKind",
    "Nonfinite",
    "StaleParams",
    "Trainable",
    "check_dense_grads",
    "check_inputs",
    "check_mesh",
    "check_options",
    "ensure_process_group",
    "first_device",
    "params_on_host",
    "reduce_device",
    "resolve_mesh",
    "trainable_params",
    "unwrap_model",
]

logger = logging.getLogger("zero_shard")

# What a step does with inf/NaN grads, and with params written since zero-shard last set them.
Nonfinite = Literal["skip", "raise"]
StaleParams = Literal["reload", "error"]
NONFINITE_POLICIES: tuple[Nonfinite, ...] = get_args(Nonfinite)
STALE_POLICIES: tuple[StaleParams, ...] = get_args(StaleParams)

Trainable = tuple[torch.Tensor, str, int]  # (param, fqn, param-group index)


class ModelKind(enum.Enum):
    """Who reduces the grads and who gathers the params."""

    REPLICATED = "replicated"  # a plain module: zero-shard reduces grads and gathers params
    DDP = "ddp"  # DistributedDataParallel reduces the grads; zero-shard gathers the params
    FSDP = "fsdp"  # FSDP2 (fully_shard): params are sharded DTensors; nothing to communicate


def _layout(param: DTensor) -> str:
    names = param.device_mesh.mesh_dim_names
    return f"placements {tuple(param.placements)} on a mesh of shape " + (
        f"{tuple(param.device_mesh.shape)}" + (f" {names}" if names else "")
    )


_SUPPORTED_TP = (
    "zero-shard supports tensor parallelism (parallelize_module over mesh['tp']) on a model "
    "replicated over mesh['dp'] (zero_shard.wrap(opt, model, mesh=mesh['dp'])), under DDP "
    "(device_mesh=mesh['dp']), or under FSDP2 (fully_shard over mesh['dp'])"
)


def _check_fsdp_managed(model: nn.Module) -> None:
    """Under FSDP2, refuses params outside every FSDP2 module: a DTensor is FSDP2's only if FSDP2
    manages it, never by guess (a column-parallel layer's Shard(0) looks like FSDP2's), and a
    plain param never is (``fully_shard(..., ignored_params=...)`` leaves it so)."""
    managed = {
        id(param)
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for param in module.parameters()
    }
    for name, param in model.named_parameters():
        if not param.requires_grad or (isinstance(param, DTensor) and id(param) in managed):
            continue
        if param.dim() == 0:
            raise ValueError(
                f"param {name!r} is 0-dim, which fully_shard refuses (or leaves to the user with "
                "ignored_params), but FSDP2 manages other params of the model: make it shape "
                "(1,), or wrap the model without fully_shard (plain or DDP), where zero-shard "
                "keeps 0-dim params whole on every rank"
            )
        what = "a DTensor with " + _layout(param) if isinstance(param, DTensor) else "plain"
        raise ValueError(
            f"param {name!r} is {what}, but FSDP2 manages other params of the model: call "
            "fully_shard on the root module too (without ignored_params), so that FSDP2 shards "
            "every param. " + _SUPPORTED_TP
        )


def _has_fsdp(model: nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def unwrap_model(model: nn.Module) -> tuple[nn.Module, ModelKind]:
    """The module whose params the optimizer holds, and who communicates. DTensor params are
    FSDP2's inside an FSDP2 model, tensor parallelism's otherwise (sharded over ``dp`` by
    zero-shard); DDP keeps its tensor-parallel params as local tensors marked ``_st_info``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        for name, param in model.module.named_parameters():
            if isinstance(param, DTensor):
                raise ValueError(
                    f"param {name!r} of the DDP model is a DTensor with {_layout(param)}, but "
                    "DDP reduces plain tensors: build DDP with device_mesh=mesh['dp'], which "
                    f"turns tensor-parallel params into local tensors. {_SUPPORTED_TP}"
                )
        return model.module, ModelKind.DDP
    if _has_fsdp(model):
        _check_fsdp_managed(model)
        return model, ModelKind.FSDP
    return model, ModelKind.REPLICATED


def check_options(
    optimizer: torch.optim.Optimizer,
    offload: Any,
    stage: Any,
    bucket_mb: Any,
    nonfinite: Any,
    stale_params: Any,
) -> OffloadPolicy:
    check_elementwise(type(optimizer))
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
    """One process with no process group (a one-GPU script, not under a launcher): makes a group
    of one, as torchrun's environment would, so that one rank is run as any number of ranks (a
    later ``init_process_group`` then raises: call it first to choose). Refuses when a
    launcher's environment says there are more processes: each would then train alone."""
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


def params_on_host(kind: ModelKind, mesh: DeviceMesh, device: torch.device) -> bool:
    """Whether an FSDP2 model keeps its sharded params on the host, off its mesh's accelerator
    (``fully_shard(..., offload_policy=CPUOffloadPolicy())``)."""
    return kind is ModelKind.FSDP and device.type == "cpu" and mesh.device_type != "cpu"


def default_mesh(device: torch.device, ddp_group: dist.ProcessGroup | None) -> DeviceMesh:
    if ddp_group is not None:  # the ranks DDP averages the grads over
        return DeviceMesh.from_group(ddp_group, device.type)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def check_mesh(mesh: Any, device: torch.device, ddp_group: dist.ProcessGroup | None) -> DeviceMesh:
    """Refuses a mesh that is not a 1-D mesh of this rank over the params' device type, one whose
    whole mesh leaves out ranks of the default group (``init_device_mesh("cuda", (8,))`` run on 16
    ranks), and, for a DDP model, one over other ranks than DDP's group. The same on every rank of
    the mesh, so that no rank waits for one that refused."""
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
    world_size = dist.get_world_size()
    root_ranks = _ranks(mesh._get_root_mesh())  # the mesh that mesh['dp'] was taken from
    if mesh.get_coordinate() is None or len(root_ranks) != world_size:
        raise ValueError(
            f"mesh covers ranks {_ranks(mesh)} (of a mesh over ranks {root_ranks}), but the "
            f"process group has {world_size} ranks (this is rank {dist.get_rank()}); build the "
            f"mesh over every rank (init_device_mesh({device.type!r}, ({world_size},))) and pass "
            "it, or its data-parallel dim (mesh['dp'])"
        )
    if ddp_group is not None:
        ddp_ranks = dist.get_process_group_ranks(ddp_group)
        if _ranks(mesh) != ddp_ranks:
            raise ValueError(
                f"mesh covers ranks {_ranks(mesh)}, but the DDP model averages its grads over "
                f"ranks {ddp_ranks}; pass the mesh of DDP's process group, or mesh=None"
            )
    return mesh


class Meshes(NamedTuple):
    """Where the optimizer shards, and where its sums go."""

    mesh: DeviceMesh  # the data-parallel mesh zero-shard shards over (FSDP2's mesh under FSDP2)
    joint: DeviceMesh | None  # with tensor parallelism under zero-shard's sharding: the 2-D
    #                           (dp, tp) mesh the state lies on
    sum_dims: tuple[int, ...]  # dims of verdict_mesh that global norms and non-finite checks
    #                            reduce over: those some param is sharded over (or, under FSDP2,
    #                            holds copies over: summed_dims)

    @property
    def verdict_mesh(self) -> DeviceMesh:
        """The ranks that must agree on every check: all that share a step's collectives."""
        return self.joint if self.joint is not None else self.mesh

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        return [self.verdict_mesh.get_group(dim) for dim in self.sum_dims]


def _default_dp_mesh(tp_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dim of the 2-D mesh ``tp_mesh`` was taken from."""
    root = tp_mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if root.ndim != 2 or tp_name not in names:
        raise ValueError(
            f"the model is tensor-parallel over {tp_mesh}, which is not a named dim of a 2-D "
            "mesh: build the mesh as init_device_mesh(device_type, (dp, tp), mesh_dim_names="
            "('dp', 'tp')) (dp may be 1), parallelize over mesh['tp'], and wrap (or pass "
            "mesh=mesh['dp'] where the mesh has more dims)"
        )
    return root[next(name for name in names if name != tp_name)]


def resolve_mesh(model: nn.Module, kind: ModelKind, mesh: Any, device: torch.device) -> Meshes:
    """The mesh the optimizer shards over, the 2-D mesh of a tensor-parallel model's state, and
    the groups its global sums reduce over. Depends only on what every rank of the mesh has
    alike."""
    trained = [(p, name) for name, p in model.named_parameters() if p.requires_grad]
    if kind is ModelKind.FSDP:
        # The mesh of most dims: FSDP2 puts a param the tensor-parallel plan left plain on the
        # data-parallel dim alone ([Note: FSDP2 params on a sub-mesh]).
        first = max((p for p, _ in trained), key=lambda p: p.device_mesh.ndim, default=None)
        if first is None:
            raise ValueError("the model has no param that requires grad: nothing to shard")
        if mesh is not None and mesh != first.device_mesh:
            raise ValueError(
                "mesh differs from the mesh of the FSDP2 params; leave mesh=None under FSDP2 "
                "(with tensor parallelism too: the params' data x tensor-parallel mesh is used)"
            )
        mesh = first.device_mesh
        return Meshes(mesh, None, tuple(summed_dims(model, mesh)))
    tp_mesh = tp_mesh_of(trained)
    ddp_group = model.process_group if kind is ModelKind.DDP else None
    if mesh is None and kind is ModelKind.DDP:
        mesh = getattr(model, "device_mesh", None)
    if mesh is None and tp_mesh is not None:
        mesh = _default_dp_mesh(tp_mesh)
    if mesh is None:
        mesh = default_mesh(device, ddp_group)
    else:
        mesh = check_mesh(mesh, device, ddp_group)
    if tp_mesh is None:
        return Meshes(mesh, None, (0,))
    return Meshes(mesh, joint_mesh(mesh, tp_mesh), (0, 1))


def trainable_params(
    param_groups: list[dict[str, Any]], fqns: dict[int, str], kind: ModelKind
) -> list[Trainable]:
    """(param, fqn, group index) of each trainable param, checked against the model."""
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
            if kind is not ModelKind.FSDP and not local_tensor(param).is_contiguous():
                raise ValueError(
                    f"param {fqn!r} is not contiguous (stride {local_tensor(param).stride()}, e.g. "
                    "channels_last); zero-shard shards params by rows of their memory: make it "
                    "contiguous (param.data = param.data.contiguous()) before wrapping"
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


def check_fsdp_layout(trainable: list[Trainable], mesh: DeviceMesh) -> None:
    """Every FSDP2 param on ``mesh`` (1-D, HSDP's 2-D, or FSDP2's data-parallel dim with tensor
    parallelism's) or on named dims of it (a param the tensor-parallel plan left plain, on
    ``mesh["dp"]`` alone: [Note: FSDP2 params on a sub-mesh]), none partial, each local tensor
    contiguous where torch places it."""
    first, first_fqn, _ = next(item for item in trainable if item[0].device_mesh == mesh)
    for param, fqn, _ in trainable:
        if placements_over(param, mesh) is None:
            raise ValueError(
                f"param {fqn!r} has {_layout(param)}, but param {first_fqn!r} has "
                f"{_layout(first)}: zero-shard expects every param on one mesh (FSDP2's, or the "
                "2-D data x tensor-parallel mesh that fully_shard and parallelize_module share), "
                "or on named dims of it (fully_shard over mesh['dp'] of a param the "
                "tensor-parallel plan left plain). Build every mesh from one "
                "init_device_mesh(..., mesh_dim_names=...) and slice it by name (mesh['dp'], "
                "mesh['tp'])"
            )
        if any(placement.is_partial() for placement in param.placements):
            raise ValueError(
                f"param {fqn!r} has {_layout(param)}: a param with partial values cannot be "
                "stepped shard by shard; params may be sharded (Shard, FSDP2's _StridedShard) or "
                "replicated over each mesh dim"
            )
        local = param._local_tensor
        expected = tuple(region.stop - region.start for region in dtensor_layout(param).region())
        if tuple(local.shape) != expected or not local.is_contiguous():
            raise ValueError(
                f"param {fqn!r} has {_layout(param)} and a local tensor of shape "
                f"{tuple(local.shape)} (contiguous: {local.is_contiguous()}); expected a "
                f"contiguous {expected}, where torch places this rank's shard (FSDP2's default "
                "dim-0 sharding, with parallelize_module's layouts)"
            )


def summed_dims(model: nn.Module, mesh: DeviceMesh) -> list[int]:
    """The dims of ``mesh`` that global norms and non-finite checks reduce over: those over which
    some trainable param of ``model`` is sharded (the others hold copies of every param), and
    those a param on named dims of ``mesh`` lacks, whose ranks hold copies of it that must skip
    together ([Note: FSDP2 params on a sub-mesh]; the norms count each copy once)."""
    dims = set()
    names = mesh.mesh_dim_names or ()
    for param in model.parameters():
        if not param.requires_grad or not isinstance(param, DTensor):
            continue
        own = () if param.device_mesh == mesh else (param.device_mesh.mesh_dim_names or ())
        for dim, placement in enumerate(placements_over(param, mesh) or ()):
            if not placement.is_replicate() or (own and names[dim] not in own):
                dims.add(dim)
    return sorted(dims)


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
    policy: OffloadPolicy
    trainable: list[Trainable]
    units: list[tuple[str, nn.Module]]  # the units other than the root (none under FSDP2)


def check_inputs(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    kind: ModelKind,
    mesh: DeviceMesh,
    device: torch.device,
    options: dict[str, Any],
    units: Units = None,
    *,
    all_gather: Any = None,
) -> CheckedInputs:
    """Checks ``wrap``'s options (``offload``, ``stage``, ``bucket_mb``, ``nonfinite``,
    ``stale_params``), ``units`` and params with one verdict for every rank of the mesh: each rank
    checks the params it holds (none sharded by another live wrapper), and a failure on any rank
    raises on all (see ``_verdict``). The ranks must also hold the same trainable params (FQN,
    shape, dtype, group), units, buffers and the options that decide the collectives: the bucket
    layout, and thus every collective, derives from them."""

    def check() -> CheckedInputs:
        policy = check_options(optimizer, **options)
        if all_gather is not None and not callable(all_gather):
            raise TypeError(
                f"all_gather must be callable as all_gather(shard, out, group), got "
                f"{type(all_gather).__name__}"
            )
        if all_gather is not None and kind is ModelKind.FSDP:
            raise ValueError(
                "all_gather has no place under FSDP2, which gathers the params itself: set it "
                "on the FSDP2 module (FSDPModule.set_custom_all_gather), or pass all_gather=None"
            )
        if policy.delayed_update and kind is not ModelKind.REPLICATED:
            raise ValueError(
                f"OffloadPolicy(delayed_update=True) needs a plain model that zero-shard shards, "
                f"got a {kind.name} model: its backward writes the grads that the delayed CPU "
                "step may still be copying. Pass the module itself (without DDP or fully_shard), "
                "or delayed_update=False"
            )
        if policy.delayed_update and dist.get_world_size() > 1:
            raise ValueError(
                f"OffloadPolicy(delayed_update=True) runs on one process for now, got "
                f"{dist.get_world_size()}: at more ranks the update in flight would have to be "
                "gathered by calls that some ranks make alone (finish_param_sync, a module's "
                "state_dict). Use delayed_update=False, or one process"
            )
        fqns = {id(p): name for name, p in module.named_parameters()}
        trainable = trainable_params(optimizer.param_groups, fqns, kind)
        on_host = params_on_host(kind, mesh, trainable[0][0].device) if trainable else False
        if on_host and policy.fraction != 1.0:
            raise ValueError(
                f"the FSDP2 params live on the host (CPUOffloadPolicy), so their optimizer "
                f"state and step do too, got an offload fraction of {policy.fraction}: pass "
                "offload=zero_shard.OffloadPolicy(fraction=1.0), or fully_shard without "
                "CPUOffloadPolicy to keep a share on the accelerator"
            )
        check_dense_grads(module, trainable)
        if kind is ModelKind.FSDP:
            check_fsdp_layout(trainable, mesh)
            if units is not None:
                warnings.warn(
                    "units has no effect on an FSDP2 model: FSDP2 gathers params by its own "
                    "fully_shard units",
                    stacklevel=4,
                )
            return CheckedInputs(policy, trainable, [])
        return CheckedInputs(policy, trainable, resolve_units(module, units))

    def summarize(checked: CheckedInputs) -> Summary:
        shared = [
            f"{key}={options[key]!r}" for key in ("stage", "bucket_mb", "nonfinite", "stale_params")
        ]
        shared.append(f"delayed_update={checked.policy.delayed_update!r}")
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

    return on_every_rank(check, mesh=mesh, device=device, summarize=summarize)
