"""CPU steps taken while backward runs, before the step knows its clip factor and verdict.

[Note: speculative host steps]
With ``OffloadPolicy.speculative`` on (``True``, or ``"auto"`` where the host has the memory),
a staging buffer per chunk and early grad copies (see [Note: early grad copies] in _early.py), a
chunk on the single-pass kernel is stepped by the worker as soon as its grads have landed on the
host, during backward, as if the step will stand with no clip factor and finite grads, at the
hyperparameters its group holds then. The kernel reads the live state and writes the new state
to twins of it, and the new weights to a buffer of their own, so the live state, the step counts
and the grads in staging stay as they were, and nothing reaches the params ([Note: speculative
kernel steps] in _cpu_kernel.py). When the step comes, the worker settles each such chunk first,
with the step's real arguments: the speculated step stands where each piece's coefficients are
the same to the bit (no clip factor, or one of exactly 1; the same lr, betas, eps, weight decay
and grad scale), and its twins are moved into the live state (their pages, not a copy: [Note:
page moves] in offload/_page_moves.py); otherwise it is redone from the live state and the grads,
or, where the step is skipped (an inf or NaN), forgotten. Only then does its H2D copy go out.
Each way, the state and weights are the bits of the step taken once at ``step()``.

The kernel moves no version counter, so a change of the state's counters since the speculation
began is someone else's in-place write (through a tensor read from ``optimizer.state``): the
write is in the live state, and the step is redone from it, as torch's step would read it. A
write that moves no counter (through ``.data``, a numpy view or a raw pointer) is not seen, and
the twins replace it where the step stands, as a grad written so after its early copy is not seen
([Note: early grad copies]). A
tensor that aliases the state but keeps a counter of its own (a DTensor over it, as ``zero_shard``
hands them out: an in-place op on a DTensor moves its counter, not its local tensor's) is watched
by its own counter (``HostPart.watch_live``): written after the first speculation of a step, the
step drops its speculations and takes the CPU share at the step. Reads and edits through
``optimizer.state`` during the window drop the speculations too (the counts they read are those
before the step either way).

Speculations the worker has not started when the step starts are cancelled: backward is over, so
the step's own work goes first (the one in progress finishes). A speculation is dropped (the step
then taken as without it) wherever its chunk is not stepped from that early copy: its grads
changed or were cleared since (the early copy does not serve), its group now asks for what the
kernel lacks, or the state is read, edited, loaded or reloaded through the optimizer before the
step.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from offload import HostBufferRequest, HostBuffers, wait_event

from ._cpu_kernel import KernelPiece, KernelTable, unmet_option
from ._records import HostChunk

__all__ = [
    "TWIN_BYTES_PER_ELEMENT",
    "Speculation",
    "SpeculationBackoff",
    "SpeculationCounts",
    "SpeculativeBuffers",
    "settle_speculation",
    "speculate",
]


TWIN_BYTES_PER_ELEMENT = 12  # fp32 twins of the main weight and both moments


@dataclass
class SpeculationCounts:
    """Steps whose CPU share was speculated during backward, by outcome (one step counts once,
    as redone where any of its chunks was redone or rolled back).

    Attributes:
        stood: steps whose every speculated chunk's step stood as it was. Default 0.
        redone: steps with some chunk redone (a clip, a new lr) or rolled back (a skipped step).
            Default 0.
    """

    stood: int = 0  # every speculated chunk's step stood as it was
    redone: int = 0  # some chunk was redone (a clip, a new lr) or rolled back (a skipped step)


@dataclass
class SpeculationBackoff:
    """Whether this step's backward speculates: not for a while after a redone step (a redone
    step costs more than one taken once, at the step). After 1, 2, 3, ... redone steps in a row
    the next 1, 3, 7, ... steps (at most 63) take their CPU share at the step only; a speculated
    step that stands ends the streak. A run whose every step is clipped, or changes its lr, so
    tries once in 64 steps at worst; one whose steps stand speculates at every step."""

    skip: int = 0  # steps still to take without speculating
    streak: int = 0  # speculated steps redone in a row
    decided: bool | None = None  # whether this step's backward speculates; None: not yet asked
    max_skip: int = 63  # (0: speculate at every step)

    def speculates(self) -> bool:
        """Asked at each early copy: the first of a step decides for the step."""
        if self.decided is None:
            self.decided = self.skip == 0
            self.skip = max(self.skip - 1, 0)
        return self.decided

    def step_started(self) -> None:
        self.decided = None

    def settled(self, *, stood: bool) -> None:
        """A speculated step settled: every chunk's speculation stood, or not."""
        self.streak = 0 if stood else self.streak + 1
        self.skip = min(2**self.streak - 1, self.max_skip)


