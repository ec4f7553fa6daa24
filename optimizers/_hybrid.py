"""One rank's optimizer, split by element between the accelerator and the CPU."""

from __future__ import annotations

import copy
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offload import (
    ThreadBudget,
    current_stream,
    intra_op_threads,
    record_event,
    resolve_thread_budget,
)

from ._checks import check_device_scalar, check_param, check_unique
from ._cpu_kernel import select_cpu_kernel
from ._device_part import DevicePart
from ._elementwise import (
    IMPL_KEYS,
    OptimizerSpec,
    StateKeys,
    check_elementwise,
    check_wrappable,
    constructor_defaults,
    probe_state_keys,
)
from ._group_options import (
    GroupsAtBuild,
    check_first_momentum,
    check_impl_flags,
    check_number_options,
    check_wrapped_groups,
    number_options,
    prepare_switched_on_state,
)
from ._host_part import HostPart
from ._host_step import HostStep
from ._policy import DelayedUpdate, OffloadPolicy, StagingKind
from ._records import ParamRecord, collect_grads
from ._speculation import SpeculationCounts
from ._split import DeviceSplit, ParamInfo, plan_split
from ._state import (
    StateEdits,
    StateView,
    check_saved_keys,
    check_saved_state,
    constructor_state,
    gather_main,
    init_state,
    load_main,
    match_saved,
    momentum_buffers,
    record_state,
    reset_state,
    scatter_state,
    state_step_count,
    state_to_take_over,
    torch_state,
    write_state,
)
from ._state_dict_hooks import (
    load_state_dict_with_hooks,
    share_state_dict_hooks,
    state_dict_with_hooks,
)
from ._step_hooks import share_step_hooks

__all__ = ["HybridDeviceOptimizer", "MemoryReport"]

logger = logging.getLogger("zero_shard")


@dataclass(frozen=True)
class MemoryReport:
    """Where the optimizer's memory is (the model's own params and grads not counted), as
    ``memory_report()`` returns it on each rank.

    Attributes:
        device: the params' device (``"cuda:0"``; ``"cpu"`` in a CPU run: both shares on the host).
        device_bytes: the fp32 main weights, main grads and optimizer state of the accelerator's
            share.
        host_bytes: the same for the CPU's share, plus the staging buffers and the twins of
            speculative steps (``OffloadPolicy.speculative``).
        host_staging_bytes: of ``host_bytes``, the staging buffers for host-device copies.
        pinned: whether the staging buffers are pinned; ``None`` when nothing is offloaded.
        num_device_elements, num_host_elements: param elements stepped on each device.
        host_staging: ``OffloadPolicy.host_staging``, with ``"auto"`` resolved.
    """

    device: str  # the params' device ("cuda:0"; "cpu" in a CPU run: both shares on the host)
    device_bytes: int  # fp32 main weights, main grads and state of the accelerator's share
    host_bytes: int  # the same for the CPU's share, plus the staging buffers and the
    #                 twins of speculative steps (OffloadPolicy.speculative)
    host_staging_bytes: int  # of host_bytes: the staging buffers for host<->device copies
    pinned: bool | None  # whether the staging buffers are pinned; None when nothing is offloaded
    num_device_elements: int
    num_host_elements: int
    host_staging: StagingKind  # OffloadPolicy.host_staging, "auto" resolved


