"""The README's main job, shortened: it trains, and the offload split does not change the run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_gpt


@pytest.fixture(scope="module")
def runs() -> dict[float, dict]:
    common = ["--device", "cpu", "--preset", "tiny", "--steps", "30", "--quiet", "--seed", "3"]
    return {
        fraction: train_gpt.main([*common, "--offload-fraction", str(fraction)])
        for fraction in (0.0, 1.0)
    }


def test_loss_goes_down(runs: dict[float, dict]) -> None:
    for summary in runs.values():
        assert summary["last_loss"] < summary["first_loss"] - 1.0
        assert summary["val_loss_end"] < summary["val_loss_start"]


def test_offload_fraction_does_not_change_training(runs: dict[float, dict]) -> None:
    # Both run torch's fused CPU AdamW over the same fp32 numbers; only the pieces differ, so
    # the losses agree to rounding (see tests/optimizers/_parity.py, SAME_KERNEL).
    assert runs[0.0]["first_loss"] == runs[1.0]["first_loss"]
    assert runs[0.0]["last_loss"] == pytest.approx(runs[1.0]["last_loss"], rel=1e-4)
    assert runs[0.0]["memory"]["host_bytes"] == 0
    assert runs[1.0]["memory"]["device_bytes"] == 0
