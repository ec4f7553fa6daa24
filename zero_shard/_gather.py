"""Updated shards back into the model's params: one all-gather per bucket, issued by the optimizer.

[Note: param gather]
After a step every bucket's shard buffer holds new weights that the model's params do not hold
yet. ``after_step`` hands all of the step's gathers to one job, run on an issuing thread (or at
once, without overlap). The job goes through the buckets in order: it waits until the bucket's
shards are written (the step's accelerator work, and the CPU chunks holding them, whose H2D
copies it queues), all-gathers them, copies the result into the params, records an event and
marks the bucket done. The gathers run on a process group of their own, issued by that one job
in bucket order: the same order on every rank, whatever each rank's forward runs, whether
``state_dict()`` is called on rank 0 only, or how long each rank's CPU step takes; and no
collective of the user's (inside forward, between step and forward) or of the grad reductions
can come between them on their group.

Hooks only *wait*: a unit's forward pre-hook (see [Note: units] in ``_units.py``) waits on the
host until each of its buckets is marked done, then makes the current stream wait for the
bucket's event. ``finish`` waits for every bucket: ``finish_param_sync``, the next step, the
optimizer's state dicts, and any module's ``state_dict`` or ``load_state_dict`` call it.

Stream order: the job's stream first waits for the current stream as of ``after_step``: the
step's accelerator work and every earlier use of the params (the last forward and backward). So
it reads finished shards and overwrites params that nothing reads any more. A gather's output is
allocated on the job's stream and dropped once the copy out of it is queued there; the allocator
reuses it only behind that copy, so about one bucket of output is in flight.

[Note: delayed update]
With ``OffloadPolicy(delayed_update=True)`` (full offload, a plain model) the step hands its
writes to the gatherer as *deferred*: they are gathered by the next step, after its launch has
completed them (the CPU step ran during this forward and backward; its H2D copies then write the
shards, and the new step's D2H copies of grads into the same staging buffers queue behind them).
So the next forward runs on the weights of the step before, and the CPU step overlaps it. The
next backward's first reduction waits (a stream wait) until the deferred step's D2H copies have
read the grads, not for its CPU step. A flush gathers the deferred writes at once, waiting for
the CPU step: ``finish_param_sync()``, the optimizer's state dicts and a module's
``state_dict`` / ``load_state_dict``. The delayed update runs on one process (refused at more):
there a flush communicates nothing, whereas at more ranks some of those calls may be made on
some ranks only, and the gathers are collectives.

[Note: memory the job uses]
The job's stream reads the shard buffers and writes the params, memory made on another stream
(the optimizer's, the user's). Each is recorded on the job's stream (``record_stream``) before
the job first uses it: the shard buffers when the gatherer is made, a param's memory at its
first copy (again where the param was given other memory). So memory freed while a gather is
still queued (the model and optimizer dropped right after ``step()``, a sweep building the next
model; a rank whose gather waits in NCCL for a slower rank) goes back to the allocator only
after the job's work queued before the free: new tensors made there are not overwritten by the
old gather.

A write to a param between ``step()`` and the wait for its bucket (a weight constraint such as
``p.clamp_()``, a load through ``copy_``) races with the job's copy into it, on another stream
or thread. It is seen by the param's version counter: the job does not copy into a param written
since the step and notes the counter after its own copy; the wait that finds either raises,
naming the params and ``finish_param_sync()``. A param that shares its counter with another
(views of one tensor) is copied into through a view with a counter of its own, so that the copy
moves no other param's counter ([Note: shared version counters] in ``_aliases.py``). A write
after the wait is a load, as ever: the next step reloads the main weight from it
(``stale_params``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from offload import current_stream, phase, record_event, side_stream, use_device, use_stream
from optimizers import HostStep, OffloadPolicy

from ._aliases import own_counter_targets
from ._buckets import (
    Bucket,
    ShardedParam,
    local_tensors,
    model_versions,
    stale_flags,
    storage_expired,
)
from ._collectives import AllGather, launch_all_gather, unpack_params

__all__ = ["DelayedUpdate", "HostWrites", "ParamGatherer", "PendingWrites"]


@dataclass(frozen=True)
class DelayedUpdate:
    """``OffloadPolicy(delayed_update=True)``, as zero-shard sees it ([Note: delayed update])."""

    warmup: int  # the first updates are exact (delayed_update_warmup)

    @staticmethod
    def of(policy: OffloadPolicy) -> DelayedUpdate | None:
        return DelayedUpdate(policy.delayed_update_warmup) if policy.delayed_update else None


class PendingWrites(Protocol):
    """Writes into the buckets' shard buffers still in flight when the step returned."""

    def wait(self, bucket: int) -> None:
        """Completes the bucket's writes: the calling thread's current stream sees them."""

    def wait_reads(self) -> None:
        """Makes the current stream wait until the step read every grad (the next backward may
        write them then)."""

    def follow_current(self) -> None:
        """Writes not done yet wait for the work queued so far on the current stream."""


