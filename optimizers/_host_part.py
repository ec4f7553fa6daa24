"""The elements stepped on the CPU: D2H of grads -> CPU step on a worker thread -> H2D of params.

[Note: host pipeline]
With ``d2h_during_backward``, a post-accumulate-grad hook queues each offloaded grad's copy on the
D2H stream behind the current stream as soon as backward produced it (``send_grad``); once every
param of a chunk was sent, an event on the D2H stream marks the chunk's grads (re-recorded if a
grad is sent again, as in accumulation). ``start`` records an event on the current stream (the
grads are complete there), queues the copies of the grads not sent by a hook or changed since on
the D2H stream behind that event, and hands each chunk to one worker thread, which waits for its
chunk's copies and steps it: the single-pass kernel reads the model-dtype grads from the chunk's
staging buffer and writes the model-dtype weights back there; otherwise the grads are cast to
fp32, the chunk's CPU sub-optimizer steps and the weights are cast back. It returns a
``HostStep`` that completes the chunks in the same order: it queues each one's copies to the model
params on the H2D stream and makes the current stream wait for them (the H2D stream runs in
order), so the next forward sees the new params with no host synchronization (see [Note: deferred
host step]). Meanwhile the accelerator's own share is stepped on the current stream. So the D2H of
chunk k+1, the CPU step of chunk k and the H2D of chunk k-1 overlap each other and the
accelerator's step.

[Note: pinned buffer reuse]
A chunk's staging buffer carries grads in (D2H) and params out (H2D). The next D2H into it is
queued behind the current stream (a hook's copy during backward, or start's after backward),
and the current stream waited
for this step's last H2D before that backward (every chunk is completed before the next backward
or step): so no copy into staging can start before
the previous copy out of it ended. The worker touches staging only after its D2H event
completed and before its H2D is queued. This assumes that forward and backward run on the stream
that was current when ``step()`` ran (as in ordinary training); a model run on another stream must
make that stream wait for the current one first.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.profiler import record_function

from offload import (
    CopyEngine,
    CopyPair,
    HostBufferRequest,
    HostBuffers,
    ThreadBudget,
    check_host_memory,
    wait_event,
)

from ._cpu_kernel import CpuAdamKernel, fused_kernel_applies
from ._elementwise import OptimizerSpec
from ._fused_backends import build_sub_optimizer
from ._host_step import ChunkJob, HostStep
from ._layout import ChunkSpec
from ._records import ParamRecord, Piece, SentGrad, flat_param

__all__ = ["HostChunk", "HostPart", "Verdict"]


@dataclass
class HostChunk:
    """Host pieces of one param group and dtype, copied, cast and stepped together."""

    spec: ChunkSpec
    pieces: list[tuple[ParamRecord, Piece]]
    main: torch.Tensor  # 1-D fp32, host
    grad: torch.Tensor | None  # 1-D fp32, host; `staging` itself when the model dtype is fp32;
    #                            None when the kernel reads the grads from staging
    staging: torch.Tensor  # 1-D model dtype, pinned when possible
    optimizer: torch.optim.Optimizer  # holds the state and hyperparameters in every case
    kernel: CpuAdamKernel | None  # steps the chunk in one pass, in place of optimizer.step()
    num_records: int  # distinct params with pieces in the chunk
    sent_by_hooks: set[int] = field(default_factory=set)  # record indices sent this step
    hooks_done: Any = None  # D2H-stream event after the hooks sent every param of the chunk;
    #                         None until they all did (or on CPU)


def _needs_grad_buffer(spec: ChunkSpec, kernel: CpuAdamKernel | None) -> bool:
    """An fp32 grad buffer, unless the grads are fp32 in staging or the kernel reads them there."""
    return spec.dtype != torch.float32 and kernel is None


def host_bytes_needed(
    specs: Sequence[ChunkSpec], num_state_tensors: int, kernels: Sequence[CpuAdamKernel | None]
) -> int:
    """Host bytes for ``specs``: fp32 main, fp32 grad where needed, staging, optimizer state."""
    total = 0
    for spec, kernel in zip(specs, kernels, strict=True):
        per_element = 4 * (1 + num_state_tensors) + spec.dtype.itemsize
        per_element += 4 if _needs_grad_buffer(spec, kernel) else 0
        total += spec.numel * per_element
    return total


def _slice(tensor: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    return tensor[start : start + numel]


class HostPart:
    """fp32 main weights, grads and state of the CPU's share, and the pipeline that steps them."""

    chunks: list[HostChunk]  # in parameter order
    engine: CopyEngine
    buffers: HostBuffers  # the staging buffers, one view per chunk
    threads: ThreadBudget | None  # None when nothing is offloaded
    _main_flats: list[torch.Tensor]  # 1-D fp32 host, one per param group with host elements
    _grad_flats: list[torch.Tensor]  # 1-D fp32 host, low-precision chunks only
    _cls: type[torch.optim.Optimizer]
    _chunks_of: dict[int, list[HostChunk]]  # record index -> the chunks holding its pieces
    _executor: ThreadPoolExecutor | None  # one worker: the CPU steps run one chunk at a time
    pending: HostStep | None  # the step the worker is on, until every chunk is completed
    _found_inf: torch.Tensor  # 1 element, fp32, pinned when possible: the step's found_inf, read
    #                           by the worker once the D2H copy of it is done

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
    ) -> None:
        cls = optimizer_spec.cls
        kernels = [
            kernel
            if kernel is not None and fused_kernel_applies(cls, groups[s.group_index], s.dtype)
            else None
            for s in specs
        ]
        check_host_memory(
            host_bytes_needed(specs, num_state_tensors, kernels),
            what="the fp32 main weights, grads and optimizer state offloaded to the CPU",
            setting="the offload fraction",
        )
        self.engine = CopyEngine(device)
        self.threads = threads
        self._cls = cls
        self.pending = None
        self._found_inf = torch.zeros(1, pin_memory=self.engine.is_async)
        self.buffers = HostBuffers(
            [HostBufferRequest(spec.numel, spec.dtype) for spec in specs],
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
                chunks = self._chunks_of.setdefault(record.index, [])
                if not chunks or chunks[-1] is not chunk:
                    chunks.append(chunk)
        self._executor = None
        if self.chunks:
            self._executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="zero_shard_cpu_step",
                initializer=torch.set_num_threads,
                initargs=(threads.num_threads,),
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
            staging = self.buffers.views[chunk_index]
            main = _slice(main_flat, main_offset, spec.numel)
            if _needs_grad_buffer(spec, kernel):
                grad = _slice(grad_flat, grad_offset, spec.numel)
                grad_offset += spec.numel
            else:
                grad = staging if kernel is None else None
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
                    staging=_slice(staging, offset, piece_spec.numel),
                )
                record = records[piece_spec.param_index]
                record.pieces.append(piece)
                pieces.append((record, piece))
                offset += piece_spec.numel
            num_records = len({record.index for record, _ in pieces})
            self.chunks.append(
                HostChunk(spec, pieces, main, grad, staging, optimizer, kernel, num_records)
            )

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
        param, or of the params whose record index is in ``indices``.

        Staging then holds weights, not grads: grads the backward hooks sent are sent again.
        """
        self.settle()
        self._forget_sent_grads()
        after = self.engine.record_current()
        for chunk in self.chunks:
            chosen = [(r, p) for r, p in chunk.pieces if indices is None or r.index in indices]
            pairs = [
                CopyPair(
                    piece.staging, _slice(flat_param(r.param), piece.spec.start, piece.spec.numel)
                )
                for r, piece in chosen
            ]
            wait_event(self.engine.d2h(pairs, after=[after]))
            if len(chosen) == len(chunk.pieces):
                chunk.main.copy_(chunk.staging)
            else:
                for _, piece in chosen:
                    piece.main.copy_(piece.staging)

    def _forget_sent_grads(self) -> None:
        for chunk in self.chunks:
            chunk.sent_by_hooks.clear()
            chunk.hooks_done = None
            for record, _ in chunk.pieces:
                record.sent = None

    @torch.no_grad()
    def start(
        self,
        grads: dict[int, torch.Tensor],
        grad_scale: float | None = None,
        *,
        need_order: Sequence[int] | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> HostStep:
        """Queues the D2H copies and CPU steps of every chunk with grads, the grads multiplied by
        ``grad_scale`` on the host if given; see [Note: host pipeline]. The chunks go last params
        first (their grads are ready first in backward), or, given ``need_order`` (every record
        index, in the order the new weights will be needed), by the first param of each chunk
        needed. Where ``found_inf`` (one element, on the device) is nonzero, the worker steps no
        chunk and the params are left as they are; the host does not wait for it here."""
        self.settle()
        for chunk in self.chunks:  # refuse before any chunk is handed to the worker
            if chunk.kernel is not None:
                self._check_kernel_still_applies(chunk)
        start_event = self.engine.record_current()
        verdict = None
        if found_inf is not None and self.chunks:
            # Behind start_event: the flag is final there. The worker reads it after this copy;
            # the buffer is free again once the step is settled (before the next start).
            pair = CopyPair(self._found_inf, found_inf.detach().reshape(1))  # fp32, checked
            verdict = Verdict(self._found_inf, self.engine.d2h([pair], after=[start_event]))
        everything_sent = None  # covers all hook copies so far; made when a chunk needs it
        jobs = []
        for chunk in self._chunk_order(need_order):
            active = [(r, p) for r, p in chunk.pieces if r.index in grads]
            for record, piece in chunk.pieces:
                piece.main.grad = piece.grad if record.index in grads else None
            if not active:
                continue
            # Grads sent during backward and unchanged since are on their way; the rest (none
            # sent, or changed after: accumulation, clipping, a new .grad) are sent now.
            current = [r.sent_grad_is_current() for r, _ in active]
            events = []
            if any(current):
                if chunk.hooks_done is None and everything_sent is None:
                    everything_sent = self.engine.mark_d2h()
                events.append(chunk.hooks_done or everything_sent)
            with record_function("zero_shard::d2h"):
                pairs = [
                    CopyPair(
                        piece.staging, _slice(grads[r.index], piece.spec.start, piece.spec.numel)
                    )
                    for (r, piece), sent in zip(active, current, strict=True)
                    if not sent
                ]
                if pairs:
                    events.append(self.engine.d2h(pairs, after=[start_event]))
            future = self._executor.submit(_step_chunk, chunk, active, events, grad_scale, verdict)
            jobs.append(ChunkJob(chunk, active, future))
        step = HostStep(self, jobs, grads, start_event, self._step_done, found_inf)
        if step.done:  # no chunk had a grad
            step.wait()
        else:
            self.pending = step
        return step

    def _chunk_order(self, need_order: Sequence[int] | None) -> list[HostChunk]:
        if need_order is None:
            return self.chunks[::-1]
        position = {index: place for place, index in enumerate(need_order)}
        return sorted(self.chunks, key=lambda c: min(position[r.index] for r, _ in c.pieces))

    def _step_done(self) -> None:
        self.pending = None
        self._forget_sent_grads()  # consumed, or to be sent again if the step failed

    def settle(self) -> None:
        """Completes the step in flight, if any: its chunks' weights reach the params."""
        pending = self.pending  # once: another thread completing the step may clear it
        if pending is not None:
            pending.wait()

    @torch.no_grad()
    def send_grad(self, record: ParamRecord) -> None:
        """Backward hook: queue the D2H of this param's offloaded grad elements right away.

        Runs on autograd's thread for the device, while the caller is inside ``backward()``: no
        step is running. The copy waits for the current stream (the grad is complete there), and
        that stream already waited for the last step's H2D out of the same staging slots.
        """
        self.settle()  # a step launched with launch_step() still owns staging
        grad = record.param.grad
        if grad is None or not grad.is_contiguous():
            return  # sent at step time instead (a non-contiguous grad needs a temporary)
        flat = grad.view(-1)
        pairs = [
            CopyPair(piece.staging, _slice(flat, piece.spec.start, piece.spec.numel))
            for piece in record.pieces
            if piece.staging is not None
        ]
        self.engine.d2h_behind_current(pairs)
        record.sent = SentGrad(grad, grad._version)
        for chunk in self._chunks_of[record.index]:
            chunk.sent_by_hooks.add(record.index)
            if len(chunk.sent_by_hooks) == chunk.num_records:
                # Recorded again at every later send (accumulation): it must follow the last.
                chunk.hooks_done = self.engine.mark_d2h()

    def _check_kernel_still_applies(self, chunk: HostChunk) -> None:
        group = chunk.optimizer.param_groups[0]
        if not fused_kernel_applies(self._cls, group, chunk.spec.dtype):
            raise RuntimeError(
                "a param group's options changed after construction in a way the single-pass CPU "
                "Adam kernel does not implement (amsgrad, maximize, capturable, or a tensor "
                "lr/betas/eps/weight_decay); build the optimizer with those options, or with "
                "OffloadPolicy(cpu_kernel='torch')"
            )


