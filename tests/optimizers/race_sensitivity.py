"""Shows that the CUDA race test can fail: runs it with one ordering removed at a time.

Run on a GPU machine: ``PYTHONPATH=. python tests/optimizers/race_sensitivity.py``. Each line
must say FAILED; a PASSED line means the race test could not see that missing wait.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "offload"))

import test_flag
import test_hybrid_cuda

from offload import _copy_engine, _flag
from optimizers import _host_step

original_copy = _copy_engine.copy_async
original_queue_d2h = _host_step.HostStep.queue_d2h


def no_wait_for_h2d(stream: object, event: object) -> None:
    """The current stream no longer waits for the H2D copies."""


def no_wait_before_d2h(pairs, stream, *, after=()):  # type: ignore[no-untyped-def]
    """D2H copies no longer wait for backward (nor H2D for the step start)."""
    return original_copy(pairs, stream, after=())


def no_wait_for_next_backward(self: object) -> None:
    """A delayed update's H2D copies no longer wait for the next backward."""


def no_wait_for_staging_free(self, job, *, after):  # type: ignore[no-untyped-def]
    """A D2H into a staging buffer no longer waits for the H2D out of it (see [Note: staging
    ring]; a delayed update's last weights leave its buffers as its next grads come in): only
    for the grads being final."""
    return original_queue_d2h(self, job, after=after[:1])


def no_wait_before_flag(stream: object, event: object) -> None:
    """A flag is written (or copied) to the host without waiting for the events it is sent
    after (the step's flags: for backward and the clip's norm)."""


def landed_at_once(self: object) -> bool:
    """Every chunk's grads count as on the host: the worker merges chunks into its kernel call
    without their copies having landed (see [Note: merged kernel calls])."""
    return True


def main() -> None:
    runs = [
        ("current stream does not wait for H2D",
         (_host_step, "wait_for_event", no_wait_for_h2d), exact_race),
        ("copies do not wait for backward",
         (_copy_engine, "copy_async", no_wait_before_d2h), exact_race),
        ("current stream does not wait for H2D (a buffer per chunk)",
         (_host_step, "wait_for_event", no_wait_for_h2d), exact_race_per_chunk),
        ("copies do not wait for backward (a buffer per chunk)",
         (_copy_engine, "copy_async", no_wait_before_d2h), exact_race_per_chunk),
        ("D2H into staging does not wait for the H2D out of it",
         (_host_step.HostStep, "queue_d2h", no_wait_for_staging_free), staging_race),
        ("D2H into staging does not wait for the H2D out of it (a delayed update)",
         (_host_step.HostStep, "queue_d2h", no_wait_for_staging_free), delayed_race),
        ("delayed H2D does not wait for the next backward",
         (_host_step.HostStep, "hold_writes_for_current", no_wait_for_next_backward),
         delayed_race),
        ("a chunk is merged before its grads landed",
         (_host_step.ChunkJob, "landed", landed_at_once), merge_race),
        ("a flag does not wait for its events",
         (_flag, "wait_for_event", no_wait_before_flag), flag_race),
    ]  # fmt: skip
    for name, (owner, attr, replacement), race in runs:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(owner, attr, replacement)
            try:
                race()
            except AssertionError as err:
                first_line = (str(err).splitlines() or [repr(err)])[0]  # a bare assert: empty
                print(f"{name}: FAILED as it must ({first_line[:120]})")
            else:
                print(f"{name}: PASSED (the race test did not see it)")


def exact_race() -> None:
    test_hybrid_cuda.test_no_race_between_copies_and_compute(
        1.0, modify_grads=True, micro_batches=1, staging="bounded"
    )


def exact_race_per_chunk() -> None:
    test_hybrid_cuda.test_no_race_between_copies_and_compute(
        1.0, modify_grads=True, micro_batches=1, staging="per_chunk"
    )


def staging_race() -> None:
    test_hybrid_cuda.test_no_race_on_a_staging_buffer_taken_again()


def delayed_race() -> None:
    test_hybrid_cuda.test_no_race_in_the_delayed_update()


def merge_race() -> None:
    with pytest.MonkeyPatch.context() as patch:
        test_hybrid_cuda.test_no_race_where_landed_chunks_merge(patch)


def flag_race() -> None:
    test_flag.test_on_cuda_the_device_writes_the_value_behind_the_events_it_waits_for()


if __name__ == "__main__":
    main()
