"""Updated shards back into the model's params: one all-gather per bucket, driven by the optimizer.

[Note: param gather]
After a step every bucket is *stale*: its shard buffer holds new weights that the model's params
do not. Without overlap, ``after_step`` gathers every bucket and copies the result into the
params, all ordered on the current stream. With overlap, it launches the first buckets' gathers
asynchronously and returns; a forward pre-hook on each module that owns params of a stale bucket
waits for that bucket (a stream wait on an accelerator), copies it into the params, and launches
the gathers of the buckets after it (prefetch), so each gather runs while the layers before it
compute. Gathers are launched strictly in bucket order, on every rank alike: collectives on one
group must be issued in the same order everywhere. The collective's stream waits for the current
stream when it is launched, so it reads the shards only after the step (or the H2D copies the
current stream waited for) wrote them, and writes its output only after earlier copies out of a
reused block were queued. ``finish`` launches and completes whatever is left (before the next
step, ``state_dict``, or code that reads params outside forward).

When the step returns before the CPU's share of it is done (``HybridDeviceOptimizer.launch_step``),
``after_step`` is handed those pending writes, and a bucket's gather is launched only once the
chunks writing its shards are completed: the launch waits for them (the host blocks until the
worker has stepped them). Launches still happen at the same points on every rank, whatever each
rank's CPU speed or share: a launch that went ahead only where the writes happened to be done
would put the gathers in another order relative to other collectives (the user's, the next
reductions) on different ranks. So the forward runs ``_PREFETCH`` buckets behind the CPU step,
its first layers while the CPU steps the last ones, and every pending write is completed once
every gather is launched (at the latest when the forward ends, or before backward's first
reduction).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from optimizers import HostStep

from ._buckets import Bucket
from ._collectives import launch_all_gather, unpack_params

__all__ = ["HostWrites", "ParamGatherer", "PendingWrites"]

_PREFETCH = 2  # buckets gathered ahead of the one the forward is waiting for


class _Gather(NamedTuple):
    work: Any  # the collective's Work
    out: torch.Tensor  # 1-D, world_size * shard_numel


class PendingWrites(Protocol):
    """Writes into the buckets' shard buffers still in flight when the step returned."""

    def wait(self, bucket: int) -> None:
        """Completes the bucket's writes: the current stream sees them afterwards."""


class HostWrites:
    """The CPU's share of a step (a ``HostStep``) as writes into buckets: a bucket's writes are
    the chunks holding any of its shards (``indices[bucket]``: their hybrid param indices)."""

    def __init__(self, host_step: HostStep, indices: Sequence[Sequence[int]]) -> None:
        self._host_step = host_step
        self._indices = indices

    def wait(self, bucket: int) -> None:
        self._host_step.wait_for(self._indices[bucket])


def _wait_all(in_flight: dict[int, _Gather]) -> None:
    for gather in in_flight.values():
        gather.work.wait()
    in_flight.clear()


