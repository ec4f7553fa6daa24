"""Model-only weight loads after wrap, on 2 and 3 CPU processes (gloo), and checkpoint edges.

Loads: for each model kind (replicated, DDP, FSDP2) and each way users load weights into a model
(``module.load_state_dict``, ``param.copy_``, ``dcp.load`` in place into ``model.state_dict()``,
``set_model_state_dict``, ``zero_shard.checkpoint.load(optimizer=None)``), weights W are loaded
after two steps; the next step must go on from W (``stale_params="reload"``) or raise
(``"error"``, then ``reload_model_params()``). The reference is the same trajectory with torch
AdamW, the same load at the same step (its moments kept): one process on the whole batch, or
FSDP2 + torch AdamW. Half the optimizer is offloaded, so the main weights are copies: a missed
load shows as the old weights coming back.

Checkpoint edges: a plain torch optimizer that has not stepped loads its state; a failed
``async_save`` raises at the next save on every rank, and leaves the last checkpoint intact.

The cases share a folder through ZERO_SHARD_TEST_DIR, set before the processes are spawned.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _harness import check_outcome, run_cases
from _models import adamw, global_batch, local_slice, make_model, mse, step_reference
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy

TOL = {"rtol": 0.0, "atol": 1e-6}  # fp32: the same trajectory, summed in other orders
TINY_BUCKETS = 0.0008  # MiB: a few params a bucket
KINDS = ("replicated", "ddp", "fsdp2")
ROUTES = ("load_state_dict", "copy_", "dcp_in_place", "set_model_state_dict", "checkpoint_load")
LOAD_AT = 2  # steps before the load


def folder(world: int) -> Path:
    path = Path(os.environ["ZERO_SHARD_TEST_DIR"], f"world{world}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def offload() -> OffloadPolicy:
    return OffloadPolicy(fraction=0.5, num_threads=1, chunk_numel=16)


def fsdp2_model(world: int, seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=seed)
    for layer in (model.inp, model.mid, model.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build(kind: str, world: int, seed: int) -> nn.Module:
    """What the user trains: a plain module, a DDP one, or an FSDP2 one."""
    if kind == "fsdp2":
        return fsdp2_model(world, seed)
    model = make_model(seed=seed)
    return nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model


def unwrapped(net: nn.Module) -> nn.Module:
    return net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def assert_params_close(model: nn.Module, ref: nn.Module, where: str) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(full(param), full(ref_param), **TOL, msg=f"{where}: {name}")


# -- model-only loads --------------------------------------------------------------------------


class Reference:
    """torch AdamW on the same trajectory: one process on the whole batch (replicated, DDP), or
    FSDP2 on the same slices; ``load`` loads W into it."""

    def __init__(self, kind: str, world: int, rank: int) -> None:
        self.fsdp2 = kind == "fsdp2"
        self.rank, self.world = rank, world
        self.model = fsdp2_model(world, 0) if self.fsdp2 else make_model(seed=0)
        self.opt = adamw(self.model)
        self.weights = (fsdp2_model(world, 7) if self.fsdp2 else make_model(seed=7)).state_dict()

    def step(self, step: int) -> None:
        x, y = global_batch(step)
        if not self.fsdp2:
            step_reference(self.model, self.opt, x, y)
            return
        x, y = local_slice(x, self.rank, self.world), local_slice(y, self.rank, self.world)
        mse(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()

    def load(self) -> None:
        self.model.load_state_dict(self.weights)


def save_weights(kind: str, world: int, route: str) -> tuple[dict[str, Any], Path]:
    """W, as a state dict of the kind's model (DTensors under FSDP2, 'module.' names under DDP),
    and where the routes that read files find it."""
    source = build(kind, world, seed=7)
    weights = source.state_dict()
    path = folder(world) / f"weights_{kind}_{route}"
    if route == "dcp_in_place":
        dcp.save({"model": weights}, checkpoint_id=str(path))
    elif route == "checkpoint_load":
        zero_shard.checkpoint.save(path, model=source)
    return weights, path


def load_weights(route: str, net: nn.Module, opt: Any, weights: dict[str, Any], path: Path) -> None:
    """Loads W into ``net`` the way ``route`` names, as a user would."""
    if route == "load_state_dict":
        net.load_state_dict(weights)
    elif route == "copy_":
        opt.finish_param_sync()  # writes right after step() wait first (see its docstring)
        params = dict(net.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
    elif route == "dcp_in_place":
        dcp.load({"model": net.state_dict()}, checkpoint_id=str(path))
    elif route == "set_model_state_dict":
        # Its names leave DDP's 'module.' out.
        set_model_state_dict(net, {k.removeprefix("module."): v for k, v in weights.items()})
    elif route == "checkpoint_load":
        zero_shard.checkpoint.load(path, model=net, optimizer=None)
    else:
        raise AssertionError(f"unknown route {route}")


def train_step(net: nn.Module, opt: Any, step: int, rank: int, world: int) -> None:
    x, y = global_batch(step)
    mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()
    opt.zero_grad()


def load_after_steps(rank: int, world: int, kind: str, route: str, stale_params: str) -> None:
    where = f"{kind}, {route}, stale_params={stale_params!r}, {world} ranks"
    weights, path = save_weights(kind, world, route)
    net = build(kind, world, seed=0)
    opt = zero_shard.wrap(
        adamw(unwrapped(net)), net, offload=offload(), bucket_mb=TINY_BUCKETS,
        stale_params=stale_params,
    )  # fmt: skip
    ref = Reference(kind, world, rank)
    for step in range(LOAD_AT):
        train_step(net, opt, step, rank, world)
        ref.step(step)
    load_weights(route, net, opt, weights, path)
    ref.load()
    x, y = global_batch(LOAD_AT)
    mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    if stale_params == "error":
        with pytest.raises(RuntimeError, match="written since the optimizer last set them"):
            opt.step()
        opt.reload_model_params()  # the fix the error names
    opt.step()
    opt.zero_grad()
    ref.step(LOAD_AT)
    for step in range(LOAD_AT + 1, LOAD_AT + 3):
        opt.finish_param_sync()
        assert_params_close(unwrapped(net), ref.model, f"{where}, before step {step}")
        train_step(net, opt, step, rank, world)
        ref.step(step)
    opt.finish_param_sync()
    assert_params_close(unwrapped(net), ref.model, f"{where}, the end")


def load_under_both_policies(rank: int, world: int, *, kind: str, route: str) -> None:
    for stale_params in ("reload", "error"):
        load_after_steps(rank, world, kind, route, stale_params)


LOAD_CASES = {
    f"{kind}_{route}": functools.partial(load_under_both_policies, kind=kind, route=route)
    for kind in KINDS
    for route in ROUTES
}


def fsdp2_shard_replaced_raises(rank: int, world: int) -> None:
    # FSDP2 gives a param a new local tensor when its memory changes (model.to(...) and the like):
    # the optimizer would then step memory FSDP2 no longer gathers from. It says so.
    net = fsdp2_model(world, 0)
    opt = zero_shard.wrap(adamw(net), net)
    train_step(net, opt, 0, rank, world)
    param = net.mid.weight
    # DTensor's private field, set as FSDP2's reset_sharded_param sets it: the public route
    # (net.mid.double().float()) fails in torch's swap_tensors while the optimizer holds the shards.
    param._local_tensor = param._local_tensor.clone()
    x, y = global_batch(1)
    mse(net(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    with pytest.raises(
        RuntimeError, match=r"local tensor of FSDP2 param 'mid.weight' was replaced"
    ):
        opt.step()


# -- checkpoints of plain torch optimizers -----------------------------------------------------


def torch_optimizer_setup(kind: str, world: int, seed: int) -> tuple[nn.Module, Any]:
    net = fsdp2_model(world, seed) if kind == "fsdp2" else make_model(seed=seed)
    return net, adamw(net)


def torch_train(kind: str, net: nn.Module, opt: Any, steps: range, rank: int, world: int) -> None:
    for step in steps:
        x, y = global_batch(step)
        if kind == "fsdp2":  # each rank its slice; else every rank the whole batch, alike
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        mse(net(x), y).backward()
        opt.step()
        opt.zero_grad()


def torch_adamw_loads_into_a_fresh_torch_adamw(rank: int, world: int) -> None:
    for kind in ("replicated", "fsdp2"):
        path = folder(world) / f"torch_adamw_{kind}"
        net, opt = torch_optimizer_setup(kind, world, seed=0)
        torch_train(kind, net, opt, range(3), rank, world)
        zero_shard.checkpoint.save(path, model=net, optimizer=opt)
        fresh, fresh_opt = torch_optimizer_setup(kind, world, seed=1)
        assert not fresh_opt.state  # it never stepped
        zero_shard.checkpoint.load(path, model=fresh, optimizer=fresh_opt)
        params = list(net.parameters())
        fresh_params = list(fresh.parameters())
        for index, (param, fresh_param) in enumerate(zip(params, fresh_params, strict=True)):
            state, loaded = opt.state[param], fresh_opt.state[fresh_param]
            assert set(loaded) == set(state), f"{kind}: param {index} has state {set(loaded)}"
            for key, value in state.items():
                torch.testing.assert_close(
                    full(loaded[key]), full(value), rtol=0, atol=0, msg=f"{kind} {index} {key}"
                )
        torch_train(kind, net, opt, range(3, 5), rank, world)
        torch_train(kind, fresh, fresh_opt, range(3, 5), rank, world)
        for param, fresh_param in zip(params, fresh_params, strict=True):
            torch.testing.assert_close(full(fresh_param), full(param), rtol=0, atol=0, msg=kind)

    # An optimizer that keeps no state cannot load one: refused, not loaded as nothing.
    path = folder(world) / "torch_adamw_replicated"
    model = make_model(seed=1)
    sgd = torch.optim.SGD([{"params": g["params"]} for g in adamw(model).param_groups], lr=0.1)
    with pytest.raises(
        ValueError, match="holds optimizer state, but this optimizer has none to load"
    ):
        zero_shard.checkpoint.load(path, model=model, optimizer=sgd)
    # A refused load leaves a fresh optimizer fresh (the state made to load into is dropped).
    other = nn.Linear(15, 7)
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="of this model"):
        zero_shard.checkpoint.load(path, model=other, optimizer=other_opt)
    assert not other_opt.state


# -- failed async saves ------------------------------------------------------------------------


def zero_shard_setup() -> tuple[nn.Module, Any]:
    model = make_model(seed=0)
    return model, zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)


def assert_checkpoint_holds(path: Path, step: int) -> None:
    model, opt = zero_shard_setup()
    assert zero_shard.checkpoint.load(path, model=model, optimizer=opt) == {"step": step}


def a_failed_async_save_raises_at_the_next_save(rank: int, world: int) -> None:
    from zero_shard import checkpoint

    path = folder(world) / "async"
    model, opt = zero_shard_setup()
    checkpoint.async_save(path, model=model, optimizer=opt, extra={"step": 1}).result()

    # A write that fails on rank 1 alone, in the background: DCP fails the save on every rank.
    write_data = dcp.FileSystemWriter.write_data

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("injected write failure")

    if rank == 1:
        dcp.FileSystemWriter.write_data = failing_write
    try:
        future = checkpoint.async_save(path, model=model, optimizer=opt, extra={"step": 2})
        assert future.exception() is not None  # waits; every rank's save failed
    finally:
        dcp.FileSystemWriter.write_data = write_data
    with pytest.raises(RuntimeError, match=r"last async_save, to .*async, failed"):
        checkpoint.async_save(path, model=model, optimizer=opt, extra={"step": 3})
    assert_checkpoint_holds(path, 1)  # the last complete one
    checkpoint.async_save(path, model=model, optimizer=opt, extra={"step": 4}).result()
    assert_checkpoint_holds(path, 4)  # the failure was raised once: saves go on

    # The commit failing on rank 0 alone, in the background: every rank's save fails (the
    # others do not wait for rank 0), and the next (synchronous) save raises on every rank.
    # Fault injection: the commit is private, and no public input makes it fail on one rank.
    commit = checkpoint._commit

    def failing_commit(*args: Any) -> None:
        if rank == 0:
            raise OSError("injected commit failure")

    checkpoint._commit = failing_commit
    try:
        future = checkpoint.async_save(path, model=model, optimizer=opt, extra={"step": 5})
        error = future.exception()
    finally:
        checkpoint._commit = commit
    assert error is not None and "injected commit failure" in str(error), error
    with pytest.raises(RuntimeError, match="injected commit failure"):
        checkpoint.save(path, model=model, optimizer=opt, extra={"step": 6})
    assert_checkpoint_holds(path, 4)
    checkpoint.save(path, model=model, optimizer=opt, extra={"step": 7})
    assert_checkpoint_holds(path, 7)


CASES_BY_WORLD = {
    2: {
        **LOAD_CASES,
        "fsdp2_shard_replaced_raises": fsdp2_shard_replaced_raises,
        "torch_adamw_loads_into_a_fresh_torch_adamw": torch_adamw_loads_into_a_fresh_torch_adamw,
        "a_failed_async_save_raises_at_the_next_save": a_failed_async_save_raises_at_the_next_save,
    },
    # Uneven shards, and empty ones on rank 2 (the (2, 3) and (2,) params).
    3: {name: case for name, case in LOAD_CASES.items() if not name.startswith("ddp")},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str | None]]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("loads"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {world: run_cases(cases, world) for world, cases in CASES_BY_WORLD.items()}


@pytest.mark.parametrize(
    "world, name", [(world, name) for world, cases in CASES_BY_WORLD.items() for name in cases]
)
def test_distributed(outcomes: dict[int, dict[str, str | None]], world: int, name: str) -> None:
    check_outcome(outcomes[world], name)
