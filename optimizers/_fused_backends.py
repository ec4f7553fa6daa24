"""The accelerator's sub-optimizer: torch's own, or FusedAdam from apex or TransformerEngine.

apex and TransformerEngine are optional: they are imported only when asked for, and neither is
installed in CI or on the lent GPU machines, so their adapters stay thin (constructor arguments
only) and are unverified (README.md, Status).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ._elementwise import OptimizerSpec, implementation_kwargs

__all__ = ["build_sub_optimizer"]

_FUSED_ADAM_MODULES = {
    "apex": "apex.optimizers",
    "te": "transformer_engine.pytorch.optimizers",
}
_FUSED_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _build_fused_adam(impl: str, cls: type, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if not issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"device_impl={impl!r} implements Adam and AdamW only, got {cls.__name__}")
    module_name = _FUSED_ADAM_MODULES[impl]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"device_impl={impl!r} needs {module_name}, which is not installed; use "
            f"device_impl='torch' (torch's fused AdamW, the default)"
        ) from err
    adam_w_mode = issubclass(cls, torch.optim.AdamW)
    fused_groups = [
        {"params": group["params"], **{k: group[k] for k in _FUSED_ADAM_KEYS if k in group}}
        for group in groups
    ]
    return module.FusedAdam(fused_groups, adam_w_mode=adam_w_mode)


def build_sub_optimizer(
    spec: OptimizerSpec,
    groups: list[dict[str, Any]],
    device_type: str,
    impl: str = "torch",
) -> torch.optim.Optimizer:
    """Builds the user's optimizer over ``groups`` (param lists plus hyperparameters) for
    ``device_type``, with the user's constructor arguments.

    Implementation flags (``fused``, ``foreach``, ...) are replaced by the fastest correct choice
    for the device; the math (lr, betas, weight decay, initial state...) is kept.
    """
    if impl != "torch" and device_type != "cpu":
        return _build_fused_adam(impl, spec.cls, groups)
    return spec.build(groups, implementation_kwargs(spec.cls, device_type))
