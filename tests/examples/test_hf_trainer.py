"""The Trainer example: zero-shard handed to ``transformers.Trainer`` logs the losses plain
torch AdamW logs, in one process with no process group: zero-shard makes none, so Trainer sees
no distributed run (it warns where a group exists but it was not launched as one). Each run in a
process of its own (Trainer keeps process-wide state). Skipped without transformers and
accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def logged_losses(*flags: str) -> list[float]:
    code = (
        "import json, hf_trainer, torch.distributed as dist\n"
        f"losses = hf_trainer.main({list(flags)!r})\n"
        "assert not dist.is_initialized(), 'a process group was made'\n"
        "print(json.dumps(losses))"
    )
    python_path = os.pathsep.join(
        filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")])
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=EXAMPLES, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": python_path}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process group is initialized" not in result.stderr, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_logs_the_losses_of_plain_adamw() -> None:
    flags = ("--steps", "20", "--batch-size", "4")
    wrapped = logged_losses(*flags)
    plain = logged_losses(*flags, "--optimizer", "adamw")
    assert len(wrapped) == 2 and wrapped[-1] < wrapped[0]
    assert wrapped == pytest.approx(plain, rel=1e-4)