class SpeculativeBuffers:
    """Each kernel chunk's new weights of a speculated step (model dtype, pinned: the H2D reads
    them), and the size of the twins its state is speculated into (fp32: weight and both
    moments; built with each chunk's speculative table, see [Note: page moves])."""

    weights: dict[int, torch.Tensor]  # chunk index -> 1-D, the chunk's new weights
    num_bytes: int
    _buffers: HostBuffers

    def __init__(self, chunks: list[HostChunk], *, pin: bool) -> None:
        on_kernel = [chunk for chunk in chunks if chunk.kernel is not None]
        self._buffers = HostBuffers(
            [HostBufferRequest(c.spec.numel, c.spec.dtype) for c in on_kernel], pin=pin
        )
        self.weights = {c.index: w for c, w in zip(on_kernel, self._buffers.views, strict=True)}
        twin_bytes = sum(c.spec.numel * TWIN_BYTES_PER_ELEMENT for c in on_kernel)
        self.num_bytes = twin_bytes + self._buffers.num_bytes


@dataclass
class Speculation:
    """One chunk's step speculated during backward, on the worker."""

    weights: torch.Tensor  # 1-D, the chunk's buffer its new weights are written to
    table: KernelTable | None = None  # set by the worker once it speculated; None: it did not
    future: Future | None = field(default=None, repr=False)  # the worker's speculation

    def wait(self) -> KernelTable | None:
        """Waits for the worker's speculation; its table, or ``None`` where nothing was stepped
        (cancelled, the chunk's group asked for what the kernel lacks, or the kernel failed: it
        steps nothing then)."""
        future = self.future
        if future is not None and (future.cancelled() or future.exception() is not None):
            return None
        return self.table

    def roll_back(self) -> None:
        """Forgets the speculated step, if one was taken (it wrote nothing the live state
        holds)."""
        if self.future is not None and self.future.cancel():
            return  # (not started: it never runs)
        table = self.wait()
        if table is not None:
            self.table = None
            table.roll_back()


def _table(chunk: HostChunk, staging: torch.Tensor, weights: torch.Tensor) -> KernelTable:
    """The chunk's speculative table, built once and again where a loaded state replaced its
    state (its twins then follow the new state's addresses)."""
    table = chunk.speculative_table
    states = [piece.state for _, piece in chunk.pieces]
    if table is None or not table.backs(states):
        chunk.speculative_table = None  # (its twins go before the new ones are made)
        pieces = [KernelPiece(p.main, p.in_chunk(staging), p.state) for _, p in chunk.pieces]
        piece_weights = [p.in_chunk(weights) for _, p in chunk.pieces]
        table = chunk.speculative_table = KernelTable(chunk.kernel, pieces, weights=piece_weights)
    return table


def speculate(
    speculation: Speculation,
    chunk: HostChunk,
    group: dict[str, Any],
    staging: torch.Tensor,
    landed: Any,
) -> None:
    """Worker thread: steps the chunk from its grads in ``staging`` once ``landed`` (the early
    copy's event) completed, with ``group``'s options (the chunk's group as the grads were
    given), into the twins of its state; see [Note: speculative host steps]."""
    if chunk.kernel is None or unmet_option(group) is not None:
        return
    wait_event(landed)
    table = _table(chunk, staging, speculation.weights)
    table.speculate(group)
    speculation.table = table


def settle_speculation(speculation: Speculation, chunk: HostChunk, skips: bool, **step: Any) -> str:
    """Worker thread, at the step: the speculated step stands, is redone with the step's
    arguments (``grad_scale``, ``grad_factor``) or from state written since, or is rolled back
    where the step ``skips``. Returns which: ``"stood"``, ``"redone"`` or ``"rolled back"``."""
    table = speculation.table
    if table is None:
        raise AssertionError("expected a speculated step to settle")
    if skips:
        speculation.roll_back()
        return "rolled back"
    group = chunk.optimizer.param_groups[0]
    try:
        if not table.written_since() and table.holds(group, **step):
            table.commit()
            outcome = "stood"
        else:
            # (a failure comes before the live state is written: the kernel writes the twins,
            # and moving them in falls back to a copy rather than fail)
            table.redo(group, **step)
            outcome = "redone"
    except BaseException:
        table.roll_back()  # a failed step leaves the state as before it
        raise
    finally:
        speculation.table = None
    return outcome