class HostWrites:
    """The CPU's share of a step (a ``HostStep``) as writes into buckets: a bucket's writes are
    the chunks holding any of its shards (``indices[bucket]``: their hybrid param indices)."""

    def __init__(self, host_step: HostStep, indices: Sequence[Sequence[int]]) -> None:
        self._host_step = host_step
        self._indices = indices

    def wait(self, bucket: int) -> None:
        self._host_step.wait_for(self._indices[bucket])

    def wait_reads(self) -> None:
        self._host_step.wait_grads_copied()

    def follow_current(self) -> None:
        self._host_step.hold_writes_for_current()


@dataclass
class _BucketDone:
    """One bucket's gather of one step, as the job reports it to the waits."""

    done: threading.Event = field(default_factory=threading.Event)  # set by the job, always
    event: Any = None  # on the job's stream after the copy into the params; None on the CPU
    written: list[str] = field(default_factory=list)  # params written while the copy was due
    error: BaseException | None = None  # the bucket's writes or its gather failed


@dataclass
class _Job:
    """What one step's gathers need; holds no reference to the gatherer."""

    buckets: list[Bucket]
    reports: list[_BucketDone]
    ready: Any  # event after the step on the caller's stream; None on the CPU
    writes: PendingWrites | None
    group: dist.ProcessGroup | None  # None: one rank, whose shard is the whole bucket
    stream: Any  # the job's stream; None on the CPU
    device: torch.device
    world_size: int
    all_gather: AllGather


def _copy_into_params(bucket: Bucket, gathered: torch.Tensor, stream: Any) -> list[str]:
    """Copies the gathered bucket into the params not written since the step, on ``stream``
    (current; None on the CPU); returns the FQNs of those that were, or were written while being
    copied (another thread, see the note)."""
    # One read of each counter decides: a write between a check and the copy would be missed.
    before = model_versions(bucket.params)
    locals_ = local_tensors(bucket.params)
    memory = [local.data_ptr() for local in locals_]
    # By position, not by `in`: records compare their tensors (dataclass equality). A param
    # given other memory since (param.data = t, which moves no counter) is a write too.
    written = [
        s.changed or v != s.version or (s.memory != 0 and (
            m != s.memory or (s.storage is not None and storage_expired(s.storage.handle))
        ))
        for s, v, m in zip(bucket.params, before, memory, strict=True)
    ]  # fmt: skip
    if bucket.shares_counters:  # see [Note: shared version counters] in _aliases.py
        locals_ = own_counter_targets(bucket.params, locals_)
    targets = [None if w else local for local, w in zip(locals_, written, strict=True)]
    if stream is not None:
        _record_writes(bucket.params, targets, memory, stream)
    # Out of the user's TorchDispatchModes (FlopCounterMode around a step): a multi-tensor
    # in-place op dispatched to a Python mode moves no version counter, and these counts must
    # be ours.
    with phase("zero_shard::unpack"), _disable_current_modes():
        unpack_params(gathered, bucket.gather_copies, targets)
    after = model_versions(bucket.params)
    for position, (sharded, version, now, target, pieces) in enumerate(
        zip(bucket.params, before, after, targets, bucket.gather_copies.param_sizes, strict=True)
    ):
        if target is None:
            continue
        # One write a piece copied; none through an own_counter view.
        if now != version + (0 if sharded.own_counter is not None else len(pieces)):
            written[position] = True
        else:
            sharded.version = now
    return [s.fqn for s, w in zip(bucket.params, written, strict=True) if w]


def _record_writes(
    records: Sequence[ShardedParam],
    targets: Sequence[torch.Tensor | None],
    memory: Sequence[int],
    stream: Any,
) -> None:
    """Tells the allocator, once per memory, that ``stream`` writes the params: see [Note:
    memory the job uses]."""
    for sharded, target, pointer in zip(records, targets, memory, strict=True):
        if target is not None and sharded.recorded != pointer:
            target.record_stream(stream)
            sharded.recorded = pointer


