"""Params written outside the optimizer since it last set them (a weight load after wrap, a
``copy_``, ``torch.nn.init``: their version counters moved): their main weights are stale, and
are reloaded from them (``stale_params="reload"``) or the step raises (``"error"``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from optimizers import HybridDeviceOptimizer

from ._buckets import ShardedParam, stale_flags
from ._host_group import host_group
from ._verdict import start_any_rank_each

if TYPE_CHECKING:
    from ._kind import Kind
    from ._setup import StaleParams

__all__ = ["ReplicaWrites", "StaleCheck"]

logger = logging.getLogger("zero_shard")


class ReplicaWrites:
    """Replicas (a plain or DDP model at more than one rank) agree at each step on which params
    were written: a write on one rank may reach the others unseen, through a collective."""

    unshared: set[str]  # FQNs of params reloaded from writes seen outside a step, not yet told
    #                     to the other ranks
    _group: dist.ProcessGroup | None  # every rank's, on the host; None: reduce on the device
    _mesh: DeviceMesh  # the ranks that agree
    _device: torch.device  # where they reduce without the host group

    def __init__(self, mesh: DeviceMesh, device: torch.device) -> None:
        self.unshared = set()
        self._group = host_group(mesh)
        self._mesh = mesh
        self._device = device

    def start(self, records: Sequence[ShardedParam]) -> Callable[[], list[bool]]:
        """Starts the all-reduce of each param's written flag, as this rank saw it; the returned
        call waits for it."""
        here = stale_flags(records)
        if self.unshared:
            unshared = self.unshared
            here = [w or s.fqn in unshared for s, w in zip(records, here, strict=True)]
        return start_any_rank_each(here, group=self._group, mesh=self._mesh, device=self._device)


class StaleCheck:
    """Finds the params written since zero-shard last set them, and reloads or refuses them."""

    _records: list[ShardedParam]  # every sharded param, in the hybrid's order
    _kind: Kind
    _hybrid: HybridDeviceOptimizer
    _device: torch.device  # where the ranks reduce their agreements
    _logged: bool  # a reload was logged (once)

    def __init__(
        self,
        kind: Kind,
        hybrid: HybridDeviceOptimizer,
        *,
        device: torch.device,
    ) -> None:
        self._records = list(kind.sharded)
        self._kind = kind
        self._hybrid = hybrid
        self._device = device
        self._logged = False

    def start(self) -> Callable[[], list[bool]] | None:
        """At ``step()``, where the ranks hold replicas: starts their agreement on the writes (see
        :meth:`check`); the returned call waits for it."""
        writes = self._kind.writes
        return None if writes is None else writes.start(self._records)

    def all_reloaded(self) -> None:
        """Every rank reloaded every main weight: no write is left to tell the others."""
        if self._kind.writes is not None:
            self._kind.writes.unshared.clear()

    @torch.no_grad()
    def check(
        self,
        policy: StaleParams,
        *,
        agree: bool = False,
        written: Callable[[], list[bool]] | None = None,
    ) -> None:
        """Reloads the main weights of the params written since zero-shard last did
        (``policy="reload"``), or raises (``"error"``).

        With ``agree`` (at ``step()``, which every rank calls) the ranks agree. Replicas
        (``written``, from :meth:`start`): a param written on any rank is reloaded on every rank
        from its own copy; writes seen outside a step (``state_dict()``) are shared at the next.
        Otherwise the kind says (``Kind.raise_if_written_elsewhere``)."""
        writes = self._kind.writes
        if written is not None:
            here = written()
            writes.unshared.clear()  # told to every rank now
        else:
            here = stale_flags(self._records)
        raises = policy == "error"
        if raises and agree:
            self._kind.raise_if_written_elsewhere(here, self._device)
        stale = [sharded for sharded, flag in zip(self._records, here, strict=True) if flag]
        if written is None and writes is not None and not raises:  # told at the next step
            writes.unshared.update(sharded.fqn for sharded in stale)
        if stale:
            self._reload(stale, raises=raises)

    def _reload(self, stale: list[ShardedParam], *, raises: bool) -> None:
        names = [sharded.fqn for sharded in stale]
        shown = f"{names[:5]}{' ...' if len(names) > 5 else ''}"
        if raises:
            raise RuntimeError(
                f"model params {shown} ({len(names)} in all) were written since the optimizer "
                "last set them (a weight load?); its fp32 main weights are older. Call "
                "opt.reload_model_params() after loading weights, or wrap with "
                "stale_params='reload'"
            )
        if not self._logged:
            self._logged = True
            logger.warning(
                "zero-shard: model params %s (%d in all) were written outside the optimizer; "
                "their fp32 main weights were reloaded from them, but for each element that holds "
                "exactly its main weight's rounding (stale_params='error' raises instead)",
                shown,
                len(names),
            )
        # A delayed update in flight writes the shards when its step completes: first, so that
        # the values loaded win. At one rank the shards are the params: keep the loaded values
        # aside, or the completion would overwrite them.
        if self._hybrid.step_in_flight:
            loaded = [(s.param, s.param.detach().clone()) for s in stale if s.aliased]
            self._hybrid.finish_step()
            for param, values in loaded:
                param.detach().copy_(values)
        self._kind.refresh_shards(stale)
        self._hybrid.reload_model_params([sharded.shard for sharded in stale])
        for sharded in stale:
            sharded.record_version()