class ParamGatherer:
    """All-gathers updated shards into the model's params; see [Note: param gather]."""

    buckets: list[Bucket]
    overlap: bool
    _group: dist.ProcessGroup
    _world_size: int
    _stale: list[bool]  # per bucket: the params do not hold its shards' latest values yet
    _in_flight: dict[int, _Gather]  # bucket index -> launched, not yet copied into the params
    _next_launch: int  # the next bucket to launch; len(buckets) once all are launched
    _writes: PendingWrites | None  # writes into the shards the gathers must wait for; None: none

    def __init__(
        self, buckets: Sequence[Bucket], group: dist.ProcessGroup, *, overlap: bool
    ) -> None:
        self.buckets = list(buckets)
        self.overlap = overlap
        self._group = group
        self._world_size = dist.get_world_size(group)
        self._stale = [False] * len(self.buckets)
        self._in_flight = {}
        self._next_launch = len(self.buckets)
        self._writes = None
        # Launched gathers must end before the process group does (gloo aborts the process
        # otherwise): if the optimizer goes away, or the program ends, with some in flight.
        weakref.finalize(self, _wait_all, self._in_flight)

    @property
    def pending(self) -> bool:
        """Whether some params do not hold the latest step's weights yet."""
        return any(self._stale)

    def after_step(self, writes: PendingWrites | None = None) -> None:
        """Every bucket's shards changed (or will, once ``writes`` are done): gather them now,
        or start to (overlap)."""
        self.finish()  # nothing is left from an earlier step, normally
        self._stale = [True] * len(self.buckets)
        self._next_launch = 0
        self._writes = writes
        if self.overlap:
            self._launch_through(_PREFETCH - 1)
        else:
            self.finish()

    def wait_for(self, index: int) -> None:
        """Makes bucket ``index``'s params current, launching the next gathers (prefetch)."""
        if not self._stale[index]:
            return
        self._launch_through(index + _PREFETCH)
        self._complete(index)

    def launch_all(self) -> None:
        """Launches every gather not yet launched (keeps collective order across ranks)."""
        self._launch_through(len(self.buckets) - 1)

    def finish(self) -> None:
        """Completes every pending gather, in bucket order: the params hold the latest weights
        afterwards. It launches at most ``_PREFETCH`` buckets ahead of the one it completes;
        gathers launched earlier (``launch_all``) are in flight already, each holding a
        full-size buffer."""
        for index in range(len(self.buckets)):
            self.wait_for(index)
        self._writes = None

    def discard(self) -> None:
        """Completes every pending gather without copying it into the params (whose values are
        newer: loaded by the user). Collective: every rank must call it."""
        for index in range(len(self.buckets)):
            if self._stale[index]:
                self._launch_through(index + _PREFETCH)
                self._in_flight.pop(index).work.wait()
                self._stale[index] = False
        self._writes = None

    def _launch_through(self, last: int) -> None:
        """Launches the gathers through bucket ``last``, each once its shards are written."""
        last = min(last, len(self.buckets) - 1)
        while self._next_launch <= last:
            index = self._next_launch
            if self._stale[index] and self._writes is not None:
                self._writes.wait(index)  # the current stream now follows the shards' writes
            self._next_launch += 1
            if not self._stale[index]:
                continue
            shard = self.buckets[index].shard_buffer
            out = shard.new_empty(self._world_size * shard.numel())
            self._in_flight[index] = _Gather(launch_all_gather(shard, out, self._group), out)

    @torch.no_grad()
    def _complete(self, index: int) -> None:
        gather = self._in_flight.pop(index)
        gather.work.wait()  # on an accelerator: the current stream waits, the host goes on
        bucket = self.buckets[index]
        # A param written since the last copy into it (weights loaded by the user) keeps its
        # new value, and is marked for its main weight to be reloaded from it at the next step.
        kept = [sharded for sharded in bucket.params if sharded.is_stale()]
        for sharded in kept:
            sharded.changed = True
        targets = [None if s.changed else s.param for s in bucket.params]
        unpack_params(gather.out, bucket.layout, bucket.specs, targets, self._world_size)
        for sharded in bucket.params:
            if not sharded.changed:
                sharded.record_version()
        self._stale[index] = False

    def register_hooks(self, model: nn.Module) -> list[Any]:
        """Forward pre-hooks waiting for the buckets of each module's own params; on ``model``,
        a forward hook launching the gathers its forward did not need and a state-dict pre-hook
        finishing every gather."""
        bucket_of = {
            id(sharded.param): index
            for index, bucket in enumerate(self.buckets)
            for sharded in bucket.params
        }
        this = weakref.ref(self)
        handles = []
        for module in model.modules():
            indices = sorted(
                {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
            )
            if not indices:
                continue

            def before_forward(module: nn.Module, args: Any, indices: list[int] = indices) -> None:
                gatherer = this()
                if gatherer is not None:
                    for index in indices:
                        gatherer.wait_for(index)

            handles.append(module.register_forward_pre_hook(before_forward))

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            # Buckets of modules this forward did not run (they may differ between ranks) are
            # launched now, before backward's collectives, so every rank issues them in order.
            gatherer = this()
            if gatherer is not None:
                gatherer.launch_all()

        handles.append(model.register_forward_hook(after_forward))

        def before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            gatherer = this()
            if gatherer is not None:
                gatherer.finish()

        handles.append(model.register_state_dict_pre_hook(before_state_dict))
        return handles
