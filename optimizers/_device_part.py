"""The elements stepped on the accelerator, on the caller's current stream."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from offload import phase

from ._elementwise import OptimizerSpec, step_sub_optimizer
from ._fused_backends import build_sub_optimizer
from ._grad_factor import scale_grads_
from ._policy import DeviceImpl
from ._records import ParamRecord, Piece, flat_param, reload_mains
from ._split import PieceSpec

__all__ = ["DevicePart"]

ROUND_NUMEL = 1 << 26  # low-precision elements whose fp32 grads are cast at once (256 MiB)


class Round(NamedTuple):
    """Pieces stepped together by one sub-optimizer: their low-precision grads are cast to fp32
    into the part's one scratch buffer, which the next round reuses (see [Note: main grads])."""

    optimizer: torch.optim.Optimizer
    pieces: list[tuple[ParamRecord, Piece]]  # in parameter order
    group_map: list[int]  # sub-optimizer group i steps the user's group group_map[i]
    # Per piece, the views a step of a low-precision piece takes, made once (None: fp32)
    views: list[PieceViews | None]
    whole: WholeRound | None = None  # its step's lists, where every piece is a whole param


class WholeRound(NamedTuple):
    """A round whose every piece is a whole low-precision param: the lists of its step while
    every piece has a grad and each param keeps the memory it had (every step of training),
    made once with the round's views, so that such a step makes none piece by piece."""

    indices: list[int]  # each piece's record index: the key of its grad
    params: list[torch.Tensor]  # each piece's model param
    param_ptrs: list[int]  # their data_ptr() when ``weights`` were taken
    scratch: list[torch.Tensor]  # each piece's cast grad in the scratch, one after another
    mains: list[torch.Tensor]
    weights: list[torch.Tensor]  # each param, 1-D: the new weights go there


class PieceViews(NamedTuple):
    """A low-precision piece's views for the step, made when the scratch is: so that a step takes
    no slice per piece. Each is used only where it still holds: the cast grad's place where
    every earlier piece of the round had a grad, the param's elements while the param has the
    memory it had then (``param.data = t`` gives a param other memory)."""

    scratch: torch.Tensor  # the piece's cast grad in the scratch, at ``offset``
    offset: int  # in the scratch, where every piece of the round before it has a grad
    weights: torch.Tensor  # the piece's elements of the param, 1-D: the new weights go there
    param_ptr: int  # the param's data_ptr() when ``weights`` was taken


