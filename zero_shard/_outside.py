"""Grads of a model's params that no wrapper shards: averaged over the ranks, as DDP averages them.

[Note: params outside the optimizer]
A model's trainable params left out of the wrapped optimizer (a base model fine-tuned at its top
layers without freezing the rest, a head trained by a plain torch optimizer beside the wrapper)
get each rank's own grad from backward: no bucket holds them. Code that reads them then reads
other numbers on each rank than under DDP, which averages every param's grad: torch's
``clip_grad_norm_(model.parameters())`` gets another norm on each rank, so each rank scales its
shards by another factor, and a torch optimizer over them moves each rank's replica apart. So at
the end of each backward that reduced the buckets, the grads of such params (those that require
grad and that no live wrapper shards) are averaged over the ranks: one flag per param (a grad on
any rank?) and one all-reduce per dtype; a param with no grad on a rank gets the average of the
others' there, as DDP with ``find_unused_parameters`` gives it. Where every param is in the
optimizer this costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._owners import is_claimed

__all__ = ["average_outside_grads"]


@torch.no_grad()
def average_outside_grads(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup, device: torch.device
) -> None:
    """Averages over ``group`` the grads of those of ``params`` that require grad and that no live
    wrapper shards (see [Note: params outside the optimizer]). Collective: every rank calls it
    with the same params, in the same order."""
    live = [p for p in params if p.requires_grad and not is_claimed(p)]
    if not live:
        return
    flags = torch.tensor([p.grad is not None for p in live], dtype=torch.uint8, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    present = [p for p, flag in zip(live, flags.tolist(), strict=True) if flag]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in present:
        by_dtype.setdefault(param.dtype, []).append(param)
    world_size = dist.get_world_size(group)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        grouped = by_dtype[dtype]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in grouped]
        ).to(device)
        dist.all_reduce(flat, group=group)
        flat.div_(world_size)
        for param, average in zip(grouped, flat.split([p.numel() for p in grouped]), strict=True):
            average = average.view(param.shape)
            if param.grad is None:  # none here, some elsewhere
                param.grad = average.to(param.device, copy=True)
            else:
                param.grad.copy_(average)