def _gather_bucket(job: _Job, bucket: Bucket, report: _BucketDone) -> None:
    if bucket.aliased:  # one rank, the params are the shards: the writes were all there is
        stale = stale_flags(bucket.params)  # (which counts `changed`)
        report.written = [s.fqn for s, w in zip(bucket.params, stale, strict=True) if w]
        report.event = record_event(job.stream)
        return
    out = bucket.shard_buffer  # one rank's shard is the whole bucket
    if job.group is not None:
        out = _all_gather(job, bucket.shard_buffer)
    report.written = _copy_into_params(bucket, out, job.stream)
    report.event = record_event(job.stream)


def _all_gather(job: _Job, shard: torch.Tensor) -> torch.Tensor:
    out = shard.new_empty(job.world_size * shard.numel())
    with phase("zero_shard::all_gather"):
        work = job.all_gather(shard, out, job.group)
        if not callable(getattr(work, "wait", None)):  # the caller's all_gather (every rank's)
            raise TypeError(
                f"all_gather returned {type(work).__name__}, not a handle with wait(): return "
                "what dist.all_gather_into_tensor(..., async_op=True) returns, or one like it"
            )
        work.wait()
    return out


@torch.no_grad()  # grad mode is per thread: the job's thread starts with it on
def run_gathers(job: _Job) -> None:
    """Gathers every bucket in order into the params; see [Note: param gather]. Every bucket is
    reported, failed or not: a wait must never outwait the job."""
    failure: BaseException | None = None
    try:
        with use_device(job.device), use_stream(job.stream):
            if job.stream is not None and job.ready is not None:
                job.stream.wait_event(job.ready)
            for index, (bucket, report) in enumerate(zip(job.buckets, job.reports, strict=True)):
                if job.writes is not None:
                    try:
                        job.writes.wait(index)  # the job's stream now follows the shards' writes
                    except BaseException as err:
                        # This rank's CPU step failed: gather all the same, as the other ranks do.
                        report.error = err
                try:
                    _gather_bucket(job, bucket, report)
                except BaseException as err:
                    # A gather this rank could not issue or finish (an allocation, a collective):
                    # issuing the next ones would pair them with the other ranks' previous ones.
                    # Stop; the other ranks' gathers then time out and raise there too.
                    failure = err
                    report.error = report.error or err
                    break
                finally:
                    report.done.set()
    except BaseException as err:
        failure = failure or err
    finally:
        for report in job.reports:
            if not report.done.is_set():
                report.error = failure or RuntimeError("the gather job ended before this bucket")
                report.done.set()


def _shut_down(executor: ThreadPoolExecutor) -> None:
    # Gathers in flight must end before the process group does (gloo aborts the process
    # otherwise): the job ends on its own, as its collectives complete or time out.
    executor.shutdown(wait=True)