class DevicePart:
    """fp32 main weights, grads and state of the accelerator's share, stepped in stream order.

    [Note: main grads]
    Params in a lower precision get fp32 main weights, one flat buffer per round. Their fp32 main
    grads are made at the step, round by round: a round's grads are cast into one scratch buffer
    of at most ``ROUND_NUMEL`` elements (or the largest piece), its sub-optimizer steps, and its
    params are written; the next round's cast follows on the same stream, so the buffer is free
    again. So no full-size fp32 grad is held (4 bytes a param), and between steps only the params,
    main weights and state are. fp32 params are stepped in place with their own grads (no copy).
    The rounds add no time where the accelerator is the bottleneck: the host queues a round's
    kernels while the previous round's run.
    """

    rounds: list[Round]  # empty when nothing stays on the accelerator
    pieces: list[tuple[ParamRecord, Piece]]  # in parameter order
    _main_flats: list[
        torch.Tensor
    ]  # 1-D fp32, accelerator, one per round with low-precision params
    _grad_scratch: torch.Tensor  # 1-D fp32, accelerator: the largest round's cast grads

    def __init__(
        self,
        records: Sequence[ParamRecord],
        specs: Sequence[PieceSpec],
        groups: Sequence[dict[str, Any]],
        optimizer_spec: OptimizerSpec,
        device: torch.device,
        impl: DeviceImpl,
    ) -> None:
        self.rounds, self.pieces, self._main_flats = [], [], []
        scratch_numel = 0
        for round_specs in _split_rounds(records, specs):
            by_group: dict[int, list[PieceSpec]] = {}
            for spec in round_specs:
                by_group.setdefault(records[spec.param_index].group_index, []).append(spec)
            ordered = sorted(by_group.items())
            mains = self._make_mains(records, round_specs, device)
            sub_groups = []
            for group_index, group_specs in ordered:
                hyper = {k: v for k, v in groups[group_index].items() if k != "params"}
                sub_groups.append({"params": [mains[id(s)] for s in group_specs], **hyper})
            optimizer = build_sub_optimizer(optimizer_spec, sub_groups, device.type, impl)
            pieces = []
            for (_, group_specs), sub_group in zip(ordered, optimizer.param_groups, strict=True):
                for spec in group_specs:
                    piece = Piece(
                        spec=spec, main=mains[id(spec)], grad=None, optimizer=optimizer,
                        group=sub_group,
                    )  # fmt: skip
                    record = records[spec.param_index]
                    record.pieces.insert(0, piece)
                    pieces.append((record, piece))
            pieces.sort(key=lambda pair: pair[0].index)
            self.rounds.append(Round(optimizer, pieces, [index for index, _ in ordered], []))
            self.pieces += pieces
            scratch_numel = max(scratch_numel, _low_numel(records, round_specs))
        self._grad_scratch = torch.empty(scratch_numel, dtype=torch.float32, device=device)
        for round_ in self.rounds:
            round_.views.extend(_piece_views(round_.pieces, self._grad_scratch))
        self.rounds = [round_._replace(whole=_whole_round(round_)) for round_ in self.rounds]

    def _make_mains(
        self, records: Sequence[ParamRecord], specs: Sequence[PieceSpec], device: torch.device
    ) -> dict[int, torch.Tensor]:
        """Each spec's fp32 main weight (by ``id(spec)``): a view of one new flat buffer for the
        low-precision ones, the param itself for fp32 ones."""
        main_flat = torch.empty(_low_numel(records, specs), dtype=torch.float32, device=device)
        if main_flat.numel():
            self._main_flats.append(main_flat)
        mains, offset = {}, 0
        for spec in specs:
            param = records[spec.param_index].param
            source = flat_param(param)[spec.start : spec.start + spec.numel]
            if param.dtype == torch.float32:
                mains[id(spec)] = source
                continue
            main = main_flat[offset : offset + spec.numel]
            main.copy_(source)
            mains[id(spec)] = main
            offset += spec.numel
        return mains

    @property
    def num_bytes(self) -> int:
        """Bytes of fp32 main weights, the grad scratch and optimizer state on the accelerator."""
        flats = sum(t.numel() * t.element_size() for t in (*self._main_flats, self._grad_scratch))
        state = sum(
            value.numel() * value.element_size()
            for _, piece in self.pieces
            for value in piece.state.values()
            if torch.is_tensor(value) and value.dim() > 0
        )
        return flats + state

    def sub_groups(self) -> Iterator[tuple[dict[str, Any], int]]:
        """(sub-optimizer group, index of the user's group it steps), over every round."""
        for round_ in self.rounds:
            yield from zip(round_.optimizer.param_groups, round_.group_map, strict=True)

    def check_options(self) -> None:
        """Raises, before anything is stepped, if a sub-optimizer cannot honour its groups' current
        options (an edit after construction that a FusedAdam backend has no variant for)."""
        for round_ in self.rounds:
            check = getattr(round_.optimizer, "check_options", None)
            if check is not None:
                check()

    @property
    def skips_on_device(self) -> bool:
        """Whether a step given ``found_inf`` is skipped by the kernels themselves, with no host
        synchronization: torch's fused optimizers read the flag on the device."""
        return not self.rounds or bool(self.rounds[0].optimizer.defaults.get("fused"))

    @torch.no_grad()
    def step(
        self,
        grads: dict[int, torch.Tensor],
        grad_scale: float | None = None,
        found_inf: torch.Tensor | None = None,
        grad_factor: torch.Tensor | None = None,
    ) -> None:
        """Steps every piece whose param has a grad in ``grads`` (1-D, by record index), the
        grads multiplied in place by ``grad_factor`` (one element, on the device; as
        ``scale_grads_`` multiplies) and then by ``grad_scale`` in fp32, where given; nothing
        changes where ``found_inf`` (one element, on the device) is nonzero.

        Runs on the current stream, so it is ordered after backward and before the next forward
        with no synchronization (none for ``found_inf`` either where ``skips_on_device``, but at
        an SGD param's late first step: [Note: SGD's late first steps] in ``_elementwise.py``).
        """
        if not self.rounds:
            return
        if found_inf is not None and not self.skips_on_device and bool(found_inf):
            return  # the host waited for the flag: a sub-optimizer without a found_inf input
        # torch's optimizers read a found_inf attribute (GradScaler's protocol): the fused kernels
        # leave params and state as they are where it is nonzero (the step count is put back).
        # The params written after them then get the same values again.
        skip_on_device = found_inf is not None and self.skips_on_device
        flag = found_inf.reshape(()) if skip_on_device else None
        with phase("zero_shard::device_step"):
            for round_ in self.rounds:
                self._step_round(round_, grads, grad_scale, flag, grad_factor)

    def _step_round(
        self,
        round_: Round,
        grads: dict[int, torch.Tensor],
        grad_scale: float | None,
        found_inf: torch.Tensor | None,
        grad_factor: torch.Tensor | None,
    ) -> None:
        lists = _whole_lists(round_, grads)
        if lists is None:
            lists = self._round_lists(round_, grads)
        cast_dst, cast_src, written_params, written_mains, in_place = lists
        if not cast_dst and not in_place:
            return
        if grad_factor is not None:
            scale_grads_(cast_src + in_place, grad_factor)
        if cast_dst:
            torch._foreach_copy_(cast_dst, cast_src)
        if grad_scale is not None:
            torch._foreach_mul_(cast_dst + in_place, grad_scale)
        round_.optimizer.found_inf = found_inf
        try:
            step_sub_optimizer(round_.optimizer)
        finally:
            round_.optimizer.found_inf = None
            for _, piece in round_.pieces:
                piece.main.grad = None  # drop references to the model's grads and the scratch
        if written_params:
            torch._foreach_copy_(written_params, written_mains)

    def _round_lists(self, round_: Round, grads: dict[int, torch.Tensor]) -> _RoundLists:
        """The round's step, piece by piece: each piece's main grad set (or ``None``), and the
        lists of its step."""
        cast_dst, cast_src, written_params, written_mains, in_place = [], [], [], [], []
        offset = 0
        for (record, piece), views in zip(round_.pieces, round_.views, strict=True):
            grad = grads.get(record.index)
            if grad is None:
                piece.main.grad = None  # no grad, no update: like torch
                continue
            start, numel = piece.spec.start, piece.spec.numel
            source = grad if numel == grad.numel() else grad[start : start + numel]  # whole: as is
            if views is None:  # fp32
                piece.main.grad = source
                in_place.append(source)
                continue
            # The scratch is free here: the last round's kernels that read it come first on
            # this stream ([Note: main grads]).
            if views.offset == offset:
                piece.main.grad = views.scratch
            else:  # an earlier piece had no grad
                piece.main.grad = self._grad_scratch[offset : offset + numel]
            offset += numel
            cast_dst.append(piece.main.grad)
            cast_src.append(source)
            if views.param_ptr == record.param.data_ptr():
                written_params.append(views.weights)
            else:  # the param was given other memory
                written_params.append(flat_param(record.param)[start : start + numel])
            written_mains.append(piece.main)
        return cast_dst, cast_src, written_params, written_mains, in_place

    @torch.no_grad()
    def reload_from_params(
        self, indices: set[int] | None = None, *, keep_unchanged: bool = False
    ) -> None:
        """Refreshes fp32 main weights from the model params (fp32 params are their own): of
        every param, or of the params whose record index is in ``indices``; ``keep_unchanged``:
        see ``reload_mains``."""
        for record, piece in self.pieces:
            low = record.param.dtype != torch.float32
            if low and (indices is None or record.index in indices):
                start = piece.spec.start
                values = flat_param(record.param)[start : start + piece.spec.numel]
                reload_mains(piece.main, values, keep_unchanged=keep_unchanged)


