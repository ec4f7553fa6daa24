"""ZeroShardOptimizer: an elementwise torch optimizer sharded over data-parallel ranks."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from optimizers import (
    GroupsAtBuild,
    HybridDeviceOptimizer,
    MemoryReport,
    OffloadPolicy,
    SpeculationCounts,
    check_saved_keys,
    constructor_defaults,
    has_step_post_hooks,
    load_state_dict_with_hooks,
    share_state_dict_hooks,
    share_step_hooks,
    state_dict_with_hooks,
    state_to_take_over,
    torch_state,
)

from ._buckets import ShardedParam, shard_grads
from ._collectives import AllGather
from ._gather import DelayedUpdate
from ._kind import Kind, Meshes
from ._names import canonical_names, module_state_key
from ._norms import clip_coefficient, global_norm, nonfinite_flag, scale_grads_
from ._owners import claim, live_owners
from ._released_ops import GradEdits
from ._setup import (
    NONFINITE_POLICIES,
    Nonfinite,
    StaleParams,
    check_inputs,
    choose_kind,
    ensure_process_group,
    first_device,
    reduce_device,
)
from ._skips import SkipCount
from ._stale import StaleCheck
from ._state_dict import (
    ShardedStateView,
    check_origin,
    check_saved_groups,
    keyed_by_position,
    local_state_dict,
    named_as_saved,
    sharded_state,
    tag_origin,
    to_dtensor,
)
from ._torch_calls import TorchCall, host_layout, torch_call, without_unloaded_mains
from ._units import Units
from ._verdict import on_every_rank

__all__ = ["NONFINITE_POLICIES", "ZeroShardOptimizer"]

# 256 MiB buckets beat 64 MiB ones on 2 x H200 for the step and a GPT iteration alike
# (docs/benchmarks/zero_step.md): NCCL reaches ~80% of its large-message bandwidth from there.
DEFAULT_BUCKET_MB = 256.0


class HandedGrad(NamedTuple):
    """A reduced grad handed out by ``main_grad``: the DTensor and its version when last looked
    at (held until the step or ``zero_grad``: an edit of a temporary, ``main_grad(p).add_(...)``,
    leaves nothing else to look at)."""

    dtensor: DTensor
    version: int
    local: torch.Tensor  # the grad itself: the DTensor's local tensor


def _fingerprint(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each grad's norm (its local tensor's, for a DTensor), in fp32: what a change of the grads
    changes. Read by value, not by version counter: an in-place multi-tensor op on DTensors
    (torch's clip on FSDP2 grads) moves no counter."""
    local = [grad._local_tensor if isinstance(grad, DTensor) else grad for grad in grads]
    if not local:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32))


def _refuse_between_backward_and_step(previous: list[ZeroShardOptimizer]) -> None:
    """A wrap between a backward and its step: the backward's grads were reduced into the
    buffers of the wrappers it replaces (the model's ``.grad`` holds their placeholders), and
    the new one would step none of them. Raised before anything changes."""
    if any(owner.kind.holds_unstepped_grads() for owner in previous):
        raise RuntimeError(
            "zero_shard.wrap came between a backward and its step(): that backward's grads were "
            "reduced into the ZeroShardOptimizer this wrap would take the params over from, and "
            "the new wrapper would step none of them. Call zero_grad() on the old wrapper (or "
            "step() it) first and run the backward after wrapping; nothing changed"
        )


