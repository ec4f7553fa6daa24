"""The elements stepped on the CPU: D2H of grads -> CPU step on a worker thread -> H2D of params.

[Note: host pipeline]
``start`` records an event on the current stream (the grads are complete there), queues chunks'
grads on the D2H stream behind that event into staging buffers (see [Note: staging ring] in
_staging.py), and hands each chunk to one worker thread, which waits for its chunk's copies and
steps it: the single-pass kernel reads the model-dtype grads from the staging buffer and writes
the model-dtype weights back there; otherwise the grads are cast to fp32, the chunk's CPU
sub-optimizer steps and the weights are cast back. The weights then go to the params on the H2D
stream. ``start`` returns a ``HostStep`` that completes the chunks in the same order, making the
current stream wait for each one's H2D (the H2D stream runs in order), so the next forward sees
the new params with no host synchronization (see [Note: deferred host step]). Meanwhile the
accelerator's own share is stepped on the current stream. So the D2H of chunk k+1, the CPU step
of chunk k and the H2D of chunk k-1 overlap each other and the accelerator's step.

While a step is in flight, the interpreter's GIL switch interval is shortened: the worker takes
the GIL back after each chunk's kernel (see [Note: GIL switch interval] in offload/_gil.py).

[Note: merged kernel calls]
Each call of the single-pass kernel is one OpenMP parallel region, and its threads may have to be
woken for it: a training process has two OpenMP teams (torch's on the main thread, the kernel's
on the worker), so libgomp lets idle threads spin only briefly before they sleep, and a wake-up
is paid per call (docs/benchmarks/e2e.md measures it). So where the grads of
the chunks after the one the worker takes are on the host already (early copies, bounded
staging's first buffers, the CPU), the worker steps them in the same call: up to
``MERGE_CHUNKS`` chunks, and at most half of those still to step. They are then completed as if
stepped one by one (the later ones' turns only report the call's outcome). A call's weights go
to the params only once it is done; the half keeps the calls after it at least as long as it, so
its H2D copies and the next forward over its layers run under them, and the step ends as without
merging: its last two chunks are stepped alone, and the next forward's last layers wait for the
last one's H2D only. Only whole chunks on the kernel merge, of one staging dtype.

The worker touches a buffer only after the D2H into it completed, and until it queued the H2D
out of it. This assumes that forward and backward run on the stream that was current when
``step()`` ran (as in ordinary training); a model run on another stream must make that stream
wait for the current one first.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Any, Literal

import torch

from offload import (
    CopyEngine,
    CopyPair,
    HostFlag,
    ThreadBudget,
    check_host_memory,
    current_stream,
    phase,
    record_event,
    side_stream,
    wait_event,
)

from ._cpu_kernel import (
    CpuAdamKernel,
    KernelPiece,
    KernelTable,
    fused_kernel_applies,
    unmet_option,
)
from ._elementwise import OptimizerSpec, step_sub_optimizer
from ._fused_backends import build_sub_optimizer
from ._group_options import leave_kernel_where_unmet, snapshot_hyperparams
from ._host_step import ChunkJob, HostStep
from ._policy import HostStaging, StagingKind
from ._records import HostChunk, ParamRecord, Piece, flat_param, reload_mains
from ._speculation import (
    TWIN_BYTES_PER_ELEMENT,
    Speculation,
    SpeculationBackoff,
    SpeculationCounts,
    SpeculativeBuffers,
    settle_speculation,
    speculate,
)
from ._split import ChunkSpec
from ._staging import (
    STAGING_SLOTS,
    BoundedStaging,
    PerChunkStaging,
    Staging,
    choose_speculation,
    choose_staging,
    staging_bytes,
)

__all__ = ["MERGE_CHUNKS", "HostPart"]

logger = logging.getLogger("zero_shard")

# Chunks whose grads are on the host the worker steps in one kernel call, at most (see [Note: merged
# kernel calls]): at the default 64M-element chunks, a call of up to 256M elements.
MERGE_CHUNKS = 4

# Kernel tables a chunk keeps at most: one per staging slot it takes (bounded staging's four) for
# each number of chunks merged after it, with room to spare.
_TABLES_KEPT = 4 * STAGING_SLOTS * MERGE_CHUNKS


def _start_worker(num_threads: int, device: torch.device) -> None:
    """The worker thread's setup: its intra-op threads, and the device as its current one. A new
    thread's current device is the first GPU, where its first CUDA call (an event's query) would
    make a context in every rank's process."""
    torch.set_num_threads(num_threads)
    if device.type not in ("cpu", "meta") and device.index is not None:
        torch.get_device_module(device).set_device(device)


