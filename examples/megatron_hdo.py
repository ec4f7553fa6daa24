"""Megatron-Core's HybridDeviceOptimizer, the peer that ``train_gpt.py --optimizer megatron-hdo``
trains with, in the same loop as zero-shard (docs/benchmarks/e2e.md).

It is built as Megatron-Core builds it for ``optimizer_cpu_offload``
(``megatron/core/optimizer/__init__.py``), with torch's fused AdamW on both devices (what Megatron
falls back to without Transformer Engine or Apex): fp32 master weights for bf16 params
(``param_update_in_fp32``), one CPU AdamW per offloaded param so that the grads' copies to the
host and the weights' copies back overlap the CPU steps (``overlap_cpu_optimizer_d2h_h2d``), and
pinned host grads. It offloads the first params in param-group order until ``offload_fraction``
of the elements are on the host, steps the host's share on the calling thread (torch's intra-op
threads), shards nothing (one process), and needs CUDA: it uses ``torch.cuda`` streams directly.

Only its module is used, and that needs only torch: when the ``megatron.core`` package does not
import (its ``__init__`` pulls in triton, Transformer Engine and more), the module's file is
loaded on its own. Nothing of Megatron is copied here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

PACKAGE = "megatron"
MODULE_PATH = ("core", "optimizer", "cpu_offloading", "hybrid_optimizer")


@functools.cache
def import_hybrid_device_optimizer() -> type[torch.optim.Optimizer]:
    """Megatron-Core's ``HybridDeviceOptimizer`` class; raises ImportError saying how to get it."""
    try:
        return importlib.import_module(".".join((PACKAGE, *MODULE_PATH))).HybridDeviceOptimizer
    except Exception as package_err:  # the package's __init__ fails on optional dependencies
        spec = importlib.util.find_spec(PACKAGE)
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            path = Path(root, *MODULE_PATH).with_suffix(".py")
            if path.exists():
                module_spec = importlib.util.spec_from_file_location("megatron_hdo_module", path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                return module.HybridDeviceOptimizer
        raise ImportError(
            f"megatron-core does not import ({package_err!r}); pip install megatron-core "
            "(only its HybridDeviceOptimizer module is used, and that needs only torch)"
        ) from package_err


def build_hybrid_device_optimizer(
    param_groups: list[dict[str, Any]],
    *,
    offload_fraction: float,
    lr: float,
    betas: tuple[float, float],
) -> torch.optim.Optimizer:
    """Megatron-Core's HybridDeviceOptimizer over ``param_groups`` (params on a CUDA device).

    Args:
        param_groups: torch param groups; each may set its own ``weight_decay``.
        offload_fraction: share of the elements whose fp32 master, grads and AdamW state live
            and are stepped on the host.
        lr, betas: AdamW's.
    """
    hdo_cls = import_hybrid_device_optimizer()
    # A partial, not a class: Megatron tells the two devices' optimizers apart by class only when
    # loading a state dict, which this comparison never does.
    fused_adamw = functools.partial(torch.optim.AdamW, fused=True)
    return hdo_cls(
        param_groups,
        offload_fraction=offload_fraction,
        cpu_optimizer_cls=fused_adamw,
        gpu_optimizer_cls=fused_adamw,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=True,
        pin_cpu_grads=True,
        pin_cpu_params=True,
        lr=lr,
        betas=betas,
    )


def memory_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(accelerator bytes, host bytes) of a HybridDeviceOptimizer's own memory: the fp32 master
    weights and their grads, the AdamW state and the host's grad buffers; the model's params and
    grads are not counted (as in zero-shard's ``memory_report``)."""
    model_params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    sizes: dict[int, tuple[bool, int]] = {}  # tensor id -> (on the host, bytes)
    for sub_optimizer in optimizer.sub_optimizers:
        for group in sub_optimizer.param_groups:
            for param in group["params"]:
                tensors = list(sub_optimizer.state.get(param, {}).values())
                if id(param) not in model_params:  # an fp32 master or a host copy, and its grad
                    tensors += [param, param.grad]
                for tensor in tensors:
                    if isinstance(tensor, torch.Tensor):
                        on_host = tensor.device.type == "cpu"
                        sizes[id(tensor)] = (on_host, tensor.numel() * tensor.element_size())
    host_bytes = sum(num_bytes for on_host, num_bytes in sizes.values() if on_host)
    device_bytes = sum(num_bytes for on_host, num_bytes in sizes.values() if not on_host)
    return device_bytes, host_bytes
