"""The elements stepped on the CPU: D2H of grads -> CPU step on a worker thread -> H2D of params.

[Note: host pipeline]
``start`` records an event on the current stream (the grads are complete there), queues chunks'
grads on the D2H stream behind that event into staging buffers (see [Note: staging ring]), and
hands each chunk to one worker thread, which waits for its chunk's copies and steps it: the
single-pass kernel reads the model-dtype grads from the staging buffer and writes the model-dtype
weights back there; otherwise the grads are cast to fp32, the chunk's CPU sub-optimizer steps and
the weights are cast back. The weights then go to the params on the H2D stream. ``start`` returns
a ``HostStep`` that completes the chunks in the same order, making the current stream wait for
each one's H2D (the H2D stream runs in order), so the next forward sees the new params with no
host synchronization (see [Note: deferred host step]). Meanwhile the accelerator's own share is
stepped on the current stream. So the D2H of chunk k+1, the CPU step of chunk k and the H2D of
chunk k-1 overlap each other and the accelerator's step.

[Note: staging ring]
A staging buffer carries a chunk's grads in (D2H) and its new weights out (H2D), in the model
dtype. Held for every chunk, the buffers would cost 2 bytes a param on the host beside the fp32
main weight and the two states (12); so the chunks take ``STAGING_SLOTS`` buffers of the largest
chunk's size in turn, and the host holds a bounded few hundred MiB of staging whatever the model.
``start`` queues the D2H of the first ``STAGING_SLOTS`` chunks. Once the worker stepped a chunk,
a copier thread queues its H2D into the params (behind the events the step's writes wait for, see
[Note: deferred host step]) and then the D2H of the chunk ``STAGING_SLOTS`` later into the same
buffer, behind that H2D, while the worker goes on with the next chunk; completing a chunk is then
a stream wait on its H2D. The worker waits (on the host) until a chunk's D2H is queued; the
copier queues it also after a failure, so the later chunks still step. The grads of the chunks
not copied yet are held by the step (the copies' list) until their D2H is queued, so that their
memory is not reused before it is read.

A delayed update instead gives every chunk its own buffer and queues its H2D only when the step
is completed, after the next backward, which reads the params they overwrite; its weights wait in
staging until then. The next step's D2H into a buffer waits for the last H2D out of it, so each
chunk's grads go in as soon as its weights are out, not after every chunk's.

While a step is in flight, the interpreter's GIL switch interval is shortened: the worker takes
the GIL back after each chunk's kernel (see [Note: GIL switch interval] in offload/_gil.py).

With a buffer per chunk, the grads of a chunk may instead be copied while backward runs, before
the step (see [Note: early grad copies] in _early.py).

[Note: merged kernel calls]
Each call of the single-pass kernel is one OpenMP parallel region, and its threads may have to be
woken for it: a training process has two OpenMP teams (torch's on the main thread, the kernel's
on the worker), so libgomp lets idle threads spin only briefly before they sleep, and on some
hosts each wake-up cost 1-2.5 ms a call (docs/benchmarks/e2e.md). So where the
grads of the chunks after the one the worker takes are on the host already (early copies, a ring's
first buffers, the CPU), the worker steps them in the same call: up to ``MERGE_CHUNKS`` chunks,
and at most half of those still to step. They are then completed as if stepped one by one (the
later ones' turns only report the call's outcome). A call's weights go to the params only once
it is done; the half keeps the calls after it at least as long as it, so its H2D copies and the
next forward over its layers run under them, and the step ends as without merging: its last two
chunks are stepped alone, and the next forward's last layers wait for the last one's H2D only.
Only whole chunks on the kernel merge, of one staging dtype.

The worker touches a buffer only after the D2H into it completed, and until it queued the H2D
out of it. This assumes that forward and backward run on the stream that was current when
``step()`` ran (as in ordinary training); a model run on another stream must make that stream
wait for the current one first.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from offload import (
    CopyEngine,
    CopyPair,
    HostBufferRequest,
    HostBuffers,
    HostFlag,
    ThreadBudget,
    available_after,
    check_host_memory,
    current_stream,
    format_bytes,
    phase,
    record_event,
    side_stream,
    switch_interval,
    use_device,
    wait_event,
)

from ._cpu_kernel import CpuAdamKernel, KernelPiece, KernelTable, fused_kernel_applies
from ._early import EarlyCopy, GradIdentity
from ._elementwise import OptimizerSpec
from ._fused_backends import build_sub_optimizer
from ._group_options import leave_kernel_where_unmet, snapshot_hyperparams
from ._host_step import ChunkJob, HostStep
from ._records import ParamRecord, Piece, flat_param
from ._split import ChunkSpec

__all__ = ["MERGE_CHUNKS", "STAGING_SLOTS", "HostChunk", "HostPart", "choose_staging"]

logger = logging.getLogger("zero_shard")

# Staging buffers the chunks take in turn (see [Note: staging ring]): the worker steps one while
# the H2D out of the one before and the D2H into the next run, with one to spare for their
# spread (at the default 64M-element chunks, 512 MiB of bf16 staging).
STAGING_SLOTS = 4

# Chunks whose grads are on the host the worker steps in one kernel call, at most (see [Note: merged
# kernel calls]): at the default 64M-element chunks, a call of up to 256M elements.
MERGE_CHUNKS = 4

# Kernel tables a chunk keeps at most: one per staging slot it takes (a ring's four) for each
# number of chunks merged after it, with room to spare.
_TABLES_KEPT = 4 * STAGING_SLOTS * MERGE_CHUNKS

# host_staging="auto" takes a buffer per chunk where the host keeps at least this share of its
# memory available after it (see choose_staging).
AUTO_STAGING_KEEPS_FREE = 0.25


@dataclass
class HostChunk:
    """Host pieces of one param group and dtype, copied, cast and stepped together."""

    spec: ChunkSpec
    index: int  # position in HostPart.chunks (its staging buffer when each chunk has its own)
    pieces: list[tuple[ParamRecord, Piece]]
    main: torch.Tensor  # 1-D fp32, host
    grad: torch.Tensor | None  # 1-D fp32, host, for low-precision chunks that torch steps; None:
    #                            the grads are read from staging (the kernel, or fp32 params)
    optimizer: torch.optim.Optimizer  # holds the state and hyperparameters in every case
    kernel: CpuAdamKernel | None  # steps the chunk in one pass, in place of optimizer.step();
    #                               None: optimizer.step() (for good once its group asks for an
    #                               option the kernel lacks, see leave_kernel_where_unmet)
    tables: dict[tuple[tuple[int, int], ...], KernelTable] = field(default_factory=dict)  # the
    #       kernel's call for the whole chunk, alone or with the chunks merged after it, keyed by
    #       (chunk index, staging slot) of each; built and used by the worker only


def _needs_grad_buffer(spec: ChunkSpec, kernel: CpuAdamKernel | None) -> bool:
    """An fp32 grad buffer, unless the grads are fp32 in staging or the kernel reads them there."""
    return spec.dtype != torch.float32 and kernel is None


def staging_bytes(specs: Sequence[ChunkSpec], *, ring: bool) -> list[int]:
    """The staging buffers' sizes: one per chunk, or ``STAGING_SLOTS`` of the largest chunk's
    size taken in turn (``ring``); see [Note: staging ring]."""
    sizes = [spec.numel * spec.dtype.itemsize for spec in specs]
    if ring and sizes:
        return [max(sizes)] * min(len(sizes), STAGING_SLOTS)
    return sizes


def host_bytes_needed(
    specs: Sequence[ChunkSpec],
    num_state_tensors: int,
    kernels: Sequence[CpuAdamKernel | None],
    *,
    ring: bool,
) -> int:
    """Host bytes for ``specs``: fp32 main, fp32 grad where needed, optimizer state, staging."""
    total = sum(staging_bytes(specs, ring=ring))
    for spec, kernel in zip(specs, kernels, strict=True):
        per_element = 4 * (1 + num_state_tensors)
        per_element += 4 if _needs_grad_buffer(spec, kernel) else 0
        total += spec.numel * per_element
    return total


def choose_staging(per_chunk_bytes: int) -> tuple[str, str]:
    """``host_staging="auto"``'s choice for a CPU share that needs ``per_chunk_bytes`` of host
    memory with a staging buffer per chunk, and why: ``"per_chunk"`` (the fastest full offload,
    2 bytes a bf16 param more) where the host keeps at least ``AUTO_STAGING_KEEPS_FREE`` of its
    memory available once every local rank has taken that much, else ``"bounded"``. So a model
    near what the host can hold gets bounded staging, and the same largest model fits. The rest
    of the process (the data loader, a checkpoint's copies, other models of an RL stack) keeps
    the quarter."""
    after = available_after(per_chunk_bytes)
    if after is None:
        return "bounded", "the host-memory check is off: its report is not trusted"
    available, total = after
    reason = (
        f"{format_bytes(max(available, 0))} of {format_bytes(total)} would be left available "
        f"with a buffer per chunk (kept: {AUTO_STAGING_KEEPS_FREE:.0%})"
    )
    return ("per_chunk" if available >= AUTO_STAGING_KEEPS_FREE * total else "bounded"), reason


def _slice(tensor: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    return tensor[start : start + numel]


class HostPart:
    """fp32 main weights, grads and state of the CPU's share, and the pipeline that steps them."""

    chunks: list[HostChunk]  # in parameter order
    engine: CopyEngine
    buffers: HostBuffers  # the staging buffers (1-D uint8 views), see [Note: staging ring]
    host_staging: str  # "bounded" or "per_chunk" (OffloadPolicy.host_staging, "auto" resolved)
    threads: ThreadBudget | None  # None when nothing is offloaded
    _main_flats: list[torch.Tensor]  # 1-D fp32 host, one per param group with host elements
    _grad_flats: list[torch.Tensor]  # 1-D fp32 host, low-precision chunks only
    _executor: ThreadPoolExecutor | None  # one worker: the CPU steps run one chunk at a time
    _copier: ThreadPoolExecutor | None  # a ring: queues each stepped chunk's H2D and the next
    #                                     D2H into its buffer, off the worker's path
    pending: HostStep | None  # the step the worker is on, until every chunk is completed
    num_updates: int  # steps completed and not skipped (a delayed update's warm-up counts them)
    _last_step: HostStep | None  # the last step started: when each staging buffer is free again
    _found_inf: HostFlag  # the step's found_inf on its way to the worker (reused each step: the
    #                      step in flight is settled before the next start sends another)
    _grad_factor: HostFlag  # the step's grad factor on its way to the worker (reused as above)
    _flags_stream: Any  # where both flags are sent, behind the grads' event only; None: CPU
    early_copies: bool  # grads_ready may copy chunks' grads before the step ([Note: early grad
    #                     copies]): a buffer per chunk, whose weights leave it within the step
    _early: dict[int, EarlyCopy]  # chunk index -> its grads copied since the last step
    _early_grads: dict[int, torch.Tensor]  # record index -> its grad given since the last step,
    #     held until every chunk with a piece of it was copied (a backward's grads are then held
    #     by nothing here: zero_grad frees them, as without early copies)
    _uncopied: dict[int, set[int]]  # record index -> its chunks not copied since it was given
    _chunks_of: dict[int, list[HostChunk]]  # record index -> the chunks with a piece of it
    switch_interval: float | None  # the GIL switch interval while a step is in flight (see
    #                                [Note: GIL switch interval]); None: left alone
    _release_interval: weakref.finalize | None  # ends the step in flight's hold on the shorter
    #     interval: when it is complete, or when it is collected never completed (a dropped
    #     optimizer); None: no hold

    def __init__(
        self,
        records: Sequence[ParamRecord],
        specs: Sequence[ChunkSpec],
        groups: Sequence[dict[str, Any]],
        optimizer_spec: OptimizerSpec,
        device: torch.device,
        *,
        pin_memory: bool,
        threads: ThreadBudget | None,
        num_state_tensors: int,
        kernel: CpuAdamKernel | None,
        staging: str,
        switch_interval: float | None = None,
        early_copies: bool = False,
    ) -> None:
        cls = optimizer_spec.cls
        kernels = [
            kernel
            if kernel is not None and fused_kernel_applies(cls, groups[s.group_index], s.dtype)
            else None
            for s in specs
        ]
        if staging == "auto":
            if specs:
                staging, reason = choose_staging(
                    host_bytes_needed(specs, num_state_tensors, kernels, ring=False)
                )
                logger.info(
                    "zero-shard: host staging %r (host_staging='auto': %s)", staging, reason
                )
            else:
                staging = "bounded"  # nothing to stage
        if staging not in ("bounded", "per_chunk"):
            raise AssertionError(
                f"expected a host staging of 'bounded' or 'per_chunk', got {staging!r}"
            )
        ring = staging == "bounded"
        check_host_memory(
            host_bytes_needed(specs, num_state_tensors, kernels, ring=ring),
            what="the fp32 main weights, grads and optimizer state offloaded to the CPU",
            setting="the offload fraction",
        )
        self.engine = CopyEngine(device)
        self.threads = threads
        self.host_staging = staging
        self.switch_interval = switch_interval
        self._release_interval = None
        self.pending = None
        self.num_updates = 0
        self._last_step = None
        self._found_inf = HostFlag(device)
        self._grad_factor = HostFlag(device)
        self._flags_stream = side_stream(device)
        self.early_copies = early_copies and not ring
        self.forget_early_copies()
        self.buffers = HostBuffers(
            [HostBufferRequest(size, torch.uint8) for size in staging_bytes(specs, ring=ring)],
            pin=pin_memory and device.type != "cpu",
        )
        self._main_flats, self._grad_flats, self.chunks = [], [], []
        for group_index in sorted({spec.group_index for spec in specs}):
            group_specs = [
                (i, s, kernels[i]) for i, s in enumerate(specs) if s.group_index == group_index
            ]
            self._build_group(records, group_specs, groups[group_index], optimizer_spec)
        self._chunks_of = {}
        for chunk in self.chunks:
            for record, _ in chunk.pieces:
                self._chunks_of.setdefault(record.index, []).append(chunk)
        self._executor = self._copier = None
        if self.chunks and ring:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_shard_copies")
            weakref.finalize(self, self._copier.shutdown, wait=False)
        if self.chunks:
            self._executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="zero_shard_cpu_step",
                initializer=torch.set_num_threads,
                initargs=(threads.num_threads,),
            )
            weakref.finalize(self, self._executor.shutdown, wait=False)
        self.reload_from_params()

    @property
    def ring(self) -> bool:
        """Bounded staging: the chunks take ``STAGING_SLOTS`` buffers in turn (else one each)."""
        return self.host_staging == "bounded"

    def _build_group(
        self,
        records: Sequence[ParamRecord],
        group_specs: list[tuple[int, ChunkSpec, CpuAdamKernel | None]],
        group: dict[str, Any],
        optimizer_spec: OptimizerSpec,
    ) -> None:
        main_flat = torch.empty(sum(s.numel for _, s, _ in group_specs), dtype=torch.float32)
        grad_numel = sum(s.numel for _, s, k in group_specs if _needs_grad_buffer(s, k))
        grad_flat = torch.zeros(grad_numel, dtype=torch.float32)
        self._main_flats.append(main_flat)
        if grad_numel:
            self._grad_flats.append(grad_flat)
        hyper = {k: v for k, v in group.items() if k != "params"}
        main_offset = grad_offset = 0
        for chunk_index, spec, kernel in group_specs:
            main = _slice(main_flat, main_offset, spec.numel)
            grad = None
            if _needs_grad_buffer(spec, kernel):
                grad = _slice(grad_flat, grad_offset, spec.numel)
                grad_offset += spec.numel
            main_offset += spec.numel
            pieces_main, offset = [], 0
            for piece_spec in spec.pieces:
                pieces_main.append(_slice(main, offset, piece_spec.numel))
                offset += piece_spec.numel
            optimizer = build_sub_optimizer(
                optimizer_spec, [{"params": pieces_main, **hyper}], "cpu"
            )
            pieces, offset = [], 0
            for piece_spec, piece_main in zip(spec.pieces, pieces_main, strict=True):
                piece = Piece(
                    spec=piece_spec,
                    group=optimizer.param_groups[0],
                    main=piece_main,
                    grad=None if grad is None else _slice(grad, offset, piece_spec.numel),
                    optimizer=optimizer,
                    offset=offset,
                )
                record = records[piece_spec.param_index]
                record.pieces.append(piece)
                pieces.append((record, piece))
                offset += piece_spec.numel
            self.chunks.append(HostChunk(spec, chunk_index, pieces, main, grad, optimizer, kernel))
        self.chunks.sort(key=lambda chunk: chunk.index)

    @property
    def num_slots(self) -> int:
        return len(self.buffers.views)

    def staging(self, slot: int, spec: ChunkSpec) -> torch.Tensor:
        """The staging buffer ``slot`` as a chunk of ``spec``'s: 1-D, its dtype and numel."""
        return self.buffers.views[slot][: spec.numel * spec.dtype.itemsize].view(spec.dtype)

    @property
    def num_bytes(self) -> int:
        """Bytes of host memory held: flat buffers, staging and optimizer state."""
        flats = sum(t.numel() * t.element_size() for t in (*self._main_flats, *self._grad_flats))
        state = sum(
            value.numel() * value.element_size()
            for chunk in self.chunks
            for _, piece in chunk.pieces
            for value in piece.state.values()
            if torch.is_tensor(value) and value.dim() > 0
        )
        return flats + state + self.buffers.num_bytes

    @torch.no_grad()
    def reload_from_params(self, indices: set[int] | None = None) -> None:
        """Refreshes host fp32 main weights from the model params, through staging: of every
        param, or of the params whose record index is in ``indices``."""
        self.settle()
        self.forget_early_copies()  # their buffers are overwritten here
        after = record_event(current_stream(self.engine.device))
        for chunk in self.chunks:
            chosen = [(r, p) for r, p in chunk.pieces if indices is None or r.index in indices]
            staging = self.staging(chunk.index % self.num_slots, chunk.spec)
            pairs = [
                CopyPair(
                    _slice(staging, piece.offset, piece.spec.numel),
                    _slice(flat_param(r.param), piece.spec.start, piece.spec.numel),
                )
                for r, piece in chosen
            ]
            # Synchronous: the next chunk may reuse the buffer.
            wait_event(self.engine.d2h(pairs, after=[after]))
            if len(chosen) == len(chunk.pieces):
                chunk.main.copy_(staging)
            else:
                for _, piece in chosen:
                    piece.main.copy_(_slice(staging, piece.offset, piece.spec.numel))

    @torch.no_grad()
    def start(
        self,
        grads: dict[int, torch.Tensor],
        grad_scale: float | None = None,
        *,
        need_order: Sequence[int] | None = None,
        found_inf: torch.Tensor | None = None,
        grad_factor: torch.Tensor | None = None,
        grads_final: Any,
    ) -> HostStep:
        """Queues the D2H copies and CPU steps of every chunk with grads, the grads multiplied on
        the host by ``grad_factor`` (one fp32 element, on the device; as the device would, see
        ``HostStep.grad_factor``) and then by ``grad_scale`` in fp32, where given; see [Note: host
        pipeline]. A chunk whose grads ``grads_ready`` copied, unchanged since, is not copied
        again. The chunks go last params first (their grads are ready first in backward), or,
        given ``need_order`` (every record index, in the order the new weights will be needed),
        by the first param of each chunk needed (a chunk on the host already may go first, see
        ``_lead_with_a_landed_copy``). Where ``found_inf`` (one element, on the device) is
        nonzero, the worker steps no chunk and the params are left as they are; the host does
        not wait for it here. ``grads_final``: an event on the current stream after which the
        grads and flags are final, recorded before the step in flight was settled (settling
        makes the current stream wait for every H2D: each chunk's D2H waits for its own below);
        ``None`` where nothing is recorded (the CPU)."""
        start_event = grads_final
        self.settle()
        previous = self._last_step
        # Before any chunk is handed to the worker: see [Note: group options at launch].
        self._grad_flats += leave_kernel_where_unmet(self.chunks)
        snapshot_hyperparams(chunk.optimizer.param_groups[0] for chunk in self.chunks)
        verdict = factor = None
        # The worker reads the flags first: on their own stream, behind start_event only (the
        # current stream now waits for the last step's H2D copies, the D2H stream for the early
        # copies of grads), written by the device, not copied behind those copies on the copy
        # engine ([Note: flags written by the device] in offload/_flag.py).
        if found_inf is not None and self.chunks:
            self._found_inf.send(found_inf, stream=self._flags_stream, after=[start_event])
            verdict = self._found_inf
        if grad_factor is not None and self.chunks:
            self._grad_factor.send(grad_factor, stream=self._flags_stream, after=[start_event])
            factor = self._grad_factor
        early = self._early
        self.forget_early_copies()  # used below or not at all: the next step's come afresh
        jobs: list[ChunkJob] = []
        for chunk in self._chunk_order(need_order):
            active = [(r, p) for r, p in chunk.pieces if r.index in grads]
            for record, piece in chunk.pieces:
                piece.main.grad = piece.grad if record.index in grads else None
            if not active:
                continue
            slot = len(jobs) % self.num_slots if self.ring else chunk.index
            job = ChunkJob(chunk, active, slot, self.staging(slot, chunk.spec))
            copied = early.get(chunk.index)
            if copied is not None and copied.serves([r.index for r, _ in active], grads):
                job.d2h_done = copied.done  # in its buffer already ([Note: early grad copies])
                job.d2h_queued.set()
            else:
                job.grads = [grads[record.index] for record, _ in active]
            jobs.append(job)
        if not self.ring:  # (a ring's chunks take its buffers in turn: their order is fixed)
            _lead_with_a_landed_copy(jobs)
        step = HostStep(
            self, jobs, start_event, on_done=self._step_done, verdict=verdict, factor=factor
        )
        lead = self.num_slots if self.ring else len(jobs)  # the rest: queued by the worker
        for job in jobs[:lead]:
            if job.d2h_queued.is_set():
                continue
            # Into staging once the last step's H2D out of it is done ([Note: staging ring]).
            h2d_before = None if previous is None else previous.h2d_event_of(job.slot)
            step.queue_d2h(job, after=[start_event, h2d_before])
        if jobs and self.switch_interval is not None:  # released by _step_done
            switch_interval.hold(self.switch_interval)
            self._release_interval = weakref.finalize(step, switch_interval.release)
        for position, job in enumerate(jobs):
            later = position + self.num_slots
            successor = jobs[later] if self.ring and later < len(jobs) else None
            job.future = self._executor.submit(
                _run_job, step, position, job, successor, grad_scale, self._copier
            )
        if step.done:  # no chunk had a grad
            step.wait()
        else:
            self.pending = step
        self._last_step = step
        return step

    @torch.no_grad()
    def grads_ready(self, grads: dict[int, torch.Tensor]) -> None:
        """Notes that ``grads`` (1-D, by record index) are final on the current stream, and
        copies every chunk whose records' grads have all been given since the last step into its
        staging buffer now; see [Note: early grad copies]. Does nothing without early copies, or
        while a step is in flight (its worker owns the buffers)."""
        if not self.early_copies or self.pending is not None:
            return
        chunks: dict[int, HostChunk] = {}
        for index, grad in grads.items():
            if index in self._chunks_of:  # (the accelerator's share is read at the step)
                self._early_grads[index] = grad
                self._uncopied[index] = {c.index for c in self._chunks_of[index]}
                chunks.update((c.index, c) for c in self._chunks_of[index])
        if not chunks:
            return
        after = record_event(current_stream(self.engine.device))
        previous = self._last_step
        for index in sorted(chunks):  # in the order the step needs them
            chunk = chunks[index]
            if not all(record.index in self._early_grads for record, _ in chunk.pieces):
                continue
            staging = self.staging(chunk.index, chunk.spec)
            given = {record.index: self._early_grads[record.index] for record, _ in chunk.pieces}
            pairs = [
                CopyPair(
                    _slice(staging, piece.offset, piece.spec.numel),
                    _slice(given[record.index], piece.spec.start, piece.spec.numel),
                )
                for record, piece in chunk.pieces
            ]
            # Once the last step's H2D out of the buffer is done: its weights have left.
            h2d_before = None if previous is None else previous.h2d_event_of(chunk.index)
            with phase("zero_shard::d2h"):
                done = self.engine.d2h(pairs, after=[after, h2d_before])
            identities = {i: GradIdentity.of(grad) for i, grad in given.items()}
            self._early[chunk.index] = EarlyCopy(identities, done)
            for record_index in given:  # the copy recorded its stream on the grads: they may go
                self._uncopied[record_index].discard(chunk.index)
                if not self._uncopied[record_index]:
                    del self._uncopied[record_index], self._early_grads[record_index]

    def forget_early_copies(self) -> None:
        """Drops the grads given to ``grads_ready`` since the last step and their copies (the
        grads were cleared): nothing of them is held any more."""
        self._early, self._early_grads, self._uncopied = {}, {}, {}

    def _chunk_order(self, need_order: Sequence[int] | None) -> list[HostChunk]:
        if need_order is None:
            return self.chunks[::-1]
        position = {index: place for place, index in enumerate(need_order)}
        return sorted(self.chunks, key=lambda c: min(position[r.index] for r, _ in c.pieces))

    def _step_done(self, step: HostStep) -> None:
        self.pending = None
        release, self._release_interval = self._release_interval, None
        if release is not None:
            release()  # once: a finalizer runs at most once
        # A step with no chunk updated nothing here (and nobody read its verdict: no host wait).
        if step.num_chunks and not step.skips():  # read by the worker already
            self.num_updates += 1

    def wait_for_worker(self) -> None:
        """For reads of main weights and state: the step in flight, if any, is done on the worker
        (its weights are not copied into the params here)."""
        pending = self.pending
        if pending is not None:
            pending.wait_worker()

    def drop_kernel_tables(self) -> None:
        """Forgets the kernel's tables: a loaded state dict is about to replace the state they
        point into, which they would otherwise keep alive until the next step rebuilt them."""
        self.settle()
        for chunk in self.chunks:
            chunk.tables.clear()

    def settle(self) -> None:
        """Completes the step in flight, if any: its chunks' weights reach the params."""
        pending = self.pending  # once: another thread completing the step may clear it
        if pending is not None:
            # Its H2D copies overwrite the params: after every use of them queued so far (a
            # delayed update is completed here, after the next backward that reads them).
            pending.hold_writes_for_current()
            pending.wait()