class Verdict(NamedTuple):
    """Whether to skip a step, on its way to the host: ``flag`` holds it once ``event`` is done."""

    flag: torch.Tensor  # 1 element, host
    event: Any  # on the D2H stream; None on CPU (the copy was synchronous)

    def skips(self) -> bool:
        wait_event(self.event)
        return bool(self.flag[0] != 0)


def _step_chunk(
    chunk: HostChunk,
    active: list[tuple[ParamRecord, Piece]],
    d2h_events: list[Any],
    grad_scale: float | None,
    verdict: Verdict | None,
) -> bool:
    """Worker thread: grads in staging -> fp32 -> CPU step -> weights back into staging.
    Returns whether it stepped (False: skipped, staging still holds the grads)."""
    for event in d2h_events:
        wait_event(event)  # the chunk's grads have landed in staging
    if verdict is not None and verdict.skips():
        return False
    with record_function("zero_shard::cpu_step"):
        if chunk.kernel is not None:
            group = chunk.optimizer.param_groups[0]
            for _, piece in active:
                if grad_scale is not None:  # bf16 or fp32 grads: a power-of-two scale is exact
                    piece.staging.mul_(grad_scale)
                chunk.kernel.step_piece(piece.main, piece.staging, piece.state, group)
            return True
        whole = len(active) == len(chunk.pieces)
        if chunk.grad is not chunk.staging:
            if whole:
                chunk.grad.copy_(chunk.staging)
            else:
                for _, piece in active:
                    piece.grad.copy_(piece.staging)
        if grad_scale is not None:
            for _, piece in active:
                piece.grad.mul_(grad_scale)
        chunk.optimizer.step()
        if whole:
            chunk.staging.copy_(chunk.main)
        else:
            for _, piece in active:
                piece.staging.copy_(piece.main)
    return True
