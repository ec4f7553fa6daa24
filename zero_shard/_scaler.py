"""fp16 dynamic loss scaling for ZeroShardOptimizer: torch's GradScaler, with sharded grads."""

from __future__ import annotations

import torch

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a :class:`ZeroShardOptimizer` (used the same way).

    torch's scaler unscales the grads it finds on the optimizer's params and decides to skip a
    step from this rank's grads alone. Under zero-shard the grads live in shards after the
    reduction, and ranks hold different shards: this scaler lets the optimizer unscale its
    shards and check them for infs and NaNs, and the verdict is all-reduced so that every rank
    skips (and backs off the scale) together. fp16 grads are not unscaled in fp16, where small
    values would underflow: the factor is applied in fp32 when the optimizer casts them to its
    fp32 main grads. Other optimizers are handled as by torch's scaler.

    Example::

        scaler = zero_shard.GradScaler("cuda")
        for batch in loader:
            scaler.scale(model(batch).loss).backward()
            scaler.unscale_(opt)          # optional: before clipping
            opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        unscale = getattr(optimizer, "_unscale_sharded_grads", None)
        if unscale is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return unscale(inv_scale, found_inf)
