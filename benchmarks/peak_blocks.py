"""What is alive on the GPU at a training run's peak: ``examples/train_gpt.py`` with CUDA memory
history on, replayed.

Runs the example in this process (under ``torchrun`` for one rank, as the example runs) with
torch's allocator history recording every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``). The example resets the peak statistics once its
fp32 init is done; a marker allocation of ``MARK_BYTES`` notes that point in the history. After
the run the history is replayed from the mark: the peak is the most bytes allocated at once, and
the blocks alive at it are grouped by where they were allocated (the first frame in this
repository, else the first outside torch) and by size. Run it for two optimizers and compare the
groups: what one holds that the other does not stands out (docs/benchmarks/peak_blocks.md).

Sizes are the requested ones; the allocator rounds each block up to 512 bytes, so the replayed
peak sits a little below ``max_memory_allocated``, which the report gives beside it. Results go
to ``--out``/peak_blocks.json and are printed; flags after ``--`` go to the example::

    torchrun --standalone --nproc-per-node 1 benchmarks/peak_blocks.py --out runs/pb -- \\
        --device cuda --preset 1b --offload-fraction 1 --steps 6 --eval-every 0
    ... --out runs/pb_hdo -- --device cuda --preset 1b --offload-fraction 1 --steps 6 \\
        --eval-every 0 --optimizer megatron-hdo
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import split_at_dashes, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # zero_shard and the example

MARK_BYTES = 12345 * 512  # a size nothing else in the example allocates
SMALL_BYTES = 1 << 20  # blocks below this are grouped by their exact size; larger ones together
MAX_ENTRIES = 5_000_000  # history entries kept: a 1B GPT step makes about 5,000


def record_example(argv: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Runs the example with ``argv`` under memory history; its device trace and the peak the
    allocator reports."""
    import train_gpt  # the examples' folder is on the path (above)

    reset = torch.cuda.reset_peak_memory_stats

    def marked_reset(*args: Any, **kwargs: Any) -> None:
        torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")  # freed at once: the mark
        reset(*args, **kwargs)

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    torch.cuda.reset_peak_memory_stats = marked_reset
    try:
        train_gpt.main(argv)
    finally:
        torch.cuda.reset_peak_memory_stats = reset
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.memory._record_memory_history(enabled=None)
    return trace, peak


def replay_peak(trace: Sequence[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The most bytes allocated at once after the last marker allocation of ``trace`` (from its
    start if none), and the allocations alive then. Every allocation must be in the trace: start
    recording before the run allocates."""
    marks = [i for i, entry in enumerate(trace) if _is_mark(entry)]
    start = marks[-1] if marks else -1
    alive: dict[int, dict[str, Any]] = {}
    total, peak, at_peak = 0, -1, []
    for index, entry in enumerate(trace):
        if entry["action"] == "alloc":
            alive[entry["addr"]] = entry
            total += entry["size"]
            if index > start and total > peak:
                peak, at_peak = total, list(alive.values())
        elif entry["action"] == "free_completed" and entry["addr"] in alive:
            total -= alive.pop(entry["addr"])["size"]
    return peak, at_peak


def _is_mark(entry: dict[str, Any]) -> bool:
    return entry["action"] == "alloc" and entry["size"] == MARK_BYTES


def allocated_where(frames: Sequence[dict[str, Any]]) -> str:
    """``folder/file.py:line function`` of the first frame in this repository, else of the first
    outside torch."""
    in_repo = [f for f in frames if f["filename"].startswith(str(ROOT))]
    outside = [f for f in frames if "/torch/" not in f["filename"]]
    chosen = (in_repo or outside or list(frames) or [None])[0]
    if chosen is None:
        return "?"
    path = Path(chosen["filename"])
    return f"{path.parent.name}/{path.name}:{chosen['line']} {chosen['name']}"


def group_blocks(blocks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Blocks grouped by where they were allocated and their size (blocks of ``SMALL_BYTES`` or
    more as one size, ``None``), largest total first."""
    groups: dict[tuple[str, int | None], list[int]] = defaultdict(list)
    for block in blocks:
        size = block["size"] if block["size"] < SMALL_BYTES else None
        groups[(allocated_where(block.get("frames", [])), size)].append(block["size"])
    rows = [
        {"where": where, "size": size, "count": len(sizes), "bytes": sum(sizes)}
        for (where, size), sizes in groups.items()
    ]
    return sorted(rows, key=lambda row: (-row["bytes"], row["where"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/peak_blocks"))
    parser.epilog = "Flags after a lone -- go to train_gpt.py (e.g. -- --device cuda --steps 6)."
    own, example = split_at_dashes(sys.argv[1:])
    args = parser.parse_args(own)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the allocator history is the CUDA caching allocator's")
    example_argv = [*example, "--quiet", "--out", str(args.out / "run")]
    trace, reported = record_example(example_argv)
    peak, alive = replay_peak(trace)
    rows = group_blocks(alive)
    report = {"example_flags": example_argv, "max_memory_allocated": reported,
              "replayed_peak": peak, "num_trace_entries": len(trace), "groups": rows}  # fmt: skip
    write_json(args.out / "peak_blocks.json", report)
    print(f"max_memory_allocated {reported:,} B; replayed peak {peak:,} B (requested sizes)")
    for row in rows:
        size = "large" if row["size"] is None else f"{row['size']} B"
        print(f"{row['bytes']:>16,} B  {row['count']:>5} x {size:>10}  {row['where']}")


if __name__ == "__main__":
    main()
