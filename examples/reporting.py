"""What the training examples show while they run and write at the end: a progress bar, a
per-phase step timer, memory figures, the JSON log and the plot."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil
import torch

PHASES = ("forward", "backward", "step")


class ProgressBar:
    """A one-line progress bar, redrawn at most ten times a second.

    When the stream is not a terminal (a log file), it writes a plain line every tenth of the run
    instead of redrawing.
    """

    def __init__(
        self, total: int, *, first: int = 1, stream: TextIO = sys.stderr, width: int = 24
    ) -> None:
        self.total = total
        self.first = first
        self.stream = stream
        self.width = width
        self._interactive = stream.isatty()
        self._last_draw = 0.0

    def update(self, step: int, text: str) -> None:
        if not self._due(step):
            return
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{step:>{len(str(self.total))}}/{self.total} [{bar}] {text}"
        self.stream.write(f"\r{line}\033[K" if self._interactive else f"{line}\n")
        self.stream.flush()

    def write(self, text: str) -> None:
        """Writes a line of its own under the bar."""
        self.stream.write(f"\r{text}\033[K\n" if self._interactive else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._interactive:
            self.stream.write("\n")
        self.stream.flush()

    def _due(self, step: int) -> bool:
        if step in (self.first, self.total):
            return True
        if not self._interactive:
            return step % max(self.total // 10, 1) == 0
        now = time.perf_counter()
        if now - self._last_draw < 0.1:
            return False
        self._last_draw = now
        return True


class PhaseTimer:
    """Times forward, backward and optimizer step within one training step.

    On an accelerator the phases are timed by events on the compute stream: what the device spent
    on each (waits for other streams included, such as a forward waiting for a parameter
    all-gather). On the CPU, where everything is synchronous, by the host's clock. Whatever the
    step's wall time holds beyond the phases (data, logging, the host waiting for the device, the
    device idle while the host catches up) is reported as ``other``.
    """

    def __init__(self, device: torch.device) -> None:
        self._module = torch.get_device_module(device) if device.type != "cpu" else None
        self._marks: list[tuple[str, Any, Any]] = []  # (phase, start, end)
        self._open: tuple[str, Any] | None = None
        self._wall_start = 0.0

    def start_step(self) -> None:
        self._marks.clear()
        self._wall_start = time.perf_counter()

    def begin(self, phase: str) -> None:
        self._open = (phase, self._now())

    def end(self) -> None:
        if self._open is None:
            raise RuntimeError("PhaseTimer.end() without begin()")
        phase, start = self._open
        self._marks.append((phase, start, self._now()))
        self._open = None

    def finish_step(self) -> dict[str, float]:
        """Seconds per phase and ``other``, and the step's ``wall`` time; waits for the device."""
        if self._module is not None:
            self._module.synchronize()
        wall = time.perf_counter() - self._wall_start
        split = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in self._marks:
            if self._module is None:
                split[phase] += end - start
            else:
                split[phase] += start.elapsed_time(end) / 1e3
        split["other"] = max(wall - sum(split.values()), 0.0)
        split["wall"] = wall
        return split

    def _now(self) -> Any:
        if self._module is None:
            return time.perf_counter()
        event = self._module.Event(enable_timing=True)
        event.record()
        return event


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated so far, or this process's resident host memory on
    the CPU."""
    if device.type == "cpu":
        return psutil.Process().memory_info().rss
    return torch.get_device_module(device).max_memory_allocated(device)


@dataclass
class Log:
    """Everything a run records, written as JSON and drawn as a plot at the end."""

    config: dict[str, Any]
    steps: list[dict[str, float]] = field(default_factory=list)  # one record per step
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    summary: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "summary": self.summary,
            "val_losses": {str(step): loss for step, loss in self.val_losses.items()},
            "steps": self.steps,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))


def import_pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only; raises ImportError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            f"no plot: matplotlib does not import ({err}); pip install matplotlib"
        ) from err
    return plt


def plot(log: Log, path: Path, title: str) -> str | None:
    """Draws the loss curves and the per-step time split into ``path`` (PNG). Returns why not,
    if it could not (matplotlib missing)."""
    try:
        plt = import_pyplot()
    except ImportError as err:
        return str(err)
    steps = [record["step"] for record in log.steps]
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax_loss.plot(steps, [record["loss"] for record in log.steps], lw=1, label="train")
    if log.val_losses:
        val_steps = sorted(log.val_losses)
        ax_loss.plot(val_steps, [log.val_losses[s] for s in val_steps], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats per byte)", title="loss")
    ax_loss.legend()
    bottom = [0.0] * len(steps)
    for phase in (*PHASES, "other"):
        height = [record[f"{phase}_ms"] for record in log.steps]
        ax_time.bar(steps, height, bottom=bottom, width=1.0, label=phase)
        bottom = [b + h for b, h in zip(bottom, height, strict=True)]
    ax_time.set(xlabel="step", ylabel="ms", title="step time split")
    ax_time.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
