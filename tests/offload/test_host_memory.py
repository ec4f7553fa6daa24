"""offload.check_host_memory: what a user sees. A need that fits returns; one byte more is refused
with a ValueError naming the bytes needed (per rank times the ranks on the host), the bytes
available and kept free, and the fix. The host's memory is faked through psutil."""

from collections import namedtuple

import psutil
import pytest

from offload import check_host_memory, format_bytes, local_world_size

Memory = namedtuple("Memory", "total available")
GiB = 1 << 30
MiB = 1 << 20
SKIP = "ZERO_SHARD_SKIP_HOST_MEMORY_CHECK"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside torchrun (one rank on the host), the check on: each test sets what it needs."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(SKIP, raising=False)


def fake_memory(monkeypatch: pytest.MonkeyPatch, total: int, available: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(total, available))


def refusal(num_bytes: int, *, what: str = "state", setting: str = "x") -> str:
    """The message of the ValueError that ``check_host_memory`` must raise."""
    with pytest.raises(ValueError) as info:
        check_host_memory(num_bytes, what=what, setting=setting)
    return str(info.value)


@pytest.mark.parametrize("num_ranks", [None, "1", "3"])
def test_need_times_local_ranks_up_to_the_usable_memory_fits(
    monkeypatch: pytest.MonkeyPatch, num_ranks: str | None
) -> None:
    # 32 GiB available, 2 GiB of it kept free: 30 GiB usable, shared by the ranks on the host.
    fake_memory(monkeypatch, 64 * GiB, 32 * GiB)
    if num_ranks is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", num_ranks)
    ranks = int(num_ranks or 1)
    per_rank = 30 * GiB // ranks
    assert check_host_memory(per_rank, what="state", setting="x") is None
    message = refusal(per_rank + 1)  # ranks bytes over: refused
    assert f"needs {format_bytes(30 * GiB + ranks)} of host memory" in message
    assert f"({format_bytes(per_rank + 1)} per rank x {ranks} local rank(s))" in message


def test_refusal_names_the_numbers_and_the_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 64 * GiB, 32 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    message = refusal(10 * GiB, what="optimizer state offloaded to the CPU", setting="the fraction")
    assert message == (
        "zero-shard needs 40.00 GiB of host memory for optimizer state offloaded to the CPU "
        "(10.00 GiB per rank x 4 local rank(s)), but only 32.00 GiB is available and 2.00 GiB "
        "is kept free. Lower the fraction, or run fewer ranks per host; set "
        f"{SKIP}=1 only if this host reports less memory than it has."
    )


@pytest.mark.parametrize(
    ("total", "margin", "shown"),
    [
        (64 * GiB, 2 * GiB, "2.00 GiB"),  # 5% would be 3.2 GiB: at most 2 GiB is kept
        (8 * GiB, int(8 * GiB * 0.05), "409.60 MiB"),  # 5% of a small host
    ],
)
def test_margin_is_five_percent_of_total_at_most_two_gib(
    monkeypatch: pytest.MonkeyPatch, total: int, margin: int, shown: str
) -> None:
    available = 4 * GiB
    fake_memory(monkeypatch, total, available)
    assert check_host_memory(available - margin, what="state", setting="x") is None
    message = refusal(available - margin + 1)
    assert f"but only 4.00 GiB is available and {shown} is kept free" in message


def test_nothing_to_allocate_is_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 8 * GiB, 0)  # a full host
    assert check_host_memory(0, what="state", setting="x") is None
    assert "needs 1 B of host memory" in refusal(1)


@pytest.mark.parametrize(("value", "checked"), [("1", False), ("0", True), ("", True)])
def test_skip_variable_turns_the_check_off(
    monkeypatch: pytest.MonkeyPatch, value: str, checked: bool
) -> None:
    fake_memory(monkeypatch, 8 * GiB, 1 * GiB)
    assert "needs 100.00 GiB" in refusal(100 * GiB)
    monkeypatch.setenv(SKIP, value)
    if checked:
        assert "needs 100.00 GiB" in refusal(100 * GiB)
    else:
        assert check_host_memory(100 * GiB, what="state", setting="x") is None


def test_ranks_on_the_host_come_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert local_world_size() == 1  # outside torchrun
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_world_size() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive integer, got 'two'"):
        local_world_size()
    fake_memory(monkeypatch, 8 * GiB, 1 * GiB)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive integer, got 'two'"):
        check_host_memory(GiB, what="state", setting="x")


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(MiB + MiB // 2) == "1.50 MiB"
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(5000 * GiB) == "5000.00 GiB"