_NOT_COPIED = (
    "a ZeroShardOptimizer cannot be copied or pickled: it holds the model's hooks, process "
    "groups and this rank's shards. Save its state with opt.state_dict() (or "
    "zero_shard.checkpoint.save) and load it into a new wrapper with opt.load_state_dict()"
)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _origin() -> tuple[int, int]:
    """This rank and the world size: whose rows a state dict's DTensors hold."""
    if not dist.is_initialized():  # one process alone
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class ZeroShardOptimizer(torch.optim.Optimizer):
    """An elementwise torch optimizer whose state is sharded over the data-parallel ranks.

    Built by :func:`wrap`, which takes this constructor's arguments and documents them. Each model
    param's fp32 main weight, grad and optimizer state are split by rows over the mesh
    (``Shard(0)``, ``torch.chunk`` semantics, as FSDP2; a 0-dim param is kept whole on every rank,
    ``Replicate()``: [Note: 0-dim params]); this rank's rows are stepped by a
    :class:`HybridDeviceOptimizer`, which moves ``offload.fraction`` of them to the CPU.
    ``param_groups`` are the wrapped optimizer's own dicts (LR schedulers built on either work), and
    ``state[param]`` shows a param's state as DTensors with the param's global shape.

    Args:
        optimizer: the torch optimizer to shard (``wrap``'s ``optimizer``).
        model: the model its params belong to (``wrap``'s ``model``).
        offload: ``wrap``'s ``offload``: an ``OffloadPolicy``, or ``None`` (default): no offload.
        mesh: ``wrap``'s ``mesh``, the data-parallel ``DeviceMesh``; ``None`` (default): all
            ranks of the default group, or a DDP model's group.
        stage: ``wrap``'s ``stage``: 2 (default) or 1.
        overlap_param_gather: ``wrap``'s ``overlap_param_gather``; default True.
        bucket_mb: ``wrap``'s ``bucket_mb``, MiB of params per bucket; default 256.
        nonfinite: ``wrap``'s ``nonfinite``: ``"skip"`` (default) or ``"raise"``.
        stale_params: ``wrap``'s ``stale_params``: ``"reload"`` (default) or ``"error"``.
        units: ``wrap``'s ``units``; default ``None`` (the repeated blocks).
        all_gather: ``wrap``'s ``all_gather``; default ``None`` (torch's all-gather).

    See :func:`wrap` for each in full.
    """

    kind: Kind  # the kind of model (plain, DDP, FSDP2...): who communicates (see _kind.py)
    mesh: DeviceMesh
    nonfinite: Nonfinite  # what a step with inf/NaN grads does
    stale_params: StaleParams  # what a step does when params changed under it
    _delay: DelayedUpdate | None  # the delayed update, if on (see [Note: delayed update])
    _stale: StaleCheck  # params written outside the optimizer: reloaded or refused
    _skips: SkipCount  # steps skipped for non-finite grads (see [Note: skip on the device])
    _module: nn.Module  # the model, unwrapped from DDP
    _device: torch.device  # the params' (FSDP2's CPUOffloadPolicy: the host)
    _reduce_device: torch.device  # where norms, flags and verdicts are reduced: the mesh's
    _sharded: list[ShardedParam]  # one per trainable param, in param-group order
    _hybrid: HybridDeviceOptimizer  # steps this rank's shards
    _state_view: ShardedStateView  # what `state` shows
    _meshes: Meshes  # the data-parallel mesh, a tensor-parallel model's 2-D one, the sums' groups
    _groups: list[dist.ProcessGroup]  # the groups the grads are sharded over (norms, inf checks)
    _group_params: list[list[torch.Tensor]]  # per param group, its params at wrap (frozen too)
    _group_fqns: list[list[str]]  # per param group, the FQNs of its params (frozen ones too), as
    #                               the model names them at the last state dict or load (see
    #                               _refresh_fqns), without wrappers' segments ([Note:
    #                               canonical names] in _names.py)
    _group_names_at_wrap: list[list[str]]  # per param group, its params' named_parameters()
    #                                        names at wrap (wrappers' segments in)
    _groups_at_wrap: GroupsAtBuild  # the group dicts and their params that the shards are for
    _building: bool
    _frozen: list[torch.Tensor]  # params of the groups with requires_grad=False at wrap time
    _retired: bool  # a later wrap took its params over: it steps no more
    _alone: bool  # wrapped in one process with no process group: it runs no collective
    _remove_hooks: weakref.finalize  # removes the model hooks, at retirement or collection
    _wrapped: weakref.ref[torch.optim.Optimizer]  # the torch optimizer: its group dicts are ours
    _window_norm: torch.Tensor | None  # the clip norm of the grads since the last step
    _clipped_marker: Any  # the kind's grads_marker() right after that clip
    _grad_scale: float | None  # fp16: the loss scale's inverse, applied in fp32 at the step
    _checked_by_scaler: bool  # GradScaler checked these grads for infs already
    _edits: GradEdits  # in-place changes zero-shard made to the reduced grads: norms computed
    #                    before one are not theirs

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
        nonfinite: Nonfinite = "skip",
        stale_params: StaleParams = "reload",
        units: Units = None,
        all_gather: AllGather | None = None,
    ) -> None:
        if isinstance(optimizer, (ZeroShardOptimizer, HybridDeviceOptimizer)):
            raise TypeError(
                f"the optimizer is already a {type(optimizer).__name__}; wrap the plain torch "
                "optimizer (torch.optim.AdamW(...)) instead"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        device = first_device(optimizer)
        ensure_process_group(device)
        self._alone = not dist.is_initialized()  # one process with no group: no collectives
        # The kind and its mesh first: the checks below share their verdict over it (_verdict).
        self.kind = choose_kind(model, mesh, optimizer)
        self._module, self._meshes = self.kind.module, self.kind.meshes
        self.mesh, self._groups = self._meshes.mesh, self._meshes.groups
        self._reduce_device = reduce_device(self.mesh, device)
        fqns = canonical_names(self._module)  # see [Note: canonical names]
        options = {"offload": offload, "stage": stage, "bucket_mb": bucket_mb,
                   "nonfinite": nonfinite, "stale_params": stale_params}  # fmt: skip
        checked = check_inputs(
            optimizer, self.kind, self._reduce_device, options, units, all_gather=all_gather
        )
        # A param takes one live wrapper (see _owners.py): this one takes over from the ones
        # before, whose last update reaches the params first; they retire once this one is built.
        previous = live_owners([param for param, _, _ in checked.trainable])
        _refuse_between_backward_and_step(previous)
        for owner in previous:
            owner.finish_param_sync()
        self._retired = False
        self.nonfinite = nonfinite
        self.stale_params = stale_params
        self._skips = SkipCount(device)
        self._edits = GradEdits()
        self._handed_grads: list[HandedGrad] = []  # by main_grad, since the last step
        self._scaled_model_grads: torch.Tensor | None = None  # see _unscale_sharded_grads
        self._end_window()
        self._share_param_groups(optimizer, fqns)
        self._device = checked.trainable[0][0].device
        policy = checked.policy
        self.kind.build(
            checked.trainable, checked.units, device=self._device,
            reduce_device=self._reduce_device, stage=stage, bucket_mb=bucket_mb,
            offload_fraction=policy.fraction, all_gather=all_gather,
        )  # fmt: skip
        self._sharded = self.kind.sharded
        if policy.speculative is not False and not self.kind.copies_grads_early:
            if policy.speculative is True:
                warnings.warn(
                    "OffloadPolicy(speculative=True) has no effect for this model: its CPU steps "
                    "start from grads copied to the host as backward reduces them, which "
                    "zero-shard does for a plain model only (not under DDP or FSDP2). Set "
                    "speculative=False or 'auto' to silence this",
                    RuntimeWarning,
                    stacklevel=3,
                )
            policy = dataclasses.replace(policy, speculative=False)  # (no twins held)
        self._hybrid = self._make_hybrid(optimizer, policy)
        self._delay = checked.delay
        self._stale = StaleCheck(self.kind, self._hybrid, device=self._reduce_device)
        self._take_over(optimizer, fqns, previous, overlap=overlap_param_gather)

    # -- construction -----------------------------------------------------------------------

    def _share_param_groups(self, optimizer: torch.optim.Optimizer, fqns: dict[int, str]) -> None:
        """Takes the wrapped optimizer's own group dicts (add_param_group keeps the dict it is
        given): an LR scheduler built on it before wrapping, or any edit of its groups, reaches
        here."""
        self._building = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._building = False
        share_step_hooks(self, optimizer)  # the user no longer steps it: its hooks run here
        self._wrapped = weakref.ref(optimizer)
        self._group_params = [list(g["params"]) for g in self.param_groups]
        self._group_fqns = [[fqns[id(p)] for p in params] for params in self._group_params]
        named = {id(p): name for name, p in self._module.named_parameters()}
        self._group_names_at_wrap = [[named[id(p)] for p in ps] for ps in self._group_params]
        self._groups_at_wrap = GroupsAtBuild(self.param_groups)
        self._frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]

    def _take_over(
        self,
        optimizer: torch.optim.Optimizer,
        fqns: dict[int, str],
        previous: list[ZeroShardOptimizer],
        *,
        overlap: bool,
    ) -> None:
        """Takes the wrapped optimizer's state and the params over (from ``previous`` wrappers
        too), and installs the model hooks. A previous wrapper of the same torch optimizer
        holds its state (the wrap took it over, emptying ``optimizer.state``): that state
        carries over to the params both hold, as a torch optimizer keeps its state."""
        carried = []
        if state_to_take_over(optimizer):  # of a step before, or the user's
            saved = {fqns[id(p)]: torch_state(value) for p, value in optimizer.state.items()}
            self._hybrid.load_state_dict(self._local_state_dict(saved))
            self._hybrid.state_started = True  # on every rank, whatever its shards hold
        elif optimizer.state:  # made by its constructor: made again in fp32, and held as torch's
            self._hybrid.state_started = True
        else:  # read before they retire (the same on every rank: each wraps alike)
            carried = [
                owner._state_dict(TorchCall.NONE)
                for owner in previous
                if owner._wrapped() is optimizer
            ]
        for owner in previous:
            owner._retire()
            if owner._wrapped() is optimizer:
                # A scheduler built on the old wrapper drives the groups of the torch optimizer
                # both wrap, those added since included, as one built on it would.
                owner.param_groups[:] = self.param_groups
        handles = self.kind.install(self, overlap=overlap)
        self._remove_hooks = weakref.finalize(self, _remove_hooks, handles)
        self.state = ShardedStateView(self._sharded, self._hybrid)
        for sharded in self._sharded:
            sharded.record_version()
        claim([sharded.param for sharded in self._sharded], self)
        optimizer.state.clear()  # taken over: not held twice (a scheduler may keep it alive)
        # Its state is the wrapper's from here on (not before: a wrap that failed left it there).
        share_state_dict_hooks(self, optimizer)
        if carried:
            self._load_carried_state(carried)

    def _load_carried_state(self, carried: list[dict[str, Any]]) -> None:
        """Loads the state (main weights included) that previous wrappers of the same torch
        optimizer held for params this one holds too; the others keep their fresh state. The
        group options are this wrapper's (they are the torch optimizer's)."""
        fresh = self._state_dict(TorchCall.NONE)
        mine = {fqn for group in fresh["param_groups"] for fqn in group["params"]}
        found = False
        for saved in carried:
            for fqn, value in saved["state"].items():
                if fqn in mine:
                    fresh["state"][fqn] = value
                    found = True
        if found:
            self._load_state_dict(fresh)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(_NOT_COPIED)

    def __deepcopy__(self, memo: dict[int, Any]) -> ZeroShardOptimizer:
        raise TypeError(_NOT_COPIED)

    @property
    def state(self) -> ShardedStateView:  # type: ignore[override]
        """Each param's state as DTensors, read and edited as torch users do (see
        ``ShardedStateView``)."""
        return self._state_view

    @state.setter
    def state(self, value: Mapping[Any, Any]) -> None:
        view = self.__dict__.get("_state_view")
        if isinstance(view, ShardedStateView) and not isinstance(value, ShardedStateView):
            view.replace(value)  # optimizer.state = defaultdict(dict): drops every state
        else:
            self._state_view = value  # type: ignore[assignment]  # torch's __init__, then ours

    def _make_hybrid(
        self, optimizer: torch.optim.Optimizer, policy: OffloadPolicy
    ) -> HybridDeviceOptimizer:
        """The hybrid optimizer of this rank's shards, with the kind's ``policy``."""
        shard_groups = [
            {
                **self._hyperparams(g),
                "params": [s.shard for s in self._sharded if s.group_index == g],
            }
            for g in range(len(self.param_groups))
        ]
        # Host memory differs between hosts: a rank that cannot hold its share fails all ranks.
        return on_every_rank(
            lambda: HybridDeviceOptimizer(
                shard_groups,
                type(optimizer),
                policy=policy,
                need_order=self.kind.need_order,
                **constructor_defaults(optimizer),
            ),
            mesh=self._meshes.verdict_mesh,
            device=self._reduce_device,
        )

    def _sync_hybrid_groups(self) -> None:
        """The hybrid's groups take the options of this optimizer's (a scheduler's lr)."""
        for group_index, group in enumerate(self._hybrid.param_groups):
            group.update(self._hyperparams(group_index))

    def _hyperparams(self, group_index: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[group_index].items() if k != "params"}

    # -- the public API ---------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group while the wrapper is being built; afterwards raises
        ``NotImplementedError``: the shards are laid out at wrap. Add the group to the torch
        optimizer and wrap it again while this wrapper lives: the new wrapper takes the params'
        state over from this one.

        Example:
            >>> torch_opt.add_param_group({"params": head.parameters(), "lr": 1e-4})
            >>> opt = zero_shard.wrap(torch_opt, model)  # while the old wrapper is alive
        """
        if not self._building:
            raise NotImplementedError(
                "ZeroShardOptimizer lays out its shards at wrap: add the param group to the torch "
                "optimizer before wrapping it, or add it there and wrap that optimizer again, "
                "while this wrapper is alive and before the next backward: "
                "torch_opt.add_param_group(...); opt = zero_shard.wrap(torch_opt, model) takes "
                "the params and their state over from this wrapper"
            )
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate grads locally with no communication, as DDP's
        ``no_sync``; the first backward after it reduces the accumulated grads."""
        with self.kind.no_sync():
            yield

    def finish_param_sync(self) -> None:
        """Waits until the model's params hold the last step's weights: for code that reads or
        writes params between ``step()`` and the next forward (forward, ``state_dict()``,
        ``load_state_dict()`` of the model or of any module, and the next step do it themselves).
        It only waits: every rank need not call it. A param written after ``step()`` but before
        this (or the wait of its forward) raises here, naming it.

        With ``OffloadPolicy(delayed_update=True)`` (one process) it first applies the update
        still in flight: it waits for the CPU step."""
        self.kind.flush()

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
        self._refuse_unfrozen()
        self._finalize_grads()
        clip = self.kind.clip
        if clip is not None:
            clip.apply()  # a clip before: these grads are the clipped ones
        counted, copies = self.kind.norm_grads()
        with self.kind.host_threads():
            norm = global_norm(
                counted, norm_type, self._groups, self._reduce_device, copies=copies,
                rows_from=self.kind.norm_rows_from,
            )  # fmt: skip
        if self._grad_scale is not None:  # fp16 grads still carry the loss scale
            norm = norm * self._grad_scale
        coefficient = clip_coefficient(norm, float(max_norm))
        coefficient = torch.where(torch.isfinite(norm), coefficient, torch.ones_like(coefficient))
        if clip is not None:  # see [Note: clip at the step]
            records = [s for s in self._sharded if s.shard.grad is not None]
            if records:
                clip.defer(records, coefficient)
        elif any([s.shard.grad is not None for s in self._sharded]):
            # In as few pieces as the kind holds them: a bucket's whole shard (its padding and
            # the slots of absent grads hold zeros, which stay zeros).
            with self.kind.host_threads():
                scale_grads_(self.kind.edited_grads(), coefficient)
            self._edits.count += 1
            if self._scaled_model_grads is not None:  # this edit is ours
                self._scaled_model_grads = _fingerprint(self.kind.model_grads())
        self._window_norm = norm
        self._clipped_marker = self.kind.grads_marker()
        return norm

    @torch.compiler.disable  # a compiled train step runs it eagerly: see [Note: compiled models]
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Steps this rank's shards and gathers the new weights into the model's params.

        With ``overlap_param_gather`` it returns once the accelerator's share is stepped: the
        CPU's share and the gathers go on in the background, and the next forward's unit
        pre-hooks wait for the params each unit reads. An error of the CPU step or of a gather
        then surfaces there. Until then the params may hold old or partly updated weights: code
        that reads or writes them in between (an EMA, a weight constraint) calls
        :meth:`finish_param_sync` first; step post-hooks (``register_step_post_hook`` on this
        optimizer or the torch optimizer it wraps, or global ones) run after it has waited, as
        they would after torch's step. Raises if the wrapped torch optimizer's param groups
        changed since wrap (``torch_opt.add_param_group``), before anything runs.
        """
        wrapped = self._wrapped()
        self._check_steppable(wrapped)  # before anything runs
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._refuse_unfrozen()  # the closure's backward may have given them grads
        if wrapped is not None:  # an LR scheduler built on it checks that it stepped
            wrapped._opt_called = True  # type: ignore[attr-defined]
        # Gathers of the last step read the shards this step writes: they must be done (a
        # delayed update's are issued below, after this step's launch completed its writes).
        self.kind.finish()
        # The ranks' writes are agreed on in the background while the host readies the step;
        # with nothing to agree on, they are checked at once (a model converted since wrap is
        # refused there, before its grads are reduced).
        written = self._stale.start()
        if written is None:
            self._stale.check(self.stale_params, agree=True)
        self._sync_hybrid_groups()
        self._finalize_grads()
        self._refuse_scaled_grads_changed()
        if self._window_norm is not None and self.kind.grads_marker() != self._clipped_marker:
            self._window_norm = None  # grads changed since the clip: its norm is not theirs
        self._skips.read(block=True)  # the last step's verdict, on the host long since
        if written is not None:
            self._stale.check(self.stale_params, agree=True, written=written)
        clip, grad_factor = self.kind.clip, None
        try:
            skip, found_inf = self._check_nonfinite()
            if skip:
                return loss
            grad_factor = None if clip is None else clip.take()
            host_step = self._hybrid.launch_step(
                grad_scale=self._grad_scale,
                found_inf=found_inf,
                grad_factor=grad_factor,
            )
            if clip is not None and grad_factor is not None:
                clip.read_by(host_step)
            self.kind.after_step(host_step)
        finally:
            if clip is not None and grad_factor is None:  # a factor the step did not take
                clip.apply()  # (skipped, or differing between grads)
            self._end_window()
            self.kind.end_window()
        self._skips.read(block=False)  # at once where the device is the CPU
        if has_step_post_hooks(self) and self._delay is None:
            # torch runs them as this returns, and they read the step's params (an EMA's
            # update): the CPU's share and the gathers are waited for first. (A delayed update's
            # params lag by a step by design: finishing it here would take the lag away.)
            self.finish_param_sync()
        return loss

    def _check_steppable(self, wrapped: torch.optim.Optimizer | None) -> None:
        """Refuses a step of a retired wrapper, or of one whose torch optimizer's groups changed
        (rank-local: each rank made the same calls)."""
        owners = [("ZeroShardOptimizer", self.param_groups)]
        if wrapped is not None:
            owners.append((f"wrapped {type(wrapped).__name__}", wrapped.param_groups))
        for owner, groups in owners:
            change = self._groups_at_wrap.change(groups)
            if change is None:
                continue
            raise RuntimeError(
                f"the param_groups of the {owner} changed after wrap ({change}), and this "
                "wrapper would not step them so: it lays out its shards at wrap. Put every param "
                "in its group before wrapping, or wrap the torch optimizer again after the "
                "change, while this wrapper is alive and before the next backward: opt = "
                "zero_shard.wrap(torch_opt, model) takes the params and their state over from "
                "this wrapper. Load state into the wrapper (opt.load_state_dict), not into "
                "torch_opt"
            )
        self._check_still_alone()
        if self._retired:
            raise RuntimeError(
                "this ZeroShardOptimizer was retired: a later zero_shard.wrap over its params took "
                "them over (as a new torch optimizer replaces an old one). Step the new wrapper, "
                "and build LR schedulers on it. Where two optimizers are meant to share params "
                "(an actor and a critic over one trunk), zero-shard gives each param one "
                "optimizer: put the shared params in one of them (or in a third) and the rest in "
                "the others, with disjoint params"
            )
        self._refuse_unfrozen()  # before the stale check may reload anything

    def _check_still_alone(self) -> None:
        """Refuses to go on where a wrapper made in one process with no group finds a group of
        more ranks: its grads, norms and state would be this rank's alone."""
        if self._alone and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "this ZeroShardOptimizer was wrapped in one process with no process group, so it "
                f"shards over that process alone; init_process_group has since made a group of "
                f"{dist.get_world_size()} ranks, whose grads it would never average. Wrap again "
                "after init_process_group, on every rank"
            )

    def _retire(self) -> None:
        """A later ``wrap`` over some of these params took them all over: the model's hooks go,
        and ``step()`` raises from now on (the last update reached the params before)."""
        self.finish_param_sync()
        self._remove_hooks()
        self._retired = True

    def _on_skipped_step(self) -> None:
        """``zero_shard.GradScaler`` skipped ``step()`` (non-finite fp16 grads): a delayed update
        in flight still reaches the params here, as a step that skips would apply it."""
        if self._delay is not None:
            self.kind.flush()

    @property
    def num_skipped_steps(self) -> int:
        """Steps skipped for non-finite grads so far (including the last one's verdict)."""
        self._skips.read(block=True)
        return self._skips.num_skipped

    @property
    def speculation_counts(self) -> SpeculationCounts:
        """This rank's steps whose CPU share was speculated during backward
        (``OffloadPolicy.speculative``), by outcome: stood as speculated, or redone (a clip, a
        changed option, state written since) or forgotten (a skipped step). The step in flight is counted
        once the next one starts."""
        return self._hybrid.speculation_counts

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's grads and this rank's reduced grads."""
        super().zero_grad(set_to_none)
        if self.kind.clip is not None:
            self.kind.clip.end()  # the grads are gone: nothing left to multiply
        self.kind.reset()
        self._hybrid.drop_grads_ready()
        for sharded in self._sharded:
            sharded.shard.grad = None
        self._end_window()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refreshes every fp32 main weight (accelerator and CPU) from the model's params: call
        it on every rank after loading model weights (fine-tuning from a model-only checkpoint).
        Each element of a low-precision param that holds exactly its main weight's rounding
        keeps its main weight (it holds what the optimizer set: nothing new to load).

        The last step's update reaches the params first. Weights loaded through a module's
        ``load_state_dict`` (or DCP into ``model.state_dict()``) land after it; a param written
        in place (``copy_``) right after ``step()``, before ``finish_param_sync()``, raised the
        error of :meth:`finish_param_sync` here instead, as its write raced the update.
        """
        self.finish_param_sync()
        self.kind.refresh_shards(self._sharded)
        self._hybrid.reload_model_params()
        for sharded in self._sharded:
            sharded.record_version()
        self._stale.all_reloaded()  # every rank reloads every param here

    def state_dict(self) -> dict[str, Any]:
        """The state keyed by param FQN, shaped as DCP's ``get_optimizer_state_dict`` shapes a
        torch optimizer's over FSDP2: ``{"state": {fqn: {"step", "exp_avg", ...}},
        "param_groups": [{..., "params": [fqn, ...]}]}``. Param-shaped tensors are DTensors of
        the param's global shape holding this rank's rows (live views where a shard is in one
        piece, copies where it straddles devices or chunks), plus ``main_param`` (fp32) for
        low-precision params. Save it with ``torch.distributed.checkpoint`` on every rank.

        The state-dict hooks registered on this optimizer run as torch runs them: each pre-hook
        before anything is read, then each post-hook, which may return a new state dict. They
        run wherever this method is called: by ``zero_shard.checkpoint.save`` (and by ``load``,
        for the layout it reads into, as a ``dcp.load`` into ``opt.state_dict()`` runs them),
        by ``zero_shard.full_state_dict`` and by torch's ``get_optimizer_state_dict``, as for a
        torch optimizer.

        torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` take the wrapper as
        they take a torch optimizer, with any of ``full_state_dict`` and ``cpu_offload``: the
        result is this state dict (gathered, moved to the host), and either loads into the
        wrapper or into a torch optimizer ([Note: torch's optimizer state-dict functions] in
        ``zero_shard/_torch_calls.py``).
        """
        call = torch_call(sys._getframe(1))
        return state_dict_with_hooks(self, lambda: self._state_dict(call))

    def _refresh_fqns(self) -> None:
        """Names the params as the model names them now, as torch's state-dict functions do at
        each call: a model edited after wrap (blocks reordered, activation checkpointing or a
        parametrization or pruning applied) renames params it keeps, and a state dict keyed by
        the names at wrap would hand their state to other params on a load. A param the model no
        longer holds keeps its name; where that name is now another of its params', the names
        stay as they were. Raises where the model holds, under a name of a param this optimizer
        steps, another param (replaced after wrap): its state and main weight would be saved
        as that param's, and a load would put them there."""
        current = canonical_names(self._module)
        held = set(current.values())
        # (A DTensor param's name holds another param at times: FSDP2 swaps in the unsharded
        # one between forward and reshard, DDP the local one for tensor parallelism.)
        replaced = sorted(
            s.fqn
            for s in self._sharded
            if id(s.param) not in current and s.fqn in held and not isinstance(s.param, DTensor)
        )
        if replaced:
            raise RuntimeError(
                f"the model's params {replaced[:5]} are not the params this optimizer steps "
                "under those names: they were replaced after wrap (a new nn.Parameter assigned, "
                "load_state_dict(..., assign=True), to_empty()), and the optimizer steps the "
                "old ones, which the model no longer holds (as a torch optimizer would: the "
                "model's new params are not trained). Its state would be saved as theirs. Wrap "
                "a torch optimizer over the model's params again (zero_shard.wrap("
                "torch.optim.AdamW(model.parameters(), ...), model)), or load weights in place "
                "(load_state_dict without assign=True, then opt.reload_model_params())"
            )
        renamed = [
            [current.get(id(p), fqn) for p, fqn in zip(params, fqns, strict=True)]
            for params, fqns in zip(self._group_params, self._group_fqns, strict=True)
        ]
        names = [fqn for fqns in renamed for fqn in fqns]
        if len(set(names)) != len(names):
            return
        self._group_fqns = renamed
        for sharded in self._sharded:
            sharded.fqn = current.get(id(sharded.param), sharded.fqn)

    def _state_dict(self, call: TorchCall) -> dict[str, Any]:
        self._check_still_alone()
        self.finish_param_sync()
        self._refresh_fqns()
        layout = call is TorchCall.LOAD_LAYOUT
        if not layout:  # a load's layout: the load replaces the main weights
            self._stale.check(self.stale_params)
        state = {}
        for sharded in self._sharded:
            param_state = sharded_state(sharded, self._hybrid, keep_device=True, main_alone=True)
            if layout:
                param_state = host_layout(param_state)
            if param_state:
                state[sharded.fqn] = param_state
        param_groups = [
            {**self._hyperparams(index), "params": list(fqns)}
            for index, fqns in enumerate(self._group_fqns)
        ]
        tag_origin(state, _origin())
        state_dict = {"state": state, "param_groups": param_groups}
        if call is not TorchCall.NONE:  # torch numbers the params, then names them itself
            return keyed_by_position(state_dict, self._group_fqns)
        return state_dict

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a state dict keyed by FQN: from ``state_dict()`` (DTensors, filled in place by
        ``dcp.load``, or of another world size or offload fraction) or with full tensors (a
        consolidated checkpoint, ``get_optimizer_state_dict(..., full_state_dict=True)`` of this
        wrapper or of a torch optimizer over the same model). Main weights come from
        ``main_param`` where present, else from the model's params; the model's params are then
        refreshed from the main weights. Everything is checked before anything changes.
        Collective: call it on every rank.

        The load hooks registered on this optimizer run as torch runs them: each pre-hook gets a
        shallow copy of ``state_dict`` and may return the state dict to load instead; each
        post-hook runs once it is loaded (also from ``zero_shard.checkpoint.load``,
        ``zero_shard.load_full_state_dict`` and torch's ``set_optimizer_state_dict``).
        """
        load_state_dict_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._check_still_alone()
        # The last step's update reaches the params first: where the state dict holds no
        # main_param, the main weights come from them.
        self.finish_param_sync()
        # Ranks may be handed different state dicts: a refusal on one refuses on all.
        local = on_every_rank(
            lambda: self._checked_local_state_dict(state_dict),
            mesh=self._meshes.verdict_mesh,
            device=self._reduce_device,
        )
        saved_groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            # Copies, as torch's load: a tensor option (a scheduler fills it in place) stays the
            # state dict's own, and two optimizers loaded from it do not share it.
            group.update(
                {key: copy.deepcopy(value) for key, value in saved.items() if key != "params"}
            )
        self.kind.refresh_shards(self._sharded)
        for sharded in self._sharded:  # the loaded state wins over the params as they are
            sharded.record_version()
        self._stale.all_reloaded()  # every rank loads every main weight here
        self._hybrid.load_state_dict(local)
        # As for a torch optimizer, and alike on every rank (not from this rank's shards alone).
        self._hybrid.state_started = bool(state_dict["state"])
        self.kind.after_step(None)  # the params become the loaded main weights, rounded
        self.finish_param_sync()

    def _checked_local_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        self._refresh_fqns()
        known = {fqn for fqns in self._group_fqns for fqn in fqns}
        state_dict = without_unloaded_mains(named_as_saved(state_dict, known))
        check_saved_groups(state_dict, self._group_fqns)
        check_saved_keys(state_dict["state"], [g["params"] for g in state_dict["param_groups"]])
        check_origin(state_dict["state"], _origin())
        return self._local_state_dict(state_dict["state"], state_dict["param_groups"])

    def _local_state_dict(
        self,
        saved: Mapping[str, dict[str, Any]],
        saved_groups: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The rank's share of ``saved``, for the hybrid, with each group's options as this
        optimizer's groups hold them, or as ``saved_groups`` (a load's) hold them."""
        num_groups = len(self.param_groups)
        sizes = [sum(1 for s in self._sharded if s.group_index == g) for g in range(num_groups)]
        hyperparams = [self._hyperparams(g) for g in range(num_groups)]
        if saved_groups is not None:
            hyperparams = [
                {**options, **{k: v for k, v in group.items() if k != "params"}}
                for options, group in zip(hyperparams, saved_groups, strict=True)
            ]
        return local_state_dict(saved, self._sharded, sizes, hyperparams)

    def main_grad(self, param: torch.Tensor) -> DTensor | None:
        """The param's reduced grad as a DTensor (``Shard(0)`` over the mesh, ``Replicate()``
        for a 0-dim param; the param's global shape), or ``None`` if it has none; valid from the
        end of a backward (one outside ``no_sync()``) until ``zero_grad``. It communicates
        nothing: any rank may call it. Under fp16 loss scaling it still carries the scale until
        the step."""
        for sharded in self._sharded:
            if sharded.param is param:
                self._finalize_grads(reduce=False)  # no collective: any rank may call it
                if self.kind.clip is not None:  # a clip's factor not applied yet
                    self.kind.clip.apply()
                grad = sharded.shard.grad
                if grad is None:
                    return None
                dtensor = to_dtensor(sharded, grad)
                self._handed_grads.append(HandedGrad(dtensor, dtensor._version, grad))
                return dtensor
        raise KeyError(f"a param of shape {tuple(param.shape)} is not optimized here")

    def _named_params(self, module: nn.Module) -> list[tuple[str, torch.Tensor]] | None:
        """(key in ``module.state_dict()``, param) of every param this optimizer holds, if it was
        built for ``module``: its name in the module now, else its name at wrap."""
        if module is not self._module:
            return None
        current = {id(p): name for name, p in module.named_parameters()}
        return [
            (module_state_key(current.get(id(param), at_wrap)), param)
            for params, names in zip(self._group_params, self._group_names_at_wrap, strict=True)
            for param, at_wrap in zip(params, names, strict=True)
        ]

    def memory_report(self) -> MemoryReport:
        """Where this rank's optimizer memory is: the hybrid optimizer's report, with this
        rank's model-dtype shards and reduced-grad buffers added to the accelerator's bytes."""
        report = self._hybrid.memory_report()
        extra = self.kind.device_bytes()
        return dataclasses.replace(report, device_bytes=report.device_bytes + extra)

    # -- internals --------------------------------------------------------------------------

    def _end_window(self) -> None:
        self._edits.count += 1
        self._handed_grads.clear()
        self._scaled_model_grads = None
        self._window_norm = None
        self._clipped_marker = None
        self._grad_scale = None
        self._checked_by_scaler = False

    def _finalize_grads(self, *, reduce: bool = True) -> None:
        """Makes each shard's ``.grad`` its reduced grad (or ``None``), as of the current stream;
        ``reduce=False``: without reducing grads left unreduced (no collective)."""
        self._check_still_alone()
        self._note_main_grad_edits()
        self.kind.finalize_grads(reduce=reduce)

    def _note_main_grad_edits(self) -> None:
        """An in-place op on a DTensor that ``main_grad`` handed out moves the DTensor's version
        counter, not its local tensor's, which is the grad: such an edit is made visible to
        what watches the grad's counter (the CPU share's early host copies, [Note: early grad
        copies] in optimizers/_early.py; norms computed before it)."""
        for position, handed in enumerate(self._handed_grads):
            if handed.dtensor._version != handed.version:
                torch.autograd.graph.increment_version(handed.local)
                self._edits.count += 1
                self._handed_grads[position] = handed._replace(version=handed.dtensor._version)

    def _refuse_scaled_grads_changed(self) -> None:
        """fp16 grads of a DDP or FSDP2 model carry the loss scale until the step (unscaled in
        fp16 they would underflow; torch's GradScaler refuses them): a change made to them after
        ``unscale_`` (torch's clip, which read their scaled values) would step wrong numbers."""
        then = self._scaled_model_grads
        if then is None:
            return
        now = _fingerprint(self.kind.model_grads())
        # Exactly equal, NaN to NaN: non-finite grads are the scaler's to skip, not a change.
        same = now.shape == then.shape and torch.allclose(
            now, then.to(now.device), rtol=0.0, atol=0.0, equal_nan=True
        )
        if not same:
            raise RuntimeError(
                "fp16 grads of the model were changed after scaler.unscale_(opt) "
                "(torch's clip_grad_norm_ or clip_grad_value_ on the model's params?): zero-shard "
                "keeps a DDP or FSDP2 model's fp16 grads scaled until the step, so torch's clip "
                "read scaled values. Clip with opt.clip_grad_norm_(max_norm), which clips the "
                "unscaled grads; nothing was stepped"
            )

    def _refuse_unfrozen(self) -> None:
        """Params frozen at wrap that have grads now (unfrozen since) hold no shard: torch's
        optimizer would step them, this one cannot. Raised at the clip and the step, before
        anything changes, on each rank that holds such a grad (unfrozen alike everywhere, every
        rank; a grad on some ranks only leaves the others waiting in the step's collectives)."""
        unfrozen = [p for p in self._frozen if p.grad is not None]
        if not unfrozen:
            return
        fqns = canonical_names(self.kind.module)
        names = sorted(fqns.get(id(p), f"<shape {tuple(p.shape)}>") for p in unfrozen)
        shown = f"{names[:5]}{' ...' if len(names) > 5 else ''}"
        raise RuntimeError(
            f"params {shown} had requires_grad=False when the optimizer was wrapped and have "
            "grads now: zero-shard sharded no state for them, and torch's optimizer would step "
            "them. Call opt.zero_grad() and wrap the torch optimizer again (opt = "
            "zero_shard.wrap(torch_opt, model) takes the params and their state over from this "
            "wrapper), then run the backward again; or set their .grad to None. Nothing was "
            "stepped"
        )

    def _check_nonfinite(self) -> tuple[bool, torch.Tensor | None]:
        """Whether this step is skipped for infs or NaNs in the grads (the same on every rank),
        as (known now on the host: skip, the flag for the step's kernels to read instead).

        With ``nonfinite="skip"`` and a sub-optimizer that reads the flag on the device, the host
        does not wait for it: see [Note: skip on the device].
        """
        if self._checked_by_scaler:
            return False, None  # GradScaler checked the same grads and calls step() if finite
        if self._window_norm is not None:
            flag = (~torch.isfinite(self._window_norm)).float()
        else:
            with self.kind.host_threads():
                flag = nonfinite_flag(self.kind.checked_grads(), self._groups, self._reduce_device)
        flag = flag.to(self._device)  # where the step reads it (the params may be on the host)
        on_device = self.nonfinite == "skip" and self._hybrid.skips_on_device
        return self._skips.decide(flag, self.nonfinite, on_device=on_device)

    def _unscale_sharded_grads(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """GradScaler's unscale over this rank's shards, with the verdict shared by all ranks.

        Without fp16 grads they are unscaled in place. With any fp16 grad, every grad keeps the
        loss scale until the step, which unscales all of them in fp32 (``grad_scale``): fp16
        values would underflow if unscaled in fp16, and one factor must apply to all grads.
        """
        self._finalize_grads()
        if self.kind.clip is not None:  # a clip before: the unscale multiplies the clipped grads
            self.kind.clip.apply()
        grads = shard_grads(self._sharded)
        with self.kind.host_threads():
            flag = nonfinite_flag(self.kind.checked_grads(), self._groups, self._reduce_device)
        found_inf.copy_(flag)
        if any(grad.dtype == torch.float16 for grad in grads):
            self._grad_scale = float(inv_scale)
            # A DDP or FSDP2 model's fp16 grads keep the scale on the params until the step:
            # what changes them there (torch's clip, which reads them scaled) is refused.
            self._scaled_model_grads = _fingerprint(self.kind.model_grads())
        elif grads:
            with self.kind.host_threads():
                scale_grads_(self.kind.edited_grads(), inv_scale)
        self._edits.count += 1
        self._checked_by_scaler = True
        return {found_inf.device: found_inf}
