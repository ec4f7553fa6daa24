import warnings

import pytest
import torch

from offload import _threads, intra_op_threads, resolve_thread_budget, usable_cores


def test_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_thread_budget(5).num_threads == 5
    assert resolve_thread_budget(5).source == "argument"


def test_user_omp_num_threads_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert resolve_thread_budget().num_threads == 3


def test_torchrun_one_thread_is_overridden_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(_threads, "_torchrun_warned", False)
    monkeypatch.setattr(_threads, "usable_cores", lambda: 16)
    with pytest.warns(RuntimeWarning, match="torchrun set OMP_NUM_THREADS=1"):
        budget = resolve_thread_budget()
    assert budget.num_threads == 16 and budget.source == "cores / local ranks"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process
        assert resolve_thread_budget().num_threads == 2


def test_no_setting_divides_cores_by_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert resolve_thread_budget().num_threads == max(usable_cores() // 64, 1)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_thread_count(bad: object) -> None:
    with pytest.raises(ValueError, match="num_threads must be a positive integer"):
        resolve_thread_budget(bad)  # type: ignore[arg-type]


def test_cores_kept_free_only_when_the_count_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # A delayed update keeps two cores of the rank's share for the threads that queue forward
    # and backward; an explicit count (argument or the user's OMP_NUM_THREADS) is kept as given.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_threads, "usable_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    budget = resolve_thread_budget(keep_free=2)
    assert budget.num_threads == 14 and budget.source == "cores / local ranks - 2"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_thread_budget(keep_free=2).num_threads == 1  # never fewer than one
    assert resolve_thread_budget(16, keep_free=2).num_threads == 16
    monkeypatch.setenv("OMP_NUM_THREADS", "12")
    assert resolve_thread_budget(keep_free=2).num_threads == 12


def test_intra_op_threads_for_the_block_then_restored() -> None:
    before = torch.get_num_threads()
    other = 3 if before != 3 else 2
    with intra_op_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), intra_op_threads(other):  # restored when the block raises too
        raise KeyError("x")
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


def test_torchrun_one_thread_kept_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two cores and two local ranks: the count stays torchrun's one, so nothing is to be said.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(_threads, "_torchrun_warned", False)
    monkeypatch.setattr(_threads, "usable_cores", lambda: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_thread_budget().num_threads == 1