def _lead_with_a_landed_copy(jobs: list[ChunkJob]) -> None:
    """Early copies land in the order backward reduced the grads, so the chunk the step needs
    first (the first params', reduced last) may still be on its way when the step starts while
    others are on the host: the first of those goes first then, and the worker starts at once
    instead of waiting (the next forward waits one chunk longer for its first params, which it
    does not need before the CPU step is well under way)."""
    if not jobs or _landed(jobs[0]):
        return
    for position, job in enumerate(jobs):
        if _landed(job):
            jobs.insert(0, jobs.pop(position))
            return


def _landed(job: ChunkJob) -> bool:
    """Whether the job's grads were copied and are on the host now (no wait)."""
    return job.d2h_queued.is_set() and (job.d2h_done is None or job.d2h_done.query())


def _whole_on_kernel(job: ChunkJob) -> bool:
    return job.chunk.kernel is not None and len(job.active) == len(job.chunk.pieces)


def _landed_followers(step: HostStep, position: int, job: ChunkJob) -> list[ChunkJob]:
    """Worker thread: the jobs right after ``job`` that its kernel call may step too (see [Note:
    merged kernel calls]): whole chunks on the kernel in the same staging dtype whose grads have
    landed, at most ``MERGE_CHUNKS`` with it and half of those left."""
    followers: list[ChunkJob] = []
    if not _whole_on_kernel(job):
        return followers
    size = min(MERGE_CHUNKS, (step.num_chunks - position) // 2)
    for later in range(position + 1, position + size):
        other = step.job_at(later)
        if not (
            _whole_on_kernel(other)
            and other.staging.dtype == job.staging.dtype
            and _landed(other)
            and other.d2h_error is None  # (read after d2h_queued: set before it)
        ):
            break
        followers.append(other)
    return followers


def _run_job(
    step: HostStep,
    position: int,
    job: ChunkJob,
    successor: ChunkJob | None,
    grad_scale: float | None,
    copier: ThreadPoolExecutor | None,
) -> bool:
    """Worker thread: one chunk's CPU step; with a ring, then hands the chunk to the copier (its
    H2D, and the D2H into its buffer of the chunk that takes it next), also after a failure, so
    that the next chunks still step. Returns whether it stepped (False: skipped, and staging
    still holds the grads)."""
    stepped = False
    try:
        if job.stepped_with is not None:  # in an earlier job's call ([Note: merged kernel calls])
            try:
                stepped = job.stepped_with.future.result()  # done: the worker ran it before
            except BaseException as err:
                raise RuntimeError(
                    "this chunk was stepped in one kernel call with an earlier chunk, and that "
                    "call failed"
                ) from err
            return stepped
        job.d2h_queued.wait()  # queued by start, or by the copier after the buffer's last chunk
        if job.d2h_error is not None:
            raise RuntimeError("the copy of this chunk's grads failed") from job.d2h_error
        wait_event(job.d2h_done)  # the chunk's grads have landed in staging
        if not step.skips():
            followers = _landed_followers(step, position, job)
            for follower in followers:  # before the call: they report its outcome, also a failure
                follower.stepped_with = job
            _step_chunk(job, grad_scale, step.grad_factor(job.chunk.spec.dtype), followers)
            stepped = True
    finally:
        if copier is not None:
            job.copied = _hand_to_copier(copier, step, job, successor, stepped)
    return stepped


def _hand_to_copier(
    copier: ThreadPoolExecutor,
    step: HostStep,
    job: ChunkJob,
    successor: ChunkJob | None,
    stepped: bool,
) -> Future:
    """The copier's ``_copy_out`` of the chunk; run here when the copier is shut down (the
    interpreter exiting with a step in flight stops it first): the next chunk must not wait for
    a copy nobody will queue."""
    try:
        return copier.submit(_copy_out, step, job, successor, stepped)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        done: Future = Future()
        try:
            _copy_out(step, job, successor, stepped)
        except BaseException as err:
            done.set_exception(err)
        else:
            done.set_result(None)
        return done


def _copy_out(step: HostStep, job: ChunkJob, successor: ChunkJob | None, stepped: bool) -> None:
    """Copier thread (a ring): the chunk's new weights to the params, then the grads of the
    chunk that takes its buffer next into it, behind that H2D. Off the worker's path: the CPU
    steps go on while the copies are queued."""
    with use_device(step.device):
        try:
            if stepped:
                step.queue_h2d(job)
        finally:
            if successor is not None:
                step.queue_d2h(successor, after=[step.start_event, job.h2d_done])


def _step_chunk(
    job: ChunkJob,
    grad_scale: float | None,
    grad_factor: float | None,
    followers: Sequence[ChunkJob] = (),
) -> None:
    """Grads in the job's staging (multiplied there by ``grad_factor``, see
    ``HostStep.grad_factor``) -> fp32 -> CPU step -> weights back into staging; with the kernel,
    the ``followers``' chunks too, in the same call (see [Note: merged kernel calls])."""
    chunk, active = job.chunk, job.active
    with phase("zero_shard::cpu_step"):
        if chunk.kernel is not None:
            jobs = [job, *followers]
            groups = [j.chunk.optimizer.param_groups[0] for j in jobs for _ in j.active]
            _kernel_table(jobs).run(groups, grad_scale, grad_factor)
            return
        if followers:
            raise AssertionError("expected no chunks merged into a step without the kernel")
        whole = len(active) == len(chunk.pieces)
        if grad_factor is not None:  # the fp32 product rounded to the grads' dtype
            factor = torch.tensor(grad_factor, dtype=torch.float32)
            torch._foreach_mul_([job.staging_of(piece) for _, piece in active], factor)
        if chunk.grad is None:  # fp32 params: the grads are stepped where they landed
            for _, piece in active:
                piece.main.grad = job.staging_of(piece)
        elif whole:
            chunk.grad.copy_(job.staging)
        else:
            for _, piece in active:
                piece.grad.copy_(job.staging_of(piece))
        if grad_scale is not None:
            for _, piece in active:
                piece.main.grad.mul_(grad_scale)
        chunk.optimizer.step()
        if whole:
            job.staging.copy_(chunk.main)
        else:
            for _, piece in active:
                job.staging_of(piece).copy_(piece.main)


def _kernel_table(jobs: Sequence[ChunkJob]) -> KernelTable:
    """The kernel's call for the jobs (one, or one with those merged after it): built once per
    (chunk, staging slot) of each and kept by the first chunk, and again where a loaded state
    dict replaced the state it points into (or only some pieces have grads: built for those, not
    kept)."""
    first = jobs[0]
    whole = all(len(j.active) == len(j.chunk.pieces) for j in jobs)
    key = tuple((j.chunk.index, j.slot) for j in jobs)
    tables = first.chunk.tables
    table = tables.get(key) if whole else None
    if table is None or not table.backs([p.state for j in jobs for _, p in j.active]):
        pieces = [KernelPiece(p.main, j.staging_of(p), p.state) for j in jobs for _, p in j.active]
        table = KernelTable(first.chunk.kernel, pieces)
        if whole:
            if len(tables) >= _TABLES_KEPT:  # merges that vary from step to step: start afresh
                tables.clear()
            tables[key] = table
    return table
