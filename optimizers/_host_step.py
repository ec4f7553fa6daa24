"""The CPU's share of one step, in flight: chunks stepped on the worker, completed in order.

[Note: deferred host step]
``HostPart.start`` hands every chunk to the worker and returns a ``HostStep``. Completing a chunk
means waiting for its CPU step and making the current stream wait for its H2D copy into the params
(a stream wait: the host goes on). A copier thread queued that copy as soon as the worker stepped
the chunk (bounded staging); otherwise it is queued only here (see [Note: staging ring]).
``HybridDeviceOptimizer.step()`` completes every chunk before it returns. ``launch_step()`` returns
at once instead, and the caller completes the chunks it needs when it needs them (``wait_for``),
the rest later (``wait``): with the chunks in the order the forward needs them, its first layers
can run while the worker steps the last ones. Chunks complete strictly in the order the worker runs
them, so one H2D event (the H2D stream runs in order) covers every chunk completed so far. Chunks
may be completed from more than one thread (a caller's thread that gathers the new weights as they
come, while a state dict on the main thread settles the step): a lock keeps them in order, and each
caller's current stream waits for the H2D event of every chunk completed so far, by whichever
thread.

Until the whole step is complete, the host part is *busy*: its staging buffers and main weights
belong to the worker. Everything else that writes them or the params (the next step, state dicts,
loads, reloads) completes the step first (``HostPart.settle``); reads of the state only wait for
the worker (``HostPart.wait_for_worker``), so that a delayed update keeps its lag.

Buffer lifetimes: the D2H copies read the grads on the D2H stream behind the event ``start``
recorded; the worker waits for them before it steps, and only then is the chunk's H2D queued. So
once the current stream has waited for a chunk's H2D, both copies of that chunk are done, and the
grads they read may be written again (by the next backward). Each copy records the D2H stream on
the memory it reads (``copy_async``), so the caller may drop the grads at once (``zero_grad``):
their memory waits for the copies, not for the whole CPU step. A chunk whose D2H is not queued
yet holds its grads (``ChunkJob.grads``) until it is; the copies' views of them are made when it
is queued (by the copier, for most chunks), not all at the start on the caller's thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from offload import (
    CopyEngine,
    CopyPair,
    HostFlag,
    current_stream,
    phase,
    record_event,
    switch_interval,
    wait_for_event,
)

from ._grad_factor import factor_as_multiplied
from ._records import HostChunk, ParamRecord, Piece, flat_param
from ._speculation import Speculation

__all__ = ["ChunkJob", "HostStep"]


def grad_copies(
    staging: torch.Tensor, pieces: Sequence[Piece], grads: Sequence[torch.Tensor]
) -> list[CopyPair]:
    """The copies of each piece's elements of its param's flat grad (``grads``, in the order of
    ``pieces``) into its place in the chunk's ``staging``. Pieces whose elements lie back to
    back in one grad buffer and in staging go in one copy: a bucket's reduced grads are one
    buffer, so a chunk of many small params is copied by a few copies, not one a param, each a
    dispatch on the host."""
    return [CopyPair(host, flat) for host, flat in _runs(staging, pieces, grads)]


def weight_copies(
    weights: torch.Tensor, pieces: Sequence[Piece], params: Sequence[torch.Tensor]
) -> list[CopyPair]:
    """The copies of each piece's new weights, in the chunk's ``weights`` buffer, into its
    param (``params``: the flat params, in the order of ``pieces``); merged as ``grad_copies``
    merges, where the params are one buffer (the shards of a bucket at more than one rank)."""
    return [CopyPair(flat, host) for host, flat in _runs(weights, pieces, params)]


def _runs(
    host: torch.Tensor, pieces: Sequence[Piece], flats: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a run of ``host``, the same elements of ``flats``) for each run of pieces back to back
    in both: in the chunk's ``host`` buffer and in the storage of their 1-D ``flats``."""
    runs = []
    first: torch.Tensor | None = None  # the flat the run in progress starts in
    first_storage = first_at = first_offset = length = 0
    for piece, flat in zip(pieces, flats, strict=True):
        numel = piece.spec.numel
        if numel == 0 or piece.offset is None:
            continue
        if flat.dim() != 1 or flat.stride(0) != 1:
            runs.append((piece.in_chunk(host), piece.of_param(flat)))
            continue
        storage = flat.untyped_storage()._cdata
        at = flat.storage_offset() + piece.spec.start  # (elements of the flat's storage)
        if (
            first is not None
            and storage == first_storage
            and flat.dtype == first.dtype
            and at == first_at + length
            and piece.offset == first_offset + length
        ):
            length += numel
            continue
        if first is not None:
            runs.append(_run(host, first, first_at, first_offset, length))
        first, first_storage, first_at, first_offset, length = (
            flat,
            storage,
            at,
            piece.offset,
            numel,
        )
    if first is not None:
        runs.append(_run(host, first, first_at, first_offset, length))
    return runs