_NOT_COPIED = (
    "a HybridDeviceOptimizer cannot be copied or pickled: it holds host buffers, copy streams and "
    "a worker thread. Save its state with opt.state_dict() and load it into a new one with "
    "opt.load_state_dict()"
)


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """An elementwise torch optimizer whose state is split between the accelerator and the CPU.

    ``offload_fraction`` of all parameter elements (the last parameters first, exact to the
    element) keep their fp32 main weights, grads and optimizer state on the CPU and are stepped
    there on a worker thread, chunk by chunk, while the rest is stepped on the accelerator. Grads
    travel device-to-host and weights host-to-device in the model dtype through pinned buffers,
    overlapped with each other and with the accelerator's step. Low-precision (bf16/fp16)
    params get fp32 main weights; fp32 params kept on the accelerator are stepped in place.

    It is a ``torch.optim.Optimizer``: ``param_groups`` are the user's (LR schedulers and manual
    edits reach both devices at the next step), ``state_dict()`` has torch's shape plus
    ``main_param`` (fp32) for low-precision params, and loads into an optimizer with any
    ``offload_fraction``.

    Args:
        params: parameters or param groups, as for any torch optimizer. All on one device.
        optimizer_cls: an elementwise optimizer class (default ``torch.optim.AdamW``).
        offload_fraction: share of elements on the CPU, in [0, 1]; default 0. Shorthand for
            ``policy=OffloadPolicy(fraction=...)``.
        policy: full offload settings (pinning, threads, chunk size, accelerator kernel).
        need_order: every param index over all param groups (as in ``state_dict()``), in the
            order the forward needs the params (a model's order); default, index order. The CPU
            takes the last params of this order (their grads come first in backward, and their
            weights are needed last); :meth:`launch_step` steps their chunks in it, :meth:`step`
            the last first. Param groups that list the norms of every layer apart put the first
            layers' norms last in index order: pass the model's order then.
        **optimizer_kwargs: ``optimizer_cls``'s constructor arguments (lr, betas, weight_decay,
            initial_accumulator_value...). The sub-optimizers of both devices are built with them,
            so the trajectory is ``optimizer_cls``'s. Implementation flags (``foreach``,
            ``fused``) are chosen per device, the math is kept; ``capturable=True`` is ignored
            with a warning and ``differentiable=True`` refused.

    ``optimizer.state[param]`` is the param's state as :meth:`param_state` shows it (``{}`` for a
    frozen param or one without state yet). Edits reach the state as in torch: a tensor written
    in place, an entry set, deleted or popped, the whole entry replaced or cleared.

    Example:
        >>> model = torch.nn.Linear(8, 8)
        >>> opt = HybridDeviceOptimizer(model.parameters(), torch.optim.AdamW,
        ...                             offload_fraction=0.5, lr=1e-3)
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    policy: OffloadPolicy
    _delay: DelayedUpdate | None  # policy.delay: None where every update is exact
    optimizer_cls: type[torch.optim.Optimizer]
    _state_view: StateView  # what `state` shows ([Note: state edits] in _state.py)
    _edits: StateEdits  # copies of the state handed out, written back where edited
    _record_by_param: dict[torch.Tensor, ParamRecord]  # each param's record (by identity)
    _optimizer_spec: OptimizerSpec  # how every sub-optimizer is constructed
    _records: list[ParamRecord] | None  # one per param over all groups; None while building
    _device: DevicePart
    host_num_threads: int | None  # intra-op threads for passes over params on the host (a CPU
    #                               run, FSDP2's CPUOffloadPolicy): its step, norms, clipping;
    #                               None where they are on an accelerator
    _host: HostPart
    _state_keys: list[StateKeys]  # per param group: the state the optimizer keeps per param
    _zero_momentum: set[int]  # ids of SGD momentum buffers made at zeros, not stepped since
    state_started: bool  # a torch optimizer in its place would hold state: a step was launched,
    #                      state was loaded or written (the truth value of ``state``)
    _num_elements: tuple[int, int]  # elements on the accelerator, on the CPU
    _wrapped: weakref.ref[torch.optim.Optimizer] | None  # the optimizer wrap() took over: its
    #                                                     group dicts are ours; None: not wrapped
    _groups_at_build: GroupsAtBuild  # the groups and params the buffers are laid out for
    _number_options: dict[str, Any]  # the options given as numbers, checked at each step
    _param_versions: list[int] | None  # each param's _version once step() or a load last wrote
    #                                    it; None: not taken (no step yet, or by launch_step, or a
    #                                    delayed update's weights still to land)
    _logged_written: bool  # the reload of written params was logged

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        offload_fraction: float | None = None,
        policy: OffloadPolicy | None = None,
        need_order: Iterable[int] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        check_elementwise(optimizer_cls)
        if policy is None:
            policy = OffloadPolicy(fraction=0.0 if offload_fraction is None else offload_fraction)
        elif not isinstance(policy, OffloadPolicy):
            raise TypeError(f"policy must be an OffloadPolicy, got {type(policy).__name__}")
        elif offload_fraction is not None:
            raise ValueError(
                "pass the offload fraction once: either offload_fraction=... or "
                "policy=OffloadPolicy(fraction=...), not both"
            )
        self.policy = policy
        self._delay = policy.delay
        self.optimizer_cls = optimizer_cls
        self._optimizer_spec = OptimizerSpec.of(optimizer_cls, optimizer_kwargs)
        self._records = None
        self._wrapped = None
        # The class's own constructor checks the hyperparameters and supplies their defaults.
        defaults = optimizer_cls([torch.zeros(1)], **optimizer_kwargs).defaults
        super().__init__(params, defaults)
        check_impl_flags(self.param_groups)
        self._number_options = number_options(self.defaults)
        self._need_order = self._checked_order(need_order)
        self._build()
        self._groups_at_build = GroupsAtBuild(self.param_groups)
        self._record_by_param = {record.param: record for record in self._records}
        self._edits = StateEdits()
        # torch's Adagrad holds state from its construction on; most classes from a first step.
        self.state_started = any(
            constructor_state(self._optimizer_spec, group) for group in self.param_groups
        )
        self._param_versions = None
        self._logged_written = False
        self.state = StateView(self._records, self)

    @property
    def state(self) -> StateView:  # type: ignore[override]
        """Each param's state as torch users read and edit it (see ``StateView``)."""
        return self._state_view

    @state.setter
    def state(self, value: Mapping[Any, Any]) -> None:
        view = self.__dict__.get("_state_view")
        if isinstance(view, StateView) and not isinstance(value, StateView):
            view.replace(value)  # optimizer.state = defaultdict(dict): drops every state
        else:
            self._state_view = value  # type: ignore[assignment]  # torch's __init__, then ours

    @classmethod
    def wrap(
        cls,
        optimizer: torch.optim.Optimizer,
        *,
        offload_fraction: float | None = None,
        policy: OffloadPolicy | None = None,
    ) -> HybridDeviceOptimizer:
        """Builds a HybridDeviceOptimizer from an optimizer the user already made.

        Takes its class and constructor arguments (its ``defaults``), its param groups and any
        state it has (main weights then come from the model params; its ``state`` is emptied
        afterwards, so it is not held twice).

        The param groups are shared, not copied: ``hybrid.param_groups[i] is
        optimizer.param_groups[i]``, so an LR scheduler built on ``optimizer`` before wrapping
        still sets the lr the hybrid steps with. The hybrid's steps count as ``optimizer``'s for
        such a scheduler (no "lr_scheduler.step() before optimizer.step()" warning). Step only
        the hybrid from then on; step hooks registered on ``optimizer`` (before or after) run
        around the hybrid's step, given the hybrid. A group added to
        ``optimizer`` afterwards (or its groups replaced, by its ``load_state_dict``) makes the
        next step raise: add every group before wrapping.

        Args:
            optimizer: a torch optimizer of an elementwise class (see ``check_elementwise``).
            offload_fraction: as for the constructor; default 0.
            policy: as for the constructor.

        Example:
            >>> model = torch.nn.Linear(8, 8)
            >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            >>> opt = HybridDeviceOptimizer.wrap(opt, offload_fraction=0.5)
            >>> model(torch.randn(2, 8)).sum().backward()
            >>> opt.step(); sched.step()
            >>> opt.param_groups[0]["lr"]
            0.0005
        """
        if isinstance(optimizer, HybridDeviceOptimizer):
            raise TypeError("the optimizer is already a HybridDeviceOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_wrappable(optimizer)  # (before its class is built again by constructor_defaults)
        saved = None
        if state_to_take_over(optimizer):
            saved = optimizer.state_dict()
            saved["state"] = {key: torch_state(value) for key, value in saved["state"].items()}
        hybrid = cls(
            optimizer.param_groups,
            type(optimizer),
            offload_fraction=offload_fraction,
            policy=policy,
            **constructor_defaults(optimizer),
        )
        if saved is not None:
            hybrid.load_state_dict(saved)
        elif optimizer.state:  # made by its constructor: made again in fp32, held as torch's
            hybrid.state_started = True
        optimizer.state.clear()  # taken over, or made again at construction in fp32
        hybrid._wrapped = weakref.ref(optimizer)
        share_step_hooks(hybrid, optimizer)
        share_state_dict_hooks(hybrid, optimizer)
        return hybrid

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(_NOT_COPIED)

    def __deepcopy__(self, memo: dict[int, Any]) -> HybridDeviceOptimizer:
        raise TypeError(_NOT_COPIED)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group while the optimizer is being built (its constructor calls this);
        afterwards raises ``NotImplementedError``: the flat buffers are laid out at construction.
        Build a new ``HybridDeviceOptimizer`` with every group and carry the state over with
        ``state_dict`` / ``load_state_dict``."""
        if self._records is not None:
            raise NotImplementedError(
                "HybridDeviceOptimizer lays out its flat buffers at construction; build a new one "
                "with every param group (carry the state over with state_dict/load_state_dict)"
            )
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch refuses sets (their order varies between runs)
            params = list(params)  # read a generator once
        # The group itself is kept, as torch does: wrap() shares the wrapped optimizer's groups.
        param_group["params"] = params
        check_unique(params, len(self.param_groups), self.param_groups)
        super().add_param_group(param_group)

    def _build(self) -> None:
        records = [
            ParamRecord(param=param, index=index, group_index=group_index)
            for index, (group_index, param) in enumerate(
                (g, p) for g, group in enumerate(self.param_groups) for p in group["params"]
            )
        ]
        device = records[0].param.device
        for record in records:
            check_param(record.param, record.index, device)
        trainable = [record for record in records if record.param.requires_grad]
        policy, delay, spec = self.policy, self._delay, self._optimizer_spec
        place = {index: position for position, index in enumerate(self._need_order)}
        split = plan_split(
            [ParamInfo(r.param.numel(), r.group_index, r.param.dtype) for r in trainable],
            policy.fraction,
            policy.chunk_numel,
            order=sorted(range(len(trainable)), key=lambda t: place[trainable[t].index]),
        )
        state_keys = [probe_state_keys(spec, group) for group in self.param_groups]
        threads = self._thread_budget(split, device)
        kernel = select_cpu_kernel(
            policy.cpu_kernel, self.optimizer_cls, self.param_groups, split.host_chunks, threads
        )
        self._host = HostPart(
            trainable,
            split.host_chunks,
            self.param_groups,
            spec,
            device,
            pin_memory=policy.pin_memory,
            threads=threads,
            num_state_tensors=max(len(keys.elementwise_keys) for keys in state_keys),
            kernel=kernel,
            staging=policy.host_staging if delay is None else delay.STAGING,
            switch_interval=policy.gil_switch_interval,
            early_copies=delay is None,
            speculative=policy.speculative,
        )
        self._device = DevicePart(
            trainable, split.device_pieces, self.param_groups, spec, device, policy.device_impl
        )
        num_host = split.num_host_elements
        self._num_elements = (split.num_elements - num_host, num_host)
        init_state(trainable, self.optimizer_cls, state_keys)
        self._zero_momentum = momentum_buffers(trainable, self.optimizer_cls)
        self._state_keys = state_keys
        self._records = records

    def _thread_budget(self, split: DeviceSplit, device: torch.device) -> ThreadBudget | None:
        """The CPU threads of the host chunks' steps, and ``host_num_threads`` set; ``None``
        where the CPU steps nothing."""
        keep_free = 0 if self._delay is None else self._delay.CORES_KEPT_FREE
        # Params on the host (a CPU run, FSDP2's CPUOffloadPolicy) are stepped in place by the
        # device part, on the caller's thread: with the budget, not torchrun's one thread.
        on_host = device.type == "cpu" and bool(split.device_pieces)
        threads = None
        if split.host_chunks or on_host:
            threads = resolve_thread_budget(self.policy.num_threads, keep_free=keep_free)
        self.host_num_threads = threads.num_threads if on_host else None
        return threads

    def _sub_groups(self) -> Iterable[tuple[dict[str, Any], dict[str, Any]]]:
        """(sub-optimizer group, the user's group it follows), for both devices."""
        for sub_group, index in self._device.sub_groups():
            yield sub_group, self.param_groups[index]
        for chunk in self._host.chunks:
            yield chunk.optimizer.param_groups[0], self.param_groups[chunk.spec.group_index]

    def _sync_hyperparams(self) -> None:
        # LR schedulers and users edit self.param_groups; the sub-optimizers follow at each step.
        for sub_group, group in self._sub_groups():
            for key, value in group.items():
                if key != "params" and key not in IMPL_KEYS:
                    sub_group[key] = value

    @staticmethod
    def _refuse_unfrozen(record: ParamRecord) -> None:
        raise RuntimeError(
            f"param {record.index} (shape {tuple(record.param.shape)}) has a grad but had "
            "requires_grad=False when the optimizer was built: it holds no state here, and "
            "torch's optimizer would step it. Build the optimizer again after unfreezing params, "
            "or set their .grad to None; nothing was stepped"
        )

    @property
    def skips_on_device(self) -> bool:
        """Whether a step given ``found_inf`` is skipped without the host waiting for the flag:
        the accelerator's sub-optimizer is one of torch's fused ones (or holds nothing), and the
        CPU worker reads the flag itself."""
        return self._device.skips_on_device

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        grad_scale: float | None = None,
        found_inf: torch.Tensor | None = None,
        grad_factor: torch.Tensor | None = None,
    ) -> float | None:
        """Steps every param that has a grad; returns the closure's loss if one is given.

        On return the model params hold the new weights as seen by the current stream: later
        work on it waits for the copies, the host does not. With
        ``OffloadPolicy(delayed_update=True)`` they hold the last step's instead (this step's
        reach them at the next step, or at ``state_dict()``, ``load_state_dict()`` or
        ``reload_model_params()``); the current stream then waits only until the grads were
        copied to the host, so that the next backward may write them.

        Args:
            closure: recomputes the loss, as for any torch optimizer.
            grad_scale: multiplies the grads by this factor in fp32, after they are cast to the
                fp32 main grads (unscaling fp16 loss-scaled grads without underflow). Grads
                that are fp32 already are multiplied in place. Default: none.
            found_inf: a one-element fp32 tensor on the params' device, as the current stream
                will hold it: where it is nonzero the step is skipped, params and state left
                bit-identical. Read on the device by torch's fused kernels and by the CPU worker
                (``skips_on_device``); otherwise the host waits for it. Default: none.
            grad_factor: a one-element fp32 tensor on the params' device, as the current stream
                will hold it (a clip's coefficient): the grads are multiplied by it first, with
                the bits of ``optimizers.scale_grads_`` (``torch._foreach_mul_`` by it; on CUDA
                the factor rounded to bf16 or fp16 grads' dtype, as its fused path takes it).
                The accelerator's share of the grads is multiplied in place; the CPU's share on
                the host as it is stepped, so those grads are left as they were, and a grad
                copied by :meth:`grads_ready` need not be copied again. Default: none.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reload_written_params()
        # Last params first: backward made their grads first.
        pending = self._launch(grad_scale, found_inf, grad_factor, need_order=None)
        if pending.delayed:
            pending.wait_grads_copied()  # completed by the next step, or a state dict's settle
            self._param_versions = None
        else:
            pending.wait()  # the new weights' copies into the params are queued: counted now
            self._note_param_versions()
        return loss

    def _note_param_versions(self) -> None:
        self._param_versions = [record.param._version for record in self._records]

    def _reload_written_params(self) -> None:
        """Params written since ``step()`` or a load last wrote them (a weight constraint such as
        ``p.clamp_()`` after the step, model weights loaded after the optimizer's state) are
        stepped from as they are, as torch steps them: their main weights are reloaded from them
        first (``reload_model_params``; an fp32 param stepped on the accelerator is its own main
        weight). A write through ``.data`` moves no version counter and is not seen."""
        versions = self._param_versions
        if versions is None:
            return
        records = self._records
        written = [r.param for r, v in zip(records, versions, strict=True) if r.param._version != v]
        if not written:
            return
        if not self._logged_written:
            self._logged_written = True
            logger.warning(
                "zero-shard: %d params of a HybridDeviceOptimizer were written since its last "
                "step; their fp32 main weights were reloaded from them (a low-precision param "
                "that holds its main weights' rounding keeps them)",
                len(written),
            )
        self.reload_model_params(written)

    @property
    def step_in_flight(self) -> bool:
        """Whether a step's CPU share is not completed yet (its weights not in the params)."""
        return self._host.pending is not None

    def finish_step(self) -> None:
        """Completes the step in flight, if any (one that ``launch_step`` returned, or a delayed
        update): the CPU share's weights reach the params, as the current stream sees them."""
        self._host.settle()

    @torch.no_grad()
    def launch_step(
        self,
        *,
        grad_scale: float | None = None,
        found_inf: torch.Tensor | None = None,
        grad_factor: torch.Tensor | None = None,
        need_order: Sequence[int] | None = None,
    ) -> HostStep:
        """Starts a step and returns before the CPU's share of it is done.

        The accelerator's share is stepped on the current stream; the CPU's share on the worker
        thread, chunk by chunk in ``need_order`` (every param index over all param groups, as in
        ``state_dict()``, in the order the new weights will be needed; default: the
        constructor's). The returned :class:`HostStep` completes it, from any thread:
        ``wait_for(indices)`` once those params are needed, ``wait()`` for all; each makes the
        current stream see the new weights (a stream wait; the host goes on). ``step``,
        ``state_dict``, ``load_state_dict``, ``reload_model_params`` and ``param_state`` complete
        it first. The CPU share's params must not be read (no forward) before their chunks are
        completed, nor the grads written (no backward) before the whole step is.
        ``grad_scale``, ``found_inf`` and ``grad_factor`` are as for :meth:`step`. With
        ``OffloadPolicy(delayed_update=True)`` past its warm-up the step's ``delayed`` is True:
        its weights are for the next step, which completes it.
        See [Note: deferred host step] in ``optimizers/_host_step.py``.
        """
        order = self._need_order if need_order is None else self._checked_order(need_order)
        return self._launch(grad_scale, found_inf, grad_factor, need_order=order)

    def _checked_order(self, need_order: Iterable[int] | None) -> list[int]:
        num_params = sum(len(group["params"]) for group in self.param_groups)
        if need_order is None:
            return list(range(num_params))
        order = list(need_order)  # (a generator, read once)
        if sorted(order) != list(range(num_params)):
            raise ValueError(
                f"need_order must hold every param index 0..{num_params - 1} once, got "
                f"{order[:10]}{' ...' if len(order) > 10 else ''}"
            )
        return order

    def _launch(
        self,
        grad_scale: float | None,
        found_inf: torch.Tensor | None,
        grad_factor: torch.Tensor | None,
        *,
        need_order: Sequence[int] | None,
    ) -> HostStep:
        check_wrapped_groups(self._groups_at_build, self.param_groups, self._wrapped_optimizer())
        check_number_options(self.param_groups, self._number_options)
        self._host.drop_written_speculations()  # before anything is stepped
        if self._edits.pending:  # they land before the step: not after a speculated one
            self._host.drop_speculations()
        self._edits.apply()  # edits of state handed out land before the step reads it
        self._edits.expire()
        if grad_scale is not None and not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be a finite number, got {grad_scale}")
        device = self._records[0].param.device
        if found_inf is not None:
            check_device_scalar(found_inf, "found_inf", device, "as GradScaler makes it")
        if grad_factor is not None:
            check_device_scalar(grad_factor, "grad_factor", device, "a clip's coefficient")
        # A non-contiguous grad is copied to a temporary here, which the D2H stream reads: the
        # copy records that stream on it, so dropping it is safe (copy_async).
        grads, ignored = collect_grads(self._records)
        if ignored is not None:
            self._refuse_unfrozen(ignored)
        # The grads (and the flags) are final here, before settle() makes the current stream
        # wait for the last step's H2D copies: their D2H copies wait for this, and each for the
        # H2D out of its own staging buffer only, so a delayed update's grads go to the host
        # while its last weights come back.
        grads_final = record_event(current_stream(self._host.engine.device))
        self._host.settle()
        # A delayed update past its warm-up: the updates applied so far are final here.
        delayed = self._delay is not None and self._delay.delays(self._host.num_updates)
        self._mark_stepped()
        self.state_started = True
        self._sync_hyperparams()
        self._host.drop_unmet_speculations()  # before anything reads their step counts
        self._device.check_options()  # refuse before the CPU's share is handed to the worker
        stepping = [self._records[index] for index in grads]
        prepare_switched_on_state(stepping, self.param_groups)
        check_first_momentum(stepping, self._zero_momentum)
        pending = self._host.start(
            grads,
            grad_scale,
            need_order=need_order,
            found_inf=found_inf,
            grad_factor=grad_factor,
            grads_final=grads_final,
            delayed=delayed,
        )
        try:
            # The host's copies read the CPU's share of each grad; the factor writes the rest.
            with intra_op_threads(self.host_num_threads):
                self._device.step(grads, grad_scale, found_inf, grad_factor)
        except BaseException:
            # The worker must not outlive a failed step, and the chunks it stepped must still
            # reach the model.
            pending.wait()
            raise
        return pending

    def _mark_stepped(self) -> None:
        # torch's LR schedulers warn at their first step unless the optimizer they were built on
        # has `_opt_called` set, which only a call through its scheduler-patched `step` does:
        # launch_step() bypasses that on this optimizer, and wrap()'s original is never stepped.
        self._opt_called = True
        wrapped = self._wrapped_optimizer()
        if wrapped is not None:
            wrapped._opt_called = True  # type: ignore[attr-defined]

    def _wrapped_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ``wrap`` took over, while it is alive; ``None``: not wrapped."""
        return None if self._wrapped is None else self._wrapped()

    def grads_ready(self, grads: Mapping[int, torch.Tensor]) -> None:
        """Says that these grads (by param index over all param groups, as in ``state_dict()``;
        each the param's grad or its memory, contiguous) are final for the next step as the
        current stream holds them. With a staging buffer per chunk and no delayed update, the
        CPU's chunks whose grads have all been given since the last step are copied to the host
        now, while backward runs on. The step copies a chunk again unless each of its grads is
        the same memory, its version counter unmoved (no in-place torch op on it); writes that
        bypass the counter (``.data``, raw pointers) are not seen: give only grads nothing writes
        that way ([Note: early grad copies] in ``optimizers/_early.py``). Does nothing with
        bounded staging or while a step is in flight."""
        flat = {}
        num_params = len(self._records)
        for index, grad in grads.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_params:
                raise ValueError(
                    f"grads_ready was given a grad for param {index!r}; the params are numbered "
                    f"0 to {num_params - 1} over all param groups, as in state_dict()"
                )
            param = self._records[index].param
            if grad.numel() != param.numel() or not grad.is_contiguous():
                raise ValueError(
                    f"the grad given for param {index} (shape {tuple(param.shape)}) has shape "
                    f"{tuple(grad.shape)}{'' if grad.is_contiguous() else ', not contiguous'}; "
                    "give the param's grad, contiguous"
                )
            flat[index] = grad.view(-1)
        if self.speculates:
            # The steps speculated from these grads take the groups' options as they are now
            # (a scheduler stepped since the last step), as the step will.
            self._sync_hyperparams()
        self._host.grads_ready(flat)

    @property
    def speculates(self) -> bool:
        """Whether :meth:`grads_ready` may step the chunks it copies now, speculatively (see
        ``OffloadPolicy.speculative``; not in the steps after redone ones): no step is in
        flight."""
        return self._host.speculates and self._host.pending is None

    @property
    def speculation_counts(self) -> SpeculationCounts:
        """Steps whose CPU share was speculated during backward, by outcome (see
        ``OffloadPolicy.speculative``); a step is counted once it is settled: at the next
        backward's first early copy of a chunk, or when the next step starts."""
        return self._host.speculation_counts

    @property
    def host_staging(self) -> StagingKind:
        """The staging in use, ``"bounded"`` or ``"per_chunk"``: ``OffloadPolicy.host_staging``
        with ``"auto"`` resolved for this host (``"bounded"`` where nothing is offloaded), or
        ``"per_chunk"`` for a delayed update. It says when the grads given to
        :meth:`launch_step` may be written again (see ``OffloadPolicy.host_staging``)."""
        return self._host.staging.kind

    @property
    def copies_grads_early(self) -> bool:
        """Whether :meth:`grads_ready` copies anything: a CPU share with a staging buffer per
        chunk and no delayed update (otherwise it does nothing, and callers need not call it)."""
        return self._host.staging.copies_early and bool(self._host.chunks)

    def drop_grads_ready(self) -> None:
        """Forgets the grads given to :meth:`grads_ready` since the last step, and their copies:
        for when they are cleared before any step (``zero_grad``), so that nothing holds them."""
        self._host.forget_early_copies()

    @torch.no_grad()
    def reload_model_params(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Refreshes fp32 main weights, on the accelerator and the CPU, from the model: of every
        param, or of ``params`` only. Each element of a low-precision param that holds its main
        weight's rounding keeps its main weight (weights swapped out for an evaluation and back,
        or rows restored around others, lose no precision).

        :meth:`step` does it for the params written since it or a load last wrote them (their
        version counters moved: a weight load, ``p.clamp_()``); call it where a write bypassed
        the counters (through ``.data``) or before :meth:`launch_step`, which does not check;
        otherwise the next step would continue from the old main weights.
        """
        self._host.settle()
        indices = None
        if params is not None:
            wanted = {id(param) for param in params}
            indices = {r.index for r in self._records if id(r.param) in wanted}
        self._device.reload_from_params(indices, keep_unchanged=True)
        self._host.reload_from_params(indices, keep_unchanged=True)

    def host_ranges(self, index: int) -> list[tuple[int, int]]:
        """Where the elements of param ``index`` (its position over all groups) that the CPU
        steps lie in its flat param: ``(start, numel)`` per host piece."""
        if self._records is None:
            raise RuntimeError("the optimizer is still being built")
        pieces = self._records[index].pieces
        return [(p.spec.start, p.spec.numel) for p in pieces if p.offset is not None]

    def memory_report(self) -> MemoryReport:
        """Bytes of optimizer memory on each device, and whether the staging is pinned."""
        buffers = self._host.staging.buffers
        return MemoryReport(
            device=str(self._records[0].param.device),
            device_bytes=self._device.num_bytes,
            host_bytes=self._host.num_bytes,
            host_staging_bytes=buffers.num_bytes,
            pinned=buffers.pinned if buffers.views else None,
            num_device_elements=self._num_elements[0],
            num_host_elements=self._num_elements[1],
            host_staging=self.host_staging,
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, plus ``main_param`` (fp32) for low-precision params.

        Tensors of a param kept in one piece are views of the live state; a param cut between
        devices or chunks is presented as a CPU copy. The state-dict hooks registered on this
        optimizer run as torch runs them (the pre-hooks first; a post-hook may return a new
        state dict).
        """
        return state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        self._host.settle()
        states = {
            record.index: self.read_state(record, main_alone=True) for record in self._records
        }
        state = {index: param_state for index, param_state in states.items() if param_state}
        param_groups = []
        for group_index, group in enumerate(self.param_groups):
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = [r.index for r in self._records if r.group_index == group_index]
            param_groups.append(packed)
        return {"state": state, "param_groups": param_groups}

    def read_state(
        self, record: ParamRecord, *, watch: bool = True, main_alone: bool = False
    ) -> dict[str, Any]:
        """The param's state as ``record_state`` shows it, edits of copies handed out before
        written back first. Where the param is in several pieces the tensors are copies (its
        ``step`` too), watched for edits unless ``watch`` is False ([Note: state edits] in
        ``_state.py``). With ``main_alone``, as state dicts show it: a low-precision param of a
        group whose optimizer keeps no state per param (SGD without momentum) holds its fp32
        ``main_param`` alone, which a resume would otherwise take from the rounded param."""
        self.wait_for_worker()  # the worker may be writing it
        self._edits.apply()
        state = record_state(record)
        if main_alone and not state and self._keeps_no_state(record):
            state = {"main_param": gather_main(record)}
        if len(record.pieces) > 1:
            first = record.pieces[0].state
            for key, value in state.items():
                # A scalar state (``step``, NAdam's ``mu_product``, ASGD's ``eta``) is the first
                # piece's own tensor, which its next step moves in place: every piece keeps its
                # own, so the copy handed out is a copy, as the joined ones are.
                if torch.is_tensor(value) and value is first.get(key):
                    state[key] = value.clone()
            for key, value in state.items():
                if watch and torch.is_tensor(value):
                    self.hand_out(record.param, key, value)
        return state

    def _keeps_no_state(self, record: ParamRecord) -> bool:
        """Whether ``record`` is a low-precision param stepped by an optimizer that keeps no
        state for it (its group's, as probed at construction)."""
        keys = self._state_keys[record.group_index]
        stateless = not keys.elementwise_keys and not keys.scalar_keys
        return stateless and not record.ignored and record.param.dtype != torch.float32

    def state_is_copied(self, param: torch.Tensor) -> bool:
        """Whether ``param_state(param)`` hands out copies (the param is in several pieces)."""
        return len(self._record_of(param).pieces) > 1

    def watch_live(self, tensor: torch.Tensor) -> None:
        """Watches ``tensor``, which aliases a param's live state but moves a version counter of
        its own (a DTensor over it): written between backward and the step while the step is
        speculated (``OffloadPolicy.speculative``), the step drops its speculations and
        reads the state as written ([Note: speculative host steps] in ``_speculation.py``)."""
        self._host.watch_live(tensor)

    def hand_out(
        self,
        param: torch.Tensor,
        key: str,
        copy: torch.Tensor,
        local: Callable[[torch.Tensor], torch.Tensor] | None = None,
        token: object = None,
    ) -> None:
        """Watches ``copy``, a copy of ``param``'s state ``key`` handed out (or a tensor assigned
        to it): an edit of it is written back, ``local(copy)`` if given, before the state is
        next read or stepped."""
        record = self._record_of(param)

        def write_back(tensor: torch.Tensor) -> None:
            self.wait_for_worker()
            value = tensor if local is None else local(tensor)
            if key == "main_param":  # the fp32 main weight: the param follows it, as after a step
                load_main(record, value)
            else:
                write_state(record, key, value)

        self._edits.hand_out(copy, write_back, record, token)

    def write_state(self, record: ParamRecord, key: str, value: Any, *, watch: bool = True) -> None:
        """Writes ``value`` into the param's state ``key`` (``optimizer.state[param][key] =
        value``); a tensor assigned stays watched for edits (unless ``watch`` is False), as it
        would be torch's state."""
        self.wait_for_worker()
        self._edits.apply()
        write_state(record, key, value)
        self.state_started = True
        if key == "momentum_buffer":  # the user's buffer now, not the zeros made at build
            self._zero_momentum -= momentum_buffers([record], self.optimizer_cls)
        if watch and torch.is_tensor(value):
            self.hand_out(record.param, key, value)

    def reset_state(self, records: Sequence[ParamRecord]) -> None:
        """The params' state as before their first step (``del optimizer.state[param]``): see
        ``reset_state`` in ``_state.py``."""
        self.wait_for_worker()
        self._edits.apply()
        self._edits.forget(records)
        for record in records:
            reset_state(record, self.optimizer_cls, self._state_keys[record.group_index])
        self._zero_momentum |= momentum_buffers(records, self.optimizer_cls)
        if {id(record) for record in records} >= {id(record) for record in self._records}:
            self.state_started = False  # optimizer.state.clear(): torch's is empty then

    def wait_for_worker(self) -> None:
        """Returns once no step in flight on the host's worker writes the state any more."""
        self._host.wait_for_worker()

    def _record_of(self, param: torch.Tensor) -> ParamRecord:
        record = self._record_by_param.get(param)
        if record is None:
            raise KeyError(f"a param of shape {tuple(param.shape)} is not in this optimizer")
        return record

    def param_state(
        self, param: torch.Tensor, *, watch: bool = True, main_alone: bool = False
    ) -> dict[str, Any]:
        """One param's state as ``optimizer.state`` shows it (``{}`` before it has any): tensors
        in the param's shape (views of the live state where the param is in one piece, else CPU
        copies, watched for edits unless ``watch`` is False), scalars such as ``step``, and
        ``main_param`` (fp32) for low-precision params; with ``main_alone``, as ``state_dict()``
        shows it (``read_state``)."""
        return self.read_state(self._record_of(param), watch=watch, main_alone=main_alone)

    def write_param_state(
        self, param: torch.Tensor, key: str, value: Any, *, watch: bool = True
    ) -> None:
        """``write_state`` of ``param``'s record."""
        self.write_state(self._record_of(param), key, value, watch=watch)

    def reset_param_state(self, params: Sequence[torch.Tensor]) -> None:
        """``reset_state`` of ``params``' records."""
        self.reset_state([self._record_of(param) for param in params])

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict from ``state_dict()`` (any offload fraction) or a torch optimizer.

        Main weights come from ``main_param`` where present, else from the model params.
        Everything is checked before anything changes. The load hooks registered on this
        optimizer run as torch runs them (a pre-hook may return the state dict to load).
        """
        load_state_dict_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._host.drop_kernel_tables()  # settles the step in flight first
        pairs = match_saved(self._records, self.param_groups, state_dict)
        stale = self._edits.stale_copies()
        self._edits.forget()  # the state handed out is replaced, as in torch
        saved_state = state_dict["state"]
        for record, saved_id in pairs:
            if saved_id in saved_state and not record.ignored:
                check_saved_state(record, saved_state[saved_id])
        check_saved_keys(saved_state, [group["params"] for group in state_dict["param_groups"]])
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            # Copies, as torch's load: a tensor option (a scheduler fills it in place) stays the
            # state dict's own, and two optimizers loaded from it do not share it.
            group.update(
                {key: copy.deepcopy(value) for key, value in saved.items() if key != "params"}
            )
        self._sync_hyperparams()
        # Main weights without a saved fp32 copy come from the model. The saved copies may be the
        # very views state_dict() returned, filled in place (DCP): those are not overwritten.
        without_main = {
            record.index
            for record, saved_id in pairs
            if "main_param" not in saved_state.get(saved_id, {})
        }
        self._device.reload_from_params(without_main)
        self._host.reload_from_params(without_main)
        for record, saved_id in pairs:
            if not record.ignored:
                keys = self._state_keys[record.group_index].elementwise_keys
                saved = saved_state.get(saved_id)
                if saved is not None and stale and any(id(v) in stale for v in saved.values()):
                    saved = _live_for_stale(record, saved, stale)
                scatter_state(record, saved, keys)
        loaded = momentum_buffers(self._records, self.optimizer_cls)
        init_state(self._records, self.optimizer_cls, self._state_keys)
        self._zero_momentum = momentum_buffers(self._records, self.optimizer_cls) - loaded
        self._host.num_updates = state_step_count(self._records)
        self.state_started = bool(saved_state)  # torch's state is what was loaded
        self._note_param_versions()  # the loaded main weights are in the params


def _live_for_stale(record: ParamRecord, saved: dict[str, Any], stale: set[int]) -> dict[str, Any]:
    """``saved`` with the live state in place of each tensor that is a copy handed out before the
    last step: torch's state dict holds the live state itself, so loading one kept since then
    (``sd = opt.state_dict()``, steps, ``opt.load_state_dict(sd)``) changes nothing there
    ([Note: state edits])."""
    live = record_state(record)
    return {key: live[key] if id(value) in stale else value for key, value in saved.items()}
