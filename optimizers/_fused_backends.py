"""The accelerator's sub-optimizer: torch's own, or FusedAdam from apex or TransformerEngine.

apex and TransformerEngine are optional and imported only when asked for. Their FusedAdam is put
behind :class:`FusedAdamAdapter`, which looks like torch's Adam to the rest of zero-shard (see
[Note: FusedAdam behind torch's interface]).

What is verified: the adapter, against test doubles (tests/optimizers/_fused_adam_doubles.py)
written from TransformerEngine's ``transformer_engine/pytorch/optimizers/fused_adam.py`` (commit
04912bf0) with its kernel ``common/multi_tensor/adam.cu`` (0608bdee), and from apex's
``apex/optimizers/fused_adam.py`` with ``csrc/multi_tensor_adam.cu`` (004da4ed): parity with
torch's Adam/AdamW, state dicts across offload fractions, refusals; on the CPU, and through the
CUDA device path on a GPU (the doubles' torch ops standing for the kernels). What is not: the
real packages and their CUDA kernels never ran (neither is installed in CI or on the GPU machines).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from ._elementwise import IMPL_KEYS, OptimizerSpec, implementation_kwargs, torch_class_run_as_is
from ._kept_lists import keep_step_lists
from ._policy import DeviceImpl
from ._step_hooks import step_unhooked

__all__ = ["FusedAdamAdapter", "build_sub_optimizer"]

_FUSED_ADAM_MODULES = {
    "apex": "apex.optimizers",
    "te": "transformer_engine.pytorch.optimizers",
}
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")  # what FusedAdam reads from a group
_UNSUPPORTED = ("amsgrad", "maximize")  # torch Adam options no FusedAdam implements


def _is_decoupled(cls: type, group: dict[str, Any]) -> bool:
    """Whether ``group`` decays weights as AdamW does (FusedAdam's ``adam_w_mode``)."""
    return bool(group.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW)))


def _check_options(impl: DeviceImpl, cls: type, group: dict[str, Any], adam_w_mode: bool) -> None:
    for key in _UNSUPPORTED:
        if group.get(key):
            raise ValueError(
                f"device_impl={impl!r}: FusedAdam has no {key} variant, got {key}={group[key]!r}; "
                f"use device_impl='torch' (torch's fused kernel) or {key}=False"
            )
    if _is_decoupled(cls, group) != adam_w_mode:
        raise ValueError(
            f"device_impl={impl!r}: FusedAdam decays weights one way for all param groups "
            f"(adam_w_mode={adam_w_mode}), got a group with decoupled_weight_decay="
            f"{_is_decoupled(cls, group)}; use the same in every group, or device_impl='torch'"
        )


