"""The grads' copies into a chunk's staging and the new weights' copies into the params
(``grad_copies`` and ``weight_copies`` in optimizers/_host_step.py): pieces whose grads (params)
lie back to back in one buffer go in one copy, and staging (the params) end as the copies piece
by piece leave them, whatever the layout."""

from __future__ import annotations

import torch

from offload import CopyPair
from optimizers._host_step import grad_copies, weight_copies
from optimizers._records import Piece
from optimizers._split import PieceSpec


def _pieces(numels: list[int], starts: list[int]) -> list[Piece]:
    pieces, offset = [], 0
    for index, (numel, start) in enumerate(zip(numels, starts, strict=True)):
        main = torch.empty(numel)
        spec = PieceSpec(param_index=index, start=start, numel=numel)
        pieces.append(Piece(spec, main, None, None, {}, offset=offset))  # type: ignore[arg-type]
        offset += numel
    return pieces


def _apply(pairs: list[CopyPair]) -> None:
    for pair in pairs:
        pair.dst.copy_(pair.src)


def _one_by_one(staging: torch.Tensor, pieces: list[Piece], grads: list[torch.Tensor]) -> None:
    for piece, grad in zip(pieces, grads, strict=True):
        piece.in_chunk(staging).copy_(piece.of_param(grad))


def test_grads_back_to_back_in_one_buffer_go_in_one_copy() -> None:
    buffer = torch.randn(100, dtype=torch.bfloat16)
    # Three params' flat grads laid out one after the other; the chunk holds all of the first
    # two and the head of the third, in that order.
    grads = [buffer[0:7], buffer[7:20], buffer[20:50]]
    pieces = _pieces([7, 13, 11], [0, 0, 0])
    pairs = grad_copies(torch.empty(31, dtype=torch.bfloat16), pieces, grads)
    assert len(pairs) == 1
    staging = torch.zeros(31, dtype=torch.bfloat16)
    _apply(grad_copies(staging, pieces, grads))
    assert torch.equal(staging, buffer[:31])


def test_gaps_other_buffers_and_strided_grads_split_the_copies_and_change_no_value() -> None:
    buffer = torch.randn(100)
    other = torch.randn(40)
    grads = [
        buffer[0:5],  # then a gap of 3 (padding between shards)
        buffer[8:20],
        other[0:9],  # another buffer
        torch.randn(6, 2).t().reshape(-1)[:12],  # its own memory
        torch.randn(10)[::2],  # strided: copied alone
        buffer[20:20],  # empty: nothing to copy
        buffer[30:40],
    ]
    starts = [0, 4, 0, 0, 0, 0, 3]  # the chunk holds each grad's tail from `start`
    numels = [len(g) - s for g, s in zip(grads, starts, strict=True)]
    pieces = _pieces(numels, starts)
    total = sum(numels)
    staging, want = torch.zeros(total), torch.zeros(total)
    pairs = grad_copies(staging, pieces, grads)
    _apply(pairs)
    _one_by_one(want, pieces, grads)
    assert torch.equal(staging, want)
    assert len(pairs) == 6  # every piece alone but the empty one


def test_a_piece_cut_at_its_start_continues_the_run_of_the_one_before() -> None:
    buffer = torch.randn(64)
    grads = [buffer[0:16], buffer[16:48]]
    pieces = _pieces([16, 20], [0, 0])  # the second param's first 20 elements
    staging = torch.zeros(36)
    pairs = grad_copies(staging, pieces, grads)
    _apply(pairs)
    assert len(pairs) == 1 and torch.equal(staging, buffer[:36])
    late = _pieces([16, 20], [0, 12])  # its elements 12-31: not back to back with the first
    staging = torch.zeros(36)
    pairs = grad_copies(staging, late, grads)
    _apply(pairs)
    assert len(pairs) == 2 and torch.equal(staging, torch.cat([buffer[:16], buffer[28:48]]))


def test_weights_go_back_into_shards_of_one_buffer_in_one_copy_and_elsewhere_piece_by_piece() -> (
    None
):
    shards = torch.zeros(64)  # a bucket's shard buffer: three params' shards, a gap of 4
    params = [shards[0:10], shards[10:30], shards[34:50], torch.zeros(8)]  # the last its own
    pieces = _pieces([10, 15, 16, 8], [0, 5, 0, 0])  # the second's tail from element 5
    weights = torch.randn(sum(p.spec.numel for p in pieces))
    pairs = weight_copies(weights, pieces, params)
    assert len(pairs) == 4  # a cut start, a gap and another buffer each end a run
    _apply(pairs)
    want = [torch.zeros(64), torch.zeros(8)]
    params_want = [want[0][0:10], want[0][10:30], want[0][34:50], want[1]]
    for piece, param in zip(pieces, params_want, strict=True):
        piece.of_param(param).copy_(piece.in_chunk(weights))
    assert torch.equal(shards, want[0]) and torch.equal(params[3], want[1])
    whole = _pieces([10, 20, 4], [0, 0, 0])  # back to back in both: one copy
    weights = torch.randn(34)
    pairs = weight_copies(weights, whole, [shards[0:10], shards[10:30], shards[30:34]])
    _apply(pairs)
    assert len(pairs) == 1 and torch.equal(shards[:34], weights)
