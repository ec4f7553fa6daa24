import torch

from offload import CopyEngine, CopyPair, copy_async, wait_event


def test_cpu_copies_run_at_once_and_cast() -> None:
    src = torch.randn(10).to(torch.bfloat16)
    dst = torch.empty(10, dtype=torch.float32)
    event = copy_async([CopyPair(dst, src)], None)
    assert event is None
    assert torch.equal(dst, src.float())
    wait_event(event)


def test_cpu_engine_has_no_streams_and_no_events() -> None:
    engine = CopyEngine(torch.device("cpu"))
    assert not engine.is_async
    dst, src = torch.zeros(4), torch.arange(4.0)
    assert engine.d2h([CopyPair(dst, src)], after=[None]) is None
    assert torch.equal(dst, src)
    assert engine.h2d([CopyPair(src, torch.ones(4))]) is None
    assert torch.equal(src, torch.ones(4))
