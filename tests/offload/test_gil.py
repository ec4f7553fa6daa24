"""The GIL switch interval's counted holds (offload/_gil.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from offload import SwitchInterval, check_switch_interval


@pytest.fixture(autouse=True)
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_holds_shorten_the_interval_until_the_last_release() -> None:
    holds = SwitchInterval()
    holds.hold(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    holds.hold(0.0002)  # a second, shorter hold shortens it further
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    holds.release()
    assert sys.getswitchinterval() == pytest.approx(0.0002) and holds.num_holds == 1
    holds.release()
    assert sys.getswitchinterval() == pytest.approx(0.005) and holds.num_holds == 0
    with pytest.raises(AssertionError, match="expected a hold"):
        holds.release()


def test_a_hold_never_lengthens_the_interval() -> None:
    sys.setswitchinterval(0.0001)
    holds = SwitchInterval()
    holds.hold(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    holds.release()
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_an_interval_changed_during_the_holds_is_left_alone() -> None:
    holds = SwitchInterval()
    holds.hold(0.0005)
    sys.setswitchinterval(0.002)  # the user's own setting, made meanwhile
    holds.release()
    assert sys.getswitchinterval() == pytest.approx(0.002)
    holds.hold(0.0005)  # and the next holds start from it
    holds.release()
    assert sys.getswitchinterval() == pytest.approx(0.002)


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf"), True, "0.001"])
def test_bad_interval(seconds: object) -> None:
    with pytest.raises(ValueError, match="gil_switch_interval must be a positive number"):
        check_switch_interval(seconds)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"got {seconds!r}"):
        SwitchInterval().hold(seconds)  # type: ignore[arg-type]
    check_switch_interval(None)