def _needs_grad_buffer(spec: ChunkSpec, kernel: CpuAdamKernel | None) -> bool:
    """An fp32 grad buffer, unless the grads are fp32 in staging or the kernel reads them there."""
    return spec.dtype != torch.float32 and kernel is None


def _checked_staging(
    staging: HostStaging,
    specs: Sequence[ChunkSpec],
    num_state_tensors: int,
    kernels: Sequence[CpuAdamKernel | None],
    speculative: bool | Literal["auto"],
    early_copies: bool,
) -> tuple[StagingKind, bool]:
    """``staging`` with ``"auto"`` resolved (see ``choose_staging``), and whether the steps
    speculate (``speculative`` with ``"auto"`` resolved the same way), once the host is checked
    to hold the CPU share with them: fp32 main, fp32 grad where needed, optimizer state,
    staging, and the twins and weights of speculative steps (with a buffer per chunk)."""
    other_bytes = 0
    for spec, kernel in zip(specs, kernels, strict=True):
        per_element = 4 * (1 + num_state_tensors)
        per_element += 4 if _needs_grad_buffer(spec, kernel) else 0
        other_bytes += spec.numel * per_element
    # What speculative steps hold, with a buffer per chunk (see SpeculativeBuffers).
    twin_bytes = sum(
        spec.numel * (TWIN_BYTES_PER_ELEMENT + spec.dtype.itemsize)
        for spec, kernel in zip(specs, kernels, strict=True)
        if kernel is not None and speculative is not False and early_copies
    )
    asked = twin_bytes if speculative is True else 0
    kind: StagingKind = "bounded" if staging == "auto" else staging  # (with nothing to stage)
    if staging == "auto" and specs:
        per_chunk = other_bytes + staging_bytes("per_chunk", specs) + asked
        kind, reason = choose_staging(per_chunk)
        logger.info("zero-shard: host staging %r (host_staging='auto': %s)", kind, reason)
    speculates = kind == "per_chunk" and twin_bytes > 0
    if speculative == "auto" and speculates:
        with_twins = other_bytes + staging_bytes(kind, specs) + twin_bytes
        speculates, reason = choose_speculation(with_twins)
        logger.info(
            "zero-shard: speculative host steps %s (speculative='auto': %s)",
            "on" if speculates else "off",
            reason,
        )
    if speculative is True and not speculates:
        lacking = []
        if not early_copies:
            lacking.append("grads on the host during backward (a delayed update copies none)")
        if kind != "per_chunk":
            lacking.append(
                f"a staging buffer per chunk (host_staging is {kind!r} here: set "
                "host_staging='per_chunk')"
            )
        if all(kernel is None for kernel in kernels):
            lacking.append("chunks on the single-pass Adam/AdamW kernel")
        warnings.warn(
            "OffloadPolicy(speculative=True) has no effect here: it needs grads on the host "
            "during backward, a staging buffer per chunk and chunks on the single-pass Adam/AdamW "
            f"kernel; here it lacks {'; '.join(lacking)}. Pass speculative='auto' to silence this",
            RuntimeWarning,
            stacklevel=4,
        )
    held_bytes = twin_bytes if speculates else 0
    check_host_memory(
        other_bytes + staging_bytes(kind, specs) + held_bytes,
        what="the fp32 main weights, grads and optimizer state offloaded to the CPU"
        + (" and the state speculative steps write" if held_bytes else ""),
        setting="the offload fraction" + (" (or set speculative=False)" if held_bytes else ""),
    )
    return kind, speculates


