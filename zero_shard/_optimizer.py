"""ZeroShardOptimizer: an elementwise torch optimizer sharded over data-parallel ranks."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from optimizers import (
    HybridDeviceOptimizer,
    MemoryReport,
    OffloadPolicy,
    check_elementwise,
    constructor_defaults,
)

from ._buckets import Bucket, ShardedParam, build_buckets, local_shard_of
from ._gather import ParamGatherer
from ._norms import clip_coefficient, global_norm, nonfinite_flag
from ._reduce import GradReducer

__all__ = ["NONFINITE_POLICIES", "ZeroShardOptimizer", "wrap"]

logger = logging.getLogger("zero_shard")

NONFINITE_POLICIES = ("skip", "raise")
DEFAULT_BUCKET_MB = 64.0


class ModelKind(enum.Enum):
    """Who reduces the grads and who gathers the params."""

    REPLICATED = "replicated"  # a plain module: zero-shard reduces grads and gathers params
    DDP = "ddp"  # DistributedDataParallel reduces the grads; zero-shard gathers the params
    FSDP = "fsdp"  # FSDP2 (fully_shard): params are sharded DTensors; nothing to communicate


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _unwrap(model: nn.Module) -> tuple[nn.Module, ModelKind]:
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


def _check_options(
    optimizer: Any, offload: Any, stage: Any, bucket_mb: Any, nonfinite: Any
) -> OffloadPolicy:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, (ZeroShardOptimizer, HybridDeviceOptimizer)):
        raise TypeError(
            f"the optimizer is already a {type(optimizer).__name__}; wrap the plain torch "
            "optimizer (torch.optim.AdamW(...)) instead"
        )
    check_elementwise(type(optimizer))
    if offload is None:
        offload = OffloadPolicy(fraction=0.0)
    elif not isinstance(offload, OffloadPolicy):
        raise TypeError(
            f"offload must be a zero_shard.OffloadPolicy or None, got {type(offload).__name__}"
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
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    return offload


def _default_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _check_mesh(mesh: Any, device: torch.device) -> DeviceMesh:
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


class _ShardedStateView(Mapping):
    """``optimizer.state``: model param -> its state as DTensors, built on access."""

    def __init__(self, optimizer: ZeroShardOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def _records(self) -> list[ShardedParam]:
        return self._optimizer()._sharded

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        for sharded in self._records():
            if sharded.param is param:
                return self._optimizer()._sharded_state(sharded)
        raise KeyError(f"a param of shape {tuple(param.shape)} is not optimized here")

    def __iter__(self) -> Iterator[torch.Tensor]:
        optimizer = self._optimizer()
        return iter([s.param for s in self._records() if optimizer._hybrid.param_state(s.shard)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ZeroShardOptimizer(torch.optim.Optimizer):
    """An elementwise torch optimizer whose state is sharded over the data-parallel ranks.

    Built by :func:`wrap`; see there for the arguments. Each model param's fp32 main weight,
    grad and optimizer state are split by rows over the mesh (``Shard(0)``, ``torch.chunk``
    semantics, as FSDP2); this rank's rows are stepped by a :class:`HybridDeviceOptimizer`,
    which moves ``offload.fraction`` of them to the CPU. ``param_groups`` mirror the wrapped
    optimizer's (LR schedulers work), and ``state[param]`` shows a param's state as DTensors with
    the param's global shape.
    """

    kind: ModelKind
    mesh: DeviceMesh
    nonfinite: str  # "skip" or "raise": what a step with inf/NaN grads does
    num_skipped_steps: int  # steps skipped for non-finite grads so far
    _module: nn.Module  # the model, unwrapped from DDP
    _ddp: nn.Module | None  # the DDP wrapper, if any
    _device: torch.device
    _sharded: list[ShardedParam]  # one per trainable param, in param-group order
    _buckets: list[Bucket]  # empty under FSDP2
    _hybrid: HybridDeviceOptimizer  # steps this rank's shards
    _reducer: GradReducer | None  # replicated models only
    _gatherer: ParamGatherer | None  # replicated and DDP models
    _groups: list[dist.ProcessGroup]  # the groups the grads are sharded over (norms, inf checks)
    _building: bool
    _window_norm: torch.Tensor | None  # the clip norm of the grads since the last step
    _grad_scale: float | None  # fp16: the loss scale's inverse, applied in fp32 at the step
    _checked_by_scaler: bool  # GradScaler checked these grads for infs already

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        offload: OffloadPolicy | None = None,
        mesh: DeviceMesh | None = None,
        stage: int = 2,
        overlap_param_gather: bool = True,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        nonfinite: str = "skip",
    ) -> None:
        policy = _check_options(optimizer, offload, stage, bucket_mb, nonfinite)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zero_shard.wrap needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up the "
                "environment); for one process without it, use optimizers.HybridDeviceOptimizer"
            )
        self._module, self.kind = _unwrap(model)
        self._ddp = model if self.kind is ModelKind.DDP else None
        self.nonfinite = nonfinite
        self.num_skipped_steps = 0
        self._reducer = self._gatherer = None
        self._end_window()
        fqns = {id(p): name for name, p in self._module.named_parameters()}
        self._building = True
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._building = False
        trainable = self._trainable_params(fqns)
        self._device = trainable[0][0].device
        self._build_shards(trainable, mesh, stage, bucket_mb)
        shard_groups = [
            {
                **self._hyperparams(g),
                "params": [s.shard for s in self._sharded if s.group_index == g],
            }
            for g in range(len(self.param_groups))
        ]
        self._hybrid = HybridDeviceOptimizer(
            shard_groups, type(optimizer), policy=policy, **constructor_defaults(optimizer)
        )
        if optimizer.state:
            self._hybrid.load_state_dict(self._local_state_of(optimizer))
        self._install(stage, overlap_param_gather)
        self.state = _ShardedStateView(self)  # type: ignore[assignment]

    # -- construction -----------------------------------------------------------------------

    def _trainable_params(self, fqns: dict[int, str]) -> list[tuple[torch.Tensor, str, int]]:
        """(param, fqn, group index) of each trainable param, checked against the model."""
        trainable = []
        for group_index, group in enumerate(self.param_groups):
            for param in group["params"]:
                fqn = fqns.get(id(param))
                if fqn is None:
                    raise ValueError(
                        f"the optimizer holds a param of shape {tuple(param.shape)} that is not a "
                        f"param of the model; wrap the optimizer with the model it optimizes"
                    )
                if not param.requires_grad:
                    continue
                if param.dim() == 0 and self.kind is not ModelKind.FSDP:
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

    def _build_shards(
        self,
        trainable: list[tuple[torch.Tensor, str, int]],
        mesh: DeviceMesh | None,
        stage: int,
        bucket_mb: float,
    ) -> None:
        if self.kind is ModelKind.FSDP:
            param_mesh = trainable[0][0].device_mesh
            if mesh is not None and mesh != param_mesh:
                raise ValueError(
                    "mesh differs from the mesh of the FSDP2 params; leave mesh=None under FSDP2"
                )
            self.mesh = param_mesh
            for param, fqn, _ in trainable:
                if (
                    param.device_mesh != param_mesh
                    or param.placements != trainable[0][0].placements
                ):
                    raise ValueError(
                        f"param {fqn!r} is sharded on another mesh or with other placements "
                        "than the first param; zero-shard expects one FSDP2 layout for all"
                    )
            placements = trainable[0][0].placements
            self._groups = [
                param_mesh.get_group(dim)
                for dim, placement in enumerate(placements)
                if placement.is_shard()
            ]
            self._sharded = [
                ShardedParam(param=p, fqn=fqn, group_index=g, shard=local_shard_of(p))
                for p, fqn, g in trainable
            ]
            self._buckets = []
            if stage == 1:
                warnings.warn(
                    "stage=1 has no effect on an FSDP2 model: FSDP2 reduce-scatters its grads",
                    stacklevel=3,
                )
            return
        self.mesh = _default_mesh(self._device) if mesh is None else _check_mesh(mesh, self._device)
        group = self.mesh.get_group()
        self._groups = [group]
        self._sharded, self._buckets = build_buckets(
            [p for p, _, _ in trainable],
            [fqn for _, fqn, _ in trainable],
            [g for _, _, g in trainable],
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            bucket_bytes=int(bucket_mb * (1 << 20)),
            with_grad_buffers=self.kind is ModelKind.REPLICATED,
        )

    def _install(self, stage: int, overlap_param_gather: bool) -> None:
        handles: list[Any] = []
        if self.kind is not ModelKind.FSDP:
            self._gatherer = ParamGatherer(
                self._buckets, self.mesh.get_group(), overlap=overlap_param_gather
            )
            handles += self._gatherer.register_hooks(self._module)
        if self.kind is ModelKind.REPLICATED:
            self._reducer = GradReducer(
                self._buckets,
                self.mesh.get_group(),
                stage=stage,
                device=self._device,
                before_first=self._gatherer.launch_all,
            )
            handles += self._reducer.register_hooks()
        elif self.kind is ModelKind.DDP and stage == 2:
            logger.info(
                "zero-shard: the model is DDP, which all-reduces the grads; its reduced grads are "
                "used as they are (stage 1). Pass the unwrapped module for stage 2."
            )
        weakref.finalize(self, _remove_hooks, handles)

    def _hyperparams(self, group_index: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[group_index].items() if k != "params"}

    def _local_state_of(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The wrapped optimizer's state cut to this rank's rows, as the hybrid's state dict."""
        state: dict[int, dict[str, Any]] = {}
        for index, sharded in enumerate(self._sharded):
            saved = optimizer.state.get(sharded.param)
            if saved:
                state[index] = {k: self._local_rows(sharded, v) for k, v in saved.items()}
        groups, index = [], 0
        for group_index in range(len(self.param_groups)):
            count = sum(1 for s in self._sharded if s.group_index == group_index)
            groups.append(
                {**self._hyperparams(group_index), "params": list(range(index, index + count))}
            )
            index += count
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _local_rows(sharded: ShardedParam, value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local()
        if not torch.is_tensor(value) or value.shape != sharded.param.shape or value.dim() == 0:
            return value
        spec = sharded.spec
        return value[spec.start_row : spec.start_row + spec.num_rows]

    # -- the public API ---------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise NotImplementedError(
                "ZeroShardOptimizer lays out its shards at construction; add the param group to "
                "the torch optimizer and wrap it again"
            )
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate grads locally with no communication, as DDP's
        ``no_sync``; the first backward after it reduces the accumulated grads."""
        if self.kind is ModelKind.DDP:
            with self._ddp.no_sync():
                yield
            return
        if self.kind is ModelKind.FSDP:
            modules = [
                m for m in self._module.modules() if hasattr(m, "set_requires_gradient_sync")
            ]
            for module in modules:
                module.set_requires_gradient_sync(False, recurse=False)
            try:
                yield
            finally:
                for module in modules:
                    module.set_requires_gradient_sync(True, recurse=False)
            return
        self._reducer.enabled = False
        try:
            yield
        finally:
            self._reducer.enabled = True

    def finish_param_sync(self) -> None:
        """Waits until the model's params hold the last step's weights (for code that reads
        params outside forward; forward, ``state_dict()`` and the next step do it themselves)."""
        if self._gatherer is not None:
            self._gatherer.finish()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the grads of every rank by their global norm, like
        ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, and returns that norm.

        Computed on the accelerator from the reduced shards, before anything moves to the host.
        Call it after backward and before ``step()``. A non-finite norm leaves the grads as they
        are, and the step then follows the ``nonfinite`` policy.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
        self._finalize_grads()
        grads = self._shard_grads()
        norm = global_norm(grads, norm_type, self._groups, self._device)
        if self._grad_scale is not None:  # fp16 grads still carry the loss scale
            norm = norm * self._grad_scale
        coefficient = clip_coefficient(norm, float(max_norm))
        coefficient = torch.where(torch.isfinite(norm), coefficient, torch.ones_like(coefficient))
        if grads:
            torch._foreach_mul_(grads, coefficient)
        self._window_norm = norm
        return norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Steps this rank's shards and gathers the new weights into the model's params.

        With ``overlap_param_gather`` the gathers finish during the next forward.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Gathers of the last step read the shards this step writes: they must be done.
        self.finish_param_sync()
        for group_index, group in enumerate(self._hybrid.param_groups):
            group.update(self._hyperparams(group_index))
        self._finalize_grads()
        try:
            if self._skip_nonfinite():
                return loss
            self._hybrid.step(grad_scale=self._grad_scale)
            if self._gatherer is not None:
                self._gatherer.after_step()
        finally:
            self._end_window()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's grads and this rank's reduced grads."""
        super().zero_grad(set_to_none)
        if self._reducer is not None:
            self._reducer.reset()
        for sharded in self._sharded:
            sharded.shard.grad = None
        self._end_window()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refreshes every fp32 main weight (accelerator and CPU) from the model's params: call
        it on every rank after loading model weights (fine-tuning from a model-only checkpoint)."""
        self.finish_param_sync()
        for sharded in self._sharded:
            if sharded.spec is not None:
                rows = sharded.param.detach().reshape(-1)
                spec = sharded.spec
                sharded.shard.view(-1).copy_(rows[spec.start : spec.start + spec.numel])
        self._hybrid.reload_model_params()

    def main_grad(self, param: torch.Tensor) -> DTensor | None:
        """The param's reduced grad as a DTensor (``Shard(0)`` over the mesh, the param's
        global shape), or ``None`` if it has none; valid between ``clip_grad_norm_``/``step``
        and ``zero_grad``."""
        for sharded in self._sharded:
            if sharded.param is param:
                self._finalize_grads()
                grad = sharded.shard.grad
                return None if grad is None else self._as_dtensor(sharded, grad)
        raise KeyError(f"a param of shape {tuple(param.shape)} is not optimized here")

    def memory_report(self) -> MemoryReport:
        """Where this rank's optimizer memory is: the hybrid optimizer's report, with this
        rank's model-dtype shards and reduced-grad buffers added to the accelerator's bytes."""
        report = self._hybrid.memory_report()
        extra = sum(
            t.numel() * t.element_size()
            for bucket in self._buckets
            for t in (bucket.shard_buffer, bucket.grad_buffer)
            if t is not None
        )
        return MemoryReport(**{**report.__dict__, "device_bytes": report.device_bytes + extra})

    # -- internals --------------------------------------------------------------------------

    def _end_window(self) -> None:
        self._window_norm = None
        self._grad_scale = None
        self._checked_by_scaler = False

    def _finalize_grads(self) -> None:
        """Makes each shard's ``.grad`` its reduced grad (or ``None``), as of the current stream."""
        if self.kind is ModelKind.REPLICATED:
            self._reducer.finish()
            return
        for sharded in self._sharded:
            grad = sharded.param.grad
            if grad is None:
                sharded.shard.grad = None
            elif self.kind is ModelKind.FSDP:
                sharded.shard.grad = grad._local_tensor.detach()
            else:  # DDP reduced the full grad; this rank's rows are a view of it
                spec = sharded.spec
                sharded.shard.grad = grad.detach()[spec.start_row : spec.start_row + spec.num_rows]

    def _shard_grads(self) -> list[torch.Tensor]:
        return [s.shard.grad for s in self._sharded if s.shard.grad is not None]

    def _skip_nonfinite(self) -> bool:
        """Whether this step is skipped for infs or NaNs in the grads (the same on every rank)."""
        if self._checked_by_scaler:
            return False  # GradScaler checked the same grads and calls step() only when finite
        if self._window_norm is not None:
            bad = not bool(torch.isfinite(self._window_norm))
        else:
            bad = bool(nonfinite_flag(self._shard_grads(), self._groups, self._device))
        if not bad:
            return False
        if self.nonfinite == "raise":
            raise RuntimeError(
                "the grads hold an inf or a NaN (on some rank); the step was not taken and the "
                "optimizer state is unchanged. Use nonfinite='skip' to skip such steps"
            )
        self.num_skipped_steps += 1
        warnings.warn(
            f"zero-shard skipped a step: the grads hold an inf or a NaN "
            f"({self.num_skipped_steps} step(s) skipped so far); state and params are unchanged",
            RuntimeWarning,
            stacklevel=3,
        )
        return True

    def _unscale_sharded_grads(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """GradScaler's unscale over this rank's shards, with the verdict shared by all ranks.

        bf16/fp32 grads are unscaled in place; fp16 grads are only checked here and unscaled in
        fp32 at the step (``grad_scale``), where small values cannot underflow.
        """
        self._finalize_grads()
        grads = self._shard_grads()
        local_found = torch.zeros((), dtype=torch.float32, device=self._device)
        in_place = [g for g in grads if g.dtype != torch.float16]
        deferred = [g for g in grads if g.dtype == torch.float16]
        if in_place:
            torch._amp_foreach_non_finite_check_and_unscale_(
                in_place, local_found, inv_scale.to(self._device)
            )
        if deferred:
            local_found = torch.maximum(local_found, nonfinite_flag(deferred, [], self._device))
            self._grad_scale = float(inv_scale)
        for group in self._groups:
            dist.all_reduce(local_found, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(local_found)
        self._checked_by_scaler = True
        return {found_inf.device: found_inf}

    def _as_dtensor(self, sharded: ShardedParam, local: torch.Tensor) -> DTensor:
        param = sharded.param
        if isinstance(param, DTensor):
            mesh, placements = param.device_mesh, param.placements
        else:
            mesh, placements = self.mesh, (Shard(0),)
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    def _sharded_state(self, sharded: ShardedParam) -> dict[str, Any]:
        """The param's state, each param-shaped tensor as a DTensor over the mesh."""
        local = self._hybrid.param_state(sharded.shard)
        return {
            key: self._as_dtensor(sharded, value)
            if torch.is_tensor(value) and value.shape == sharded.shard.shape and value.dim() > 0
            else value
            for key, value in local.items()
        }


def wrap(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    *,
    offload: OffloadPolicy | None = None,
    mesh: DeviceMesh | None = None,
    stage: int = 2,
    overlap_param_gather: bool = True,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    nonfinite: str = "skip",
) -> ZeroShardOptimizer:
    """Shards ``optimizer`` over the data-parallel ranks, optionally offloading to the CPU.

    Call it on every rank, after ``init_process_group`` and after the model is on its device;
    then drop the original optimizer (its state, if any, is taken over).

    Args:
        optimizer: a torch optimizer of an elementwise class (AdamW, Adam, SGD, ...) over the
            model's params, with its param groups (per-group lr, weight decay...).
        model: the model those params belong to: a plain module (replicated on every rank), a
            ``DistributedDataParallel``, or an FSDP2 (``fully_shard``) model.
        offload: how much of each rank's optimizer state moves to the CPU; ``None`` (default)
            keeps everything on the accelerator. ``OffloadPolicy(fraction=1.0)`` moves it all.
        mesh: the 1-D data-parallel ``DeviceMesh``; default: all ranks of the default group.
            Under FSDP2 the params' own mesh is used.
        stage: 2 (default) reduce-scatters grads during backward so each rank keeps only its
            shard; 1 all-reduces them and keeps the local shard. A DDP model's grads, reduced by
            DDP, are used as they are.
        overlap_param_gather: gather the updated params during the next forward (forward
            pre-hooks wait for each bucket), instead of at the end of ``step()``. Default True.
            Every rank must then run that forward, or call ``finish_param_sync()``.
        bucket_mb: MiB of (unsharded) params reduced and gathered together; default 64.
        nonfinite: a step whose grads hold an inf or NaN is skipped with a warning (``"skip"``,
            default) or raises (``"raise"``); either way nothing changes. fp16 loss scaling
            with :class:`zero_shard.GradScaler` skips and backs off as torch's GradScaler does.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        >>> opt = zero_shard.wrap(opt, model, offload=zero_shard.OffloadPolicy(fraction=0.5))
        >>> loss(model(batch)).backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    """
    return ZeroShardOptimizer(
        optimizer,
        model,
        offload=offload,
        mesh=mesh,
        stage=stage,
        overlap_param_gather=overlap_param_gather,
        bucket_mb=bucket_mb,
        nonfinite=nonfinite,
    )
