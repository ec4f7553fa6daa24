"""Checks that the GPU race test can fail: it is run with one wait removed at a time and must
fail each time. Runs on 2 GPUs (nvidia-h200-x2), or on 1 (docs/gpu-tests.md)::

    PYTHONPATH=$PWD:tests/zero_shard python tests/zero_shard/race_sensitivity.py
"""

from __future__ import annotations

import torch
from _harness import run_cases
from test_wrap_cuda import race_case

from zero_shard import _gather, _reduce  # private: each check removes one internal wait


def forward_does_not_wait_for_gathers(rank: int, world: int) -> None:
    # The forward's pre-hooks still wait on the host for the job, not for its copies on the GPU.
    _gather.ParamGatherer._stream_wait = lambda self, report: None
    _check_fails(rank, world)


def gathers_do_not_wait_for_the_step(rank: int, world: int) -> None:
    run_gathers = _gather.run_gathers

    def run_without_ready(job: _gather._Job) -> None:
        job.ready = None  # the job's stream no longer follows the step (nor the last backward)
        run_gathers(job)

    _gather.run_gathers = run_without_ready
    _check_fails(rank, world)


def _no_event_wait(self) -> None:  # type: ignore[no-untyped-def]
    self._event = None  # the step no longer waits for the reduce stream


def step_does_not_wait_for_reductions(rank: int, world: int) -> None:
    finish = _reduce.GradReducer.finish

    def finish_without_wait(self, **options) -> None:  # type: ignore[no-untyped-def]
        _no_event_wait(self)
        finish(self, **options)

    _reduce.GradReducer.finish = finish_without_wait
    _check_fails(rank, world)


def _check_fails(rank: int, world: int) -> None:
    try:
        failure = race_case(rank, world, fraction=0.0)
    except (TypeError, AttributeError):  # the patch no longer fits the code: not a race
        raise
    except Exception as err:  # garbage params can also end in skipped (non-finite) steps
        failure = f"raised {type(err).__name__}: {err}"
    assert failure is not None, "the race test PASSED with a wait removed: it cannot see it"
    print(f"rank {rank}: FAILED as it must ({failure})", flush=True)


if __name__ == "__main__":
    world = min(torch.cuda.device_count(), 2)
    assert world >= 1, "needs a GPU"
    for name, function in (
        ("forward_does_not_wait_for_gathers", forward_does_not_wait_for_gathers),
        ("gathers_do_not_wait_for_the_step", gathers_do_not_wait_for_the_step),
        ("step_does_not_wait_for_reductions", step_does_not_wait_for_reductions),
    ):
        outcome = run_cases({name: function}, world, backend="nccl")[name]
        print(f"{name}: {'race test FAILED as it must' if outcome is None else outcome}")
