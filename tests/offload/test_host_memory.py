from collections import namedtuple

import pytest

from offload import _host_memory, check_host_memory, format_bytes

Memory = namedtuple("Memory", "total available")
GiB = 1 << 30


def fake_memory(monkeypatch: pytest.MonkeyPatch, total: int, available: int) -> None:
    monkeypatch.setattr(_host_memory.psutil, "virtual_memory", lambda: Memory(total, available))


def test_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 64 * GiB, 32 * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    check_host_memory(20 * GiB, what="state", setting="the offload fraction")


def test_too_much_names_needed_available_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 64 * GiB, 32 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK", raising=False)
    with pytest.raises(ValueError) as info:
        check_host_memory(10 * GiB, what="state", setting="the offload fraction")
    message = str(info.value)
    assert "40.00 GiB" in message and "x 4 local rank" in message
    assert "32.00 GiB is available" in message and "Lower the offload fraction" in message


def test_margin_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 64 * GiB, 10 * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"2\.00 GiB is kept"):
        check_host_memory(9 * GiB, what="state", setting="x")


def test_skip_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 8 * GiB, 1 * GiB)
    monkeypatch.setenv("ZERO_SHARD_SKIP_HOST_MEMORY_CHECK", "1")
    check_host_memory(100 * GiB, what="state", setting="x")


def test_bad_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 8 * GiB, 1 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive integer, got 'two'"):
        check_host_memory(GiB, what="state", setting="x")


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(5000 * GiB) == "5000.00 GiB"
