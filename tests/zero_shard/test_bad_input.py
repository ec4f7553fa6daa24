"""Bad input on every public entry point: an error of the right type that names the value and the
fix, raised on every rank alike (a check that fails on one rank only must not leave the others
waiting in a collective). docs/reliability.md lists each row and its test.

Two CPU processes (gloo) run the distributed cases in one spawn; the single-process cases
(HybridDeviceOptimizer, host memory, pinning) are plain tests. Each distributed case checks the
error on every rank: the rank that failed raises its own, the others name it ("on rank 1: ...").
"""

from __future__ import annotations

import contextlib
import math
import os
import types
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import psutil
import pytest
import torch
from _harness import check_outcome, run_cases
from _models import Net, adamw, global_batch, local_slice, make_model, mse
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import zero_shard
from offload import _pinned
from optimizers import HybridDeviceOptimizer, OffloadPolicy

CASES = {}
GiB = 1 << 30


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def folder() -> Path:
    return Path(os.environ["ZERO_SHARD_TEST_DIR"])


# -- zero_shard.wrap ----------------------------------------------------------------------------


@case
def offload_that_is_not_a_policy(rank: int, world: int) -> None:
    model = make_model()
    with pytest.raises(TypeError, match=r"got 1\.5; pass offload=zero_shard\.OffloadPolicy"):
        zero_shard.wrap(adamw(model), model, offload=1.5)
    for fraction in (-0.1, 1.5, math.nan):  # refused where the policy is made, before any wrap
        with pytest.raises(ValueError, match=rf"must be in \[0, 1\].*got {fraction}"):
            OffloadPolicy(fraction=fraction)


