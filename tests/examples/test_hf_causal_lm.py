"""The Hugging Face example: a transformers Llama trains under zero-shard, whatever the offload
fraction. Skipped without transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_causal_lm


def test_trains_the_same_at_any_offload_fraction() -> None:
    flags = ["--device", "cpu", "--steps", "20"]
    on_device = hf_causal_lm.main([*flags, "--offload-fraction", "0"])
    offloaded = hf_causal_lm.main([*flags, "--offload-fraction", "1"])
    assert len(on_device) == 20
    assert sum(on_device[-5:]) / 5 < on_device[0] - 1.0
    # The same AdamW arithmetic on the same fp32 numbers (tests/optimizers): equal to rounding.
    assert offloaded == pytest.approx(on_device, rel=1e-5)