class ParamGatherer:
    """All-gathers updated shards into the model's params; see [Note: param gather]."""

    buckets: list[Bucket]
    overlap: bool
    _group: dist.ProcessGroup | None  # the gathers' own group, the same ranks as the mesh's;
    #                                   None at one rank
    _all_gather: AllGather  # launch_all_gather, or the caller's (``wrap(all_gather=...)``)
    _world_size: int
    _device: torch.device
    _stream: Any  # the job's stream; None on the CPU
    _executor: ThreadPoolExecutor  # one thread: issues the jobs, one after the other
    _reports: list[_BucketDone] | None  # the step in flight; None: the params are current
    _deferred: PendingWrites | None  # a delayed update's writes, gathered at the next step or
    #                                  at a flush (see [Note: delayed update])
    _waited: list[bool]  # per bucket: the current stream follows its copy into the params
    _num_waited: int
    wait_everything: bool  # the forwards wait for every bucket: the planned waits no longer
    #                        hold ([Note: params registered after wrap] in _hooks.py)

    def __init__(
        self,
        buckets: Sequence[Bucket],
        group: dist.ProcessGroup | None,
        *,
        device: torch.device,
        overlap: bool,
        all_gather: AllGather = launch_all_gather,
    ) -> None:
        self.buckets = list(buckets)
        self.overlap = overlap
        self._group = group
        self._all_gather = all_gather
        self._world_size = 1 if group is None else dist.get_world_size(group)
        self._device = device
        self._stream = side_stream(device)
        if self._stream is not None:  # the gathers read the shard buffers on it
            for bucket in self.buckets:
                bucket.shard_buffer.record_stream(self._stream)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="zero_shard_gather")
        self._reports = None
        self._deferred = None
        self._waited = []
        self._num_waited = 0
        self.wait_everything = False
        weakref.finalize(self, _shut_down, self._executor)

    @property
    def pending(self) -> bool:
        """Whether some params may not hold the latest step's weights yet."""
        return self._reports is not None or self._deferred is not None

    def after_delayed_step(self, writes: PendingWrites) -> None:
        """A delayed update: ``writes`` reach the params at the next step (or a flush); the
        step before's, deferred until now, are gathered now. Every rank calls it (collective)."""
        previous, self._deferred = self._deferred, writes
        if previous is not None:
            self.after_step(previous)

    def flush(self) -> None:
        """Applies a deferred update (a delayed update runs on one process: no collective) and
        waits for every bucket."""
        if self._deferred is not None:
            writes, self._deferred = self._deferred, None
            # At one rank the writes are into the params themselves: after every use of them
            # queued since the step (a forward run in between).
            writes.follow_current()
            self.after_step(writes)
        self.finish()

    def wait_deferred_reads(self) -> None:
        """The current stream waits until the deferred step read its grads."""
        if self._deferred is not None:
            self._deferred.wait_reads()

    def after_step(self, writes: PendingWrites | None = None) -> None:
        """Every bucket's shards changed (or will, once ``writes`` are done): gathers them into
        the params, in the background with overlap."""
        self.finish()  # nothing is left from an earlier step, normally
        self._reports = [_BucketDone() for _ in self.buckets]
        self._waited = [False] * len(self.buckets)
        self._num_waited = 0
        job = _Job(
            self.buckets,
            self._reports,
            record_event(current_stream(self._device)),
            writes,
            self._group,
            self._stream,
            self._device,
            self._world_size,
            self._all_gather,
        )
        if self.overlap:
            self._executor.submit(run_gathers, job)
        else:
            run_gathers(job)
            self.finish()

    def stop_overlap(self) -> None:
        """Waits for the gathers in flight; from now on ``after_step`` gathers before it returns
        (a model compiled without graph breaks: [Note: compiled models])."""
        self.finish()
        self.overlap = False

    def wait_for(self, indices: Iterable[int]) -> None:
        """Makes the params of buckets ``indices`` current on the current stream (waits only)."""
        if self._reports is None:
            return
        for index in indices:
            self._wait(index)

    def finish(self) -> None:
        """Waits for every bucket gathering: the params hold the latest weights afterwards (but
        a deferred update's: see :meth:`flush`)."""
        self.wait_for(range(len(self.buckets)))

    def _wait(self, index: int) -> None:
        reports = self._reports
        if reports is None or self._waited[index]:
            return
        report = reports[index]
        if not report.done.is_set():
            with phase("zero_shard::wait_gather"):
                report.done.wait()
        self._stream_wait(report)
        self._waited[index] = True
        self._num_waited += 1
        if self._num_waited == len(self.buckets):
            self._reports = None
        bucket = self.buckets[index]
        stale = stale_flags(bucket.params)
        written = set(report.written) | {
            s.fqn for s, w in zip(bucket.params, stale, strict=True) if w
        }
        for sharded in bucket.params:
            if sharded.fqn in written:
                sharded.changed = True  # whatever it holds now, the next step reloads from it
        if report.error is not None:
            raise report.error
        if written:
            _raise_written(sorted(written))

    def _stream_wait(self, report: _BucketDone) -> None:
        # The copy into the params was queued on the job's stream; the host saw it queued.
        if report.event is not None:
            current_stream(self._device).wait_event(report.event)


def _raise_written(fqns: list[str]) -> None:
    shown = f"{fqns[:5]}{' ...' if len(fqns) > 5 else ''}"
    raise RuntimeError(
        f"params {shown} were written after step() while its update was still being gathered "
        "into them (a weight constraint such as p.clamp_(), a load through copy_ or "
        "torch.nn.init); the write and the update raced, and the params now hold either. Call "
        "opt.finish_param_sync() after step() and before writing params; the next step takes "
        "the params' values as they are then (as after a weight load)"
    )
