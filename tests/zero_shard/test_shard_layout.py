"""Shard specs, bucket plans and the packing around collectives, in one process."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch

from zero_shard._bucket_layout import (
    BucketLayout,
    ShardSpec,
    offload_start,
    plan_buckets,
    shard_spec,
)
from zero_shard._buckets import StorageRef, _norm_runs

# Private free functions, unit-tested: the public API shows neither the layout nor the packing.
from zero_shard._collectives import (
    RowCopies,
    choose_reduce_scaling,
    chunk_pack_grads,
    chunk_packable,
    pack_grads,
    plan_row_copies,
    unpack_params,
)


def _copies(layout: BucketLayout, specs: list[ShardSpec], world: int, *, reduce: bool) -> RowCopies:
    segment_numel = layout.segment_numel if reduce else layout.shard_numel
    return plan_row_copies(layout, specs, world_size=world, segment_numel=segment_numel)


SHAPES = [(7, 15), (3,), (2, 5), (0, 4), (1,), (16, 16), (5,)]


@pytest.mark.parametrize(("shape", "world"), list(itertools.product(SHAPES, [1, 2, 3, 4])))
def test_shards_follow_torch_chunk(shape: tuple[int, ...], world: int) -> None:
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    chunks = list(torch.chunk(full, world, dim=0)) if shape[0] else []
    for rank in range(world):
        spec = shard_spec(shape, rank, world)
        expected = chunks[rank] if rank < len(chunks) else full[:0]
        rows = full.reshape(-1)[spec.start : spec.start + spec.numel].view(spec.local_shape(shape))
        assert torch.equal(rows, expected), (shape, world, rank)
        assert spec.numel <= spec.padded_numel
    # Empty shards exist where chunk gives fewer pieces: (2, 5) on 3 ranks -> 1, 1, 0 rows.
    if shape == (2, 5) and world == 3:
        assert shard_spec(shape, 2, 3).num_rows == 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero_dim_params_are_held_whole_by_every_rank(world: int) -> None:
    shapes = [(), (3,), ()]
    for rank in range(world):
        spec = shard_spec((), rank, world)
        assert spec.replicated and (spec.start, spec.numel) == (0, 1)
        assert spec.local_shape(()) == ()  # the shard keeps the param's shape
    specs = [shard_spec(shape, 0, world) for shape in shapes]
    layout = plan_buckets(specs, [torch.float32] * 3, world, 1 << 20)[0]
    assert layout.replicated_offsets == (layout.offsets[0], layout.offsets[2])
    # The grad goes into rank 0's segment alone (the reduction gives it to every rank), and
    # the gathered param comes from there.
    packed = torch.zeros(world * layout.segment_numel)
    grads = [torch.tensor(2.0), torch.ones(3), torch.tensor(-1.0)]
    pack_grads(packed, layout, _copies(layout, specs, world, reduce=True), grads, world)
    segments = packed.view(world, layout.segment_numel)
    assert segments[0, layout.offsets[0]] == 2.0 and segments[0, layout.offsets[2]] == -1.0
    assert segments[1:, layout.offsets[0]].eq(0).all()
    gathered = torch.full((world * layout.shard_numel,), 7.0)  # the other ranks' copies: 7
    gathered[layout.offsets[0]], gathered[layout.offsets[2]] = 5.0, 6.0  # rank 0's
    targets = [torch.tensor(0.0), torch.zeros(3), torch.tensor(0.0)]
    unpack_params(gathered, _copies(layout, specs, world, reduce=False), targets)
    assert targets[0] == 5.0 and targets[2] == 6.0


def test_buckets_keep_order_split_by_size_and_dtype() -> None:
    world = 2
    specs = [shard_spec(shape, 0, world) for shape in [(8, 8), (8, 8), (4,), (64, 64), (8,)]]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16]
    buckets = plan_buckets(specs, dtypes, world, bucket_bytes=600)
    assert [b.param_indices for b in buckets] == [(0, 1), (2,), (3,), (4,)]
    # Each shard starts aligned to 128 bytes inside a segment.
    assert buckets[0].offsets == (0, 32)
    assert all(b.dtype == torch.bfloat16 for b in buckets[-1:])
    assert buckets[0].segment_numel == buckets[0].shard_numel + 2


def test_a_bucket_starts_where_the_offloaded_share_does() -> None:
    numels = [100, 30, 50, 20]  # 200 elements; the CPU takes from the end
    assert offload_start(numels, 0.0) is None  # nothing offloaded
    assert offload_start(numels, 1.0) is None  # all: one share, no boundary
    assert offload_start(numels, 0.1) == 3  # 20 elements: the last param whole
    assert offload_start(numels, 0.11) == 2  # 22: two of the one before
    assert offload_start(numels, 0.35) == 2  # 70: the last two whole
    assert offload_start(numels, 0.9) is None  # the first param: no cut needed
    world = 2
    specs = [shard_spec((n,), 0, world) for n in numels]
    units = [0, 1, 1, 2]
    cut = offload_start(numels, 0.11)
    buckets = plan_buckets(specs, [torch.float32] * 4, world, 1 << 20, units, cut=cut)
    # A bucket starts at the cut, inside unit 1; the unit after it starts one of its own.
    assert [b.param_indices for b in buckets] == [(0, 1), (2,), (3,)]
    assert [b.param_indices for b in plan_buckets(specs, [torch.float32] * 4, world, 1 << 20)] == [
        (0, 1, 2, 3)
    ]


def test_a_bucket_holds_its_params_by_param_group() -> None:
    world = 2
    specs = [shard_spec((n,), 0, world) for n in [64, 4, 64, 4, 64, 4]]  # weight, norm, ...
    groups = [0, 1, 0, 1, 0, 1]
    buckets = plan_buckets(specs, [torch.float32] * 6, world, 1 << 20, groups=groups)
    assert [b.param_indices for b in buckets] == [(0, 2, 4, 1, 3, 5)]
    # Each shard (32 of 64 elements; 2 of 4, padded to 32 to align) right after the one before.
    assert buckets[0].offsets == (0, 32, 64, 96, 128, 160)
    # Buckets are cut by size in the params' order first, then ordered inside.
    small = plan_buckets(specs, [torch.float32] * 6, world, 1100, groups=groups)
    assert [b.param_indices for b in small] == [(0, 2, 1, 3), (4, 5)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pack_and_unpack_round_trip(world: int) -> None:
    shapes = [(7, 15), (3,), (2, 5), (5, 0), (0, 4)]
    params = [torch.randn(shape) for shape in shapes]
    specs_by_rank = [[shard_spec(s, r, world) for s in shapes] for r in range(world)]
    layout = plan_buckets(specs_by_rank[0], [torch.float32] * len(shapes), world, 1 << 20)[0]
    # Packing grads lays out, for each destination rank, that rank's rows of every param.
    packed = torch.zeros(world * layout.segment_numel)
    grads = [p.clone() for p in params[:-1]] + [None]
    pack_grads(packed, layout, _copies(layout, specs_by_rank[0], world, reduce=True), grads, world)
    segments = packed.view(world, layout.segment_numel)
    for rank in range(world):
        for position, param in enumerate(params[:-1]):
            spec = specs_by_rank[rank][position]
            got = segments[rank, layout.offsets[position] : layout.offsets[position] + spec.numel]
            assert torch.equal(got, param.reshape(-1)[spec.start : spec.start + spec.numel])
        flags = segments[rank, layout.shard_numel :]
        assert flags.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    # An all-gather output (every rank's shard segment) unpacks into the full params.
    gathered = torch.zeros(world * layout.shard_numel)
    for rank in range(world):
        segment = gathered[rank * layout.shard_numel : (rank + 1) * layout.shard_numel]
        for position, param in enumerate(params):
            spec = specs_by_rank[rank][position]
            offset = layout.offsets[position]
            segment[offset : offset + spec.numel] = param.reshape(-1)[
                spec.start : spec.start + spec.numel
            ]
    targets = [torch.zeros_like(p) for p in params]
    unpack_params(gathered, _copies(layout, specs_by_rank[0], world, reduce=False), targets)
    for target, param in zip(targets, params, strict=True):
        assert torch.equal(target, param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_back_to_back_pack_in_one_chunked_copy_as_param_by_param(
    world: int, dtype: torch.dtype
) -> None:
    # Padded shards of whole multiples of the alignment, with rows past the last rank's (5 rows
    # of 64: at 4 ranks 2, 2, 1, 0): every element written as pack_grads writes it.
    shapes = [(5, 64), (3, 64), (768,), (12, 64)]
    specs = [shard_spec(shape, 0, world) for shape in shapes]
    layout = plan_buckets(specs, [dtype] * len(shapes), world, 1 << 20)[0]
    copies = _copies(layout, specs, world, reduce=True)
    assert copies.back_to_back
    grads: list[torch.Tensor | None] = [torch.randn(shape).to(dtype) for shape in shapes]
    assert chunk_packable(copies, grads, dtype)
    expected = torch.zeros(world * layout.segment_numel, dtype=dtype)
    pack_grads(expected, layout, copies, grads, world)
    packed = torch.full_like(expected, float("nan"))  # nothing left unwritten
    chunk_pack_grads(packed, [grad for grad in grads if grad is not None], world)
    assert torch.equal(packed, expected)
    # What the chunked copy cannot pack goes param by param.
    assert not chunk_packable(copies, [*grads[:3], None], dtype)  # a param without a grad
    assert not chunk_packable(copies, [*grads[:3], torch.randn(64, 12).t()], dtype)  # strided
    other = torch.float16 if dtype == torch.float32 else torch.float32
    assert not chunk_packable(copies, [*grads[:3], torch.randn(12, 64).to(other)], dtype)
    for gapped in ([(7, 15), (3,)], [(), (64,)], [(0, 64), (64,)]):  # a gap, 0-dim, no elements
        specs = [shard_spec(shape, 0, world) for shape in gapped]
        layout = plan_buckets(specs, [dtype] * len(gapped), world, 1 << 20)[0]
        assert not _copies(layout, specs, world, reduce=True).back_to_back, gapped


@pytest.mark.parametrize("world", [1, 2, 3])
def test_norm_runs_cover_the_counted_slots_and_their_padding(world: int) -> None:
    shapes = [(7, 15), (3,), (), (2, 5), (5, 0), (0, 4), (9,)]
    counted = [True, True, False, True, True, False, False]
    for rank in range(world):
        specs = [shard_spec(shape, rank, world) for shape in shapes]
        layout = plan_buckets(specs, [torch.float32] * len(shapes), world, 1 << 20)[0]
        runs = _norm_runs(layout, specs, counted)
        # Marks each slot's elements with its param's index + 1; padding and flags hold 0.
        buffer = torch.zeros(layout.segment_numel)
        for position, (spec, offset) in enumerate(zip(specs, layout.offsets, strict=True)):
            buffer[offset : offset + spec.numel] = position + 1
        for found, counts in ((runs.counted, True), (runs.copies, False)):
            marks = torch.cat([buffer[start:end] for start, end in found] + [torch.zeros(0)])
            expected = [
                float(i + 1) for i, spec in enumerate(specs) if counted[i] == counts
                for _ in range(spec.numel)
            ]  # fmt: skip
            assert marks[marks > 0].tolist() == expected, (rank, counts, found)
            assert all(end <= layout.shard_numel for _, end in found)  # no flag
        covered = [set(range(start, end)) for start, end in (*runs.counted, *runs.copies)]
        assert sum(map(len, covered)) == len(set().union(*covered))  # no element twice


def test_reduce_scaling_is_a_mean() -> None:
    cpu = torch.device("cpu")
    assert choose_reduce_scaling(1, cpu, torch.float32).post_divide is None
    assert choose_reduce_scaling(3, cpu, torch.float32).post_divide == 3.0
    fp16 = choose_reduce_scaling(8, cpu, torch.float16)
    assert (fp16.pre_divide, fp16.post_divide) == (8.0, None)  # as DDP: no overflow in the sum
    cuda = choose_reduce_scaling(2, torch.device("cuda"), torch.bfloat16)
    assert cuda.pre_divide is None and cuda.post_divide is None  # NCCL's AVG


def test_a_storage_ref_is_shared_by_copies_and_expires_with_its_memory() -> None:
    """A record's weak reference to its param's storage: copies share it (a copied handle would be
    freed twice: a deep copy of a DDP model's optimizer crashed the process), it does not pickle,
    and it expires once the param is given other memory, wherever that lies."""
    param = torch.zeros(4)
    ref = StorageRef(param)
    assert copy.deepcopy(ref) is ref and copy.copy(ref) is ref
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ref)
    assert not ref.expired()
    param.data = torch.ones(4)
    assert ref.expired()
