"""What every benchmark shares: one clock, the machine's description, memory, results files.

The scripts run as ``python benchmarks/<script>.py`` (or under torchrun), which puts this folder
first on the import path: they import it as ``from _common import Clock``.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Clock",
    "describe_run",
    "device_name",
    "free_memory",
    "init_distributed",
    "median_ms",
    "package_version",
    "peak_memory",
    "reset_peak_memory",
    "split_at_dashes",
    "today",
    "write_json",
]


class Clock:
    """Timestamps in stream order: timing events on an accelerator, ``time.perf_counter`` on the
    CPU. Read two marks with :meth:`ms` after :meth:`synchronize`.

    Example:
        >>> clock = Clock(torch.device("cpu"))
        >>> start = clock.mark(); work(); end = clock.mark(); clock.synchronize()
        >>> clock.ms(start, end)
    """

    device: torch.device
    _events: bool  # device events (an accelerator) or host seconds (the CPU)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events = device.type != "cpu"

    def mark(self) -> Any:
        """A float of host seconds, or an event recorded on the device's current stream."""
        if not self._events:
            return time.perf_counter()
        module = torch.get_device_module(self.device)
        event = module.Event(enable_timing=True)
        event.record(module.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        """Waits until every mark so far has been reached (a no-op on the CPU)."""
        if self._events:
            torch.get_device_module(self.device).synchronize(self.device)

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``; call after :meth:`synchronize`."""
        return start.elapsed_time(end) if self._events else (end - start) * 1e3


def median_ms(function: Callable[[], Any], repeat: int) -> float:
    """Median host milliseconds of ``function`` over ``repeat`` calls, after one untimed call
    (CPU work: the host clock is the work's clock)."""
    clock = Clock(torch.device("cpu"))
    function()
    samples = []
    for _ in range(repeat):
        start = clock.mark()
        function()
        samples.append(clock.ms(start, clock.mark()))
    return statistics.median(samples)


def device_name(device: torch.device) -> str:
    """The CUDA device's name (``NVIDIA H100 80GB HBM3``), or ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None`` where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def today() -> str:
    return time.strftime("%Y-%m-%d")


def describe_run(device: torch.device) -> dict[str, Any]:
    """The ``date``, ``device`` (its name) and ``torch`` keys that open a results.json."""
    return {"date": today(), "device": device_name(device), "torch": torch.__version__}


def init_distributed(device_type: str) -> torch.device:
    """Joins torchrun's process group, or makes one of this process alone; returns the device.

    ``"cuda"``: NCCL (NVLink multicast off unless ``NCCL_NVLS_ENABLE`` is set: the GPU machines
    do not support it) on the GPU of ``LOCAL_RANK``; ``"cpu"``: gloo.
    """
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0")
        os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return torch.device(device_type)


def free_memory(device: torch.device) -> None:
    """Returns the memory of dropped objects: collected, and the caching allocators emptied."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # Pinned blocks freed by the last system stay in torch's caching host allocator (and in
        # RSS) until emptied; the private hook exists in CUDA builds of torch >= 2.5.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def reset_peak_memory(device: torch.device) -> int:
    """Starts a peak measurement of CUDA memory; returns the bytes allocated now (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory(device: torch.device) -> int:
    """The most CUDA memory allocated since :func:`reset_peak_memory` (0 off CUDA)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def write_json(path: Path, payload: Any) -> None:
    """Writes ``payload`` as indented JSON, making the folder first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split at its first lone ``--``: the script's own flags, and those after it (for
    the example the script runs)."""
    split = argv.index("--") if "--" in argv else len(argv)
    return argv[:split], argv[split + 1 :]