class HostPart:
    """fp32 main weights, grads and state of the CPU's share, and the pipeline that steps them."""

    chunks: list[HostChunk]  # in the order the forward needs them (``plan_split``)
    engine: CopyEngine
    staging: Staging  # its buffers and the order of the copies through them
    threads: ThreadBudget | None  # None when nothing is offloaded
    _main_flats: list[torch.Tensor]  # 1-D fp32 host, one per param group with host elements
    _grad_flats: list[torch.Tensor]  # 1-D fp32 host, low-precision chunks only
    _executor: ThreadPoolExecutor | None  # one worker: the CPU steps run one chunk at a time
    num_updates: int  # steps settled and not skipped (a delayed update's warm-up counts them)
    _last_step: HostStep | None  # the last step started: when each staging buffer is free again
    _unsettled: HostStep | None  # the last step started, until settle() counted its update
    _found_inf: HostFlag  # the step's found_inf on its way to the worker (reused each step: the
    #                      step in flight is settled before the next start sends another)
    _grad_factor: HostFlag  # the step's grad factor on its way to the worker (reused as above)
    _flags_stream: Any  # where both flags are sent, behind the grads' event only; None: CPU
    _chunks_of: dict[int, list[HostChunk]]  # record index -> the chunks with a piece of it
    switch_interval: float | None  # the GIL switch interval while a step is in flight (see
    #                                [Note: GIL switch interval]); None: left alone
    speculation_counts: SpeculationCounts  # steps speculated during backward, by outcome
    _speculative: SpeculativeBuffers | None  # speculated steps' new weights (and twins' size);
    #                                          None: no speculation ([Note: speculative host
    #                                          steps] in _speculation.py)
    _speculations: dict[int, Speculation]  # chunk index -> its step speculated since the last
    #                                        step started
    _backoff: SpeculationBackoff  # whether this step's backward speculates (not right after
    #                               redone steps)
    _live: list[weakref.ref]  # tensors that alias the state with counters of their own (see
    #                           watch_live); kept while speculating is on
    _live_since: list[tuple[weakref.ref, int]] | None  # their counters when this step's first
    #                                                    speculation began; None: none began

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
        staging: HostStaging,
        switch_interval: float | None = None,
        early_copies: bool = False,
        speculative: bool | Literal["auto"] = False,
    ) -> None:
        cls = optimizer_spec.cls
        kernels = [
            kernel
            if kernel is not None and fused_kernel_applies(cls, groups[s.group_index], s.dtype)
            else None
            for s in specs
        ]
        kind, speculates = _checked_staging(
            staging, specs, num_state_tensors, kernels, speculative, early_copies
        )
        self.engine = CopyEngine(device)
        self.threads = threads
        self.switch_interval = switch_interval
        self.num_updates = 0
        self._last_step = self._unsettled = None
        self._found_inf = HostFlag(device)
        self._grad_factor = HostFlag(device)
        self._flags_stream = side_stream(device)
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
        pin = pin_memory and device.type != "cpu"
        self.speculation_counts = SpeculationCounts()
        self._speculations = {}
        self._backoff = SpeculationBackoff()
        self._live, self._live_since = [], None
        self._speculative = None
        on_copied = None
        if speculates:
            self._speculative = SpeculativeBuffers(self.chunks, pin=pin)
            on_copied = _weak_call(self, HostPart._speculate)
        if kind == "bounded":
            self.staging = BoundedStaging(self.chunks, self.engine, pin=pin)
        else:
            self.staging = PerChunkStaging(
                self.chunks,
                self.engine,
                self._chunks_of,
                pin=pin,
                early_copies=early_copies,
                on_copied=on_copied,
            )
        self._executor = None
        if self.chunks:
            self._executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="zero_shard_cpu_step",
                initializer=_start_worker,
                initargs=(threads.num_threads, device),
            )
            weakref.finalize(self, self._executor.shutdown, wait=False)
        self.reload_from_params()

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
            main = main_flat.narrow(0, main_offset, spec.numel)
            grad = None
            if _needs_grad_buffer(spec, kernel):
                grad = grad_flat.narrow(0, grad_offset, spec.numel)
                grad_offset += spec.numel
            main_offset += spec.numel
            offsets = list(accumulate((p.numel for p in spec.pieces[:-1]), initial=0))
            pieces_main = [
                main.narrow(0, o, p.numel) for o, p in zip(offsets, spec.pieces, strict=True)
            ]
            optimizer = build_sub_optimizer(
                optimizer_spec, [{"params": pieces_main, **hyper}], "cpu"
            )
            pieces = []
            for piece_spec, offset, piece_main in zip(
                spec.pieces, offsets, pieces_main, strict=True
            ):
                piece = Piece(
                    spec=piece_spec,
                    group=optimizer.param_groups[0],
                    main=piece_main,
                    grad=None if grad is None else grad.narrow(0, offset, piece_spec.numel),
                    optimizer=optimizer,
                    offset=offset,
                )
                record = records[piece_spec.param_index]
                record.pieces.append(piece)
                pieces.append((record, piece))
            self.chunks.append(HostChunk(spec, chunk_index, pieces, main, grad, optimizer, kernel))
        self.chunks.sort(key=lambda chunk: chunk.index)

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
        twins = 0 if self._speculative is None else self._speculative.num_bytes
        return flats + state + self.staging.buffers.num_bytes + twins

    @property
    def speculates(self) -> bool:
        """Whether chunks are stepped speculatively as their grads are copied early (but for
        the steps after redone ones: see ``SpeculationBackoff``)."""
        return self._speculative is not None

    @property
    def pending(self) -> HostStep | None:
        """The step in flight: started, and not every chunk completed yet."""
        step = self._unsettled
        return None if step is None or step.done else step

    @torch.no_grad()
    def reload_from_params(
        self, indices: set[int] | None = None, *, keep_unchanged: bool = False
    ) -> None:
        """Refreshes host fp32 main weights from the model params, through staging: of every
        param, or of the params whose record index is in ``indices``; ``keep_unchanged``: see
        ``reload_mains`` (each piece decides)."""
        self.settle()
        self.forget_early_copies()  # their buffers are overwritten here
        after = record_event(current_stream(self.engine.device))
        for chunk in self.chunks:
            chosen = [(r, p) for r, p in chunk.pieces if indices is None or r.index in indices]
            staging = self.staging.view(self.staging.slot(chunk.index, chunk), chunk.spec)
            pairs = [
                CopyPair(piece.in_chunk(staging), piece.of_param(flat_param(r.param)))
                for r, piece in chosen
            ]
            # Synchronous: the next chunk may reuse the buffer.
            wait_event(self.engine.d2h(pairs, after=[after]))
            if len(chosen) == len(chunk.pieces) and not keep_unchanged:
                chunk.main.copy_(staging)
            else:
                for _, piece in chosen:
                    main, values = piece.main, piece.in_chunk(staging)
                    reload_mains(main, values, keep_unchanged=keep_unchanged)

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
        delayed: bool = False,
    ) -> HostStep:
        """Queues the D2H copies and CPU steps of every chunk with grads (see [Note: host
        pipeline]), the grads multiplied on the host by ``grad_factor`` (see
        ``HostStep.grad_factor``), then by ``grad_scale`` in fp32, where given. The chunks go
        last params first (their grads are ready first in backward), or, given ``need_order``
        (every record index, in the order the new weights will be needed), by the first param of
        each chunk needed (see ``_lead_with_a_landed_copy``). Where ``found_inf`` is nonzero, the
        worker steps no chunk; the host does not wait for it here. ``grads_final``: an event on
        the current stream after which the grads and flags are final, recorded before the step
        in flight was settled (settling makes the current stream wait for every H2D: each
        chunk's D2H waits for its own below); ``None`` on the CPU. ``delayed``: the step is a
        delayed update's (its weights reach the params at the next step)."""
        start_event = grads_final
        self._backoff.step_started()  # (the next backward decides anew)
        self.settle()
        previous = self._last_step
        # Before any chunk is handed to the worker: see [Note: group options at launch].
        self._grad_flats += leave_kernel_where_unmet(self.chunks)
        snapshot_hyperparams(chunk.optimizer.param_groups[0] for chunk in self.chunks)
        verdict, factor = self._send_flags(found_inf, grad_factor, start_event)
        with_grads = []
        for chunk in self._chunk_order(need_order):
            active = [(r, p) for r, p in chunk.pieces if r.index in grads]
            for record, piece in chunk.pieces:
                piece.main.grad = piece.grad if record.index in grads else None
            if active:
                with_grads.append((chunk, active))
        jobs = self.staging.make_jobs(with_grads, grads)
        self._attach_speculations(jobs)
        try:
            step = HostStep(
                jobs,
                start_event,
                engine=self.engine,
                delayed=delayed,
                verdict=verdict,
                factor=factor,
                gil_switch_interval=self.switch_interval,
            )
            self.staging.queue_first_copies(step, jobs, previous)
        except BaseException:  # no job runs: the speculations attached go back
            _roll_back_all(j.speculation or j.undo for j in jobs if j.speculation or j.undo)
            raise
        for position, job in enumerate(jobs):
            job.future = self._executor.submit(
                _run_job, step, position, job, grad_scale, self.staging
            )
        self._last_step = self._unsettled = step
        return step

    def _send_flags(
        self, found_inf: torch.Tensor | None, grad_factor: torch.Tensor | None, start_event: Any
    ) -> tuple[HostFlag | None, HostFlag | None]:
        """The step's verdict and factor on their way to the worker (``None``: not given)."""
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
        return verdict, factor

    def _speculate(self, chunk: HostChunk, staging: torch.Tensor, landed: Any) -> None:
        """Staging copied the chunk's grads early: the worker steps it now, speculatively, if it
        is on the kernel (see [Note: speculative host steps])."""
        if self._speculative is None or chunk.index not in self._speculative.weights:
            return
        if self._backoff.decided is None and self._unsettled is not None and self._unsettled.done:
            self.settle()  # (counts the step before: its outcome decides for this one)
        if not self._backoff.speculates():
            return
        if self._live_since is None:  # the window in which a write cannot come first any more
            self._live_since = [(ref, t._version) for ref in self._live if (t := ref()) is not None]
        earlier = self._speculations.pop(chunk.index, None)
        if earlier is not None and not earlier.future.cancel():
            # Its grads were given again: the worker undoes it first.
            self._executor.submit(earlier.roll_back)
        speculation = Speculation(self._speculative.weights[chunk.index])
        # The group's options as they are now, when the grads were given: what the step takes
        # unless they change before it (then it redoes the step).
        group = dict(chunk.optimizer.param_groups[0])
        speculation.future = self._executor.submit(
            speculate, speculation, chunk, group, staging, landed
        )
        self._speculations[chunk.index] = speculation

    def _attach_speculations(self, jobs: Sequence[ChunkJob]) -> None:
        """Hands each speculation the worker started to its chunk's job: settled there where the
        job steps the chunk from the early copy the speculation read, on the kernel, else rolled
        back on the worker before the job steps; those of chunks not stepped are rolled back
        here. Those not started when the step starts are cancelled: backward is over, and the
        step's own work goes first."""
        speculations, self._speculations = self._speculations, {}
        # Those not started yet never run: their chunks step at the step, as without them.
        started = {i: s for i, s in speculations.items() if not s.future.cancel()}
        try:
            for job in jobs:
                speculation = started.pop(job.chunk.index, None)
                if speculation is None:
                    continue
                chunk = job.chunk
                whole = len(job.active) == len(chunk.pieces)
                if job.early and chunk.kernel is not None and whole:
                    job.speculation = speculation
                else:
                    job.undo = speculation
            _roll_back_all(started.values())  # chunks not stepped now: here, before it returns
        except BaseException:
            _roll_back_all(j.speculation or j.undo for j in jobs if j.speculation or j.undo)
            raise

    def drop_speculations(self) -> None:
        """Rolls back every step speculated since the last step started (the state is read,
        edited, loaded or reloaded first, or the grads cleared)."""
        speculations, self._speculations = self._speculations, {}
        self._live_since = None
        _roll_back_all(speculations.values())

    def watch_live(self, tensor: torch.Tensor) -> None:
        """Watches ``tensor``, which aliases live state but moves a version counter of its own
        (a DTensor over it: an in-place op on a DTensor moves its counter, not its local
        tensor's), for writes while a step is speculated (see ``drop_written_speculations``)."""
        if self._speculative is not None:
            self._live = [ref for ref in self._live if ref() is not None]
            self._live.append(weakref.ref(tensor))

    def drop_written_speculations(self) -> None:
        """At the step, before anything is stepped: where a watched tensor was written since the
        step's first speculation began, the speculations may have read the state before that
        write; they are dropped, and the step takes the state as written ([Note: speculative host
        steps])."""
        since, self._live_since = self._live_since, None
        if since is None or not self._speculations:
            return
        if any((t := ref()) is not None and t._version != version for ref, version in since):
            self.drop_speculations()

    def drop_unmet_speculations(self) -> None:
        """Rolls back the speculated steps of chunks whose group now asks for what the kernel
        lacks (amsgrad switched on reads the step counts first)."""
        for index, speculation in list(self._speculations.items()):
            if unmet_option(self.chunks[index].optimizer.param_groups[0]) is not None:
                del self._speculations[index]
                speculation.roll_back()

    def forget_early_copies(self) -> None:
        """Forgets the grads copied early, and rolls back the steps speculated from them."""
        self.drop_speculations()
        self.staging.forget_early_copies()

    def grads_ready(self, grads: dict[int, torch.Tensor]) -> None:
        """Notes that ``grads`` (1-D, by record index) are final on the current stream; staging
        that copies early copies the chunks whose grads have all been given since the last step
        now (see [Note: early grad copies]). Does nothing while a step is in flight (its worker
        owns the buffers)."""
        if self.pending is None:
            self.staging.grads_ready(grads, self._last_step)

    def _chunk_order(self, need_order: Sequence[int] | None) -> list[HostChunk]:
        if need_order is None:
            return self.chunks[::-1]
        position = {index: place for place, index in enumerate(need_order)}
        return sorted(self.chunks, key=lambda c: min(position[r.index] for r, _ in c.pieces))

    def wait_for_worker(self) -> None:
        """For reads of main weights and state: the step in flight, if any, is done on the worker
        (its weights are not copied into the params here), and steps speculated since are rolled
        back (the state reads as before the step)."""
        self.drop_speculations()
        pending = self.pending
        if pending is not None:
            pending.wait_worker()

    def drop_kernel_tables(self) -> None:
        """Forgets the kernel's tables: a loaded state dict is about to replace the state they
        point into, which they would otherwise keep alive until the next step rebuilt them."""
        self.settle()
        self.drop_speculations()
        for chunk in self.chunks:
            chunk.tables.clear()
            chunk.speculative_table = None

    def settle(self) -> None:
        """Completes the step in flight, if any: its chunks' weights reach the params; and
        counts the last step's update, unless it was skipped."""
        step, self._unsettled = self._unsettled, None
        if step is None:
            return
        try:
            if not step.done:
                # Its H2D copies overwrite the params: after every use of them queued so far (a
                # delayed update is completed here, after the next backward that reads them).
                step.hold_writes_for_current()
                step.wait()
        finally:
            # A step with no chunk updated nothing here (and nobody read its verdict: no host
            # wait); the worker read the verdict of one with chunks already.
            if step.done and step.num_chunks and not step.skips():
                self.num_updates += 1
            if step.done:
                self._count_speculations(step.speculations())

    def _count_speculations(self, outcomes: list[str]) -> None:
        if not outcomes:
            return
        stood = all(outcome == "stood" for outcome in outcomes)
        if stood:
            self.speculation_counts.stood += 1
        else:
            self.speculation_counts.redone += 1
        self._backoff.settled(stood=stood)


