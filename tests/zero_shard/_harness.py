"""Runs named test cases in ``world_size`` processes (gloo on CPU, or NCCL), all in one spawn.

A spawn costs seconds on the 2-core CI machines, so each test module registers its cases with
``@case`` and a module-scoped fixture runs them all at once per world size; each pytest test
then reports its case's outcome (every failing rank's traceback). A case fails if it raised on
any rank; every rank runs every case in the same order. A case that fails on some ranks only can
leave the others waiting in a collective: the gloo timeout (``TIMEOUT``) then fails them, and
later cases may fail in turn: the first failure is the one to read. A spawn that outlives ``SPAWN_DEADLINE`` (a hang no
collective timeout ends: a thread waiting forever) is killed, and its unfinished cases fail.

The gloo ranks are forked from a server process that imported torch and the packages once
(``forkserver``, started at the first spawn, with this process's ``sys.path``), not started
afresh: a fresh interpreter importing torch takes seconds of the 2 cores per rank and spawn.
Each rank takes the environment of the test that spawns it (a fork has the server's), so a case
sees what its test set, as with ``spawn``, and checks that it runs the packages this process
imported. The ranks share the server's string-hash seed (a set of strings iterates alike on every
rank, where separate interpreters may differ; the examples' torchrun tests start ranks afresh).
NCCL ranks start afresh (``spawn``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessContext, ProcessException

TIMEOUT = datetime.timedelta(seconds=90)
PRELOAD = ["torch", "torch.distributed", "offload", "optimizers", "zero_shard"]
SPAWN_DEADLINE = 420.0  # seconds; under pytest's own 600 s timeout
PORT_TAKEN = "port_taken"  # a rank's note in the spawn's folder: the port was taken

Case = Callable[[int, int], None]  # (rank, world_size) -> None; raises on failure


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    cases: list[tuple[str, Case]],
    out_dir: str,
    backend: str,
    env: dict[str, str],
    packages: dict[str, str | None],
) -> None:
    os.environ.clear()
    os.environ.update(env)
    for name, path in packages.items():
        here = getattr(sys.modules.get(name), "__file__", None)
        if path is not None and here != path:
            raise AssertionError(f"expected {name} from {path}, the rank imported {here}")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="1")
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
        torch.cuda.set_device(rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    else:
        torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT)
    except dist.DistNetworkError as err:
        if "EADDRINUSE" in str(err):  # taken since _free_port: run_cases spawns again
            Path(out_dir, PORT_TAKEN).write_text(str(err))
        raise
    results: dict[str, str | None] = {}
    try:
        for name, function in cases:
            try:
                function(rank, world_size)
                results[name] = None
            except BaseException:  # a case's failure is recorded, the next case runs
                results[name] = traceback.format_exc()
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_cases(
    cases: dict[str, Case], world_size: int, backend: str = "gloo"
) -> dict[str, str | None]:
    """Runs every case on ``world_size`` ranks (``"nccl"``: one GPU each); returns case ->
    None, or the failure's text. A spawn whose rendezvous port was taken between ``_free_port``
    and the ranks' bind (by another process on the machine) runs again once, on another port."""
    merged, port_taken = _run_cases_once(cases, world_size, backend)
    if port_taken:
        merged, _ = _run_cases_once(cases, world_size, backend)
    return merged


def _run_cases_once(
    cases: dict[str, Case], world_size: int, backend: str
) -> tuple[dict[str, str | None], bool]:
    """``run_cases`` on one port; also whether a rank found that port taken."""
    with tempfile.TemporaryDirectory() as out_dir:
        items = list(cases.items())
        forked = backend == "gloo"
        if forked:
            mp.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first spawn)
        packages = {name: getattr(sys.modules.get(name), "__file__", None) for name in PRELOAD}
        with _server_path(forked):
            context = mp.start_processes(
                _worker,
                args=(
                    world_size,
                    _free_port(),
                    items,
                    out_dir,
                    backend,
                    dict(os.environ),
                    packages,
                ),
                nprocs=world_size,
                join=False,
                start_method="forkserver" if forked else "spawn",
            )
        ended = _join_before(context, time.monotonic() + SPAWN_DEADLINE)
        merged: dict[str, str | None] = dict.fromkeys(cases)
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.json")
            ranks = json.loads(path.read_text()) if path.exists() else {}
            for name in cases:
                failure = ranks.get(name, f"rank {rank} did not reach this case ({ended})")
                if failure:  # every failing rank's: the first to fail may not be the lowest
                    shown = f"rank {rank}:\n{failure}"
                    merged[name] = shown if merged[name] is None else f"{merged[name]}\n{shown}"
        return merged, Path(out_dir, PORT_TAKEN).exists()


@contextlib.contextmanager
def _server_path(forked: bool) -> Iterator[None]:
    """While the fork server may start: this process's ``sys.path`` as its ``PYTHONPATH``, so
    that it preloads the packages this process imports (it does not take ``sys.path`` itself)."""
    if not forked:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _join_before(context: ProcessContext, deadline: float) -> str:
    """Waits for every process until ``deadline``, then kills them; says how they ended."""
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                return f"killed: the spawn outlived its {SPAWN_DEADLINE:.0f} s deadline"
    except ProcessException as err:  # a process died (the others are ended by join)
        return f"a process died: {err}"
    return "the processes exited"


@contextlib.contextmanager
def delayed(owner: Any, name: str, delay: Callable[[], None]) -> Iterator[None]:
    """Calls ``delay()`` before every call of ``owner.name`` (a module's function) inside the
    block: race tests slow one side down so that a missing wait on the other shows."""
    original = getattr(owner, name)

    def slow(*args: Any) -> Any:
        delay()
        return original(*args)

    setattr(owner, name, slow)
    try:
        yield
    finally:
        setattr(owner, name, original)


def check_outcome(outcomes: dict[str, str | None], name: str) -> None:
    """Fails the calling test with case ``name``'s failure text, if it failed on some rank."""
    failure = outcomes[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)
