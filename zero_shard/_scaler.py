"""fp16 dynamic loss scaling for ZeroShardOptimizer: torch's GradScaler, with sharded grads."""

from __future__ import annotations

from typing import Any

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

    Args (torch's, with torch's defaults):
        device: the grads' device type, ``"cuda"`` by default.
        init_scale: the first scale factor, ``2.0**16``.
        growth_factor: the scale's factor after ``growth_interval`` steps without an inf or a
            NaN, ``2.0``.
        backoff_factor: the scale's factor after a step with one (the step is skipped on every
            rank), ``0.5``.
        growth_interval: steps without an inf or a NaN before the scale grows, ``2000``.
        enabled: ``False`` makes every method a no-op (``scale`` returns its input), ``True``.

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

    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # A skipped step skips the optimizer's step(): a delayed update in flight must still
        # reach the params now, as at a step that skips (the optimizer's own verdict).
        skipped = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        on_skip = getattr(optimizer, "_on_skipped_step", None)
        if skipped and on_skip is not None:
            on_skip()
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