def _piece_views(
    pieces: Sequence[tuple[ParamRecord, Piece]], scratch: torch.Tensor
) -> Iterator[PieceViews | None]:
    """Each piece's views for the step, in order (see ``PieceViews``)."""
    offset = 0
    for record, piece in pieces:
        if record.param.dtype == torch.float32:
            yield None
            continue
        start, numel = piece.spec.start, piece.spec.numel
        weights = flat_param(record.param)[start : start + numel]
        scratch_view = scratch[offset : offset + numel]
        yield PieceViews(scratch_view, offset, weights, record.param.data_ptr())
        offset += numel


# A round's step: (cast grads' places, their sources, params written, their mains, fp32 grads)
_RoundLists = tuple[
    list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
    list[torch.Tensor],
]  # fmt: skip


def _whole_round(round_: Round) -> WholeRound | None:
    """The round's ``WholeRound``, if every piece is a whole low-precision param."""
    pieces = list(zip(round_.pieces, round_.views, strict=True))
    if not all(
        views is not None and piece.spec.start == 0 and piece.spec.numel == record.param.numel()
        for (record, piece), views in pieces
    ):
        return None
    views = [views for _, views in pieces]
    return WholeRound(
        indices=[record.index for record, _ in round_.pieces],
        params=[record.param for record, _ in round_.pieces],
        param_ptrs=[v.param_ptr for v in views],
        scratch=[v.scratch for v in views],
        mains=[piece.main for _, piece in round_.pieces],
        weights=[v.weights for v in views],
    )


