"""Test doubles of apex's and TransformerEngine's FusedAdam, in pure torch, on any device.

Neither package can be installed in CI or on the GPU machines. Each double is written here
(no upstream code copied) from the upstream source its docstring names, and behaves as that
source in every respect zero-shard's adapter (optimizers/_fused_backends.py) depends on: the
constructor's signature and refusals, where ``step`` lives (one count per param group), which
params get state and under which keys, ``step()``'s signature, and the kernel's math
(``multi_tensor_adam`` in fp32, bias corrections computed on the host from the group's step).

The kernels' known hazard is modelled as an error: ``multi_tensor_apply`` (apex
``csrc/multi_tensor_apply.cuh`` at 123854c3; TransformerEngine
``common/multi_tensor/multi_tensor_apply.cuh``) decides when to launch inside a tensor's chunk
loop, which a zero-element tensor never enters, so a group ending with one silently skips the
pending updates and one in the last metadata slot makes later writes go out of bounds
(TransformerEngine issues #3202, #3207; fixed upstream in PR #3212, after the versions followed
here). Here any zero-element tensor reaching the kernel raises ``AssertionError``.

Not modelled (the adapter uses none of them, leaving each at its default): capturable mode and
``grad_scaler``, master weights, fp16/bf16/fp8 states, param remainders, decoupled grads, and
the CUDA-only parts (the overflow buffer on ``cuda``, the ``is_cuda`` checks).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

__all__ = ["ApexFusedAdam", "TransformerEngineFusedAdam", "install_doubles"]


def _float32(value: float) -> float:
    """``value`` as the kernels receive it: a C++ ``float``."""
    return torch.tensor(value, dtype=torch.float32).item()


def multi_tensor_adam(
    grads: list[torch.Tensor],
    params: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    step: int,
    adam_w_mode: bool,
    bias_correction: bool,
    weight_decay: float,
) -> None:
    """The fp32 math of ``multi_tensor_adam`` (apex csrc/multi_tensor_adam.cu at 004da4ed,
    TransformerEngine common/multi_tensor/adam.cu at 0608bdee: the same in both)."""
    for tensors in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True):
        if any(tensor.numel() == 0 for tensor in tensors):
            raise AssertionError(
                "a zero-element tensor reached multi_tensor_apply, which then skips or corrupts "
                "its neighbours' updates (TransformerEngine issues #3202, #3207)"
            )
    beta1, beta2 = _float32(betas[0]), _float32(betas[1])
    # Computed on the host in double from the float betas and the int step, then made float.
    correction1 = _float32(1 - beta1**step) if bias_correction else 1.0
    correction2 = _float32(1 - beta2**step) if bias_correction else 1.0
    for grad, param, exp_avg, exp_avg_sq in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True):
        g, p = grad.float(), param.float()
        if not adam_w_mode:  # L2: the decay joins the grad
            g = g + weight_decay * p
        exp_avg.mul_(beta1).add_((1 - beta1) * g)
        exp_avg_sq.mul_(beta2).add_((1 - beta2) * g * g)
        denom = (exp_avg_sq / correction2).sqrt() + eps
        update = (exp_avg / correction1) / denom
        if adam_w_mode:  # decoupled: the decay joins the update
            update = update + weight_decay * p
        param.copy_(p - lr * update)


class _FusedAdamDouble(torch.optim.Optimizer):
    """What both doubles share: one step count per group, and the fp32 kernel."""

    adam_w_mode: int
    num_launches: int  # kernel launches so far (one per group with grads to step)

    def _init_double(
        self,
        params: Any,
        *,
        lr: float,
        bias_correction: bool,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        adam_w_mode: bool,
    ) -> None:
        """The constructor both share once their own arguments are checked: ``defaults`` holds
        what both FusedAdams keep there (no ``maximize``, no ``fused``)."""
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.num_launches = 0

    def _count_group_step(self, group: dict[str, Any]) -> None:
        # Before anything else, for every group stepped, whether its params have grads or not.
        group["step"] = group["step"] + 1 if "step" in group else 1

    def _launch(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if not params:
            return
        if any(p.dtype != torch.float32 for p in params):
            raise NotImplementedError("the doubles model fp32 params only (the adapter's mains)")
        states = [self.state[p] for p in params]
        multi_tensor_adam(
            [p.grad for p in params],
            params,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            step=group["step"],
            adam_w_mode=bool(self.adam_w_mode),
            bias_correction=bool(group["bias_correction"]),
            weight_decay=group["weight_decay"],
        )
        self.num_launches += 1


def _zero_moments(param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "exp_avg": torch.zeros_like(param, dtype=torch.float32),
        "exp_avg_sq": torch.zeros_like(param, dtype=torch.float32),
    }


class TransformerEngineFusedAdam(_FusedAdamDouble):
    """Double of ``transformer_engine.pytorch.optimizers.FusedAdam``, after NVIDIA/TransformerEngine
    ``transformer_engine/pytorch/optimizers/fused_adam.py`` at commit 04912bf0 (kernel:
    ``transformer_engine/common/multi_tensor/adam.cu`` at 0608bdee).

    - ``__init__(params, lr=1e-3, betas, eps, weight_decay=0.0, amsgrad=False, *,
      bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False, ...)``;
      ``amsgrad=True`` raises ``RuntimeError``. ``defaults`` are lr, bias_correction, betas, eps
      and weight_decay only: no ``maximize`` (never read: a group's ``maximize`` is ignored), no
      ``fused``.
    - ``step(closure=None, grad_scaler=None)``: groups without params are skipped; every other
      group's ``group["step"]`` is counted up first (set to 1 if absent), then every param of the
      group without state gets ``exp_avg`` / ``exp_avg_sq`` (fp32 zeros), with a grad or not,
      and the params with a grad are stepped with the group's count. No ``found_inf`` input
      outside capturable mode; sparse grads raise ``RuntimeError``.
    - ``state_dict()``: torch's, each state value read back by its name through a map of
      ``exp_avg``, ``exp_avg_sq``, ``master_param``: any other per-param key is a ``KeyError``.
    """

    _STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        modelled = (torch.float32, torch.float32, torch.float32, False, False)
        given = (master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype, use_decoupled_grad,
                 store_param_remainders)  # fmt: skip
        if capturable or master_weights or given != modelled:
            raise NotImplementedError("the double models TE's default fp32 path only")
        self._init_double(
            params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
            weight_decay=weight_decay, adam_w_mode=adam_w_mode,
        )  # fmt: skip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            self._count_group_step(group)
            stepped = []
            for param in group["params"]:
                if not self.state[param]:
                    self.state[param].update(_zero_moments(param))
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients.")
                stepped.append(param)
            self._launch(group, stepped)
        return loss

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for key, state in saved["state"].items():
            unknown = [name for name in state if name not in self._STATE_NAMES]
            if unknown:
                raise KeyError(unknown[0])
            saved["state"][key] = dict(state)
        return saved


class ApexFusedAdam(_FusedAdamDouble):
    """Double of ``apex.optimizers.FusedAdam``, after NVIDIA/apex ``apex/optimizers/fused_adam.py``
    at commit 004da4ed (kernel: ``csrc/multi_tensor_adam.cu`` at the same commit).

    - ``__init__(params, lr=1e-3, bias_correction=True, betas, eps, adam_w_mode=True,
      weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, use_master=False)``,
      all positional-or-keyword; ``amsgrad=True`` raises ``RuntimeError``. ``defaults`` are lr,
      bias_correction, betas, eps and weight_decay: no ``maximize``, no ``fused``.
    - ``step(closure=None, grads=None, output_params=None, scale=None, grad_norms=None,
      grad_scaler=None)``: the deprecated arguments raise ``RuntimeError``. Every group reads
      ``group["params"][0].device`` first (a group without params is an ``IndexError``) and
      counts its ``group["step"]`` up (set to 1 if absent); only params with a grad get state
      (``exp_avg`` / ``exp_avg_sq``, fp32 zeros) and are stepped with the group's count. No
      ``found_inf`` input outside capturable mode.
    - ``state_dict()`` / ``load_state_dict()``: torch's.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        use_master: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or use_master:
            raise NotImplementedError("the double models apex's non-capturable path only")
        self._init_double(
            params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
            weight_decay=weight_decay, adam_w_mode=adam_w_mode,
        )  # fmt: skip

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
        grad_scaler: Any = None,
    ) -> Any:
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated: call step() with no arguments")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            _ = group["params"][0].device  # IndexError for a group without params, as upstream
            self._count_group_step(group)
            stepped = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                if not self.state[param]:
                    self.state[param].update(_zero_moments(param))
                stepped.append(param)
            self._launch(group, stepped)
        return loss


DOUBLES: dict[str, tuple[str, type[torch.optim.Optimizer]]] = {
    "te": ("transformer_engine.pytorch.optimizers", TransformerEngineFusedAdam),
    "apex": ("apex.optimizers", ApexFusedAdam),
}


def install_doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``import apex.optimizers`` and ``import transformer_engine.pytorch.optimizers``
    give a module whose ``FusedAdam`` is the double, until the test ends."""
    for module_name, cls in DOUBLES.values():
        module = types.ModuleType(module_name)
        module.FusedAdam = cls  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module_name, module)
