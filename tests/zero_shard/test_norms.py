"""Norms and non-finite checks over grads of every dtype, on the CPU and (marked) on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from zero_shard._norms import (  # private free functions, unit-tested
    global_norm,
    nonfinite_flag,
    scale_grads_,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def grads_of(dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096, 1024), (3,), (0,), (1000, 7), (2048,)]
    return [(torch.randn(s, generator=gen) * 1e-2).to(device, dtype) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_flag_is_exact_and_leaves_grads_alone(device: str, dtype: torch.dtype) -> None:
    grads = grads_of(dtype, device)
    before = [g.clone() for g in grads]
    assert float(nonfinite_flag(grads, [], torch.device(device))) == 0.0
    for old, new in zip(before, grads, strict=True):
        assert torch.equal(old, new)
    for bad in (math.inf, -math.inf, math.nan):
        poisoned = [g.clone() for g in grads]
        poisoned[3][999, 6] = bad  # the very last element of a middle tensor
        assert float(nonfinite_flag(poisoned, [], torch.device(device))) == 1.0, bad
    if dtype != torch.float16:
        # Finite, but its square overflows a norm: the host's screen by norms must not flag it.
        large = [g.clone() for g in grads]
        large[0][4095, 1023] = 3e30  # reduced by rows on the host
        large[3][999, 6] = 3e30  # reduced with the small tensors
        assert float(nonfinite_flag(large, [], torch.device(device))) == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_global_norm_on_one_rank_is_torchs(
    device: str, dtype: torch.dtype, norm_type: float
) -> None:
    grads = grads_of(dtype, device)
    # In fp64: torch's own fp32 norm of one long CPU tensor is off by ~1e-4 here (4.2M elements),
    # which zero-shard's norm by rows is not.
    expected = torch.linalg.vector_norm(
        torch.cat([g.double().reshape(-1) for g in grads]), norm_type
    ).float()
    norm = global_norm(grads, norm_type, [], torch.device(device))
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_grads_has_the_bits_of_foreach_mul_with_the_fp32_factor(
    device: str, dtype: torch.dtype
) -> None:
    # What torch.nn.utils.clip_grad_norm_ computes (foreach_mul_ by the fp32 factor on the
    # device), and what a grad-by-grad mul_ computes; the factors include ones that bf16 and
    # fp16 round, and the empty grad.
    for value in (0.3183098861837907, 1.0, 1e-3 / 7, 0.999):
        factor = torch.tensor(value, dtype=torch.float32, device=device)
        grads = [*grads_of(dtype, device), grads_of(torch.float32, device)[0]]  # mixed dtypes
        by_foreach = [g.clone() for g in grads]
        by_tensor = [g.clone() for g in grads]
        scale_grads_(grads, factor)
        torch._foreach_mul_(by_foreach, factor)
        for grad in by_tensor:
            grad.mul_(factor)
        for got, foreach, one_by_one in zip(grads, by_foreach, by_tensor, strict=True):
            assert torch.equal(got, foreach), (value, got.dtype)
            assert torch.equal(got, one_by_one), (value, got.dtype)
