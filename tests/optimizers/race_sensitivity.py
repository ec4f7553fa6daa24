"""Shows that the CUDA race test can fail: runs it with one ordering removed at a time.

Run on a GPU machine: ``PYTHONPATH=. python tests/optimizers/race_sensitivity.py``. Each line
must say FAILED; a PASSED line means the race test could not see that missing wait.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import test_hybrid_cuda

from offload import _copy_engine
from optimizers import _host_step

original_copy = _copy_engine.copy_async


def no_wait_for_h2d(stream: object, event: object) -> None:
    """The current stream no longer waits for the H2D copies."""


def no_wait_before_d2h(pairs, stream, *, after=()):  # type: ignore[no-untyped-def]
    """D2H copies no longer wait for backward (nor H2D for the step start)."""
    return original_copy(pairs, stream, after=())


def main() -> None:
    cases = {
        "current stream does not wait for H2D": (_host_step, "wait_for_event", no_wait_for_h2d),
        "copies do not wait for backward": (_copy_engine, "copy_async", no_wait_before_d2h),
    }
    for name, (owner, attr, replacement) in cases.items():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(owner, attr, replacement)
            try:
                test_hybrid_cuda.test_no_race_between_copies_and_compute(
                    1.0, modify_grads=True, micro_batches=1
                )
            except AssertionError as err:
                print(f"{name}: FAILED as it must ({str(err).splitlines()[0][:120]})")
            else:
                print(f"{name}: PASSED (the race test did not see it)")


if __name__ == "__main__":
    main()