def _run(
    host: torch.Tensor, flat: torch.Tensor, at: int, offset: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``host[offset:]`` and ``length`` elements of ``flat``'s storage from element ``at``."""
    return host.narrow(0, offset, length), flat.as_strided((length,), (1,), at)


@dataclass
class ChunkJob:
    """One chunk's part of a step: its staging buffer, copies and CPU step."""

    chunk: HostChunk
    active: list[tuple[ParamRecord, Piece]]  # the pieces whose param has a grad this step
    slot: int  # the staging buffer it takes (see [Note: staging ring])
    staging: torch.Tensor  # that buffer as the chunk's: 1-D, model dtype, chunk numel
    grads: list[torch.Tensor] | None = None  # the flat grad of each active piece's param, held
    #                                          until its D2H is queued
    d2h_queued: threading.Event = field(default_factory=threading.Event)  # set once d2h_done is
    d2h_error: BaseException | None = None  # the D2H could not be queued
    d2h_done: Any = None  # after its D2H into staging; None: not queued, or ran synchronously
    h2d_done: Any = None  # after its H2D out of staging; None: none queued, or synchronous
    future: Future | None = field(default=None, repr=False)  # the worker's CPU step: stepped?
    stepped_with: ChunkJob | None = field(default=None, repr=False)  # the earlier job whose
    #     kernel call stepped this one too (see [Note: merged kernel calls]); None: its own
    copied: Future | None = field(default=None, repr=False)  # the copier's queuing of its H2D
    #     and of the next D2H into its buffer (bounded staging); None: the step queues its H2D
    #     when it completes the job
    early: bool = False  # its grads were copied before the step (an early copy that serves)
    speculation: Speculation | None = None  # its step speculated during backward, to settle
    #                                         first; None: none ([Note: speculative host steps])
    undo: Speculation | None = None  # a speculation of its chunk that this step does not use:
    #                                  rolled back before the job steps
    weights: torch.Tensor | None = None  # where its new weights are, where not in staging (a
    #                                      speculated step's own buffer)
    settled: str | None = None  # how its speculation ended: "stood", "redone", "rolled back"

    def staging_of(self, piece: Piece) -> torch.Tensor:
        return piece.in_chunk(self.staging)

    def weights_buffer(self) -> torch.Tensor:
        """Where the chunk's new weights are once the job stepped (1-D, the chunk's numel)."""
        return self.staging if self.weights is None else self.weights

    def landed(self) -> bool:
        """Whether the job's grads were copied and are on the host now (no wait)."""
        return self.d2h_queued.is_set() and (self.d2h_done is None or self.d2h_done.query())


class HostStep:
    """The CPU share of one step; see [Note: deferred host step].

    Args:
        jobs: one ``ChunkJob`` per chunk with grads, in the order the worker runs them.
        start_event: an event on the current stream after which the grads are final (``None`` on
            the CPU); the H2D copies into the params wait for it.
        engine: the ``CopyEngine`` whose D2H and H2D streams the copies run on.
        delayed: the step is a delayed update's: its weights reach the params at the next step
            (see ``OffloadPolicy.delayed_update``). Default False.
        verdict: the step's found_inf on its way to the host (a ``HostFlag``); nonzero skips the
            step. Default ``None``: no check.
        factor: the grads' factor on its way to the host (a ``HostFlag``), which the worker
            multiplies the grads by (see ``grad_factor``). Default ``None``: no factor.
        gil_switch_interval: seconds; the GIL switch interval held while the step is in flight
            (see ``OffloadPolicy.gil_switch_interval``). Default ``None``: the interval stays.
    """

    start_event: Any  # on the current stream when the step started: the grads are final there
    delayed: bool  # a delayed update's: its weights reach the params at the next step (see
    #               OffloadPolicy.delayed_update)
    _engine: CopyEngine  # the copies' streams
    _jobs: list[ChunkJob]  # in the order the worker runs them
    _num_completed: int  # jobs[:_num_completed] are done and their H2D is queued (or they failed)
    _completed: bool  # every job completed and the current stream waits for their H2D (see done)
    _last_job_of: dict[int, int]  # record index -> position of the last job with a piece of it
    _writes_after: list[Any]  # events the H2D copies into the params wait for: the current
    #                          stream after this step's backward, and after the next backward
    #                          where the step is completed only then (a delayed update)
    _writes_lock: threading.Lock  # for _writes_after: the copier reads it while a caller that
    #                               holds _lock waits for it
    _h2d_of: dict[int, Any]  # staging slot -> the event after the last H2D out of it
    _h2d_event: Any  # after the H2D of every chunk completed so far; None: none queued (or CPU)
    _lock: threading.Lock  # held while completing chunks
    _release_interval: weakref.finalize | None  # ends the step's hold on the shorter GIL switch
    #     interval (see [Note: GIL switch interval]): once it is complete, or when it is
    #     collected never completed (a dropped optimizer); None: no hold
    _verdict: HostFlag | None  # the step's found_inf on its way to the host; None: no check
    _skips: bool | None  # its value once the worker read it (the first chunk); None: not yet
    _factor: HostFlag | None  # the grads' factor on its way to the host; None: no factor
    _factor_of: dict[torch.dtype, float | None]  # its value in each grad dtype, once read

    def __init__(
        self,
        jobs: Sequence[ChunkJob],
        start_event: Any,
        *,
        engine: CopyEngine,
        delayed: bool = False,
        verdict: HostFlag | None = None,
        factor: HostFlag | None = None,
        gil_switch_interval: float | None = None,
    ) -> None:
        self._engine = engine
        self._factor = factor
        self._factor_of = {}
        self.delayed = delayed
        self._verdict = verdict
        self._skips = None
        self.start_event = start_event
        self._jobs = list(jobs)
        self._num_completed = 0
        self._completed = not self._jobs
        self._writes_after = [start_event]
        self._writes_lock = threading.Lock()
        self._h2d_of = {}
        self._h2d_event = None
        self._lock = threading.Lock()
        self._last_job_of = {}
        for position, job in enumerate(self._jobs):
            for record, _ in job.active:
                self._last_job_of[record.index] = position
        self._release_interval = None
        if self._jobs and gil_switch_interval is not None:
            switch_interval.hold(gil_switch_interval)
            self._release_interval = weakref.finalize(self, switch_interval.release)

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def num_chunks(self) -> int:
        """Chunks this step steps (those with a grad)."""
        return len(self._jobs)

    def job_at(self, position: int) -> ChunkJob:
        """The job the worker runs ``position``-th."""
        return self._jobs[position]

    @property
    def done(self) -> bool:
        """Whether every chunk is completed (its weights queued to the params, and the current
        stream told to wait for them): set last, under the lock, so that a thread reading it
        while another completes the last chunk still finds the step in flight."""
        return self._completed

    def _last_position(self, indices: Iterable[int]) -> int:
        last_job_of = self._last_job_of  # (a list, not a generator: no call per index)
        return max([last_job_of.get(index, -1) for index in indices], default=-1)

    def wait_for(self, indices: Iterable[int]) -> None:
        """Completes the chunks up to the last one holding a param with one of these record
        indices: afterwards the current stream sees those params' new weights."""
        self._complete_through(self._last_position(indices))

    def hold_writes_for_current(self) -> None:
        """The H2D copies of chunks not completed yet also wait for the work queued so far on
        the current stream: a step completed only after later forwards or backwards (a delayed
        update) must not change the params under them."""
        event = record_event(current_stream(self._engine.device))
        with self._writes_lock:
            self._writes_after.append(event)

    def h2d_event_of(self, slot: int) -> Any:
        """The event after the last H2D out of staging buffer ``slot`` (``None``: none queued, or
        it ran synchronously): a later D2H into that buffer waits for it."""
        return self._h2d_of.get(slot)

    def queue_d2h(self, job: ChunkJob, *, after: Sequence[Any]) -> None:
        """Queues the job's grads into its staging buffer, behind ``after``; the grads are then
        no longer held here (the copies recorded their stream on them). The worker learns of it
        (``d2h_queued``) also when it failed."""
        try:
            with phase("zero_shard::d2h"):
                pieces = [piece for _, piece in job.active]
                pairs = grad_copies(job.staging, pieces, job.grads)
                job.d2h_done = self._engine.d2h(pairs, after=after)
        except BaseException as err:
            job.d2h_error = err
            raise
        finally:
            job.grads = None
            job.d2h_queued.set()

    def queue_h2d(self, job: ChunkJob) -> None:
        """Queues the job's new weights (from its staging buffer, or their own buffer) into the
        params, behind the events the writes wait for."""
        pieces = [piece for _, piece in job.active]
        params = [flat_param(record.param) for record, _ in job.active]
        pairs = weight_copies(job.weights_buffer(), pieces, params)
        with self._writes_lock:
            after = list(self._writes_after)
        with phase("zero_shard::h2d"):
            job.h2d_done = self._engine.h2d(pairs, after=after)
        self._h2d_of[job.slot] = job.h2d_done

    def speculations(self) -> list[str]:
        """How each of its speculated chunks settled (see ``ChunkJob.settled``)."""
        return [job.settled for job in self._jobs if job.settled is not None]

    def skips(self) -> bool:
        """Whether the step is skipped (its found_inf is nonzero). The worker reads the flag at
        its first chunk (blocking until the copy landed) and the later chunks reuse the value:
        each read is a host wait and a GIL hand-off."""
        if self._skips is None:
            self._skips = self._verdict is not None and self._verdict.read() != 0
        return self._skips

    def grad_factor(self, dtype: torch.dtype) -> float | None:
        """The factor the worker multiplies grads of ``dtype`` by, as the device would (``None``
        where there is none, or it is 1); read once by the worker (a host wait for its copy)."""
        if self._factor is None:
            return None
        if dtype not in self._factor_of:
            value = factor_as_multiplied(self._factor.read(), self.device, dtype)
            self._factor_of[dtype] = None if value == 1.0 else value
        return self._factor_of[dtype]

    def wait_worker(self) -> None:
        """Waits until the worker is done with every chunk (main weights and state are final),
        without completing any: nothing is copied into the params (a delayed update keeps its
        lag). A chunk's error surfaces where the chunk is completed."""
        for job in self._jobs:
            job.future.exception()

    def wait_grads_copied(self) -> None:
        """Makes the current stream wait until every grad of the step was copied to the host (a
        stream wait): afterwards the grads may be written again (the next backward)."""
        # With a buffer per chunk every copy was queued by the time the step started, some
        # before it (early copies); bounded staging queues most later, as buffers free up.
        if not all(job.d2h_queued.is_set() for job in self._jobs):
            raise AssertionError(
                "expected every grad copy queued (per-chunk staging): with bounded staging the "
                "grads are read until the step is complete"
            )
        stream = current_stream(self.device)
        for event in {id(job.d2h_done): job.d2h_done for job in self._jobs}.values():
            wait_for_event(stream, event)

    def wait_grads_read(self) -> None:
        """Makes the current stream wait until the step reads its grads no more: their copies to
        the host, where every one is queued (a buffer per chunk), else the whole step (bounded
        staging copies them as its buffers free up)."""
        if all(job.d2h_queued.is_set() for job in self._jobs):
            self.wait_grads_copied()
        else:
            self.wait()

    def wait(self) -> None:
        """Completes every chunk: the current stream then sees all the new weights."""
        self._complete_through(len(self._jobs) - 1)

    @torch.no_grad()
    def _complete_through(self, last: int) -> None:
        with self._lock:
            self._complete_through_locked(last)

    def _complete_through_locked(self, last: int) -> None:
        error = None
        while self._num_completed <= last:
            job = self._jobs[self._num_completed]
            self._num_completed += 1
            try:
                stepped = job.future.result()
                if job.copied is not None:
                    job.copied.result()  # the copier queued its H2D
            except BaseException as err:
                # Wait for every chunk before raising: the worker must not outlive the step, and
                # the chunks that stepped must still reach the params.
                error = error or err
                last = len(self._jobs) - 1
                continue
            if not stepped:  # a skipped step: staging holds the grads, the params stay
                continue
            if job.copied is None:
                self.queue_h2d(job)
            self._h2d_event = job.h2d_done
        # The H2D stream runs in order: its last event covers every chunk queued so far.
        wait_for_event(current_stream(self._engine.device), self._h2d_event)
        self._completed = self._num_completed == len(self._jobs)
        if self._completed and self._release_interval is not None:
            release, self._release_interval = self._release_interval, None
            release()  # once: a finalizer runs at most once
        if error is not None:
            raise error
