import itertools

import pytest
import torch

from optimizers._split import ParamInfo, plan_split

BF16, FP32 = torch.bfloat16, torch.float32
PARAMS = [
    ParamInfo(105, 0, BF16),
    ParamInfo(0, 0, BF16),
    ParamInfo(3, 0, BF16),
    ParamInfo(250, 0, BF16),
    ParamInfo(7, 1, FP32),
    ParamInfo(40, 1, BF16),
    ParamInfo(1, 1, BF16),
]


def covered(layout, params):
    seen = [[0] * p.numel for p in params]
    pieces = list(layout.device_pieces) + [p for c in layout.host_chunks for p in c.pieces]
    for piece in pieces:
        for i in range(piece.start, piece.start + piece.numel):
            seen[piece.param_index][i] += 1
    return seen


@pytest.mark.parametrize(
    ("fraction", "chunk"), list(itertools.product([0.0, 0.37, 0.5, 0.999, 1.0], [1, 8, 64, 10_000]))
)
def test_every_element_once_and_fraction_exact(fraction: float, chunk: int) -> None:
    layout = plan_split(PARAMS, fraction, chunk)
    total = sum(p.numel for p in PARAMS)
    assert layout.num_elements == total
    assert layout.num_host_elements == round(fraction * total)
    assert sum(c.numel for c in layout.host_chunks) == layout.num_host_elements
    assert all(count == 1 for row in covered(layout, PARAMS) for count in row)
    for c in layout.host_chunks:
        assert c.numel <= chunk
        assert {PARAMS[p.param_index].group_index for p in c.pieces} == {c.group_index}
        assert {PARAMS[p.param_index].dtype for p in c.pieces} == {c.dtype}


def test_last_params_go_first_and_split_is_a_tail() -> None:
    layout = plan_split(PARAMS, 0.3, 64)
    num_host = layout.num_host_elements  # 122 of 406
    host = sorted((p.param_index, p.start, p.numel) for c in layout.host_chunks for p in c.pieces)
    # params 6, 5, 4 whole (48 elements), then the last 74 elements of param 3
    assert [h[0] for h in host] == [3, 3, 4, 5, 6]
    assert host[0][1] == 250 - (num_host - 48)
    device = {p.param_index: (p.start, p.numel) for p in layout.device_pieces}
    assert device[3] == (0, 250 - (num_host - 48))
    assert 1 in device and device[1] == (0, 0)  # zero-numel params stay on the accelerator


def test_params_smaller_than_a_chunk_are_not_cut() -> None:
    params = [ParamInfo(10, 0, BF16)] * 5
    layout = plan_split(params, 1.0, 25)
    assert [len(c.pieces) for c in layout.host_chunks] == [2, 2, 1]
    assert all(p.numel == 10 for c in layout.host_chunks for p in c.pieces)


def test_the_cpu_takes_the_end_of_the_order_and_packs_each_group_in_it() -> None:
    # Two groups listed apart (weights, then the norms of every layer), as weight-decay groups
    # are; the model's order interleaves them: layer 0 (params 0, 3), layer 1 (1, 4), layer 2
    # (2, 5).
    params = [ParamInfo(40, 0, BF16)] * 3 + [ParamInfo(4, 1, BF16)] * 3
    order = [0, 3, 1, 4, 2, 5]
    by_index = plan_split(params, 0.5, 64)  # 66 of 132 elements from the end of index order
    assert {p.param_index for c in by_index.host_chunks for p in c.pieces} == {1, 2, 3, 4, 5}
    layout = plan_split(params, 0.5, 64, order=order)
    host = [[(p.param_index, p.start, p.numel) for p in c.pieces] for c in layout.host_chunks]
    # Layer 2 whole, layer 1's norm and the last 18 elements of its weight: 44 + 4 + 18.
    assert host == [[(1, 22, 18), (2, 0, 40)], [(4, 0, 4), (5, 0, 4)]]
    assert {p.param_index for p in layout.device_pieces} == {0, 1, 3}
    assert all(count == 1 for row in covered(layout, params) for count in row)
    # Small chunks: a group's pieces fill its chunks in the order, chunks by first piece.
    small = plan_split(params, 1.0, 40, order=order)
    firsts = [c.pieces[0].param_index for c in small.host_chunks]
    assert firsts == [0, 3, 1, 2]  # group 1's three norms fit one chunk of 40
    assert [len(c.pieces) for c in small.host_chunks] == [1, 3, 1, 1]
