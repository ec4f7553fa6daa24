"""Checks that the 2-GPU race test can fail: it is run with one wait removed at a time and must
fail each time. Run on the lent nvidia-h200-x2 (docs/gpu-tests.md)::

    PYTHONPATH=$PWD:tests/zero_shard python tests/zero_shard/race_sensitivity.py
"""

from __future__ import annotations

import torch
from _harness import run_cases
from test_wrap_cuda import race_case

from zero_shard import _gather, _reduce


def _gather_without_wait(self, index: int) -> None:  # type: ignore[no-untyped-def]
    gather = self._in_flight.pop(index)  # no gather.work.wait(): the copy out may read early
    bucket = self.buckets[index]
    params = [sharded.param for sharded in bucket.params]
    _gather.unpack_params(gather.out, bucket.layout, bucket.specs, params, self._world_size)
    self._stale[index] = False


def _no_event_wait(self) -> None:  # type: ignore[no-untyped-def]
    self._event = None  # the step no longer waits for the reduce stream


def forward_does_not_wait_for_gathers(rank: int, world: int) -> None:
    _gather.ParamGatherer._complete = _gather_without_wait
    _check_fails(rank, world)


def step_does_not_wait_for_reductions(rank: int, world: int) -> None:
    finish = _reduce.GradReducer.finish

    def finish_without_wait(self) -> None:  # type: ignore[no-untyped-def]
        _no_event_wait(self)
        finish(self)

    _reduce.GradReducer.finish = finish_without_wait
    _check_fails(rank, world)


def _check_fails(rank: int, world: int) -> None:
    try:
        failure = race_case(rank, world, fraction=0.0)
    except Exception as err:  # garbage params can also end in skipped (non-finite) steps
        failure = f"raised {type(err).__name__}: {err}"
    assert failure is not None, "the race test PASSED with a wait removed: it cannot see it"
    print(f"rank {rank}: FAILED as it must ({failure})", flush=True)


if __name__ == "__main__":
    assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    for name, function in (
        ("forward_does_not_wait_for_gathers", forward_does_not_wait_for_gathers),
        ("step_does_not_wait_for_reductions", step_does_not_wait_for_reductions),
    ):
        outcome = run_cases({name: function}, 2, backend="nccl")[name]
        print(f"{name}: {'race test FAILED as it must' if outcome is None else outcome}")
