"""Host-memory guard: refuse an allocation that the host cannot hold, before making it."""

from __future__ import annotations

import os

import psutil

__all__ = ["available_after", "check_host_memory", "format_bytes", "local_world_size"]

# Kept free for the rest of the process (the model on CPU, the data loader, the page cache).
_MARGIN_FRACTION = 0.05
_MARGIN_MAX_BYTES = 2 << 30
_SKIP_ENV = "ZERO_SHARD_SKIP_HOST_MEMORY_CHECK"


def format_bytes(num_bytes: int | float) -> str:
    """Renders a byte count with a binary unit: ``format_bytes(3 << 30) == "3.00 GiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def local_world_size() -> int:
    """Ranks on this host, from torchrun's ``LOCAL_WORLD_SIZE`` (1 outside torchrun)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError as err:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {raw!r}") from err
    return max(value, 1)


def check_host_memory(num_bytes: int, *, what: str, setting: str) -> None:
    """Raises ``ValueError`` unless ``num_bytes`` per rank fit in this host's available memory.

    Every rank on the host allocates about the same, so the need is ``num_bytes`` times
    ``LOCAL_WORLD_SIZE``; a margin (5% of total memory, at most 2 GiB) stays free. Call it before
    allocating anything. ``ZERO_SHARD_SKIP_HOST_MEMORY_CHECK=1`` turns the check off, for hosts
    whose reported memory grows as it is used (some virtual machines).

    Args:
        num_bytes: bytes this rank is about to allocate on the host.
        what: what the bytes are for, for the message ("optimizer state offloaded to the CPU").
        setting: the option that lowers the need, for the message ("offload_fraction").
    """
    if num_bytes <= 0 or os.environ.get(_SKIP_ENV, "0") not in ("", "0"):
        return
    memory = psutil.virtual_memory()
    ranks = local_world_size()
    needed = num_bytes * ranks
    margin = min(int(memory.total * _MARGIN_FRACTION), _MARGIN_MAX_BYTES)
    usable = memory.available - margin
    if needed > usable:
        raise ValueError(
            f"zero-shard needs {format_bytes(needed)} of host memory for {what} "
            f"({format_bytes(num_bytes)} per rank x {ranks} local rank(s)), but only "
            f"{format_bytes(memory.available)} is available and {format_bytes(margin)} is kept "
            f"free. Lower {setting}, or run fewer ranks per host; set {_SKIP_ENV}=1 only if "
            f"this host reports less memory than it has."
        )


def available_after(num_bytes: int) -> tuple[int, int] | None:
    """The host's available memory once every local rank allocated ``num_bytes`` more, and its
    total memory, in bytes: ``(available_after, total)``. ``None`` where the host's report is
    not to be trusted (``ZERO_SHARD_SKIP_HOST_MEMORY_CHECK=1``: the report may be low). For
    choices that trade host memory for speed, beyond what :func:`check_host_memory` refuses."""
    if os.environ.get(_SKIP_ENV, "0") not in ("", "0"):
        return None
    memory = psutil.virtual_memory()
    return memory.available - max(num_bytes, 0) * local_world_size(), memory.total