def _whole_lists(round_: Round, grads: dict[int, torch.Tensor]) -> _RoundLists | None:
    """The lists of a ``WholeRound``'s step, its main grads set, where every piece has a grad
    and each param keeps its memory; else ``None`` (the step goes piece by piece)."""
    whole = round_.whole
    if whole is None:
        return None
    sources = [grads[index] for index in whole.indices if index in grads]
    if len(sources) != len(whole.indices):
        return None
    if [param.data_ptr() for param in whole.params] != whole.param_ptrs:
        return None  # a param was given other memory
    for main, scratch in zip(whole.mains, whole.scratch, strict=True):
        main.grad = scratch  # the scratch is free here, as in _round_lists
    return whole.scratch, sources, whole.weights, whole.mains, []


def _low_numel(records: Sequence[ParamRecord], specs: Iterable[PieceSpec]) -> int:
    """Elements of ``specs`` whose params are in a lower precision than fp32."""
    return sum(s.numel for s in specs if records[s.param_index].param.dtype != torch.float32)


def _split_rounds(
    records: Sequence[ParamRecord], specs: Sequence[PieceSpec]
) -> list[list[PieceSpec]]:
    """``specs`` cut in order into rounds of at most ``ROUND_NUMEL`` low-precision elements (a
    larger piece makes a round alone); fp32 pieces cost the scratch nothing."""
    rounds: list[list[PieceSpec]] = []
    numel = 0
    for spec in specs:
        size = _low_numel(records, [spec])
        if not rounds or (size and numel + size > ROUND_NUMEL and numel):
            rounds.append([])
            numel = 0
        rounds[-1].append(spec)
        numel += size
    return rounds
