"""Checkpoint faults and interchange on CPU processes (gloo), at 2 and 3 ranks: damaged
checkpoints (a truncated, missing or garbled data file, a truncated ``.metadata``) raise on
every rank, naming the file, and leave the live model and optimizer bit-identical; a torch
AdamW checkpoint loads into zero-shard and back (keyed by FQN, or by position as torch's own
``state_dict()``); a model that registers its params in another order loads by FQN; a bucket
size under one byte is refused; a save called on rank 0 alone raises there within the process
group's timeout.

The rank-0-only saves leave the ranks' collectives out of step: one runs last in its spawn, the
other (the first save of a process) in a spawn of its own. The cases share a folder through
ZERO_SHARD_TEST_DIR, set before the processes are spawned.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _harness import check_outcome, run_cases
from _models import (
    LR,
    PARAM_TOL,
    Net,
    adamw,
    global_batch,
    local_slice,
    make_model,
    mse,
    step_reference,
)
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import zero_shard
from zero_shard import OffloadPolicy, ZeroShardOptimizer, _reading, checkpoint
from zero_shard.checkpoint import DamagedCheckpointError

TINY_BUCKETS = 0.0008  # MiB: a few params a bucket
EXACT = {"rtol": 0.0, "atol": 0.0}
SHORT_TIMEOUT = datetime.timedelta(seconds=5)  # for the saves on rank 0 alone


def folder(world: int) -> Path:
    path = Path(os.environ["ZERO_SHARD_TEST_DIR"], f"world{world}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(seed: int) -> tuple[nn.Module, Any]:
    model = make_model(seed=seed)
    offload = OffloadPolicy(fraction=0.5, num_threads=1, chunk_numel=16)
    return model, zero_shard.wrap(adamw(model), model, offload=offload, bucket_mb=TINY_BUCKETS)


def train(model: nn.Module, opt: Any, steps: range, rank: int, world: int) -> None:
    """Zero-shard on each rank's slice of the batch; a torch optimizer on the whole batch."""
    for step in steps:
        x, y = global_batch(step)
        if not isinstance(opt, ZeroShardOptimizer):
            step_reference(model, opt, x, y)
            continue
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    if isinstance(opt, ZeroShardOptimizer):
        opt.finish_param_sync()


def full(value: Any) -> torch.Tensor:
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)


