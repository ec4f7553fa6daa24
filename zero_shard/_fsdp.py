"""FSDP2 models: FSDP2 communicates; the shards zero-shard steps, in place, are its params' local
tensors (with ``CPUOffloadPolicy``, on the host: ``FSDPHostKind``)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from offload import intra_op_threads
from optimizers import HostStep, HybridDeviceOptimizer, OffloadPolicy

from ._buckets import fsdp_sharded_param
from ._collectives import AllGather
from ._gather import DelayedUpdate
from ._kind import (
    SUPPORTED_TP,
    Kind,
    Meshes,
    Trainable,
    refuse_delayed_update,
    watch_state_dict_entries,
)
from ._released_ops import DeferredClip
from ._tp import describe_layout, dtensor_layout, placements_over
from ._units import Units
from ._verdict import on_any_rank

if TYPE_CHECKING:
    from ._optimizer import ZeroShardOptimizer

__all__ = [
    "FSDPHostKind",
    "FSDPKind",
    "check_fsdp_managed",
    "fsdp_meshes",
    "has_fsdp",
    "params_on_host",
]


class FSDPKind(Kind):
    """An FSDP2 model: FSDP2 communicates; the shards are its params' local tensors."""

    writes = None  # each rank reloads its own shards, which are the model's memory
    clip: DeferredClip | None = None  # the grads are the model's: a clip multiplies them at once

    def __init__(self, module: nn.Module, meshes: Meshes) -> None:
        self.module = module
        self.meshes = meshes
        self.sharded = []
        self.buckets = []

    # -- wrap ------------------------------------------------------------------------------------

    def check_options(self, delay: DelayedUpdate | None, all_gather: AllGather | None) -> None:
        if all_gather is not None:
            raise ValueError(
                "all_gather has no place under FSDP2, which gathers the params itself: set it "
                "on the FSDP2 module (FSDPModule.set_custom_all_gather), or pass all_gather=None"
            )
        refuse_delayed_update(delay, "FSDP")

    def units(self, trainable: list[Trainable], units: Units) -> list[tuple[str, nn.Module]]:
        check_fsdp_layout(trainable, self.meshes.mesh)
        if units is not None:
            warnings.warn(
                "units has no effect on an FSDP2 model: FSDP2 gathers params by its own "
                "fully_shard units",
                stacklevel=5,
            )
        return []

    def build(self, trainable: list[Trainable], units: list[tuple[str, nn.Module]], *,
              stage: int, **options: Any) -> None:  # fmt: skip
        """The shards are the params' local tensors; FSDP2 has the other options' say."""
        if stage == 1:
            warnings.warn(
                "stage=1 has no effect on an FSDP2 model: FSDP2 reduce-scatters its grads",
                stacklevel=4,
            )
        mesh, dims = self.meshes.mesh, self.meshes.sum_dims
        self.sharded = [fsdp_sharded_param(p, fqn, g, mesh, dims) for p, fqn, g in trainable]

    def install(self, optimizer: ZeroShardOptimizer, *, overlap: bool) -> list[Any]:
        """Makes the model's state dicts watched as its params are (see [Note: FSDP2 versions])."""
        return watch_state_dict_entries(self.module, self.sharded)

    # -- each step -------------------------------------------------------------------------------

    def model_grads(self) -> list[torch.Tensor]:
        return [s.param.grad for s in self.sharded if s.param.grad is not None]

    def finalize_grads(self, *, reduce: bool = True) -> None:
        for sharded in self.sharded:
            grad = sharded.param.grad
            if grad is not None and grad.placements != sharded.param.placements:
                # FSDP2 leaves grads laid out as their params (with tensor parallelism too); a
                # partial or otherwise placed grad would step the local tensor with other values.
                raise RuntimeError(
                    f"the grad of FSDP2 param {sharded.fqn!r} has placements {grad.placements}, "
                    f"the param {sharded.param.placements}: zero-shard steps each local tensor "
                    "with its own local grad, so they must match; set .grad to a DTensor laid "
                    "out as its param"
                )
            sharded.shard.grad = None if grad is None else grad._local_tensor.detach()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        modules = [m for m in self.module.modules() if hasattr(m, "set_requires_gradient_sync")]
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    def after_step(self, host_step: HostStep | None) -> None:
        if host_step is not None:
            if host_step.delayed:
                raise AssertionError("expected no delayed update under FSDP2 (refused at wrap)")
            host_step.wait()  # the step writes the params' local shards in place
        for sharded in self.sharded:
            sharded.record_version()

    def finish(self) -> None:
        """Checks that every shard still is its param's memory: the step writes the shards, and
        FSDP2 all-gathers from the params' local tensors."""
        for sharded in self.sharded:
            local = sharded.param._local_tensor
            if sharded.shard.numel() and (
                local.data_ptr() != sharded.shard.data_ptr() or local.shape != sharded.shard.shape
            ):
                raise RuntimeError(
                    f"the local tensor of FSDP2 param {sharded.fqn!r} was replaced since the "
                    "optimizer was built (FSDP2 does so when a param's memory changes: "
                    "model.to(...), torch.utils.swap_tensors): the optimizer would update memory "
                    "FSDP2 no longer reads. Change the params' memory before zero_shard.wrap, or "
                    "wrap the torch optimizer again after"
                )

    def raise_if_written_elsewhere(self, here: list[bool], device: torch.device) -> None:
        """A load in place into the local shards (DCP) writes nothing on a rank whose shard of a
        param is empty, so that rank alone may see no write: the ranks raise together."""
        mesh = self.meshes.verdict_mesh
        if on_any_rank(any(here), mesh=mesh, device=device) and not any(here):
            raise RuntimeError(
                "model params were written since the optimizer last set them, on other "
                "ranks (a weight load?; their error names the params). Call "
                "opt.reload_model_params() after loading weights, or wrap with "
                "stale_params='reload'"
            )


