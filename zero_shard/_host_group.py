"""A process group whose collectives run on the host, for agreements the host reads at once.

Some checks must be agreed by every rank before a step changes anything (a param written on one
rank: ``StaleCheck`` in ``_stale.py``): the host reads the verdict at once. Reduced on the
accelerator, that read would wait for every kernel queued before it (the whole backward), and the
step's launch would no longer overlap backward's tail. Reduced over gloo on the host it waits for
the other ranks alone. The group is the default group where that has a CPU backend (gloo runs, or
``init_process_group("cpu:gloo,cuda:nccl")``), else a gloo group of every rank, made once per
process by the first ``wrap`` (every rank wraps: ``new_group`` is collective).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["default_timeout", "host_group"]

_made: list[dist.ProcessGroup] = []  # the gloo group made, while the groups it was made in live


def _has_cpu_backend(group: dist.ProcessGroup) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return False
    return True


def default_timeout() -> datetime.timedelta:
    """The default process group's timeout (``init_process_group(timeout=...)``)."""
    default = distributed_c10d._get_default_group()
    for device in default._device_types:
        timeout = getattr(getattr(default._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.default_pg_timeout


def host_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """A host-side group over the ranks of ``mesh`` (all its dims), or ``None`` where those are
    not every rank (a model over a subgroup: the caller reduces on the accelerator instead).
    Every rank calls it, in the same order."""
    world = dist.get_world_size()
    if sorted(mesh.mesh.flatten().tolist()) != list(range(world)):
        return None
    default = dist.group.WORLD
    if default is not None and _has_cpu_backend(default):
        return default
    alive = distributed_c10d._world.pg_map
    if not _made or _made[0] not in alive:  # none yet, or destroyed with the default group
        _made[:] = [dist.new_group(backend="gloo", timeout=default_timeout())]
    return _made[0]
