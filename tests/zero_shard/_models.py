"""The model, data and reference training shared by the distributed tests.

The model's params have odd shapes ((7, 15), (7,), (3, 7), (3,), (2, 3), (2,)) so that on 3 ranks
some shards are empty. Each rank trains on its slice of a global batch of 12; the reference trains
the same model with plain ``torch.optim.AdamW`` on the whole batch in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 12
LR = 1e-2
# fp32 tolerances for zero-shard against the single-process reference. The data-parallel grads
# are the mean of per-rank means, summed in another order than the reference's one mean over the
# batch: they differ by a few ulps (~1e-7 relative); AdamW's update, lr * m / (sqrt(v) + eps),
# carries such relative differences into the params at O(lr) = 1e-2 per step, over 10 steps.
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-7}


class Net(nn.Module):
    def __init__(self, with_side: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 7)
        self.mid = nn.Linear(7, 3)
        self.out = nn.Linear(3, 2)
        # `side` is used for the first two rows of the global batch only (so by rank 0 alone);
        # `never` is never used.
        self.side = nn.Linear(15, 2) if with_side else None
        self.never = nn.Linear(3, 3) if with_side else None

    def forward(self, x: torch.Tensor, first_rows: int = 0) -> torch.Tensor:
        y = self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        if self.side is not None and first_rows:
            y = torch.cat([y[:first_rows] + self.side(x[:first_rows]), y[first_rows:]])
        return y


def make_model(seed: int = 0, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as users do (and two groups with different options)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": LR / 2},
    ]


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=LR)


def global_batch(
    step: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 15, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 2, generator=gen)
    return x.to(dtype), y.to(dtype)


def local_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = GLOBAL_BATCH // world_size
    return tensor[rank * per_rank : (rank + 1) * per_rank]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float())


def step_reference(
    ref: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """One step of the single-process reference on the whole batch; returns its loss."""
    loss = mse(ref(x, **kwargs), y)
    loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return loss.detach()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def assert_params_close(model: nn.Module, ref: nn.Module, where: str, exact: bool = False) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        tol = {"rtol": 0.0, "atol": 0.0} if exact else PARAM_TOL
        local = param.full_tensor() if hasattr(param, "full_tensor") else param
        other = ref_param.full_tensor() if hasattr(ref_param, "full_tensor") else ref_param
        torch.testing.assert_close(
            local.detach().float(), other.detach().float(), **tol, msg=f"{where}: {name}"
        )
