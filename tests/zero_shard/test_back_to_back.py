"""Buckets whose padded shards lie back to back, packed by one chunked copy, on 1, 2 and 3 CPU
processes (gloo): see ``_packing.py``."""

from __future__ import annotations

import pytest
import torch
from _harness import check_outcome, run_cases
from _packing import check_back_to_back_packing

CASES = {}


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


@case
def back_to_back_shards_packed_in_one_copy_as_param_by_param(rank: int, world: int) -> None:
    check_back_to_back_packing(rank, world, torch.device("cpu"))


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda world: f"world{world}")
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_distributed(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