class FusedAdamAdapter(torch.optim.Optimizer):
    """apex's or TransformerEngine's FusedAdam with torch Adam's state and step counts.

    [Note: FusedAdam behind torch's interface]
    zero-shard saves, loads, splits and creates state as torch's Adam keeps it: per param
    ``{"step", "exp_avg", "exp_avg_sq"}``, the step count counting the steps that param took.
    FusedAdam keeps one ``step`` per param group instead (counted up at each ``step()`` for every
    group, whether its params had grads or not), keeps only the moments per param, has no
    ``maximize`` or ``amsgrad``, and its ``multi_tensor_apply`` mishandles zero-element tensors
    (an update silently skipped, or out-of-bounds writes: TransformerEngine issues #3202 and
    #3207). So this optimizer holds the state in torch's layout and, at each step, hands
    FusedAdam one param group per (param group, step count) of the params with a grad, each
    group's ``step`` set to that count (FusedAdam adds the step's 1 itself), and their moments
    as FusedAdam's state for that step only. Zero-element params never reach it; their step
    count moves as in torch. FusedAdam has no device-side ``found_inf`` input: ``defaults``
    holds no ``fused``, so DevicePart reads the flag on the host.
    """

    optimizer_cls: type[torch.optim.Optimizer]  # the torch class whose math and state it keeps
    _impl: DeviceImpl  # "apex" or "te", for messages
    _adam_w_mode: bool
    _fused: torch.optim.Optimizer | None  # FusedAdam over the non-empty params; None if none

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        impl: DeviceImpl,
        optimizer_cls: type[torch.optim.Optimizer],
        fused_adam: Callable[..., torch.optim.Optimizer],
    ) -> None:
        groups = [{k: v for k, v in g.items() if k not in IMPL_KEYS} for g in groups]
        adam_w_mode = _is_decoupled(optimizer_cls, groups[0])
        for group in groups:
            _check_options(impl, optimizer_cls, group, adam_w_mode)
        super().__init__(groups, {key: groups[0][key] for key in _HYPER_KEYS})
        self.optimizer_cls = optimizer_cls
        self._impl = impl
        self._adam_w_mode = adam_w_mode
        fused_groups = [
            {"params": params, **{key: group[key] for key in _HYPER_KEYS}}
            for group in self.param_groups
            if (params := [p for p in group["params"] if p.numel()])
        ]
        self._fused = (
            fused_adam(fused_groups, adam_w_mode=adam_w_mode, bias_correction=True)
            if fused_groups
            else None
        )

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The param's state; zeros (as torch's Adam makes at a first step) if it has none."""
        state = self.state[param]
        if not state:
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.zeros((), dtype=scalar)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def check_options(self) -> None:
        """Raises if a group asks for what FusedAdam cannot do (edited after construction)."""
        for group in self.param_groups:
            _check_options(self._impl, self.optimizer_cls, group, self._adam_w_mode)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused_groups: list[dict[str, Any]] = []
        empty: list[dict[str, Any]] = []  # states of zero-element params with a grad
        self.check_options()
        for group in self.param_groups:
            by_count: dict[int, list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue  # no grad, no update, no step counted: like torch
                if not param.numel():
                    empty.append(self._state_of(param))
                    continue
                count = int(self._state_of(param)["step"])
                by_count.setdefault(count, []).append(param)
            hyper = {key: group[key] for key in _HYPER_KEYS}
            for count, params in by_count.items():
                fused_groups.append({"params": params, **hyper, "step": count})
        if fused_groups:
            self._step_fused(fused_groups)
        for state in empty:
            state["step"] += 1
        return loss

    def _step_fused(self, fused_groups: list[dict[str, Any]]) -> None:
        fused = self._fused
        if fused is None:
            raise AssertionError("expected a FusedAdam for the non-empty params, got none")
        # FusedAdam holds the groups and moments for this step only: the hybrid's load_state_dict
        # replaces our state dicts, which FusedAdam must not keep (nor their memory) alive.
        fused.param_groups = [{**fused.defaults, **group} for group in fused_groups]
        for group in fused.param_groups:
            for param in group["params"]:
                state = self.state[param]
                fused.state[param] = {
                    "exp_avg": state["exp_avg"],
                    "exp_avg_sq": state["exp_avg_sq"],
                }
        try:
            step_unhooked(fused)
            stepped = fused.param_groups
        finally:
            fused.param_groups = []
            fused.state.clear()
        for group, asked in zip(stepped, fused_groups, strict=True):
            if group["step"] != asked["step"] + 1:
                raise AssertionError(
                    f"expected FusedAdam to count the group's step from {asked['step']} to "
                    f"{asked['step'] + 1}, got {group['step']}"
                )
            for param in group["params"]:
                self.state[param]["step"] += 1


def _build_fused_adam(
    impl: DeviceImpl, spec: OptimizerSpec, groups: list[dict[str, Any]]
) -> FusedAdamAdapter:
    cls = spec.cls
    # FusedAdam computes torch's Adam/AdamW: not a subclass that changes its step or the state
    # its first step makes.
    adams = (torch.optim.AdamW, torch.optim.Adam)
    if torch_class_run_as_is(cls, adams, ("step", "_init_group")) is None:
        raise ValueError(
            f"device_impl={impl!r} implements torch's Adam and AdamW only, got {cls.__name__}; "
            "use device_impl='torch' (the class's own step)"
        )
    module_name = _FUSED_ADAM_MODULES[impl]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"device_impl={impl!r} needs {module_name}, which is not installed; use "
            f"device_impl='torch' (torch's fused AdamW, the default)"
        ) from err
    return FusedAdamAdapter(groups, impl=impl, optimizer_cls=cls, fused_adam=module.FusedAdam)


def build_sub_optimizer(
    spec: OptimizerSpec,
    groups: list[dict[str, Any]],
    device_type: str,
    impl: DeviceImpl = "torch",
) -> torch.optim.Optimizer:
    """Builds the user's optimizer over ``groups`` (param lists plus hyperparameters) for
    ``device_type``, with the user's constructor arguments.

    Implementation flags (``fused``, ``foreach``, ...) are replaced by the fastest correct choice
    for the device; the math (lr, betas, weight decay, initial state...) is kept. ``impl``
    ``"apex"`` or ``"te"`` puts their FusedAdam behind :class:`FusedAdamAdapter` on an accelerator
    (they have no CPU kernel: on the CPU torch's is used).
    """
    if impl != "torch" and device_type != "cpu":
        return _build_fused_adam(impl, spec, groups)
    optimizer = spec.build(groups, implementation_kwargs(spec.cls, device_type))
    keep_step_lists(optimizer)  # [Note: kept step lists]
    return optimizer