@case
def an_all_gather_that_is_not_callable_or_under_fsdp2(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    with pytest.raises(TypeError, match=r"all_gather must be callable .* got str"):
        zero_shard.wrap(adamw(model), model, all_gather="nccl")
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    with pytest.raises(ValueError, match=r"set it on the FSDP2 module.*set_custom_all_gather"):
        zero_shard.wrap(adamw(model), model, all_gather=lambda shard, out, group: None)


@case
def tensor_parallel_layouts_zero_shard_cannot_take(rank: int, world: int) -> None:
    # Never taken for FSDP2 by guess (a column-parallel Shard(0) looks like FSDP2's); the
    # supported compositions are in test_tensor_parallel.py.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    pair = {"0": ColwiseParallel(), "2": RowwiseParallel()}

    def tensor_parallel(tp_mesh: Any = mesh["tp"]) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return parallelize_module(model, tp_mesh, pair)

    def fsdp_first_layer() -> nn.Module:
        model = tensor_parallel()
        fully_shard(model[0], mesh=mesh["dp"])  # the other layer's DTensors are TP's alone
        return model

    def over_both_dims() -> nn.Module:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model[0].weight = nn.Parameter(
            distribute_tensor(model[0].weight.detach(), mesh, [Shard(0), Shard(0)])
        )
        return model

    def fsdp_on_a_mesh_of_its_own() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))
        parallelize_module(model, mesh["tp"], pair)  # the LayerNorm stays plain
        # Its own "dp" mesh over every rank: not mesh["dp"] (a plan-less param on mesh["dp"]
        # trains: test_tensor_parallel.py).
        fully_shard(model[3], mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        return fully_shard(model, mesh=mesh["dp"])

    refused = {
        "FSDP2 over one layer of a TP model": (
            fsdp_first_layer,
            None,
            r"'2\.weight' is a DTensor.*fully_shard on the root",
        ),
        "TP over a 1-D mesh, no dp mesh": (
            # (A 1-D mesh named "tp" over the same ranks would be mesh["tp"] of the 2-D one.)
            lambda: tensor_parallel(init_device_mesh("cpu", (world,), mesh_dim_names=("model",))),
            None,
            r"not a named dim of a 2-D mesh: build the mesh as init_device_mesh",
        ),
        "a dp mesh of another mesh": (
            tensor_parallel,
            init_device_mesh("cpu", (world,)),
            r"must be two named dims of one mesh",
        ),
        "the tensor-parallel dim as the mesh": (
            tensor_parallel,
            mesh["tp"],
            r"mesh is the tensor-parallel dim 'tp' itself; pass the data-parallel dim",
        ),
        "FSDP2 + TP with a param on a mesh of its own": (
            fsdp_on_a_mesh_of_its_own,
            None,
            r"param '3\.weight' has placements \(Shard\(dim=0\),\) on a mesh of shape "
            rf"\({world},\) \('dp',\), but param '0\.weight' has .*or on named dims of it",
        ),
        "a param split over both dims": (
            over_both_dims,
            None,
            r"param '0\.weight' has placements \(Shard\(dim=0\), Shard\(dim=0\)\)",
        ),
    }
    for build, dp_mesh, message in refused.values():
        model = build()
        with pytest.raises(ValueError, match=message):
            zero_shard.wrap(torch.optim.AdamW(model.parameters()), model, mesh=dp_mesh)


@case
def non_elementwise_optimizer(rank: int, world: int) -> None:
    model = make_model()
    for cls in (torch.optim.LBFGS, torch.optim.Adafactor):
        with pytest.raises(
            NotImplementedError, match=rf"{cls.__name__} is not a known elementwise"
        ):
            zero_shard.wrap(cls(model.parameters()), model)
    # accelerate's AcceleratedOptimizer around the torch optimizer (wrapped after prepare)
    accelerated = types.new_class("AcceleratedOptimizer", (torch.optim.Optimizer,))
    outer = accelerated.__new__(accelerated)
    outer.optimizer = torch.optim.AdamW(model.parameters())
    outer.param_groups, outer.defaults = outer.optimizer.param_groups, outer.optimizer.defaults
    with pytest.raises(TypeError, match=r"AcceleratedOptimizer around a AdamW.*prepare"):
        zero_shard.wrap(outer, model)


class WithEmbedding(nn.Module):
    def __init__(self, sparse: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=sparse)
        self.head = nn.Linear(4, 2).to(dtype)


@case
def sparse_and_complex_params(rank: int, world: int) -> None:
    model = WithEmbedding(sparse=True)
    with pytest.raises(TypeError, match=r"module 'emb' \(Embedding\) has sparse=True"):
        zero_shard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model = WithEmbedding()
    model.emb.weight = nn.Parameter(torch.eye(10, 4).to_sparse())
    with pytest.raises(TypeError, match=r"param 'emb.weight' is sparse \(torch.sparse_coo\)"):
        zero_shard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model = WithEmbedding(dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"param 'head.weight' is complex \(torch.complex64\)"):
        zero_shard.wrap(adamw(model), model)
    # fp32 main weights would round float64 params and lose updates below fp32's precision.
    model = WithEmbedding(dtype=torch.float64)
    with pytest.raises(TypeError, match=r"param 'head.weight' is torch.float64; .*fp32 main"):
        zero_shard.wrap(adamw(model), model)


@case
def one_param_in_two_groups(rank: int, world: int) -> None:
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch only warns about a repeat inside one group
        opt = torch.optim.AdamW([model.inp.weight, model.inp.bias, model.inp.weight])
    with pytest.raises(ValueError, match="param 'inp.weight' appears twice in param group 0"):
        zero_shard.wrap(opt, model)
    opt = adamw(model)  # torch refuses the repeat across groups at construction; not after it
    opt.param_groups[1]["params"].append(model.mid.weight)
    with pytest.raises(ValueError, match="'mid.weight' is in param groups 0 and 1; put each"):
        zero_shard.wrap(opt, model)


class OverlappingViews(nn.Module):
    """Two params that are views of one tensor and share rows 5 and 6 of it."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(10, 3)
        self.head = nn.Parameter(base[:7])
        self.tail = nn.Parameter(base[5:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.head.t() + (x @ self.tail.t()).sum(-1, keepdim=True)


@case
def params_that_share_elements(rank: int, world: int) -> None:
    # torch's AdamW would apply both updates to rows 5 and 6; separate main weights cannot. A
    # plain and a DDP model are refused on every rank; views that share no element train
    # (test_habits.py).
    expected = (
        r"params 'head' \(elements 0-20 of their storage\) and 'tail' \(elements 15-29 of their "
        r"storage\) share elements .* Make them one Parameter .*\.clone\(\)"
    )
    model = OverlappingViews()
    for net in (model, nn.parallel.DistributedDataParallel(model)):
        with pytest.raises(ValueError, match=expected):
            zero_shard.wrap(torch.optim.AdamW(model.parameters()), net)


@case
def params_of_one_rank_on_the_meta_device(rank: int, world: int) -> None:
    # Rank 1 alone built a param on the meta device: every rank raises (none waits in the next
    # collective), rank 0 naming rank 1.
    model = make_model()
    if rank == 1:
        model.out.weight = nn.Parameter(torch.empty(2, 3, device="meta"))
    expected = "param 'out.weight' is on the meta device; materialize the model first"
    with pytest.raises(ValueError, match=("" if rank == 1 else "on rank 1: .*") + expected):
        zero_shard.wrap(adamw(model), model)


@case
def params_that_differ_between_ranks(rank: int, world: int) -> None:
    model = make_model()
    if rank == 1:
        model.mid = nn.Linear(7, 4)  # another shape: the buckets, and every collective, differ
        model.out = nn.Linear(4, 2)
    with pytest.raises(
        ValueError,
        match=r"the ranks differ: param 'mid.weight' of shape \(3, 7\), torch.float32, in param "
        r"group 0 on rank 0, but param 'mid.weight' of shape \(4, 7\)",
    ):
        zero_shard.wrap(adamw(model), model)
    model = make_model()
    with pytest.raises(ValueError, match=r"bucket_mb=256.0 on rank 0, but bucket_mb=1.0 on rank 1"):
        zero_shard.wrap(adamw(model), model, bucket_mb=256.0 if rank == 0 else 1.0)
    # A fraction of each rank's own (by its host's memory, say): a bucket starts at its share.
    fraction = OffloadPolicy(fraction=0.25 if rank == 0 else 0.5)
    with pytest.raises(ValueError, match=r"fraction=0.25 on rank 0, but offload fraction=0.5"):
        zero_shard.wrap(adamw(model), model, offload=fraction)


@case
def a_mesh_that_does_not_match_the_process_group(rank: int, world: int) -> None:
    model = make_model()
    small = init_device_mesh("cpu", (1,))  # a mesh of rank 0 alone, as (8,) on 16 ranks
    with pytest.raises(ValueError, match=r"mesh covers ranks \[0\] .* the process group has 2"):
        zero_shard.wrap(adamw(model), model, mesh=small)
    grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"1-D data-parallel mesh, got 2 dims.*mesh\['dp'\]"):
        zero_shard.wrap(adamw(model), model, mesh=grid)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(
        ValueError, match=rf"ranks \[{rank}\], but the DDP model averages its grads"
    ):
        zero_shard.wrap(adamw(model), ddp, mesh=grid["tp"])
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh or None, got str"):
        zero_shard.wrap(adamw(model), model, mesh="dp")
    opt = zero_shard.wrap(adamw(model), model, mesh=grid["dp"])  # the dp dim of a full mesh
    assert opt.mesh.size() == world


@case
def host_memory_short_on_one_rank(rank: int, world: int) -> None:
    model = make_model()
    tiny = mock.Mock(total=64 * GiB, available=1 << 10)  # rank 1's host is full
    fake = mock.patch.object(psutil, "virtual_memory", return_value=tiny)
    expected = r"needs .* of host memory .* but only 1\.00 KiB is available"
    with fake if rank == 1 else contextlib.nullcontext():
        with pytest.raises(ValueError, match=("" if rank == 1 else "on rank 1: .*") + expected):
            zero_shard.wrap(adamw(model), model, offload=OffloadPolicy(fraction=1.0))


@case
def load_state_dict_with_missing_extra_or_misshapen_fqns(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    good = opt.state_dict()
    extra = {**good, "state": {**good["state"], "gone.weight": good["state"]["inp.weight"]}}
    with pytest.raises(ValueError, match=r"state for params this model lacks: \['gone.weight'\]"):
        opt.load_state_dict(extra)
    groups = [dict(group) for group in good["param_groups"]]
    groups[0]["params"] = [fqn for fqn in groups[0]["params"] if fqn != "mid.weight"]
    with pytest.raises(ValueError, match=r"param group 0 .* missing \['mid.weight'\]"):
        opt.load_state_dict({**good, "param_groups": groups})
    # Rank 1 alone is handed a state of another shape: both refuse, nothing changes.
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    if rank == 1:
        state["state"]["out.weight"] = {
            **state["state"]["out.weight"],
            "exp_avg": torch.zeros(3, 2),
        }
    expected = r"'exp_avg' of 'out.weight' has shape \(3, 2\), but the param has shape \(2, 3\)"
    with pytest.raises(ValueError, match=("" if rank == 1 else "on rank 1: .*") + expected):
        opt.load_state_dict(state)
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new.detach())


# -- zero_shard.checkpoint.load -----------------------------------------------------------------


class Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(15, 7)
        self.mid = nn.Linear(7, 3)
        self.out = nn.Linear(3, 2)


class Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 8)
        self.mid = nn.Linear(8, 3)
        self.out = nn.Linear(3, 2)


class Smaller(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 7)


@case
def checkpoint_of_another_model(rank: int, world: int) -> None:
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    x, y = global_batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()
    zero_shard.checkpoint.save(folder() / "net", model=model, optimizer=opt)
    zero_shard.checkpoint.save(folder() / "net_only", model=model)
    refusals = [
        (Renamed, r"has no \['first.bias', 'first.weight'\] \(2 in all\) of this model"),
        (Wider, r"holds 'inp.weight' of shape \(7, 15\), but this model's has shape \(8, 15\)"),
        (
            Smaller,
            r"holds \['mid.bias', 'mid.weight', 'out.bias', 'out.weight'\] \(4 in all\) that",
        ),
    ]
    for cls, message in refusals:
        other = cls()
        before = [p.detach().clone() for p in other.parameters()]
        for with_optimizer in (False, True):
            other_opt = zero_shard.wrap(adamw(other), other) if with_optimizer else None
            with pytest.raises(ValueError, match=message):
                zero_shard.checkpoint.load(folder() / "net", model=other, optimizer=other_opt)
        for old, new in zip(before, other.parameters(), strict=True):
            assert torch.equal(old, new.detach()), "a refused load changed the model"
    fresh = make_model(seed=1)
    with pytest.raises(ValueError, match="holds no optimizer state .* load it with optimizer=None"):
        zero_shard.checkpoint.load(folder() / "net_only", model=fresh,
                                   optimizer=zero_shard.wrap(adamw(fresh), fresh))  # fmt: skip
    one_group = zero_shard.wrap(torch.optim.AdamW(fresh.parameters()), fresh)
    with pytest.raises(ValueError, match="has 2 optimizer param groups, this optimizer has 1"):
        zero_shard.checkpoint.load(folder() / "net", model=fresh, optimizer=one_group)
    # Rank 1 alone has another model: both refuse (DCP's collectives would otherwise hang).
    other = Wider() if rank == 1 else make_model(seed=1)
    expected = r"holds 'inp.weight' of shape \(7, 15\), but this model's has shape \(8, 15\)"
    with pytest.raises(ValueError, match=("" if rank == 1 else "on rank 1: .*") + expected):
        zero_shard.checkpoint.load(folder() / "net", model=other)
    zero_shard.checkpoint.load(folder() / "net", model=fresh)  # the model it was saved from
    for saved, loaded in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(saved.detach(), loaded.detach())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("bad_input"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cases(CASES, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)


@pytest.mark.cuda
def test_params_on_two_devices_under_wrap() -> None:
    assert run_cases({"params_on_two_devices": params_on_two_devices}, 2) == {
        "params_on_two_devices": None
    }


def params_on_two_devices(rank: int, world: int) -> None:
    model = make_model()
    if rank == 1:
        model.out.cuda()  # the last params: the first (and the mesh) stay on the CPU
    expected = r"the params are on different devices \['cpu', 'cuda:0'\]; move the model"
    with pytest.raises(ValueError, match=("" if rank == 1 else "on rank 1: .*") + expected):
        zero_shard.wrap(adamw(model), model)


# -- HybridDeviceOptimizer (one process) --------------------------------------------------------


def test_hybrid_sparse_params_and_grads() -> None:
    sparse = nn.Parameter(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"param 0 \(shape \(3, 3\)\) is sparse \(torch.sparse_coo"):
        HybridDeviceOptimizer([sparse])
    embedding = nn.Embedding(10, 4, sparse=True)
    opt = HybridDeviceOptimizer(embedding.parameters(), torch.optim.SGD, lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"grad of a param of shape \(10, 4\) is sparse"):
        opt.step()


def test_hybrid_state_of_another_shape_with_as_many_elements() -> None:
    net = Net()
    opt = HybridDeviceOptimizer(net.parameters(), offload_fraction=0.5)
    state = opt.state_dict()
    state["state"][0] = {**state["state"][0], "exp_avg": torch.zeros(15, 7)}  # (7, 15) transposed
    with pytest.raises(ValueError, match=r"'exp_avg' of param 0 has shape \(15, 7\).*\(7, 15\)"):
        opt.load_state_dict(state)


@pytest.mark.cuda
def test_hybrid_params_on_two_devices() -> None:
    params = [nn.Parameter(torch.zeros(4, device="cuda")), nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match=r"different devices \(cuda:0 and cpu for param 1"):
        HybridDeviceOptimizer(params)


def test_host_memory_refused_before_any_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    tiny = mock.Mock(total=64 * GiB, available=1 << 10)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: tiny)

    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("host buffers were allocated before the memory check")

    # Fault injection: no public API tells whether host memory was allocated before a refusal.
    monkeypatch.setattr(_pinned, "_allocate_block", no_allocation)
    net = Net()
    # 144 fp32 elements offloaded, 16 bytes each: main weight, two AdamW states, staging (which
    # holds the grads too).
    with pytest.raises(
        ValueError,
        match=r"needs 2\.25 KiB of host memory .* but only 1\.00 KiB is available .* Lower the "
        r"offload fraction",
    ):
        HybridDeviceOptimizer(net.parameters(), offload_fraction=1.0)


@pytest.mark.cuda
def test_failed_pin_falls_back_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    real_empty = torch.empty

    def pin_fails(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")
        return real_empty(*args, **kwargs)

    # The warn-once flag is private state: reset, so this test sees the warning whatever ran before.
    monkeypatch.setattr(_pinned, "_pin_failure_warned", False)
    monkeypatch.setattr(_pinned.torch, "empty", pin_fails)
    torch.manual_seed(0)
    net, ref = Net().cuda(), Net().cuda()
    ref.load_state_dict(net.state_dict())
    with pytest.warns(RuntimeWarning, match="falling back to pageable memory"):
        opt = HybridDeviceOptimizer(net.parameters(), offload_fraction=0.5, lr=1e-2)
    monkeypatch.undo()
    assert opt.memory_report().pinned is False
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = global_batch(step)
        for model, optimizer in ((net, opt), (ref, ref_opt)):
            mse(model(x.cuda()), y.cuda()).backward()
            optimizer.step()
            optimizer.zero_grad()
    for param, ref_param in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-6)
