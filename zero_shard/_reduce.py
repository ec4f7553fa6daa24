"""Grads of a replicated model: reduced bucket by bucket while backward runs, kept as shards.

[Note: grad reduction]
A post-accumulate-grad hook on every sharded model param marks it ready. Buckets are reduced
strictly from the last to the first: the order in which backward produces them, and one order
on every rank, which collectives on one group need. When the next bucket in that order has all
its params ready, it is reduced on a side stream that first waits for the current stream (the
grads are complete there): the grads are packed (zeros and a 0 flag for a param without a grad
on this rank), the model's ``.grad`` is released (``record_stream`` keeps its memory from reuse
until the side stream has read it), the collective is launched and waited for on the side stream
(a stream wait: the host goes on), and the result is divided and written, or added, into the
bucket's grad buffer. The packed buffer is allocated on the side stream and used only there and
by the collective the side stream waited for, so dropping it is safe. At the end of backward (an
autograd callback queued by the first hook), the buckets not yet reduced are reduced in the same
order, so every rank reduces every bucket once per backward. Before the step reads the grad
buffers, the current stream waits for the side stream's last event.

Stage 2 reduce-scatters (each rank receives only its own segment); stage 1 all-reduces the whole
packed buffer and keeps this rank's segment. The grads of 0-dim params, which every rank steps,
are all-reduced beside a stage 2 reduce-scatter (see [Note: 0-dim params] in ``_bucket_layout.py``).

A grad buffer accumulates over backwards as ``.grad`` does in torch, param by param: the next
reduction adds to a param's reduced grad unless its ``.grad`` was cleared since ([Note: released
grads]), and ``zero_grad`` clears them all. A step with no backward since the last step (grads set
by hand, or none at all) reduces every bucket then, as grads left from before are kept.

[Note: grads after their reduction]
Autograd runs a param's post-accumulate-grad hook once per graph task, so in one backward a grad
comes again only from a backward nested in it: reentrant activation checkpointing
(``use_reentrant=True``) runs one per checkpointed call. A param used both inside and outside
such a call, or in several, gets a grad after its bucket may have been reduced. A hook that runs
in another graph task than the one the end-of-backward callback is queued on marks the backward
as nested; at its end, the ranks agree (one small all-reduce over the reducer's group, only after
such a backward) on the buckets where any rank holds a grad no reduction took, and each of those
is reduced again and added, in the same order on every rank. Reductions are sums, so the result is
the grad of the whole backward. Whether a bucket was reduced before a late grad came depends on
which params had grads on the rank, hence the agreement. Every rank must run the same
checkpointed calls (as DDP's ``static_graph`` and FSDP2 assume): a rank whose backward nests
takes part in the agreement, and one that skipped every checkpointed call (data-dependent) would
not, mismatching the collectives; ``use_reentrant=False`` has no nested backward.

[Note: reductions of several wrappers]
Collectives on one group pair up across ranks by the order each rank issues them. One wrapper's
reductions come in one order on every rank (its buckets'), but two wrappers' reductions in one
backward would interleave by when each bucket's grads are complete, and that differs by rank
where a param has grads on some ranks only (a branch only some ranks' data reach): one wrapper's
bucket on a rank would pair with the other wrapper's on another rank, and grads of equal size
would be summed with others' silently (or, on the CPU, each rank would wait for a reduction the
other issues later). So while more than one live wrapper reduces over the same ranks, none of
them reduces during backward: one callback, queued at the first grad of any of them in a
backward, reduces each one's buckets at its end, the wrappers in the order they were made (the
same on every rank: every rank wraps in one order). Their reductions then do not overlap
backward's compute.

At one rank the packed grads are the reduced ones: they are packed straight into the grad buffer
and no collective runs, on backward's own stream unless the bucket's params are large
(``GradReducer._stream_for``).

[Note: reduced grads held]
A bucket holds its grad buffer from its first reduction after the grads were cleared until they
are cleared again, as torch holds ``.grad``: ``opt.zero_grad()`` drops every bucket's, and a
forward drops the buffer of a bucket whose every param's ``.grad`` was set to ``None`` since
(``model.zero_grad()``). So the reduced grads never stand beside the next forward's activations,
and at one rank a step holds no more than torch's. The buffer is allocated on the current
stream, where the step reads it, and records the side stream, which writes it: the allocator
reuses its memory only after the side stream's work queued before the drop, and after any
copy that recorded its own stream (the D2H of grads to the CPU). The current stream waits for
the reductions in flight before a drop, since the presence flags are copied out there (a
zeroed ``.grad`` reads them: ``_flag_zeroed_as_before``) where some param lacked a grad; where
none did, every flag is set, and no copy is kept.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from offload import current_stream, phase, record_event, side_stream, use_stream, wait_stream

from ._buckets import Bucket, FlagsBefore, ShardedParam
from ._collectives import (
    choose_reduce_scaling,
    chunk_pack_grads,
    chunk_packable,
    launch_reduction,
    pack_grads,
    replicated_grads,
    write_replicated,
)
from ._gather import ParamGatherer
from ._outside import average_outside_grads
from ._released import GradWatch, PlaceholderRemoval, ReleasedGrad, Taken, forget_all
from ._released_ops import DeferredClip, EarlyCopies

__all__ = ["SIDE_PACK_NUMEL", "GradReducer"]

# At one rank, a bucket whose params average this many elements or more is packed on the side
# stream (see GradReducer._stream_for): a 1B-param GPT's (7M on average), not a 38M one's (0.3M).
SIDE_PACK_NUMEL = 1 << 21


# The live reducers over each set of ranks, in the order they were made, and the graph tasks
# whose end reduces them in that order ([Note: reductions of several wrappers]).
_REDUCING: dict[tuple[int, ...], list[weakref.ref[GradReducer]]] = {}
_ORDERED_ENDS: set[tuple[tuple[int, ...], int]] = set()


def _reducing(ranks: tuple[int, ...]) -> list[GradReducer]:
    """The live reducers over ``ranks``, in the order they were made."""
    live = [reducer() for reducer in _REDUCING.get(ranks, [])]
    return [reducer for reducer in live if reducer is not None]


def _queue_ordered_end(ranks: tuple[int, ...], task: int) -> None:
    """Queues, once per graph task, the callback that ends the backward of every reducer over
    ``ranks`` that started in it, in the order they were made."""
    key = (ranks, task)
    if key in _ORDERED_ENDS:
        return
    _ORDERED_ENDS.add(key)

    @torch.compiler.disable  # see [Note: compiled models] in _compiled.py
    def end() -> None:
        _ORDERED_ENDS.discard(key)
        for reducer in _reducing(ranks):
            if reducer.in_backward_of(task):
                reducer._end_backward()

    torch.autograd.Variable._execution_engine.queue_callback(end)


class GradReducer:
    """Reduces the grads of a replicated model into per-bucket shards ([Note: grad reduction])."""

    buckets: list[Bucket]
    enabled: bool  # False inside no_sync(): grads accumulate unreduced in the model's .grad
    outer_unsynced: bool  # the last forward under a DDP around the model ran inside its
    #                       no_sync(): DDP would hold each rank's own grads now ([Note: DDP
    #                       around a wrapped model])
    _group: dist.ProcessGroup | None  # None: one rank, which reduces nothing
    ranks: tuple[int, ...]  # the global ranks of _group
    _shared: bool  # this backward, another live reducer is over the same ranks: reduce at its end,
    #                in order ([Note: reductions of several wrappers])
    _rank: int
    _world_size: int
    _scatter: bool  # stage 2: reduce-scatter; stage 1: all-reduce
    _device: torch.device
    _stream: Any  # the side stream reductions run on (see _stream_for); None on the CPU
    _event: Any  # on _stream after the last reduction there; None when none is in flight
    #              there (or on the CPU; one rank's reductions on backward's stream record none)
    _next: int  # the next bucket to reduce in this backward (they go from last to first)
    _in_backward: bool  # an end-of-backward callback is queued
    _round_task: int  # the autograd graph task the callback is queued on
    _nested: bool  # a hook ran in a backward nested in that task (reentrant checkpointing)
    _late: set[int]  # buckets a grad reached after their reduction in this backward
    _deferred: list[ShardedParam]  # grads whose later post-accumulate hooks are still to run
    _reduced_in_window: bool  # some reduction ran since the last step or zero_grad
    _unreduced_backward: bool  # a backward inside no_sync() left grads on the params since
    _warned_late_grads: bool
    _gatherer: ParamGatherer  # the last step's gathers, which read the grads' staging
    _clip: DeferredClip | None  # factors pending on the grads a reduction may add to
    _early: EarlyCopies | None  # hands each reduced bucket on to the host's early copies
    _accumulators: list[Any]  # the params' grad accumulators (autograd nodes) the hooks are on
    _outside: list[torch.Tensor]  # the model's params no bucket holds ([Note: params outside
    #                               the optimizer] in _outside.py)
    num_changes: int  # reductions, and clears seen after one, so far: the grads changed if it did
    _finished_at: int  # num_changes when finish() last set the shards' grads

    def __init__(
        self,
        buckets: Sequence[Bucket],
        group: dist.ProcessGroup | None,
        *,
        stage: int,
        device: torch.device,
        gatherer: ParamGatherer,
        clip: DeferredClip | None,
        early: EarlyCopies | None,
        outside: Sequence[torch.Tensor] = (),
    ) -> None:
        self.buckets = list(buckets)
        self._outside = list(outside)
        self.enabled = True
        self.outer_unsynced = False
        self._group = group
        self.ranks = () if group is None else tuple(dist.get_process_group_ranks(group))
        self._shared = False
        self._rank = 0 if group is None else dist.get_rank(group)
        self._world_size = 1 if group is None else dist.get_world_size(group)
        self._scatter = stage == 2
        self._device = device
        self._stream = side_stream(device)
        self._event = None
        self._next = len(self.buckets) - 1
        self._in_backward = False
        self._round_task = -1
        self._nested = False
        self._late = set()
        self._deferred = []
        self._reduced_in_window = False
        self._unreduced_backward = False
        self._warned_late_grads = False
        self._gatherer = gatherer
        self._clip = clip
        self._early = early
        self._accumulators = []
        self.num_changes = 0
        self._finished_at = -1

    def register_hooks(self) -> list[Any]:
        """On each param, a pre-hook on its grad accumulator that takes the placeholder ``.grad``
        off before autograd accumulates into it ([Note: released grads]), and a
        post-accumulate-grad hook; the hooks hold no reference to ``self``."""
        this = weakref.ref(self)
        handles: list[Any] = []
        for bucket in self.buckets:
            for sharded in bucket.params:
                watch = GradWatch(sharded.param, ReleasedGrad(sharded.param, sharded.fqn))
                sharded.watch = watch
                with torch.enable_grad():  # the accumulator is made on first use; keep it alive
                    accumulator = sharded.param.view_as(sharded.param).grad_fn.next_functions[0][0]
                self._accumulators.append(accumulator)

                mine: list[int] = []  # the hook's handle id, once registered

                def ready(
                    param: torch.Tensor, sharded: ShardedParam = sharded, mine: list[int] = mine
                ) -> None:
                    reducer = this()
                    hooks = param._post_accumulate_grad_hooks
                    if reducer is not None and reducer.enabled and next(reversed(hooks)) != mine[0]:
                        reducer.defer(sharded)  # hooks registered after wrap run after this one
                        return
                    if param.grad is None:  # a hook before this one took it (p.grad = None)
                        return
                    sharded.watch.after_accumulate()
                    if reducer is not None:
                        reducer.on_grad_ready(sharded)

                handles.append(accumulator.register_prehook(watch.before_accumulate))
                handles.append(sharded.param.register_post_accumulate_grad_hook(ready))
                mine.append(handles[-1].id)
        handles.append(PlaceholderRemoval([s.watch for b in self.buckets for s in b.params]))
        handles.append(_AccumulatorRelease(self._accumulators))
        if self._group is not None:
            _REDUCING.setdefault(self.ranks, []).append(this)
            handles.append(_Reducing(self.ranks, this))
        return handles

    def forget_aborted_backward(self) -> None:
        """A forward (outside any backward) while a backward's end never came: that backward
        raised midway. Its buckets left unreduced are forgotten (their grads stay on the params,
        as torch leaves them), so the next backward reduces every bucket afresh."""
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._in_backward = False
            self._nested = False
            self._late.clear()
            self._deferred.clear()
            self._next = len(self.buckets) - 1
            for bucket in self.buckets:
                bucket.ready.clear()
            _ORDERED_ENDS.discard((self.ranks, self._round_task))

    def in_backward_of(self, task: int) -> bool:
        """Whether this reducer's backward started in graph task ``task`` and has not ended."""
        return self._in_backward and self._round_task == task

    def defer(self, sharded: ShardedParam) -> None:
        """Hook, where post-accumulate-grad hooks registered after wrap follow zero-shard's on
        the param: they are to see the param's own grad, as those registered before wrap do (and
        as under DDP), so its grad is taken as complete at the next hook or at backward's end,
        once they have run."""
        if not self._in_backward:
            self._start_backward()
        elif torch._C._current_graph_task_id() != self._round_task:
            self._nested = True  # seen here, at the hook's own time: see on_grad_ready
        if self._deferred:  # another param's hook runs: the earlier ones' hooks are done
            self._take_deferred()
        self._deferred.append(sharded)

    def _take_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for sharded in deferred:
            if sharded.param.grad is None:  # a later hook took the grad (p.grad = None)
                continue
            sharded.watch.after_accumulate()
            self.on_grad_ready(sharded)

    def _start_backward(self) -> None:
        self._in_backward = True
        self._round_task = torch._C._current_graph_task_id()
        self._before_first_reduction()
        # [Note: reductions of several wrappers]
        self._shared = len(_reducing(self.ranks)) > 1
        if self._shared:
            _queue_ordered_end(self.ranks, self._round_task)
        else:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def on_grad_ready(self, sharded: ShardedParam) -> None:
        """Hook: the param's grad is complete for this backward; reduce what is ready."""
        if self._deferred:
            self._take_deferred()
        if not self.enabled:
            self._unreduced_backward = True
            return
        task = torch._C._current_graph_task_id()
        if not self._in_backward:
            self._start_backward()
        elif task != self._round_task:
            self._nested = True  # see [Note: grads after their reduction]
        if sharded.bucket > self._next:  # its bucket is reduced already
            self._late.add(sharded.bucket)
        self.buckets[sharded.bucket].ready.add(sharded.position)
        while self._next >= 0 and not self._shared:
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                break
            self._reduce(bucket)
            self._next -= 1

    def _before_first_reduction(self) -> None:
        """The reductions write the grad buffers that the last step's D2H copies read: the step
        must be complete first (the gathers waited for every CPU chunk), whatever the forward
        waited for (see [Note: deferred host step]); a delayed update's CPU step runs on, but
        its copies of the grads must be done (see [Note: delayed update])."""
        self._gatherer.finish()
        self._gatherer.wait_deferred_reads()

    @torch.compiler.disable  # see [Note: compiled models] in _compiled.py
    def _end_backward(self) -> None:
        """Autograd callback: reduce the buckets this backward left, in order."""
        try:
            self._take_deferred()
            self._reduce_rest()
            if self._group is not None and self._outside:
                average_outside_grads(self._outside, self._group, self._device)
        finally:
            self._in_backward = False

    def _reduce_rest(self) -> None:
        while self._next >= 0:
            self._reduce(self.buckets[self._next])
            self._next -= 1
        if self._nested:
            self._reduce_late()
        self._late.clear()
        self._next = len(self.buckets) - 1
        for bucket in self.buckets:
            bucket.ready.clear()

    def _reduce_late(self) -> None:
        """After a backward with nested backwards: the buckets where any rank holds grads that
        came after the bucket's reduction are reduced again, added to the reduced grads. See
        [Note: grads after their reduction]."""
        self._nested = False
        late = [index in self._late for index in range(len(self.buckets))]
        self._late.clear()
        if self._group is not None:
            agreed = torch.tensor(late, dtype=torch.uint8, device=self._device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group)
            late = [bool(flag) for flag in agreed.tolist()]
        for index in reversed(range(len(self.buckets))):
            if late[index]:
                self._reduce(self.buckets[index])

    def _take_grads(
        self, bucket: Bucket
    ) -> tuple[list[torch.Tensor | None], list[bool], list[bool]]:
        """Takes the bucket's grads off its params (the placeholders' watches): each local grad
        or ``None``, whether the grads held are kept and added to, and which were zeroed."""
        taken = [sharded.watch.take() for sharded in bucket.params]
        grads = [
            _local_grad(each, sharded)
            if each.zeroed or isinstance(each.grad, DTensor)
            else each.grad
            for each, sharded in zip(taken, bucket.params, strict=True)
        ]
        for sharded, grad in zip(bucket.params, grads, strict=True):
            if grad is not None and (grad.is_sparse or grad.device != self._device):
                raise TypeError(
                    f"the grad of {sharded.fqn} is {'sparse' if grad.is_sparse else 'on '}"
                    f"{'' if grad.is_sparse else grad.device}; zero-shard reduces dense grads on "
                    f"{self._device}"
                )
        has_grads = bucket.has_grads
        return grads, [has_grads and each.kept for each in taken], [e.zeroed for e in taken]

    def _stream_for(self, bucket: Bucket) -> Any:
        """Where the bucket is packed and reduced: the side stream, but at one rank (no
        collective to overlap) backward's own stream, so that no grad needs record_stream (each
        would leave the allocator an event to poll at reuse), unless the bucket's params average
        ``SIDE_PACK_NUMEL`` elements or more: their copy is then long enough to be worth running
        beside backward's compute, and an event per grad is small beside it."""
        if self._world_size > 1:
            return self._stream
        large = bucket.layout.segment_numel >= SIDE_PACK_NUMEL * len(bucket.params)
        return self._stream if large else None

    def _hold_buffer(self, bucket: Bucket, stream: Any) -> None:
        """A grad buffer for a bucket that holds none, made on the current stream, where the step
        reads it; the side stream's writes are recorded, so that its memory waits for them once
        the grads are dropped."""
        layout = bucket.layout
        buffer = torch.empty(layout.segment_numel, dtype=layout.dtype, device=self._device)
        if stream is not None:
            buffer.record_stream(stream)
        bucket.hold_grads(buffer)

    @torch.no_grad()
    @torch.compiler.disable  # see [Note: compiled models] in _compiled.py
    def _reduce(self, bucket: Bucket) -> None:
        if self._clip is not None:  # this reduction may add to the grads held
            self._clip.apply()
        grads, kept, zeroed = self._take_grads(bucket)
        layout, world = bucket.layout, self._world_size
        adds = any(kept)
        # The grads are complete on the stream current here (backward's); read it before
        # switching, or the side stream would wait on itself.
        compute = current_stream(self._device)
        stream = self._stream_for(bucket)
        before = _flags_before(bucket)
        if not bucket.has_grads:
            self._hold_buffer(bucket, stream)
        # One rank: the packed grads are the reduced ones, packed straight into the buffer
        # unless added to it (or its flags are still to be read).
        alone = world == 1
        into_buffer = alone and not adds and not any(zeroed)
        # A bucket whose shards lie back to back, every param with a grad, is packed by one
        # chunked copy that writes every element: no zero fill, no view per param on the host.
        chunked = chunk_packable(bucket.reduce_copies, grads, layout.dtype)
        with use_stream(stream):
            wait_stream(stream, compute)
            if into_buffer:
                packed = bucket.grad_buffer if chunked else bucket.grad_buffer.zero_()
            else:
                fill = torch.empty if chunked else torch.zeros
                packed = fill(world * layout.segment_numel, dtype=layout.dtype, device=self._device)
            with phase("zero_shard::pack"):
                if chunked:
                    chunk_pack_grads(packed, cast("list[torch.Tensor]", grads), world)
                elif into_buffer:
                    _pack_into_slots(bucket, grads)
                else:
                    pack_grads(packed, layout, bucket.reduce_copies, grads, world)
                if any(zeroed):
                    _flag_zeroed_as_before(packed, bucket, zeroed, before, world)
            for sharded, grad in zip(bucket.params, grads, strict=True):
                if grad is not None and stream is not None:
                    grad.record_stream(stream)
                # Every param's, with a local grad or not: the slot holds the grad of all ranks.
                sharded.watch.release()
            if adds and not all(kept):
                _clear_slots(bucket, [not keep for keep in kept])
            if not alone:
                self._reduce_over_ranks(bucket, packed, adds)
            elif adds:
                bucket.grad_buffer.add_(packed)
            elif not into_buffer:
                bucket.grad_buffer.copy_(packed)
            if stream is not None:  # (the side stream runs in order: its last event covers all)
                self._event = record_event(stream)
            if self._early is not None:
                self._early.grads_reduced(bucket)
        # A rewritten bucket forgets what was missing before: its flags are this reduction's.
        missing_now = any([grad is None for grad in grads]) or any(zeroed)
        bucket.missing = (bucket.missing and adds) or missing_now
        self.num_changes += 1
        self._reduced_in_window = True
        self._unreduced_backward = False

    def _reduce_over_ranks(self, bucket: Bucket, packed: torch.Tensor, adds: bool) -> None:
        """On the side stream: reduces ``packed`` over the ranks into the bucket's grad buffer,
        written, or added to it."""
        layout, world = bucket.layout, self._world_size
        scaling = choose_reduce_scaling(world, self._device, layout.dtype)
        direct = self._scatter and not adds
        out = None
        if self._scatter:
            out = bucket.grad_buffer if direct else torch.empty_like(bucket.grad_buffer)
        # 0-dim params: every rank steps them, with the same reduced bits ([Note: 0-dim params]).
        whole = None
        if self._scatter and layout.replicated_offsets:
            whole = replicated_grads(packed, layout, world)
        with phase("zero_shard::reduce_scatter" if self._scatter else "zero_shard::all_reduce"):
            works = [launch_reduction(packed, out, self._group, scaling)]
            if whole is not None:
                works.append(launch_reduction(whole, None, self._group, scaling))
            for work in works:
                work.wait()
        if not self._scatter and layout.replicated_offsets:  # all-reduced: alike on every rank
            whole = replicated_grads(packed, layout, world)
        result = out if self._scatter else packed.view(world, -1)[self._rank]
        if scaling.post_divide is not None:
            result.div_(scaling.post_divide)
            if whole is not None:
                whole.div_(scaling.post_divide)
        if whole is not None:
            write_replicated(result, layout, whole)
        if adds:
            bucket.grad_buffer.add_(result)
        elif not direct:
            bucket.grad_buffer.copy_(result)

    @torch.no_grad()
    def finish(self, *, reduce: bool = True) -> None:
        """Makes every shard's ``.grad`` its reduced grad (or ``None``), visible on the current
        stream. With ``reduce``, grads no backward hook reduced (no backward since the last step
        or ``zero_grad``: grads set by hand, or kept; or a last backward inside ``no_sync()``)
        are reduced now, every bucket: collective. Without, it communicates nothing."""
        if reduce and (not self._reduced_in_window or self._unreduced_backward):
            if self._world_size > 1:  # (every rank reduces here, or none does)
                self._refuse_unreduced_edits()
            self._before_first_reduction()  # as before a backward's first reduction
            self._reduce_rest()
        untouched = [_untouched(bucket) for bucket in self.buckets]
        self._warn_late_grads(untouched)
        self._wait_reductions()
        # No reduction or clear since the last pass: an untouched bucket's shards hold their
        # grads as it left them (the clip's finalize and the step's find the same).
        settled = self._finished_at == self.num_changes
        for bucket, as_reduced in zip(self.buckets, untouched, strict=True):
            if settled and as_reduced:
                continue
            if not bucket.has_grads:  # none reduced since the grads were cleared
                for sharded in bucket.params:
                    sharded.shard.grad = None
                continue
            dropped = [False] * bucket.layout.num_params
            if not as_reduced:
                dropped, changed = _clear_after_reduction(bucket)
                self.num_changes += changed
            present = [True] * bucket.layout.num_params
            if bucket.missing:
                # Some rank may have lacked a grad: a param is stepped iff any rank had one. Ranks
                # that had every grad skip this read; their answer is "all", the same as here.
                flags = bucket.grad_buffer[bucket.layout.shard_numel :].cpu()
                present = (flags > 0).tolist()
            for sharded, has_grad, drop in zip(bucket.params, present, dropped, strict=True):
                stepped = has_grad and not drop
                sharded.shard.grad = sharded.grad_slot if stepped else None
                if not has_grad:
                    sharded.watch.drop()  # no rank had one: None, as torch's .grad
        self._finished_at = self.num_changes

    def _refuse_unreduced_edits(self) -> None:
        """Raises on every rank where a rank's grads, left unreduced by a last backward inside
        ``no_sync()``, were written in place before the step reduces them: a write that differs
        by rank (torch's ``clip_grad_norm_`` or ``clip_grad_value_``, each rank clipping its own
        grads by its own factor) would be averaged, where torch's clip on a whole batch's grads
        scales them alike. Collective: every rank that reduces at the step calls it (grads set by
        hand, kept, or left by ``no_sync()``, on any rank), a rare path."""
        edited = [
            s.fqn for b in self.buckets for s in b.params if s.watch.written_since_accumulated()
        ]
        anywhere = bool(edited)
        if self._group is not None:
            flag = torch.tensor([anywhere], dtype=torch.uint8, device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            anywhere = bool(flag.item())
        if anywhere:
            shown = "another rank's params"
            if edited:
                shown = f"params {edited[:3]}{' ...' if len(edited) > 3 else ''}"
            raise RuntimeError(
                f"the grads of {shown} were written in place (torch's clip_grad_norm_, "
                "clip_grad_value_, or an edit) after a backward inside no_sync(), with no "
                "backward outside it: zero-shard reduces such grads at the step, after the "
                "write, and a write that differs by rank, as a clip of each rank's own grads "
                "does, would not give torch's result on the whole batch (a scale by one number "
                "on every rank would, but cannot be told from it: scale the loss instead). Run "
                "the last micro-batch's backward outside no_sync() (as DDP requires), so that "
                "the grads are reduced before the clip, or clip with opt.clip_grad_norm_("
                "max_norm). Nothing was stepped"
            )

    def _warn_late_grads(self, untouched: list[bool]) -> None:
        if self._warned_late_grads:
            return
        late = [
            s.fqn
            for b, as_reduced in zip(self.buckets, untouched, strict=True)
            if not as_reduced
            for s in b.params
            if s.watch.holds_unreduced_grad()
        ]
        if late:
            self._warned_late_grads = True
            warnings.warn(
                f"params {late[:3]}{' ...' if len(late) > 3 else ''} got a .grad after backward "
                "had reduced the grads; this step uses the reduced grads, not these (the next "
                "backward adds to them), and does not step a param that had none in that "
                "backward. Change grads through the optimizer (clip_grad_norm_).",
                RuntimeWarning,
                stacklevel=4,
            )

    def _wait_reductions(self) -> None:
        """Makes the current stream wait for the reductions in flight."""
        if self._event is not None:
            current_stream(self._device).wait_event(self._event)
            self._event = None

    def _drop_grads(self, bucket: Bucket) -> None:
        bucket.drop_grads()  # on the current stream, which waited for the reductions
        bucket.missing = False
        forget_all([sharded.watch for sharded in bucket.params])

    def reset(self) -> None:
        """``zero_grad``: the reduced grads are dropped (their memory freed); the next reduction
        writes a new grad buffer. See [Note: reduced grads held].

        Also forgets a backward that raised before its end-of-backward callback ran (its
        buckets half reduced), so the next backward starts clean.
        """
        self._wait_reductions()
        for bucket in self.buckets:
            self._drop_grads(bucket)  # the shards' .grad too
            bucket.ready.clear()
        self._next = len(self.buckets) - 1
        self._in_backward = False
        self._nested = False
        self._late.clear()
        self._reduced_in_window = False
        self._unreduced_backward = False

    def drop_cleared(self) -> None:
        """Before a forward (outside backward): a bucket whose every param's ``.grad`` was set to
        ``None`` since its reduction (``model.zero_grad()``) drops its reduced grads, as torch
        frees them, so that they do not stand beside the activations. See [Note: reduced grads
        held]."""
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside backward (activation checkpointing)
        for bucket in self.buckets:
            if bucket.has_grads and all(s.param.grad is None for s in bucket.params):
                self._wait_reductions()
                self._drop_grads(bucket)

    def end_window(self) -> None:
        """A step took the reduced grads: the next ``finish`` reduces again unless a backward
        does first."""
        self._reduced_in_window = False

    @property
    def reduced_in_window(self) -> bool:
        """Whether a reduction ran since the last step or ``zero_grad``."""
        return self._reduced_in_window


class _AccumulatorRelease:
    """A handle whose removal lets the grad accumulators go with the hooks: autograd reuses a
    param's live accumulator, which keeps the param's shape of when it was made, so a param
    given new data of another shape (HF's ``resize_token_embeddings`` sets ``weight.data``) and
    taken over by a new wrapper would get the old one's."""

    def __init__(self, accumulators: list[Any]) -> None:
        self._accumulators = accumulators

    def remove(self) -> None:
        self._accumulators.clear()


class _Reducing:
    """A handle whose removal (the wrapper retired or dropped) takes the reducer out of those
    over its ranks ([Note: reductions of several wrappers])."""

    def __init__(self, ranks: tuple[int, ...], reducer: weakref.ref[GradReducer]) -> None:
        self._ranks, self._reducer = ranks, reducer

    def remove(self) -> None:
        held = _REDUCING.get(self._ranks, [])
        if self._reducer in held:
            held.remove(self._reducer)


def _untouched(bucket: Bucket) -> bool:
    """Whether every param of the bucket holds its placeholder as the last reduction left it
    (not cleared, not zeroed, no grad set since): then no watch has anything to report
    (``cleared_after_reduction`` is None, ``holds_unreduced_grad`` False), and the step skips
    asking each, param by param."""
    return all(
        [
            s.param.grad is s.watch.placeholder
            and s.watch.expected is s.watch.placeholder
            and not s.watch.placeholder.zeroed
            for s in bucket.params
        ]
    )


def _local_grad(taken: Taken, sharded: ShardedParam) -> torch.Tensor | None:
    """The grad of the param's local tensor: a tensor-parallel param's grad is a DTensor, laid
    out as the param, or partial over ``tp`` (a replicated param that met sequence-split
    activations), which is summed over ``tp`` here, as torch's optimizer would on stepping it."""
    grad = taken.grad
    if taken.zeroed:
        return grad.new_zeros(()).expand(sharded.local.shape)  # zeros without memory
    if not isinstance(grad, DTensor):
        return grad
    param = sharded.param
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def _pack_into_slots(bucket: Bucket, grads: Sequence[torch.Tensor | None]) -> None:
    """One rank: each grad into its slot of the zeroed grad buffer, which has the grad's shape
    (the shard is the whole param), and its flag set, as ``pack_grads`` packs them but with no
    cut of the buffer or of the grads."""
    slots = [s.grad_slot for s, grad in zip(bucket.params, grads, strict=True) if grad is not None]
    present = [grad for grad in grads if grad is not None]
    if present:
        torch._foreach_copy_(slots, present)
    flags = bucket.grad_buffer[bucket.layout.shard_numel :]
    if len(present) == len(grads):
        flags.fill_(1)
    else:
        for position, grad in enumerate(grads):
            if grad is not None:
                flags[position].fill_(1)


def _clear_slots(bucket: Bucket, cleared: list[bool]) -> None:
    """Zeroes the reduced grads and presence flags of the params whose ``.grad`` was cleared."""
    flags = bucket.grad_buffer[bucket.layout.shard_numel :]
    for position, (sharded, clear) in enumerate(zip(bucket.params, cleared, strict=True)):
        if clear:
            sharded.grad_slot.zero_()
            flags[position].zero_()
            torch.autograd.graph.increment_version(sharded.grad_slot)  # (as above)


def _flags_before(bucket: Bucket) -> torch.Tensor | FlagsBefore:
    """The presence flags of the bucket's last reduction: in the grad buffer, or as kept when it
    was dropped."""
    if bucket.has_grads:
        return bucket.grad_buffer[bucket.layout.shard_numel :]
    return bucket.flags_before


def _flag_zeroed_as_before(
    packed: torch.Tensor,
    bucket: Bucket,
    zeroed: list[bool],
    before: torch.Tensor | FlagsBefore,
    world_size: int,
) -> None:
    """A zeroed placeholder is a zero grad where the param had a grad (its flag ``before``, after
    the last reduction), and no grad where no rank had one: torch's zero_grad zeroes a grad, and
    leaves a None one None."""
    layout = bucket.layout
    flags = packed.view(world_size, layout.segment_numel)[:, layout.shard_numel :]
    for position, is_zeroed in enumerate(zeroed):
        if not is_zeroed:
            continue
        if isinstance(before, torch.Tensor):
            flags[:, position] = (before[position] > 0).to(flags.dtype)
        else:
            flags[:, position] = 1 if before is FlagsBefore.ALL_PRESENT else 0


def _clear_after_reduction(bucket: Bucket) -> tuple[list[bool], bool]:
    """Params whose ``.grad`` was cleared after their reduction, before the step: set to ``None``,
    they are not stepped (returned True), as in torch; zeroed in place, they step zeros. Also
    returns whether any was cleared."""
    dropped = [False] * bucket.layout.num_params
    changed = False
    for position, sharded in enumerate(bucket.params):
        cleared = sharded.watch.cleared_after_reduction()
        if cleared is None:
            continue
        changed = True
        if cleared:
            sharded.watch.forget()
            sharded.watch.renew_if_held()  # its grad is cleared from the slot below
            dropped[position] = True
        else:
            sharded.grad_slot.zero_()
            # (Inside a placeholder's dispatch this zero moves no version counter: the early
            # host copy of the grads before it would be taken to serve. A view shares its base's
            # counter: the bucket's other early copies are made again too.)
            torch.autograd.graph.increment_version(sharded.grad_slot)
            sharded.watch.release()  # zeros from now on, as the param's .grad in torch
    if any(dropped):
        _clear_slots(bucket, dropped)
        bucket.missing = True  # their flags are 0 now: read them at every finish until reset
    return dropped, changed