def _roll_back_all(speculations: Iterable[Speculation]) -> None:
    """Rolls back each of ``speculations``; raises the first error once all were tried."""
    error = None
    for speculation in list(speculations):
        try:
            speculation.roll_back()
        except BaseException as err:
            error = error or err
    if error is not None:
        raise error


def _weak_call(owner: HostPart, method: Callable[..., None]) -> Callable[..., None]:
    """``method`` of ``owner``, holding ``owner`` weakly (its staging holds the call)."""
    ref = weakref.ref(owner)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            method(target, *args)

    return call


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
            and other.speculation is None  # (settled on its own)
            and other.undo is None
            and other.staging.dtype == job.staging.dtype
            and other.landed()
            and other.d2h_error is None  # (read after d2h_queued: set before it)
        ):
            break
        followers.append(other)
    return followers


def _run_job(
    step: HostStep, position: int, job: ChunkJob, grad_scale: float | None, staging: Staging
) -> bool:
    """Worker thread: one chunk's CPU step; then hands the chunk to ``staging`` (bounded
    staging's copier queues its H2D and the next D2H into its buffer), also after a failure, so
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
        if job.undo is not None:
            job.undo.roll_back()
        speculation = job.speculation
        if speculation is not None and speculation.wait() is not None:
            try:
                skips, factor = step.skips(), step.grad_factor(job.chunk.spec.dtype)
            except BaseException:
                speculation.roll_back()  # a failed step leaves the state as before it
                raise
            job.settled = settle_speculation(
                speculation, job.chunk, skips, grad_scale=grad_scale, grad_factor=factor
            )
            stepped = job.settled != "rolled back"
            job.weights = speculation.weights if stepped else None
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
        staging.copy_out(step, position, job, stepped)
    return stepped


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
        step_sub_optimizer(chunk.optimizer)
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