class FSDPHostKind(FSDPKind):
    """An FSDP2 model whose sharded params live on the host, off its mesh's accelerator
    (``fully_shard(..., offload_policy=CPUOffloadPolicy())``): stepped there in place."""

    _hybrid: HybridDeviceOptimizer  # made by install(): its threads step the params

    def offload_policy(self, policy: OffloadPolicy) -> OffloadPolicy:
        if policy.fraction != 1.0:
            raise ValueError(
                f"the FSDP2 params live on the host (CPUOffloadPolicy), so their optimizer "
                f"state and step do too, got an offload fraction of {policy.fraction}: pass "
                "offload=zero_shard.OffloadPolicy(fraction=1.0), or fully_shard without "
                "CPUOffloadPolicy to keep a share on the accelerator"
            )
        # The whole step is the host's already: the hybrid's "accelerator" share is the host's,
        # stepped in place, with no copies.
        return dataclasses.replace(policy, fraction=0.0)

    def install(self, optimizer: ZeroShardOptimizer, *, overlap: bool) -> list[Any]:
        self._hybrid = optimizer._hybrid
        return super().install(optimizer, overlap=overlap)

    def host_threads(self) -> contextlib.AbstractContextManager:
        """The rank's CPU threads for passes over the grads, which live on the host, not
        torchrun's one."""
        return intra_op_threads(self._hybrid.host_num_threads)


def has_fsdp(model: nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def params_on_host(meshes: Meshes, param: torch.Tensor | None) -> bool:
    """Whether an FSDP2 model keeps its sharded params (``param``: the first trained one) on the
    host, off its mesh's accelerator (``CPUOffloadPolicy``)."""
    return param is not None and param.device.type == "cpu" and meshes.mesh.device_type != "cpu"


def check_fsdp_managed(model: nn.Module) -> None:
    """Refuses params outside every FSDP2 module: a DTensor is FSDP2's only if FSDP2 manages it,
    never by guess (a column-parallel layer's Shard(0) looks like FSDP2's), and a plain param
    never is (``fully_shard(..., ignored_params=...)`` leaves it so)."""
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
        what = "a DTensor with " + describe_layout(param) if isinstance(param, DTensor) else "plain"
        raise ValueError(
            f"param {name!r} is {what}, but FSDP2 manages other params of the model: call "
            "fully_shard on the root module too (without ignored_params), so that FSDP2 shards "
            "every param. " + SUPPORTED_TP
        )


def fsdp_meshes(model: nn.Module, mesh: Any) -> Meshes:
    """FSDP2's mesh, and the groups global sums reduce over."""
    trained = [p for p in model.parameters() if p.requires_grad]
    # The mesh of most dims: FSDP2 puts a param the tensor-parallel plan left plain on the
    # data-parallel dim alone ([Note: FSDP2 params on a sub-mesh]).
    first = max(trained, key=lambda p: p.device_mesh.ndim, default=None)
    if first is None:
        raise ValueError("the model has no param that requires grad: nothing to shard")
    if mesh is not None and mesh != first.device_mesh:
        raise ValueError(
            "mesh differs from the mesh of the FSDP2 params; leave mesh=None under FSDP2 "
            "(with tensor parallelism too: the params' data x tensor-parallel mesh is used)"
        )
    return Meshes(first.device_mesh, None, tuple(summed_dims(model, first.device_mesh)))


def check_fsdp_layout(trainable: list[Trainable], mesh: DeviceMesh) -> None:
    """Every FSDP2 param on ``mesh`` (1-D, HSDP's 2-D, or FSDP2's data-parallel dim with tensor
    parallelism's) or on named dims of it (a param the tensor-parallel plan left plain, on
    ``mesh["dp"]`` alone: [Note: FSDP2 params on a sub-mesh]), none partial, each local tensor
    contiguous where torch places it."""
    first, first_fqn, _ = next(item for item in trainable if item[0].device_mesh == mesh)
    for param, fqn, _ in trainable:
        if placements_over(param, mesh) is None:
            raise ValueError(
                f"param {fqn!r} has {describe_layout(param)}, but param {first_fqn!r} has "
                f"{describe_layout(first)}: zero-shard expects every param on one mesh (FSDP2's, "
                "or the 2-D data x tensor-parallel mesh that fully_shard and parallelize_module "
                "share), or on named dims of it (fully_shard over mesh['dp'] of a param the "
                "tensor-parallel plan left plain). Build every mesh from one "
                "init_device_mesh(..., mesh_dim_names=...) and slice it by name (mesh['dp'], "
                "mesh['tp'])"
            )
        if any(placement.is_partial() for placement in param.placements):
            raise ValueError(
                f"param {fqn!r} has {describe_layout(param)}: a param with partial values cannot "
                "be stepped shard by shard; params may be sharded (Shard, FSDP2's _StridedShard) "
                "or replicated over each mesh dim"
            )
        local = param._local_tensor
        expected = tuple(region.stop - region.start for region in dtensor_layout(param).region())
        if tuple(local.shape) != expected or not local.is_contiguous():
            raise ValueError(
                f"param {fqn!r} has {describe_layout(param)} and a local tensor of shape "
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