def snapshot(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Params and optimizer state by FQN, as full tensors (collective under zero-shard)."""
    out = {}
    for name, param in model.named_parameters():
        out[f"param {name}"] = full(param)
        state = opt.state[param]
        for key, value in state.items():
            out[f"state {name} {key}"] = full(value)
        if isinstance(opt, ZeroShardOptimizer) and param.dtype != torch.float32 and state:
            out[f"state {name} main_param"] = full(state["main_param"])  # read by name alone
    return out


def assert_same(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], where: str,
                tol: dict[str, float]) -> None:  # fmt: skip
    assert mine.keys() == theirs.keys(), f"{where}: {sorted(mine)} vs {sorted(theirs)}"
    for key, value in mine.items():
        torch.testing.assert_close(value, theirs[key], **tol, msg=f"{where}: {key}")


def damaged_copy(world: int, name: str, damage: Callable[[Path], None]) -> Path:
    """A copy of the checkpoint ``good`` with ``damage`` done to it (by rank 0)."""
    path = folder(world) / name
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(folder(world) / "good", path)
        damage(path)
    dist.barrier()
    return path


def truncate_last_data_file(path: Path) -> None:
    last = sorted(path.glob("*.distcp"))[-1]
    os.truncate(last, last.stat().st_size - 100)  # its last entry loses its tail


def remove_rank_1s_data(path: Path) -> None:
    (path / "__1_0.distcp").unlink()


def garble_an_entry(path: Path) -> None:
    """Zeroes the end of one entry's archive ('model.out.bias', which every rank reads): the
    files keep their sizes, and DCP fails midway through its reads."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    for index, info in metadata.storage_data.items():
        if index.fqn == "model.out.bias":
            with open(path / info.relative_path, "r+b") as file:
                file.seek(info.offset + info.length - 32)
                file.write(bytes(32))


def truncate_metadata(path: Path) -> None:
    os.truncate(path / ".metadata", (path / ".metadata").stat().st_size // 2)


# -- damaged checkpoints -----------------------------------------------------------------------


def save_good_checkpoint(rank: int, world: int) -> None:
    model, opt = build(seed=0)
    train(model, opt, range(3), rank, world)
    checkpoint.save(folder(world) / "good", model=model, optimizer=opt, extra={"step": 3})


def refused_and_nothing_changed(rank: int, world: int, name: str, damage: Callable[[Path], None],
                                match: str) -> None:  # fmt: skip
    """Loads a damaged copy of ``good`` into a zero-shard run and a torch AdamW run: raises on
    every rank, and each run then trains as its twin that never tried (bit for bit)."""
    save_good_checkpoint(rank, world)
    path = damaged_copy(world, name, damage)
    zero, zero_opt = build(seed=1)
    twin, twin_opt = build(seed=1)
    torch_model = make_model(seed=1)
    torch_opt = adamw(torch_model)
    torch_twin = make_model(seed=1)
    torch_twin_opt = adamw(torch_twin)
    for model, opt in ((zero, zero_opt), (twin, twin_opt), (torch_model, torch_opt),
                       (torch_twin, torch_twin_opt)):  # fmt: skip
        train(model, opt, range(2), rank, world)
    for model, opt, other, other_opt in ((zero, zero_opt, twin, twin_opt),
                                         (torch_model, torch_opt, torch_twin, torch_twin_opt)):  # fmt: skip
        where = f"{type(opt).__name__}, {name}"
        before = snapshot(model, opt)
        with pytest.raises(DamagedCheckpointError, match=match):
            checkpoint.load(path, model=model, optimizer=opt)
        assert_same(snapshot(model, opt), before, f"{where}, right after the load", EXACT)
        train(model, opt, range(2, 4), rank, world)
        train(other, other_opt, range(2, 4), rank, world)
        assert_same(snapshot(model, opt), snapshot(other, other_opt), f"{where}, 2 steps on", EXACT)


def a_truncated_data_file_changes_nothing(rank: int, world: int) -> None:
    match = (
        r"checkpoint at .*truncated_data is damaged: its data file __\d_0.distcp, written by "
        r"rank \d, is truncated \(\d+ bytes of \d+\), so \['.*'\]( and \d+ more)? cannot be "
        r"read; nothing was loaded"
    )
    refused_and_nothing_changed(rank, world, "truncated_data", truncate_last_data_file, match)


def a_missing_data_file_names_the_file_and_rank(rank: int, world: int) -> None:
    match = r"its data file __1_0.distcp, written by rank 1, is missing, so \[.*\]( and \d+ more)? "
    match += "cannot be read"
    refused_and_nothing_changed(rank, world, "missing_data", remove_rank_1s_data, match)


def a_garbled_data_file_changes_nothing(rank: int, world: int) -> None:
    match = (
        r"checkpoint at .*garbled_data could not be read whole \(rank 0: .*\); nothing was "
        r"loaded: the model and optimizer are as they were"
    )
    refused_and_nothing_changed(rank, world, "garbled_data", garble_an_entry, match)


@contextlib.contextmanager
def no_room_to_stage() -> Iterator[None]:
    """A host that cannot spare a staged copy of the state: the checkpoint is read twice, in
    batches of a few entries, then in place (``zero_shard/_reading.py``)."""
    # Private: which route a load takes depends on the host's free memory, which a test cannot set.
    with (
        mock.patch.object(_reading, "_staging_fits", lambda num_bytes: False),
        mock.patch.object(_reading, "_BATCH_BYTES", 256),
    ):
        yield


def without_room_to_stage_loads_verify_first(rank: int, world: int) -> None:
    with no_room_to_stage():
        match = r"checkpoint at .*garbled_batched could not be read whole \(rank 0: .*\); nothing"
        refused_and_nothing_changed(rank, world, "garbled_batched", garble_an_entry, match)
        model, opt = build(seed=1)
        train(model, opt, range(1), rank, world)
        assert checkpoint.load(folder(world) / "good", model=model, optimizer=opt) == {"step": 3}
    other, other_opt = build(seed=1)
    checkpoint.load(folder(world) / "good", model=other, optimizer=other_opt)  # staged
    assert_same(snapshot(model, opt), snapshot(other, other_opt), "batched, then in place", EXACT)


def other_groups(model: nn.Module) -> torch.optim.AdamW:
    """Two param groups again, the params split between them otherwise than ``adamw``'s."""
    params = dict(model.named_parameters())
    first = [params.pop("inp.weight"), params.pop("inp.bias")]
    return torch.optim.AdamW([{"params": first}, {"params": list(params.values())}], lr=1e-2)


def a_checkpoint_of_other_param_groups_changes_nothing(rank: int, world: int) -> None:
    # Refused once the checkpoint's param groups are read, by either route of the read: before
    # the live model and optimizer are written.
    save_good_checkpoint(rank, world)
    for room in (contextlib.nullcontext, no_room_to_stage):
        model = make_model(seed=1)
        opt = zero_shard.wrap(other_groups(model), model, bucket_mb=TINY_BUCKETS)
        train(model, opt, range(2), rank, world)
        before = snapshot(model, opt)
        with room(), pytest.raises(ValueError, match="param group 0 of the state dict does not"):
            checkpoint.load(folder(world) / "good", model=model, optimizer=opt)
        assert_same(snapshot(model, opt), before, f"{room.__name__}: after the refusal", EXACT)


def a_truncated_metadata_names_its_path(rank: int, world: int) -> None:
    match = (
        r"checkpoint at .*truncated_metadata is damaged: its index .*truncated_metadata/"
        r"\.metadata cannot be read \(UnpicklingError: pickle data was truncated\)"
    )
    refused_and_nothing_changed(rank, world, "truncated_metadata", truncate_metadata, match)


# -- interchange with torch AdamW --------------------------------------------------------------


def torch_run(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=0)
    opt = adamw(model)
    for step in range(steps):
        step_reference(model, opt, *global_batch(step))
    return model, opt


def save_keyed_by_position(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A checkpoint whose optimizer state is torch's own ``state_dict()``: params numbered."""
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": pickle.dumps({})}
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (path / checkpoint._MARKER).write_text("{}")
    dist.barrier()


def loaded_by_torch(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The checkpoint at ``path`` loaded into a fresh torch AdamW as torch loads the FSDP2 +
    AdamW layout: ``get_state_dict``, ``dcp.load``, ``set_state_dict``."""
    model = make_model(seed=2)
    opt = adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    return model, opt


def a_torch_adamw_checkpoint_loads_into_zero_shard_and_back(rank: int, world: int) -> None:
    ref, ref_opt = torch_run(steps=3)
    saved = snapshot(ref, ref_opt)
    by_fqn, by_position = folder(world) / "torch_by_fqn", folder(world) / "torch_by_position"
    checkpoint.save(by_fqn, model=ref, optimizer=ref_opt, extra={"step": 3})
    save_keyed_by_position(by_position, ref, ref_opt)
    assert_same(snapshot(*loaded_by_torch(by_fqn)), saved, "by torch's dcp.load", EXACT)
    for path in (by_fqn, by_position):
        fresh = make_model(seed=2)
        fresh_opt = adamw(fresh)
        checkpoint.load(path, model=fresh, optimizer=fresh_opt)
        assert_same(snapshot(fresh, fresh_opt), saved, f"{path.name} into torch AdamW", EXACT)
        model, opt = build(seed=1)
        checkpoint.load(path, model=model, optimizer=opt)
        assert_same(snapshot(model, opt), saved, f"{path.name} into zero-shard", EXACT)
    ref_go_on, ref_go_on_opt = torch_run(steps=6)
    train(model, opt, range(3, 6), rank, world)
    assert_same(snapshot(model, opt), snapshot(ref_go_on, ref_go_on_opt), "3 steps on", PARAM_TOL)
    # Back: zero-shard's checkpoint into a torch AdamW that never stepped.
    checkpoint.save(folder(world) / "zero_to_torch", model=model, optimizer=opt)
    back = make_model(seed=3)
    back_opt = adamw(back)
    checkpoint.load(folder(world) / "zero_to_torch", model=back, optimizer=back_opt)
    assert_same(snapshot(back, back_opt), snapshot(model, opt), "back in torch", EXACT)


class Reordered(Net):
    """``Net`` with its layers assigned in the other order: the same FQNs, other param order."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.out = nn.Linear(3, 2)
        self.mid = nn.Linear(7, 3)
        self.inp = nn.Linear(15, 7)
        self.side = self.never = None


def params_registered_in_another_order_load_by_name(rank: int, world: int) -> None:
    model, opt = build(seed=0)
    train(model, opt, range(3), rank, world)
    path = folder(world) / "for_reordered"
    checkpoint.save(path, model=model, optimizer=opt)
    saved = snapshot(model, opt)
    assert [n for n, _ in Reordered().named_parameters()][:2] == ["out.weight", "out.bias"]
    torch.manual_seed(1)
    other = Reordered()
    other_opt = zero_shard.wrap(adamw(other), other, bucket_mb=TINY_BUCKETS)
    checkpoint.load(path, model=other, optimizer=other_opt)
    assert_same(snapshot(other, other_opt), saved, "loaded", EXACT)
    train(model, opt, range(3, 6), rank, world)
    train(other, other_opt, range(3, 6), rank, world)
    assert_same(snapshot(other, other_opt), snapshot(model, opt), "3 steps on", PARAM_TOL)
    plain = Reordered()
    plain_opt = adamw(plain)
    checkpoint.load(path, model=plain, optimizer=plain_opt)
    assert_same(snapshot(plain, plain_opt), saved, "into torch AdamW", EXACT)


# -- options -----------------------------------------------------------------------------------


def bucket_mb_below_one_byte_is_refused(rank: int, world: int) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"bucket_mb must be at least 9.5367431640625e-07 MiB "
                       r"\(one byte a bucket\), got 1e-09"):  # fmt: skip
        zero_shard.wrap(adamw(model), model, bucket_mb=1e-9)
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=2.0**-20)  # the smallest: one byte
    train(model, opt, range(1), rank, world)


# -- collectives called on rank 0 alone --------------------------------------------------------


def raised_within(seconds: float, call: Callable[[], None]) -> BaseException:
    """What ``call`` raised, in a thread given ``seconds`` (a hang fails, not waits forever)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"still waiting after {seconds:.0f} s (the timeout is 5 s): a hang")
    if outcome[0] is None:
        raise AssertionError("returned, but the other rank never called it")
    return outcome[0]


def save_on_rank_0_alone(rank: int, world: int, name: str) -> None:
    """Rank 0 saves alone, under a 5 s process-group timeout; rank 1 waits for its outcome in
    a file, with no collective (a rank in its next training step would time out there too)."""
    model, opt = build(seed=0)
    distributed_c10d._set_pg_timeout(SHORT_TIMEOUT)  # after wrap's collectives
    done = folder(world) / f"{name}.done"
    if rank != 0:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert done.exists(), "rank 0 never came back from its save"
        return
    try:
        started = time.monotonic()
        path = folder(world) / name
        error = raised_within(45, lambda: checkpoint.save(path, model=model, optimizer=opt))
        assert time.monotonic() - started < 20, f"raised after {time.monotonic() - started:.0f} s"
        assert isinstance(error, RuntimeError), repr(error)
        assert "zero_shard.checkpoint.save is collective, but rank 0 waited 0:00:05" in str(error)
        assert "Call save on every rank, not under `if rank == 0:`" in str(error), str(error)
        assert not Path(f"{path}.partial").exists()  # nothing was written
    finally:
        done.touch()


def a_save_on_rank_0_alone_after_a_save_on_every_rank_raises_there(rank: int, world: int) -> None:
    model, opt = build(seed=0)
    checkpoint.save(folder(world) / "every_rank", model=model, optimizer=opt)
    save_on_rank_0_alone(rank, world, "alone_after_a_save")


def the_first_save_on_rank_0_alone_raises_there(rank: int, world: int) -> None:
    save_on_rank_0_alone(rank, world, "alone_first")


def interrupted_on_rank_0(
    rank: int, storage: type, method: str
) -> contextlib.AbstractContextManager:
    """Ctrl-C in ``storage.method`` (DCP's reads or writes) on rank 0."""

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    if rank != 0:
        return contextlib.nullcontext()
    return mock.patch.object(storage, method, interrupted)


def an_interrupted_load_raises_keyboardinterrupt_and_changes_nothing(rank: int, world: int) -> None:
    # Ctrl-C while rank 0 reads: DCP shares the failure; every rank raises KeyboardInterrupt (not
    # DamagedCheckpointError: nothing is damaged), and nothing was loaded.
    save_good_checkpoint(rank, world)
    model, opt = build(seed=1)
    train(model, opt, range(2), rank, world)
    before = snapshot(model, opt)
    with interrupted_on_rank_0(rank, dcp.FileSystemReader, "read_data"):
        with pytest.raises(KeyboardInterrupt, match="nothing was loaded"):
            checkpoint.load(folder(world) / "good", model=model, optimizer=opt)
    assert_same(snapshot(model, opt), before, "right after the interrupted load", EXACT)


def an_interrupted_save_raises_keyboardinterrupt_and_keeps_the_last(rank: int, world: int) -> None:
    # Ctrl-C while rank 0 writes: every rank raises KeyboardInterrupt (DCP shares the failure as
    # its CheckpointException), nothing is marked complete, the last checkpoint loads as it was.
    save_good_checkpoint(rank, world)
    model, opt = build(seed=1)
    train(model, opt, range(2), rank, world)
    with interrupted_on_rank_0(rank, dcp.FileSystemWriter, "write_data"):
        with pytest.raises(KeyboardInterrupt, match="the save was interrupted"):
            checkpoint.save(folder(world) / "good", model=model, optimizer=opt, extra={"step": 9})
    assert checkpoint.load(folder(world) / "good", model=model, optimizer=opt) == {"step": 3}


def a_save_one_rank_cannot_give_fails_on_every_rank(rank: int, world: int) -> None:
    # Under stale_params="error", a param written on rank 0 alone makes rank 0's state dict
    # raise: every rank raises at once (not at the process group's timeout), nothing written.
    model = make_model(seed=0)
    opt = zero_shard.wrap(adamw(model), model, stale_params="error", bucket_mb=TINY_BUCKETS)
    train(model, opt, range(1), rank, world)
    if rank == 0:
        with torch.no_grad():
            model.mid.weight.add_(1.0)
    path = folder(world) / "one_rank_fails"
    error = raised_within(30, lambda: checkpoint.save(path, model=model, optimizer=opt))
    assert isinstance(error, RuntimeError), repr(error)
    assert ("mid.weight" in str(error)) if rank == 0 else str(error).startswith("on rank 0: ")
    assert not path.exists()


class AroundOptimizer(torch.optim.Optimizer):
    """What accelerate's AcceleratedOptimizer is (``accelerator.prepare`` returns one, and a
    ``TrainerCallback`` is handed one): a torch optimizer around the one it was given."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def an_optimizer_around_the_wrapper_saves_and_loads_as_the_wrapper(rank: int, world: int) -> None:
    model, opt = build(seed=0)
    train(model, opt, range(3), rank, world)
    saved = snapshot(model, opt)
    path = folder(world) / "around"
    checkpoint.save(path, model=model, optimizer=AroundOptimizer(opt), extra={"step": 3})
    other, other_opt = build(seed=1)
    extra = checkpoint.load(path, model=other, optimizer=AroundOptimizer(other_opt))
    assert extra == {"step": 3}
    assert_same(snapshot(other, other_opt), saved, "loaded through the optimizer around it", EXACT)


def a_folder_of_other_files_is_refused_and_kept(rank: int, world: int) -> None:
    # A Trainer's checkpoint-N folder (its model, state and tokenizer files) handed to save as
    # the path: save replaces the whole directory at the path, so it refuses, on every rank,
    # and every file stays. An empty folder made beforehand, a folder of its own inside, and a
    # complete checkpoint at the path are saved into as usual.
    model, opt = build(seed=0)
    trainer = folder(world) / "checkpoint-5"
    files = {"model.safetensors": "weights", "trainer_state.json": "{}", "tokenizer/vocab.txt": "a"}
    if rank == 0:
        for name, text in files.items():
            (trainer / name).parent.mkdir(parents=True, exist_ok=True)
            (trainer / name).write_text(text)
        (folder(world) / "made_empty").mkdir(exist_ok=True)
        (folder(world) / "a_file").write_text("not a folder")
    dist.barrier()
    for path, says in ((trainer, "holds files zero-shard did not write"),
                       (folder(world) / "a_file", "is a file")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            checkpoint.save(path, model=model, optimizer=opt)
    dist.barrier()
    assert {name: (trainer / name).read_text() for name in files} == files
    assert sorted(p.name for p in trainer.iterdir()) == sorted(["model.safetensors",
        "trainer_state.json", "tokenizer"])  # fmt: skip
    assert not trainer.with_name("checkpoint-5.partial").exists()
    for path in (trainer / "zero_shard", folder(world) / "made_empty"):
        for step in range(2):  # the second replaces the first
            checkpoint.save(path, model=model, optimizer=opt, extra={"step": step})
            assert checkpoint.load(path, model=model, optimizer=opt) == {"step": step}
    assert {name: (trainer / name).read_text() for name in files} == files
    # Notes added to a complete checkpoint are kept too: the next save there refuses.
    notes = folder(world) / "made_empty" / "notes.txt"
    if rank == 0:
        notes.write_text("best so far")
    dist.barrier()
    with pytest.raises(ValueError, match=r"did not write \(\['notes.txt'\]\)"):
        checkpoint.save(folder(world) / "made_empty", model=model, optimizer=opt)
    assert notes.read_text() == "best so far"
    # A link to an empty folder: the checkpoint goes where it points.
    target, link = folder(world) / "link_target", folder(world) / "link"
    if rank == 0:
        target.mkdir()
        link.symlink_to(target, target_is_directory=True)
    dist.barrier()
    for step in range(2):
        checkpoint.save(link, model=model, optimizer=opt, extra={"step": step})
        assert checkpoint.load(link, model=model, optimizer=opt) == {"step": step}
    assert (target / ".metadata").exists()


def extra_and_the_scheduler_are_rank_0s(rank: int, world: int) -> None:
    # save's extra is rank 0's, as its docstring says: a value only rank 0 knows (the best
    # validation loss) comes back on every rank, whichever rank DCP would write a shared key from.
    model, opt = build(seed=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    train(model, opt, range(1), rank, world)
    sched.step()
    if rank > 0:
        sched.last_epoch = 100 + rank  # another rank's scheduler drifted: rank 0's is saved
    path = folder(world) / "rank_0s"
    extra = {"saver": rank, "best": 0.5 if rank == 0 else None}
    checkpoint.save(path, model=model, optimizer=opt, scheduler=sched, extra=extra)
    other, other_opt = build(seed=1)
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda step: 1.0 / (1 + step))
    loaded = checkpoint.load(path, model=other, optimizer=other_opt, scheduler=other_sched)
    assert loaded == {"saver": 0, "best": 0.5}, loaded
    assert other_sched.last_epoch == 1, other_sched.last_epoch


class Tied(nn.Module):
    """``again`` applies ``mid``'s weight (tied) with a bias of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 7)
        self.mid = nn.Linear(7, 7)
        self.again = nn.Linear(7, 7)
        self.again.weight = self.mid.weight
        self.out = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.again(h)))


def a_checkpoint_of_another_param_dtype_keeps_its_full_precision(rank: int, world: int) -> None:
    # Saved with bf16 params, loaded into an fp32 model: the params are the saved fp32 main
    # weights (not the rounded bf16 params). Saved with fp32 params, loaded into a bf16 model:
    # the main weights are the saved fp32 params, and the params their rounding.
    def build_as(dtype: torch.dtype, seed: int, fraction: float) -> tuple[nn.Module, Any]:
        model = make_model(seed=seed).to(dtype)
        policy = OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)
        opt = zero_shard.wrap(adamw(model), model, offload=policy, bucket_mb=TINY_BUCKETS)
        return model, opt

    for saved_dtype, loaded_dtype in ((torch.bfloat16, torch.float32),
                                      (torch.float32, torch.bfloat16)):  # fmt: skip
        model, opt = build_as(saved_dtype, 0, 0.5)
        for step in range(2):
            x, y = global_batch(step)
            x, y = local_slice(x, rank, world).to(saved_dtype), local_slice(y, rank, world)
            mse(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        path = folder(world) / f"from_{saved_dtype}"
        checkpoint.save(path, model=model, optimizer=opt)
        saved = zero_shard.full_state_dict(opt, rank=rank)["state"]
        exact = {name: full(p).float() for name, p in model.named_parameters()}
        if saved_dtype == torch.bfloat16:
            exact = {name: saved[name]["main_param"] for name in exact}
        paths = {"": path}
        if saved_dtype == torch.float32:  # and torch AdamW's own state dict, numbered
            ref, ref_opt = torch_run(2)
            paths["torch's, numbered, "] = folder(world) / "numbered_fp32"
            save_keyed_by_position(paths["torch's, numbered, "], ref, ref_opt)
        for what, each in paths.items():
            if what:
                exact = {name: full(p).float() for name, p in ref.named_parameters()}
            other, other_opt = build_as(loaded_dtype, 1, 1.0)
            checkpoint.load(each, model=other, optimizer=other_opt)
            loaded = zero_shard.full_state_dict(other_opt, rank=rank)["state"]
            for name, param in other.named_parameters():
                where = f"{what}{saved_dtype} saved, {loaded_dtype} loaded: {name}"
                assert torch.equal(full(param), exact[name].to(loaded_dtype)), where
                if loaded_dtype == torch.bfloat16:
                    assert torch.equal(loaded[name]["main_param"], exact[name]), where
        if saved_dtype != torch.bfloat16:
            continue
        # The bf16 checkpoint into an fp32 model with a torch AdamW, and through torch's own
        # full-state functions into an fp32 zero-shard wrapper (the model's weights first, then
        # the optimizer's state): the params are the saved fp32 main weights there too.
        plain = make_model(seed=1)
        plain_opt = adamw(plain)
        checkpoint.load(path, model=plain, optimizer=plain_opt)
        assert all("main_param" not in each for each in plain_opt.state.values())
        full_options = StateDictOptions(full_state_dict=True)
        model_state, optim_state = get_state_dict(model, opt, options=full_options)
        other, other_opt = build_as(torch.float32, 1, 0.5)
        set_model_state_dict(other, model_state, options=full_options)
        set_optimizer_state_dict(other, other_opt, optim_state, options=full_options)
        for route, net in (("load into torch AdamW", plain), ("set_*_state_dict", other)):
            for name, param in net.named_parameters():
                assert torch.equal(full(param), exact[name]), f"{route}: {name}"
    # A tied param (two keys of the model's state dict, one param) into fp32 and a torch AdamW:
    # both keys read its main weight.
    model = Tied().to(torch.bfloat16)
    opt = zero_shard.wrap(adamw(model), model, bucket_mb=TINY_BUCKETS)
    for step in range(2):
        x, y = global_batch(step)
        mse(model(local_slice(x, rank, world).bfloat16()), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(folder(world) / "tied_bf16", model=model, optimizer=opt)
    saved = zero_shard.full_state_dict(opt, rank=rank)["state"]
    plain = Tied()
    checkpoint.load(folder(world) / "tied_bf16", model=plain, optimizer=adamw(plain))
    for name, param in plain.named_parameters():
        assert torch.equal(param.detach(), saved[name]["main_param"]), f"tied: {name}"


def plain_sgd_of_a_bf16_model_keeps_its_main_weights_across_checkpoints(
    rank: int, world: int
) -> None:
    # SGD without momentum keeps no state per param; a bf16 model's fp32 main weights are its
    # only precision beyond the params, so its state dict holds each param's main_param alone:
    # a run resumed from its checkpoints is the uninterrupted one, bit for bit (resumed from the
    # rounded params, updates under half a bf16 step would be lost at each resume). Loaded into
    # an fp32 model, the params are the main weights; into a bf16 model with torch's SGD, the
    # saved params.
    def build_as(dtype: torch.dtype, seed: int, fraction: float, wrapped: bool = True) -> Any:
        model = make_model(seed=seed).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if wrapped:
            policy = OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=16)
            opt = zero_shard.wrap(opt, model, offload=policy, bucket_mb=TINY_BUCKETS)
        return model, opt

    def steps(model: nn.Module, opt: Any, first: int) -> None:
        for step in range(first, first + 2):
            x, y = global_batch(step)
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
            mse(model(x.to(next(model.parameters()).dtype)), y).backward()
            opt.step()
            opt.zero_grad()
        opt.finish_param_sync()

    for fraction in (0.0, 0.5):
        model, opt = build_as(torch.bfloat16, 0, fraction)
        steps(model, opt, 0)
        assert len(opt.state) == 0, "torch's SGD without momentum holds no state"
        assert all(set(s) == {"main_param"} for s in opt.state_dict()["state"].values())
        path = folder(world) / f"sgd_bf16_{fraction}"
        checkpoint.save(path, model=model, optimizer=opt)
        mains = {k: full(v["main_param"]) for k, v in opt.state_dict()["state"].items()}
        steps(model, opt, 2)
        expected = [full(p) for p in model.parameters()]
        resumed, resumed_opt = build_as(torch.bfloat16, 1, 1.0 - fraction)
        checkpoint.load(path, model=resumed, optimizer=resumed_opt)
        steps(resumed, resumed_opt, 2)
        for (name, param), want in zip(resumed.named_parameters(), expected, strict=True):
            assert torch.equal(full(param), want), f"fraction {fraction}: {name}"
        for loaded_dtype, wrapped in ((torch.float32, True), (torch.float32, False),
                                      (torch.bfloat16, False)):  # fmt: skip
            other, other_opt = build_as(loaded_dtype, 1, 0.5, wrapped)
            checkpoint.load(path, model=other, optimizer=other_opt)
            for name, param in other.named_parameters():
                want = mains[name].to(loaded_dtype)
                assert torch.equal(full(param), want), f"{loaded_dtype}, {wrapped=}: {name}"
            if not wrapped:
                assert not other_opt.state, "torch's SGD without momentum holds no state"
    # Saved from fp32 params, loaded into a bf16 model: the main weights are the saved params.
    model, opt = build_as(torch.float32, 0, 0.5)
    steps(model, opt, 0)
    checkpoint.save(folder(world) / "sgd_fp32", model=model, optimizer=opt)
    other, other_opt = build_as(torch.bfloat16, 1, 0.5)
    checkpoint.load(folder(world) / "sgd_fp32", model=other, optimizer=other_opt)
    loaded = other_opt.state_dict()["state"]
    for (name, _), saved in zip(other.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(full(loaded[name]["main_param"]), full(saved)), name
    # Momentum switched on after wrap: a param that had no grad since holds its main weight
    # alone, beside the buffers of the others; the state dict loads back, and resumes.
    model = make_model(with_side=True).bfloat16()
    opt = zero_shard.wrap(torch.optim.SGD(model.parameters(), lr=LR), model)
    steps(model, opt, 0)
    opt.param_groups[0]["momentum"] = 0.9
    steps(model, opt, 2)
    held = opt.state_dict()["state"]
    assert set(held["side.weight"]) == {"main_param"}, sorted(held["side.weight"])
    assert "momentum_buffer" in held["inp.weight"]
    opt.load_state_dict(opt.state_dict())
    checkpoint.save(folder(world) / "sgd_momentum_later", model=model, optimizer=opt)
    checkpoint.load(folder(world) / "sgd_momentum_later", model=model, optimizer=opt)


def ranks_given_other_checkpoints_are_refused(rank: int, world: int) -> None:
    # Each rank writes and reads its part of one checkpoint: paths that resolve apart on the
    # ranks (a relative path against each rank's working directory, node-local disks) are
    # refused on every rank, nothing written or loaded; a save whose parts did not all reach
    # rank 0's folder is not marked complete, and the checkpoint before it stays.
    model, opt = build(seed=0)
    train(model, opt, range(2), rank, world)
    base = folder(world) / "apart"
    with pytest.raises(ValueError, match="resolve to different directories .*rank 1: "):
        checkpoint.save(base / f"rank{rank}", model=model, optimizer=opt)
    dist.barrier()
    assert not base.exists() or not any(base.iterdir()), sorted(base.rglob("*"))
    # Two complete checkpoints of other steps, each rank handed its own: refused.
    for step in (2, 3):
        checkpoint.save(base / f"step{step}", model=model, optimizer=opt, extra={"step": step})
        train(model, opt, range(step, step + 1), rank, world)
    before = snapshot(model, opt)
    mine = base / f"step{2 + rank % 2}"
    with pytest.raises(ValueError, match="resolve to different checkpoints .*rank 1: "):
        checkpoint.load(mine, model=model, optimizer=opt)
    assert_same(snapshot(model, opt), before, "after the refused load", EXACT)
    # Copies of one save, one a rank, load as that save.
    copy = base / f"copy_of_step3_{rank}"
    shutil.copytree(base / "step3", copy)
    assert checkpoint.load(copy, model=model, optimizer=opt) == {"step": 3}
    # Rank 1's part written elsewhere (a disk of its own under the same path): not complete.
    path, elsewhere = base / "good", base / "elsewhere"
    checkpoint.save(path, model=model, optimizer=opt, extra={"step": "good"})
    save = dcp.save

    def own_disk(state: Any, *, checkpoint_id: str, **kwargs: Any) -> Any:
        return save(state, checkpoint_id=str(elsewhere), **kwargs)

    with mock.patch.object(dcp, "save", own_disk if rank == 1 else save):
        with pytest.raises(RuntimeError, match=r"not whole: its data file __1_0.distcp, written "
                           r"by rank 1, is missing.*It was not marked complete"):  # fmt: skip
            checkpoint.save(path, model=model, optimizer=opt, extra={"step": "apart"})
    assert checkpoint.load(path, model=model, optimizer=opt) == {"step": "good"}


DAMAGED = {
    "a_truncated_data_file_changes_nothing": a_truncated_data_file_changes_nothing,
    "a_missing_data_file_names_the_file_and_rank": a_missing_data_file_names_the_file_and_rank,
    "a_garbled_data_file_changes_nothing": a_garbled_data_file_changes_nothing,
    "a_truncated_metadata_names_its_path": a_truncated_metadata_names_its_path,
    "without_room_to_stage_loads_verify_first": without_room_to_stage_loads_verify_first,
    "a_checkpoint_of_other_param_groups_changes_nothing": (
        a_checkpoint_of_other_param_groups_changes_nothing
    ),
    "a_torch_adamw_checkpoint_loads_into_zero_shard_and_back": (
        a_torch_adamw_checkpoint_loads_into_zero_shard_and_back
    ),
    "params_registered_in_another_order_load_by_name": (
        params_registered_in_another_order_load_by_name
    ),
    "bucket_mb_below_one_byte_is_refused": bucket_mb_below_one_byte_is_refused,
    "an_interrupted_load_raises_keyboardinterrupt_and_changes_nothing": (
        an_interrupted_load_raises_keyboardinterrupt_and_changes_nothing
    ),
    "an_optimizer_around_the_wrapper_saves_and_loads_as_the_wrapper": (
        an_optimizer_around_the_wrapper_saves_and_loads_as_the_wrapper
    ),
    "a_folder_of_other_files_is_refused_and_kept": a_folder_of_other_files_is_refused_and_kept,
    "extra_and_the_scheduler_are_rank_0s": extra_and_the_scheduler_are_rank_0s,
    "a_checkpoint_of_another_param_dtype_keeps_its_full_precision": (
        a_checkpoint_of_another_param_dtype_keeps_its_full_precision
    ),
    "plain_sgd_of_a_bf16_model_keeps_its_main_weights_across_checkpoints": (
        plain_sgd_of_a_bf16_model_keeps_its_main_weights_across_checkpoints
    ),
    "ranks_given_other_checkpoints_are_refused": ranks_given_other_checkpoints_are_refused,
    "an_interrupted_save_raises_keyboardinterrupt_and_keeps_the_last": (
        an_interrupted_save_raises_keyboardinterrupt_and_keeps_the_last
    ),
    "a_save_one_rank_cannot_give_fails_on_every_rank": (
        a_save_one_rank_cannot_give_fails_on_every_rank
    ),
}
LAST = {  # leaves the collectives out of step
    "a_save_on_rank_0_alone_after_a_save_on_every_rank_raises_there": (
        a_save_on_rank_0_alone_after_a_save_on_every_rank_raises_there
    ),
}
ALONE = {"the_first_save_on_rank_0_alone_raises_there": the_first_save_on_rank_0_alone_raises_there}
SPAWNS = [(2, {**DAMAGED, **LAST}), (3, DAMAGED), (2, ALONE)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], str | None]:
    os.environ["ZERO_SHARD_TEST_DIR"] = str(tmp_path_factory.mktemp("checkpoint_faults"))
    results: dict[tuple[int, str], str | None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for world, cases in SPAWNS:
            for name, failure in run_cases(cases, world).items():
                results[(world, name)] = failure
    return results


@pytest.mark.parametrize(
    ("world", "name"), [(world, name) for world, cases in SPAWNS for name in cases]
)
def test_checkpoint_faults(
    outcomes: dict[tuple[int, str], str | None], world: int, name: str
) -> None:
    check_outcome({name: outcomes[(world, name)]}, name)
