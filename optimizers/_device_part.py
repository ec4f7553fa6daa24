"""The elements stepped on the accelerator, on the caller's current stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import record_function

from ._elementwise import OptimizerSpec
from ._fused_backends import build_sub_optimizer
from ._layout import PieceSpec
from ._records import ParamRecord, Piece, flat_param

__all__ = ["DevicePart"]


class DevicePart:
    """fp32 main weights, grads and state of the accelerator's share, stepped in stream order.

    Params in a lower precision get fp32 main weights and main grads in one flat buffer per
    param group; fp32 params are stepped in place with their own grads (no extra copy).
    """

    optimizer: torch.optim.Optimizer | None  # None when nothing stays on the accelerator
    pieces: list[tuple[ParamRecord, Piece]]  # in parameter order
    group_map: list[int]  # sub-optimizer group i steps the user's group group_map[i]
    _main_flats: list[
        torch.Tensor
    ]  # 1-D fp32, accelerator, one per group with low-precision params
    _grad_flats: list[torch.Tensor]  # 1-D fp32, same layout

    def __init__(
        self,
        records: Sequence[ParamRecord],
        specs: Sequence[PieceSpec],
        groups: Sequence[dict[str, Any]],
        optimizer_spec: OptimizerSpec,
        device: torch.device,
        impl: str,
    ) -> None:
        self.pieces, self.group_map = [], []
        self._main_flats, self._grad_flats = [], []
        by_group: dict[int, list[PieceSpec]] = {}
        for spec in specs:
            by_group.setdefault(records[spec.param_index].group_index, []).append(spec)
        ordered = sorted(by_group.items())
        sub_groups, mains_per_group = [], []
        for group_index, group_specs in ordered:
            mains = self._make_mains(records, group_specs, device)
            mains_per_group.append(mains)
            hyper = {k: v for k, v in groups[group_index].items() if k != "params"}
            sub_groups.append({"params": [main for main, _ in mains], **hyper})
            self.group_map.append(group_index)
        if not sub_groups:
            self.optimizer = None
            return
        self.optimizer = build_sub_optimizer(optimizer_spec, sub_groups, device.type, impl)
        for (_, group_specs), mains, sub_group in zip(
            ordered, mains_per_group, self.optimizer.param_groups, strict=True
        ):
            for spec, (main, grad) in zip(group_specs, mains, strict=True):
                piece = Piece(
                    spec=spec, main=main, grad=grad, optimizer=self.optimizer, group=sub_group
                )
                record = records[spec.param_index]
                record.pieces.insert(0, piece)
                self.pieces.append((record, piece))

    def _make_mains(
        self, records: Sequence[ParamRecord], specs: Sequence[PieceSpec], device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        low = [s for s in specs if records[s.param_index].param.dtype != torch.float32]
        main_flat = torch.empty(sum(s.numel for s in low), dtype=torch.float32, device=device)
        grad_flat = torch.zeros_like(main_flat)
        if low:
            self._main_flats.append(main_flat)
            self._grad_flats.append(grad_flat)
        mains, offset = [], 0
        for spec in specs:
            source = flat_param(records[spec.param_index].param)[
                spec.start : spec.start + spec.numel
            ]
            if records[spec.param_index].param.dtype == torch.float32:
                mains.append((source, None))
                continue
            main = main_flat[offset : offset + spec.numel]
            main.copy_(source)
            mains.append((main, grad_flat[offset : offset + spec.numel]))
            offset += spec.numel
        return mains

    @property
    def num_bytes(self) -> int:
        """Bytes of fp32 main weights, main grads and optimizer state held on the accelerator."""
        flats = sum(t.numel() * t.element_size() for t in (*self._main_flats, *self._grad_flats))
        state = sum(
            value.numel() * value.element_size()
            for _, piece in self.pieces
            for value in piece.state.values()
            if torch.is_tensor(value) and value.dim() > 0
        )
        return flats + state

    @property
    def skips_on_device(self) -> bool:
        """Whether a step given ``found_inf`` is skipped by the kernels themselves, with no host
        synchronization: torch's fused optimizers read the flag on the device."""
        return self.optimizer is None or bool(self.optimizer.defaults.get("fused"))

    @torch.no_grad()
    def step(
        self,
        grads: dict[int, torch.Tensor],
        grad_scale: float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Steps every piece whose param has a grad in ``grads`` (1-D, by record index), the
        grads multiplied by ``grad_scale`` in fp32 if given; nothing changes where ``found_inf``
        (one element, on the device) is nonzero.

        Runs on the current stream, so it is ordered after backward and before the next forward
        with no synchronization (none for ``found_inf`` either where ``skips_on_device``).
        """
        if self.optimizer is None:
            return
        if found_inf is not None and not self.skips_on_device and bool(found_inf):
            return  # the host waited for the flag: a sub-optimizer without a found_inf input
        with record_function("zero_shard::device_step"):
            cast_dst, cast_src, written_params, written_mains, in_place = [], [], [], [], []
            for record, piece in self.pieces:
                grad = grads.get(record.index)
                if grad is None:
                    piece.main.grad = None  # no grad, no update: like torch
                    continue
                source = grad[piece.spec.start : piece.spec.start + piece.spec.numel]
                if piece.grad is None:
                    piece.main.grad = source
                    in_place.append(source)
                    continue
                piece.main.grad = piece.grad
                cast_dst.append(piece.grad)
                cast_src.append(source)
                start = piece.spec.start
                written_params.append(flat_param(record.param)[start : start + piece.spec.numel])
                written_mains.append(piece.main)
            if cast_dst:
                torch._foreach_copy_(cast_dst, cast_src)
            if grad_scale is not None and (cast_dst or in_place):
                torch._foreach_mul_(cast_dst + in_place, grad_scale)
            # torch's optimizers read a found_inf attribute (GradScaler's protocol): the fused
            # kernels leave params and state as they are where it is nonzero (the step count is
            # put back). The params written below then get the same values again.
            skip_on_device = found_inf is not None and self.skips_on_device
            self.optimizer.found_inf = found_inf.reshape(()) if skip_on_device else None
            try:
                self.optimizer.step()
            finally:
                self.optimizer.found_inf = None
            if written_params:
                torch._foreach_copy_(written_params, written_mains)
            for _, piece in self.pieces:
                piece.main.grad = None  # drop references to the model's grads

    @torch.no_grad()
    def reload_from_params(self, indices: set[int] | None = None) -> None:
        """Refreshes fp32 main weights from the model params (fp32 params are their own): of
        every param, or of the params whose record index is in ``indices``."""
        for record, piece in self.pieces:
            if piece.grad is not None and (indices is None or record.index in indices):
                start = piece.spec.start
                piece.main.copy_(flat_param(record.param)[start : start + piece.spec.numel])
