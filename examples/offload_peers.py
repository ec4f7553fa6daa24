"""torchao's ``CPUOffloadOptimizer`` and FSDP2's ``CPUOffloadPolicy``: the offload peers that
``train_gpt.py --optimizer torchao-offload | fsdp2-offload`` trains with, in the same loop as
zero-shard (``benchmarks/e2e_gpt.py peers``; docs/benchmarks/e2e.md).

- ``torchao-offload``: ``CPUOffloadOptimizer`` (torchao >= 0.7, ``torchao.optim``; earlier
  ``torchao.prototype.low_bit_optim``) over fp32 params, with bf16 autocast in the loop as
  ``--optimizer adamw`` has. It keeps a pinned fp32 host copy of each param of at least 4096
  elements with one fused CPU AdamW each; a post-accumulate-grad hook copies each grad to the host
  as backward makes it, and ``step()`` steps the host copies in the order their grads arrived and
  copies them back. Smaller params (norms, biases) stay on the GPU with one fused AdamW. One GPU
  (CUDA or XPU), one process: it shards nothing.
- ``fsdp2-offload``: ``fully_shard`` on each block, then the root, with ``CPUOffloadPolicy()``:
  fp32 param shards and their grads live on the host, each unit's params are copied to the GPU
  and all-gathered for its forward and backward (cast to ``param_dtype``), grads are
  reduce-scattered in fp32 and copied to the host, where plain ``torch.optim.AdamW`` steps the
  shards on the calling thread. Any number of ranks; runs on the CPU too (gloo, no pinning).

Nothing of either peer is copied here; both are used through their public constructors.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

TORCHAO_MODULES = ("torchao.optim", "torchao.prototype.low_bit_optim")


@functools.cache
def import_torchao_offload() -> type[torch.optim.Optimizer]:
    """torchao's ``CPUOffloadOptimizer`` class; raises ImportError saying why and how to get it."""
    reasons = []
    for module_name in TORCHAO_MODULES:
        try:
            return importlib.import_module(module_name).CPUOffloadOptimizer
        except Exception as err:  # a torchao built for another torch may fail in many ways
            reasons.append(f"{module_name}: {type(err).__name__}: {err}")
    raise ImportError(
        f"torchao CPUOffloadOptimizer does not import ({'; '.join(reasons)}); pip install torchao "
        "(docs/benchmarks/README.md: carried as a wheel to the GPU machines)"
    )


def build_torchao_offload(
    param_groups: list[dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    offload_gradients: bool,
) -> torch.optim.Optimizer:
    """torchao's ``CPUOffloadOptimizer`` wrapping ``torch.optim.AdamW(fused=True)``.

    Args:
        param_groups: torch param groups (params on a CUDA or XPU device); each may set its own
            ``weight_decay``. It takes groups, and gives each param of at least 4096 elements an
            AdamW of its own built from that param's group.
        lr, betas: AdamW's.
        offload_gradients: free each device grad once its copy to the host is queued (less GPU
            memory; wrong under gradient accumulation, torchao says: each micro-batch's copy would
            replace the last one's).
    """
    offload_cls = import_torchao_offload()
    # It pops "params" from the dicts it is given: hand it copies, so the caller's stay whole.
    groups = [dict(group) for group in param_groups]
    return offload_cls(
        groups,
        torch.optim.AdamW,
        offload_gradients=offload_gradients,
        fused=True,
        lr=lr,
        betas=betas,
    )


def torchao_memory_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(accelerator bytes, host bytes) of a ``CPUOffloadOptimizer``'s own memory: the pinned fp32
    host copies of the params and of their grads, and the AdamW state on either device; the
    model's params and grads are not counted (as in zero-shard's ``memory_report``)."""
    # optim_dict (device param -> the AdamW of its host copy) and d_opt (the AdamW of the small
    # params left on the device, or None) are plain attributes of torchao's class.
    sub_optimizers = [*optimizer.optim_dict.values(), optimizer.d_opt]
    tensors = []
    for sub_optimizer in filter(None, sub_optimizers):
        tensors += state_tensors(sub_optimizer)
        if sub_optimizer is not optimizer.d_opt:
            for group in sub_optimizer.param_groups:
                for p_host in group["params"]:
                    tensors += [p_host, p_host.grad]
    return count_bytes(tensors)


def shard_with_fsdp2_offload(
    model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None
) -> nn.Module:
    """``fully_shard`` on each of ``model.blocks``, then on the root, with ``CPUOffloadPolicy``.

    Args:
        model: the GPT, fp32 params on any device (sharded, they move to the host).
        mesh: the data-parallel mesh; its device is where forward and backward run.
        param_dtype: what the params are cast to for forward and backward (None: kept fp32).
            Grads are reduced in fp32.
    """
    # Pinned host memory needs an accelerator; on a CPU-only torch the shards stay pageable.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=offload, mp_policy=mixed)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mixed)
    return model


def build_fsdp2_adamw(
    param_groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float]
) -> torch.optim.Optimizer:
    """Plain ``torch.optim.AdamW`` over FSDP2's host shards (DTensors on the CPU).

    ``fused=True``: DTensor dispatches the fused AdamW op to the local shards (torch >= 2.4,
    pytorch/pytorch#125369), and torch's fused CPU kernel is its fastest CPU AdamW. Run here on
    torch 2.13 (CPU, gloo, 2 ranks, uneven shards). Some versions leak one small DTensorSpec per
    param and step on this path (pytorch/pytorch#188174, #181761): nothing over a benchmark's few
    steps.
    """
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, fused=True)


@contextlib.contextmanager
def fsdp2_no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulates grads unsharded on the device (no reduce-scatter) within the block."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"expected a fully_shard-ed module, got {type(model).__name__}")
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def fsdp2_memory_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(accelerator bytes, host bytes) of the AdamW state over FSDP2's shards (this rank's). The
    fp32 param shards and their grads, also on the host, are the model's and not counted (as in
    zero-shard's ``memory_report``)."""
    return count_bytes(state_tensors(optimizer))


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def count_bytes(tensors: Iterable[torch.Tensor | None]) -> tuple[int, int]:
    """(accelerator bytes, host bytes) of ``tensors``, each counted once; a DTensor by its
    local shard."""
    sizes: dict[int, tuple[bool, int]] = {}  # tensor id -> (on the host, bytes)
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        sizes[id(tensor)] = (local.device.type == "cpu", local.numel() * local.element_size())
    host_bytes = sum(num_bytes for on_host, num_bytes in sizes.values() if on_host)
    device_bytes = sum(num_bytes for on_host, num_bytes in sizes.values() if not on_host)
    return device_bytes, host_bytes
