"""The host buffers a chunk's grads land in and its new weights leave from, one kind a class.

[Note: staging ring]
A staging buffer carries a chunk's grads in (D2H) and its new weights out (H2D), in the model
dtype. Held for every chunk, the buffers would cost 2 bytes a param on the host beside the fp32
main weight and the two states (12). So ``BoundedStaging`` gives the chunks ``STAGING_SLOTS``
buffers of the largest chunk's size in turn, and the host holds a bounded few hundred MiB of
staging whatever the model. A step queues the D2H of its first ``STAGING_SLOTS`` chunks. Once the
worker stepped a chunk, a copier thread queues its H2D into the params (behind the events the
step's writes wait for, see [Note: deferred host step]) and then the D2H of the chunk
``STAGING_SLOTS`` later into the same buffer, behind that H2D, while the worker goes on with the
next chunk; completing a chunk is then a stream wait on its H2D. The worker waits (on the host)
until a chunk's D2H is queued; the copier queues it also after a failure, so the later chunks
still step. The grads of the chunks not copied yet are held by the step (the copies' list) until
their D2H is queued, so that their memory is not reused before it is read.

``PerChunkStaging`` gives every chunk its own buffer: a step queues every chunk's D2H at once,
and each chunk's H2D is queued when the step completes the chunk. A delayed update completes its
step only after the next backward, which reads the params the H2D overwrites; its weights wait in
staging until then. The next step's D2H into a buffer waits for the last H2D out of it, so each
chunk's grads go in as soon as its weights are out, not after every chunk's. With a buffer per
chunk, the grads of a chunk may also be copied while backward runs, before the step (see [Note:
early grad copies] in _early.py), but not for a delayed update, whose buffers hold its weights
through the next backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from offload import (
    CopyEngine,
    HostBufferRequest,
    HostBuffers,
    available_after,
    current_stream,
    format_bytes,
    local_world_size,
    phase,
    record_event,
    use_device,
)

from ._early import EarlyCopy, GradIdentity
from ._host_step import ChunkJob, HostStep, grad_copies
from ._policy import StagingKind
from ._records import HostChunk, ParamRecord, Piece
from ._split import ChunkSpec

__all__ = [
    "AUTO_STAGING_KEEPS_FREE",
    "STAGING_SLOTS",
    "BoundedStaging",
    "PerChunkStaging",
    "Staging",
    "choose_speculation",
    "choose_staging",
    "staging_bytes",
]

# Staging buffers the chunks take in turn (see [Note: staging ring]): the worker steps one while
# the H2D out of the one before and the D2H into the next run, with one to spare for their
# spread (at the default 64M-element chunks, 512 MiB of bf16 staging).
STAGING_SLOTS = 4

# host_staging="auto" takes a buffer per chunk where the host keeps at least this share of its
# memory available after it (see choose_staging).
AUTO_STAGING_KEEPS_FREE = 0.25


def choose_staging(per_chunk_bytes: int) -> tuple[StagingKind, str]:
    """``host_staging="auto"``'s choice for a CPU share that needs ``per_chunk_bytes`` of host
    memory with a staging buffer per chunk, and why: ``"per_chunk"`` (the fastest full offload,
    2 bytes a bf16 param more) where the host keeps at least ``AUTO_STAGING_KEEPS_FREE`` of its
    memory available once every local rank has taken that much, else ``"bounded"``. So a model
    near what the host can hold gets bounded staging, and the same largest model fits. The rest
    of the process (the data loader, a checkpoint's copies, other models of an RL stack) keeps
    the quarter."""
    fits, reason = _keeps_free(per_chunk_bytes, "with a buffer per chunk")
    return ("per_chunk" if fits else "bounded"), reason


def choose_speculation(with_twins_bytes: int) -> tuple[bool, str]:
    """``speculative="auto"``'s choice for a CPU share that needs ``with_twins_bytes`` of host
    memory with the twins of speculative steps (14 bytes a bf16 element more), and why: on where
    this process is the host's only rank and the host keeps memory by the rule of
    ``choose_staging``. With more ranks on a host, the CPU steps speculated beside each rank's
    backward take the cores that drive those backwards: measured slower than without on two
    GPUs of one host, faster on one (docs/benchmarks/e2e.md, speculative host steps)."""
    num_ranks = local_world_size()
    if num_ranks > 1:
        return False, (
            f"{num_ranks} ranks on this host (LOCAL_WORLD_SIZE): their CPU steps would take the "
            "cores that drive their backwards"
        )
    return _keeps_free(with_twins_bytes, "with the twins of speculative steps")


def _keeps_free(num_bytes: int, what: str) -> tuple[bool, str]:
    after = available_after(num_bytes)
    if after is None:
        return False, "the host-memory check is off: its report is not trusted"
    available, total = after
    reason = (
        f"{format_bytes(max(available, 0))} of {format_bytes(total)} would be left available "
        f"{what} (kept: {AUTO_STAGING_KEEPS_FREE:.0%})"
    )
    return available >= AUTO_STAGING_KEEPS_FREE * total, reason


def staging_bytes(kind: StagingKind, specs: Sequence[ChunkSpec]) -> int:
    """Bytes of the staging buffers of ``kind`` for chunks of ``specs``."""
    sizes = [spec.numel * spec.dtype.itemsize for spec in specs]
    if kind == "bounded":
        return max(sizes, default=0) * min(len(sizes), STAGING_SLOTS)
    return sum(sizes)


ChunkPieces = tuple[HostChunk, list[tuple[ParamRecord, Piece]]]  # a chunk, its pieces with grads
Grads = Mapping[int, torch.Tensor]  # record index -> its flat grad


class Staging(Protocol):
    """Staging buffers and the order of the copies through them; see [Note: staging ring]."""

    kind: StagingKind
    buffers: HostBuffers  # 1-D uint8 views, one per slot
    copies_early: bool  # whether grads_ready copies grads before the step

    def view(self, slot: int, spec: ChunkSpec) -> torch.Tensor:
        """Buffer ``slot`` as a chunk of ``spec``'s: 1-D, its dtype and numel."""
        return self.buffers.views[slot][: spec.numel * spec.dtype.itemsize].view(spec.dtype)

    def slot(self, position: int, chunk: HostChunk) -> int:
        """The buffer ``chunk`` takes as the ``position``-th chunk of a pass over them."""

    def make_jobs(self, chunks: Sequence[ChunkPieces], grads: Grads) -> list[ChunkJob]:
        """The jobs of a step over ``chunks`` (each with its pieces that have grads), in the
        order the worker runs them, each with its buffer and its grads or early copy."""

    def queue_first_copies(
        self, step: HostStep, jobs: Sequence[ChunkJob], previous: HostStep | None
    ) -> None:
        """Queues the D2H copies ``step`` starts with, each once ``previous``'s H2D out of its
        buffer is done; the rest are queued as buffers free up."""

    def copy_out(self, step: HostStep, position: int, job: ChunkJob, stepped: bool) -> None:
        """Worker thread, once the worker is done with ``job``: what the kind queues then."""

    def grads_ready(self, grads: Grads, previous: HostStep | None) -> None:
        """Copies chunks whose grads are final before the step, where the kind does so."""

    def forget_early_copies(self) -> None:
        """Drops the grads given to ``grads_ready`` since the last step and their copies."""


def _queue_d2h_of(step: HostStep, jobs: Sequence[ChunkJob], previous: HostStep | None) -> None:
    for job in jobs:
        if job.d2h_queued.is_set():
            continue
        # Into staging once the last step's H2D out of it is done ([Note: staging ring]).
        h2d_before = None if previous is None else previous.h2d_event_of(job.slot)
        step.queue_d2h(job, after=[step.start_event, h2d_before])


class BoundedStaging(Staging):
    """``STAGING_SLOTS`` buffers taken in turn, and the copier; see [Note: staging ring]."""

    kind: StagingKind = "bounded"
    copies_early = False
    _copier: ThreadPoolExecutor | None  # off the worker's path; None: nothing offloaded

    def __init__(self, chunks: Sequence[HostChunk], engine: CopyEngine, *, pin: bool) -> None:
        size = max((_spec_bytes(c.spec) for c in chunks), default=0)
        requests = [HostBufferRequest(size, torch.uint8)] * min(len(chunks), STAGING_SLOTS)
        self.buffers = HostBuffers(requests, pin=pin)
        self._copier = None
        if chunks:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_shard_copies")
            weakref.finalize(self, self._copier.shutdown, wait=False)

    def slot(self, position: int, chunk: HostChunk) -> int:
        return position % len(self.buffers.views)

    def make_jobs(self, chunks: Sequence[ChunkPieces], grads: Grads) -> list[ChunkJob]:
        jobs = []
        for position, (chunk, active) in enumerate(chunks):
            slot = self.slot(position, chunk)
            job = ChunkJob(chunk, active, slot, self.view(slot, chunk.spec))
            job.grads = [grads[record.index] for record, _ in active]
            jobs.append(job)
        return jobs

    def queue_first_copies(
        self, step: HostStep, jobs: Sequence[ChunkJob], previous: HostStep | None
    ) -> None:
        _queue_d2h_of(step, jobs[: len(self.buffers.views)], previous)  # the rest: by the copier

    def copy_out(self, step: HostStep, position: int, job: ChunkJob, stepped: bool) -> None:
        """Hands the chunk to the copier, also after a failure, so that the next chunks still
        step; runs its copies here once the copier is shut down (the interpreter exiting with a
        step in flight stops it first): the next chunk must not wait for a copy nobody queues."""
        later = position + len(self.buffers.views)
        successor = step.job_at(later) if later < step.num_chunks else None
        try:
            job.copied = self._copier.submit(_copy_out, step, job, successor, stepped)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future = Future()
            try:
                _copy_out(step, job, successor, stepped)
            except BaseException as err:
                done.set_exception(err)
            else:
                done.set_result(None)
            job.copied = done

    def grads_ready(self, grads: Grads, previous: HostStep | None) -> None:
        """Nothing: the buffers are taken in turn as chunks step, no grads held before it."""

    def forget_early_copies(self) -> None:
        pass


def _spec_bytes(spec: ChunkSpec) -> int:
    return spec.numel * spec.dtype.itemsize


def _copy_out(step: HostStep, job: ChunkJob, successor: ChunkJob | None, stepped: bool) -> None:
    """Copier thread: the chunk's new weights to the params, then the grads of the chunk that
    takes its buffer next into it, behind that H2D. Off the worker's path: the CPU steps go on
    while the copies are queued."""
    with use_device(step.device):
        try:
            if stepped:
                step.queue_h2d(job)
        finally:
            if successor is not None:
                step.queue_d2h(successor, after=[step.start_event, job.h2d_done])


class PerChunkStaging(Staging):
    """A buffer per chunk, and the early copies into them; see [Note: staging ring]."""

    kind: StagingKind = "per_chunk"
    _engine: CopyEngine
    _chunks_of: Mapping[int, Sequence[HostChunk]]  # record index -> the chunks with a piece of it
    _early: dict[int, EarlyCopy]  # chunk index -> its grads copied since the last step
    _early_grads: dict[int, torch.Tensor]  # record index -> its grad given since the last step,
    #     held until every chunk with a piece of it was copied (a backward's grads are then held
    #     by nothing here: zero_grad frees them, as without early copies)
    _uncopied: dict[int, set[int]]  # record index -> its chunks not copied since it was given
    _on_copied: Callable[[HostChunk, torch.Tensor, Any], None] | None  # told of each early copy
    #     queued (the chunk, its staging, the copy's event)

    def __init__(
        self,
        chunks: Sequence[HostChunk],
        engine: CopyEngine,
        chunks_of: Mapping[int, Sequence[HostChunk]],
        *,
        pin: bool,
        early_copies: bool,
        on_copied: Callable[[HostChunk, torch.Tensor, Any], None] | None = None,
    ) -> None:
        """``chunks_of``: record index -> the chunks with a piece of it; ``early_copies``:
        ``grads_ready`` copies grads (not for a delayed update, see [Note: staging ring]);
        ``on_copied``: called with each chunk copied early, its staging and the copy's event."""
        requests = [HostBufferRequest(_spec_bytes(c.spec), torch.uint8) for c in chunks]
        self.buffers = HostBuffers(requests, pin=pin)
        self.copies_early = early_copies
        self._engine = engine
        self._chunks_of = chunks_of
        self._on_copied = on_copied
        self.forget_early_copies()

    def slot(self, position: int, chunk: HostChunk) -> int:
        return chunk.index

    def make_jobs(self, chunks: Sequence[ChunkPieces], grads: Grads) -> list[ChunkJob]:
        early = self._early
        self.forget_early_copies()  # used below or not at all: the next step's come afresh
        jobs = []
        for chunk, active in chunks:
            job = ChunkJob(chunk, active, chunk.index, self.view(chunk.index, chunk.spec))
            copied = early.get(chunk.index)
            if copied is not None and copied.serves([r.index for r, _ in active], grads):
                job.d2h_done = copied.done  # in its buffer already ([Note: early grad copies])
                job.d2h_queued.set()
                job.early = True
            else:
                job.grads = [grads[record.index] for record, _ in active]
            jobs.append(job)
        _lead_with_a_landed_copy(jobs)
        return jobs

    def queue_first_copies(
        self, step: HostStep, jobs: Sequence[ChunkJob], previous: HostStep | None
    ) -> None:
        _queue_d2h_of(step, jobs, previous)

    def copy_out(self, step: HostStep, position: int, job: ChunkJob, stepped: bool) -> None:
        pass  # the chunk's H2D is queued when the step completes it

    @torch.no_grad()
    def grads_ready(self, grads: Grads, previous: HostStep | None) -> None:
        """Notes that ``grads`` (1-D, by record index) are final on the current stream, and
        copies every chunk whose records' grads have all been given since the last step into its
        buffer now (``previous``: the last step, whose H2D out of a buffer the copy waits for)."""
        if not self.copies_early:
            return
        chunks: dict[int, HostChunk] = {}
        for index, grad in grads.items():
            if index in self._chunks_of:  # (the accelerator's share is read at the step)
                self._early_grads[index] = grad
                self._uncopied[index] = {c.index for c in self._chunks_of[index]}
                chunks.update((c.index, c) for c in self._chunks_of[index])
        if not chunks:
            return
        after = record_event(current_stream(self._engine.device))
        for index in sorted(chunks):  # in the order the step needs them
            chunk = chunks[index]
            if all(record.index in self._early_grads for record, _ in chunk.pieces):
                self._copy_early(chunk, after, previous)

    def _copy_early(self, chunk: HostChunk, after: Any, previous: HostStep | None) -> None:
        staging = self.view(chunk.index, chunk.spec)
        given = {record.index: self._early_grads[record.index] for record, _ in chunk.pieces}
        pairs = grad_copies(
            staging, [piece for _, piece in chunk.pieces], [given[r.index] for r, _ in chunk.pieces]
        )
        # Once the last step's H2D out of the buffer is done: its weights have left.
        h2d_before = None if previous is None else previous.h2d_event_of(chunk.index)
        with phase("zero_shard::d2h"):
            done = self._engine.d2h(pairs, after=[after, h2d_before])
        identities = {i: GradIdentity.of(grad) for i, grad in given.items()}
        self._early[chunk.index] = EarlyCopy(identities, done)
        if self._on_copied is not None:
            self._on_copied(chunk, staging, done)
        for record_index in given:  # the copy recorded its stream on the grads: they may go
            self._uncopied[record_index].discard(chunk.index)
            if not self._uncopied[record_index]:
                del self._uncopied[record_index], self._early_grads[record_index]

    def forget_early_copies(self) -> None:
        self._early, self._early_grads, self._uncopied = {}, {}, {}


def _lead_with_a_landed_copy(jobs: list[ChunkJob]) -> None:
    """Early copies land in the order backward reduced the grads, so the chunk the step needs
    first (the first params', reduced last) may still be on its way when the step starts while
    others are on the host: the first of those goes first then, and the worker starts at once
    instead of waiting (the next forward waits one chunk longer for its first params, which it
    does not need before the CPU step is well under way)."""
    if not jobs or jobs[0].landed():
        return
    for position, job in enumerate(jobs):
        if job.landed():
            jobs.insert(0, jobs.pop(position))
            return
