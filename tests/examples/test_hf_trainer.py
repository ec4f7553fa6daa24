"""The Trainer example: zero-shard handed to ``transformers.Trainer`` logs the losses plain
torch AdamW logs. Skipped without transformers and accelerate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_trainer


def test_logs_the_losses_of_plain_adamw() -> None:
    flags = ["--steps", "20", "--batch-size", "4"]
    wrapped = hf_trainer.main(flags)
    plain = hf_trainer.main([*flags, "--optimizer", "adamw"])
    assert len(wrapped) == 2 and wrapped[-1] < wrapped[0]
    assert wrapped == pytest.approx(plain, rel=1e-4)
