"""Shared pieces of the parity tests: the same params, grads and hyperparameters for a plain
torch optimizer on fp32 copies (the reference) and for HybridDeviceOptimizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from optimizers import HybridDeviceOptimizer

# Odd shapes, a zero-numel param and one longer than the test chunk size.
SHAPES = [(7, 15), (3,), (0,), (16, 16), (5,), (33,)]
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
}
# Tolerances (rtol, atol) on fp32 main weights and states, whose values are O(1) and whose
# updates are O(lr) = O(1e-2).
# OTHER_KERNEL: the reference runs another implementation (torch's single-tensor loop, or another
# device's kernel); the two round differently by about an ulp (1.2e-7 at 1.0) per operation, a
# handful of operations per step, over a few steps.
OTHER_KERNEL = (1e-5, 1e-6)
# SAME_KERNEL: the reference runs the same fused kernel, but on whole params where we cut them
# into pieces; elements at a piece's end take the kernel's vector-tail path, which was seen to
# round differently by up to half an ulp of its O(1) inputs (5.6e-8 on an SGD momentum buffer).
SAME_KERNEL = (1e-6, 2e-7)
EXACT = (0.0, 0.0)


def make_params(dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype=dtype, device=device))
        for shape in SHAPES
    ]


def groups_of(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]


def fp32_copies(params: list[torch.Tensor], device: str | None = None) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(p.detach().to(device=device or p.device, dtype=torch.float32).clone())
        for p in params
    ]


def main_weights(opt: HybridDeviceOptimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each param's fp32 main weight as the optimizer holds it."""
    state = opt.state_dict()["state"]
    out = []
    for index, param in enumerate(params):
        main = state.get(index, {}).get("main_param")
        out.append((main if main is not None else param).detach().float().cpu())
    return out


def set_grads(
    params: list[torch.Tensor],
    refs: list[torch.Tensor],
    gen: torch.Generator,
    skip: set[int] = frozenset(),
) -> None:
    """The same grads for both: drawn in fp32, rounded to the model dtype, then widened."""
    for index, (param, ref) in enumerate(zip(params, refs, strict=True)):
        if index in skip:
            param.grad, ref.grad = None, None
            continue
        grad = torch.randn(param.shape, generator=gen).to(param.dtype)
        param.grad = grad.to(param.device)
        ref.grad = grad.float().to(ref.device)


def assert_matches(
    opt: HybridDeviceOptimizer,
    params: list[torch.Tensor],
    refs: list[torch.Tensor],
    tol: tuple[float, float],
    where: str,
) -> None:
    for index, (main, param, ref) in enumerate(
        zip(main_weights(opt, params), params, refs, strict=True)
    ):
        ref = ref.detach().cpu()
        torch.testing.assert_close(
            main, ref, rtol=tol[0], atol=tol[1], msg=f"{where}: param {index}"
        )
        # The model param is the main weight in the model dtype, exactly.
        assert torch.equal(param.detach().cpu(), main.to(param.dtype)), f"{where}: param {index}"


def train_side_by_side(
    opt: HybridDeviceOptimizer,
    ref_opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    refs: list[torch.Tensor],
    steps: int,
    seed: int = 1,
    skip: dict[int, set[int]] | None = None,
) -> Iterator[int]:
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        set_grads(params, refs, gen, (skip or {}).get(step, set()))
        opt.step()
        ref_opt.step()
        yield step
