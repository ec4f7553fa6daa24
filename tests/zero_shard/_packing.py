"""One case for the CPU (gloo, 1 to 3 ranks) and the GPUs (NCCL): buckets whose padded shards
lie back to back (the shapes of real models) are packed for their reduction by one chunked copy
(``chunk_pack_grads``), bit for bit as param by param (the odd shapes of the other tests), and
as torch AdamW: plain steps, two reductions added in one step, grads zeroed in place, and a
layer that only rank 0 uses at one step (the other ranks pack that bucket param by param)."""

from __future__ import annotations

import torch
import torch.nn as nn
from _models import GLOBAL_BATCH, local_slice, mse, param_groups

import zero_shard
import zero_shard._reduce as reduce_module
from zero_shard import OffloadPolicy

WIDTH = 768  # rows of every param: shards of whole multiples of the alignment at 1 to 4 ranks
STEPS = 6


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.side = nn.Linear(WIDTH, WIDTH)  # used by the ranks given it
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, with_side: bool = False) -> torch.Tensor:
        hidden = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        if with_side:
            hidden = hidden + self.side(hidden)
        return self.out(hidden)


def _dense(device: torch.device, dtype: torch.dtype) -> Dense:
    torch.manual_seed(0)
    return Dense().to(device, dtype)


def _batch(step: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    x, y = (
        torch.randn(GLOBAL_BATCH, 16, generator=gen),
        torch.randn(GLOBAL_BATCH, WIDTH, generator=gen),
    )
    return [x.to(device, dtype), y.to(device, dtype)]


def _train(
    rank: int, world: int, device: torch.device, dtype: torch.dtype, options: tuple
) -> list[list[torch.Tensor]]:
    """Six steps; against torch AdamW in fp32. Returns the params after each step."""
    fraction, stage, bucket_mb = options
    model, ref = _dense(device, dtype), _dense(device, torch.float32)
    policy = OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=1 << 16)
    opt = zero_shard.wrap(
        torch.optim.AdamW(param_groups(model), lr=1e-2), model,
        offload=policy if fraction else None, stage=stage, bucket_mb=bucket_mb,
    )  # fmt: skip
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    trajectory = []
    for step in range(STEPS):
        x, y = _batch(step, device, dtype)
        side_ranks = {0} if step == 4 else set(range(world))  # at step 4 rank 0 alone
        micro = 2 if step == 2 else 1  # two reductions into the same grads
        xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
        for rows in torch.arange(xs.shape[0]).tensor_split(micro):  # parts of the local mean
            part = mse(model(xs[rows], with_side=rank in side_ranks), ys[rows])
            (part * len(rows) / xs.shape[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=step != 2)  # in place after step 2: zeroed grads
        x, y = x.float(), y.float()
        ref_loss = sum(
            mse(ref(local_slice(x, r, world), with_side=r in side_ranks), local_slice(y, r, world))
            for r in range(world)
        ) / world  # fmt: skip
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=step != 2)
        opt.finish_param_sync()
        if dtype == torch.float32:
            _check_close(model, ref, f"{options} step {step}")
        trajectory.append([param.detach().clone() for param in model.parameters()])
    return trajectory


def _check_close(model: nn.Module, ref: nn.Module, where: str) -> None:
    # Adam's first steps move an element by about lr whatever its grad's size, so grads near zero
    # summed in another order (ranks, fused kernel) may differ by 1e-4 after a few steps; a
    # misplaced or unflagged grad moves whole params by O(lr) = 1e-2.
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        at = f"{where} {name}"
        torch.testing.assert_close(
            param, ref_param, rtol=0, atol=1e-3, msg=lambda text, at=at: f"{at}: {text}"
        )


def check_back_to_back_packing(
    rank: int, world: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> None:
    """Trains with the chunked copy and with it turned off (white-box), and compares."""
    chunked = 0
    pack, packable = reduce_module.chunk_pack_grads, reduce_module.chunk_packable

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal chunked
        chunked += 1
        pack(*args, **kwargs)

    reduce_module.chunk_pack_grads = counted
    try:
        for options in ((0.0, 2, 25.0), (0.5, 2, 0.2), (0.5, 1, 25.0)):
            chunked_before = chunked
            fast = _train(rank, world, device, dtype, options)
            assert chunked > chunked_before, f"{options}: no bucket was packed by the chunked copy"
            reduce_module.chunk_packable = lambda *args: False
            try:
                slow = _train(rank, world, device, dtype, options)
            finally:
                reduce_module.chunk_packable = packable
            for step, (got, expected) in enumerate(zip(fast, slow, strict=True)):
                for a, b in zip(got, expected, strict=True):
                    assert torch.equal(a, b), f"{options}: step {step}, chunked and param by param"
    finally:
        reduce_module.chunk_pack_grads = pack
