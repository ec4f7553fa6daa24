"""Units and unit-aligned buckets, in one process: which modules wait for which params, and that
no unit waits for a bucket placed after it (so the gathers can run ahead of the forward)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# Private free functions, unit-tested: the public API shows neither the layout nor the units.
from zero_shard._bucket_layout import plan_buckets, shard_spec
from zero_shard._units import default_units, plan_units, resolve_units

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, GPTConfig


def names(units: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in units]


def test_default_units_are_the_repeated_blocks() -> None:
    gpt = GPT(GPTConfig(3, 2, 8, 16))
    # The blocks; not the Linears of each block's MLP Sequential, which the blocks hold.
    assert names(default_units(gpt)) == ["blocks.0", "blocks.1", "blocks.2"]
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    assert names(default_units(encoder)) == ["layers.0", "layers.1"]
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert names(default_units(mlp)) == ["0", "2"]
    # Siblings of different classes, or one module listed twice, are not repeated blocks.
    assert default_units(nn.ModuleList([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)])) == []
    shared = nn.Linear(2, 2)
    assert default_units(nn.Sequential(shared, shared)) == []


def test_default_units_look_through_modules_that_never_run() -> None:
    # Stages (lists of lists) and levels (bare modules holding blocks) are never called: the
    # blocks inside them are the units.
    stages = nn.ModuleList(nn.ModuleList(nn.Linear(2, 2) for _ in range(2)) for _ in range(2))
    assert names(default_units(nn.Sequential(stages))) == ["0.0.0", "0.0.1", "0.1.0", "0.1.1"]
    levels = nn.ModuleList()
    for _ in range(2):
        level = nn.Module()
        level.block = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        level.proj = nn.Conv1d(2, 2, 1)
        levels.append(level)
    assert names(default_units(levels)) == ["0.block.0", "0.block.1", "1.block.0", "1.block.1"]
    dicts = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(2, 2)}) for _ in range(2))
    assert names(default_units(dicts)) == []  # the root waits for their params


def test_parametrization_lists_are_not_containers_of_blocks() -> None:
    layer = nn.Linear(4, 4)
    torch.nn.utils.parametrizations.weight_norm(layer)
    torch.nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
    model = nn.Sequential(layer, nn.Linear(4, 4))
    assert names(default_units(model)) == ["0", "1"]
    plan_root, first, _ = plan_units(model, default_units(model)).units
    # The unit waits for the parametrization's original tensors, which it reads through weight.
    originals = {id(p) for p in layer.parametrizations.weight.parameters()}
    assert originals <= first.param_ids and not originals & plan_root.param_ids


def test_units_nest_outermost_and_wait_for_their_whole_subtree() -> None:
    gpt = GPT(GPTConfig(2, 2, 8, 16))
    units = resolve_units(gpt, [nn.Linear, type(gpt.blocks[0])])
    # The Linears inside the blocks are covered by them; the head is a Linear of the root.
    assert names(units) == ["blocks.0", "blocks.1", "head"]
    plan = plan_units(gpt, units)
    block = plan.units[1]
    assert block.param_ids == {id(p) for p in gpt.blocks[0].parameters()}
    # The root waits for the embeddings, final norm and (tied) head: everything else.
    root_params = {id(p) for p in gpt.parameters()} - {
        id(p) for b in gpt.blocks for p in b.parameters()
    }
    assert plan.units[0].param_ids == root_params
    assert all(plan.owner[pid] == 0 for pid in root_params)


def test_a_param_shared_with_the_root_is_waited_for_by_both() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    model.extra = nn.Linear(2, 2)
    model.extra.weight = model.blocks[1].weight  # read by the root, owned by a unit
    plan = plan_units(model, default_units(model))
    shared = id(model.blocks[1].weight)
    assert shared in plan.units[0].param_ids and shared in plan.units[2].param_ids
    assert plan.owner[shared] == 0  # placed with the root: first in gather order


def test_bad_units_name_the_value_and_the_fix() -> None:
    gpt = GPT(GPTConfig(1, 2, 8, 16))
    with pytest.raises(ValueError, match="class Conv1d, but the model has no submodule"):
        resolve_units(gpt, [nn.Conv1d])
    with pytest.raises(ValueError, match="not a submodule of the model"):
        resolve_units(gpt, [nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="got 3"):
        resolve_units(gpt, [3])
    with pytest.raises(TypeError, match="got int"):
        resolve_units(gpt, 3)
    assert resolve_units(gpt, []) == [] and resolve_units(gpt, [gpt]) == []
    with pytest.raises(ValueError, match=r"ModuleList, which has no forward.*list\(model.layers\)"):
        resolve_units(gpt, [gpt.blocks])


@pytest.mark.parametrize("bucket_bytes", [1, 3000, 9000, 40000, 1 << 30])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_buckets_hold_whole_units_or_a_part_of_one(bucket_bytes: int, world: int) -> None:
    gpt = GPT(GPTConfig(4, 2, 16, 8))
    plan = plan_units(gpt, default_units(gpt))
    order = {id(p): place for place, p in enumerate(gpt.parameters())}
    params = sorted(gpt.parameters(), key=lambda p: (plan.owner[id(p)], order[id(p)]))
    units = [plan.owner[id(p)] for p in params]
    specs = [shard_spec(p.shape, 0, world) for p in params]
    buckets = plan_buckets(specs, [p.dtype for p in params], world, bucket_bytes, units)
    assert [i for b in buckets for i in b.param_indices] == list(range(len(params)))
    bucket_of = {i: b for b, layout in enumerate(buckets) for i in layout.param_indices}
    for layout in buckets:
        held = {units[i] for i in layout.param_indices}
        whole = all(
            {i for i, u in enumerate(units) if u == unit} <= set(layout.param_indices)
            for unit in held
        )
        assert len(held) == 1 or whole, (bucket_bytes, [units[i] for i in layout.param_indices])
    # Hence no unit waits for a bucket that holds params of a later unit only.
    for unit_index, unit in enumerate(plan.units):
        waited = {bucket_of[i] for i, p in enumerate(params) if id(p) in unit.param_ids}
        later_only = [
            b for b in waited if all(units[i] > unit_index for i in buckets[b].param_indices)
        ]
        assert not later_only, (unit.name, later_only)
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 1


def test_a_unit_that_does_not_fit_starts_a_new_bucket() -> None:
    specs = [shard_spec((8, 8), 0, 1)] * 4
    dtypes = [torch.float32] * 4
    # 256 bytes a param. Units of 2 params: a bucket of 700 bytes takes the first whole, not the
    # second's head; a bucket of 300 bytes splits each unit, and never shares one across units.
    assert [b.param_indices for b in plan_buckets(specs, dtypes, 1, 700, [0, 0, 1, 1])] == [
        (0, 1),
        (2, 3),
    ]
    assert [b.param_indices for b in plan_buckets(specs, dtypes, 1, 600, [0, 1, 1, 2])] == [
        (0,),
        (1, 2),
        (3,),
    ]
    split = plan_buckets(specs, dtypes, 1, 300, [0, 0, 0, 1])
    assert [b.param_indices for b in split] == [(0,), (1,), (2,), (3,)]
    # Without units, buckets fill up as before.
    assert [b.param_indices for b in plan_buckets(specs, dtypes, 1, 600)] == [(0, 1), (2, 3)]
    tails = plan_buckets(specs, dtypes, 1, 600, [0, 0, 0, 1])
    assert [b.param_indices for b in tails] == [(0, 1), (2,), (3,)]  # unit 0's tail stays alone
