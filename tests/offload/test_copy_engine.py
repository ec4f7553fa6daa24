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


def test_copies_from_grads_that_require_grad_make_no_graph() -> None:
    """Grads made by ``backward(create_graph=True)`` require grad, and a copier thread runs with
    grad mode on: the copies into staging views are no part of a graph (views of one buffer that
    require grad would refuse the next copy in place)."""
    staging = torch.zeros(8)
    weight = torch.randn(4, requires_grad=True)
    pairs = [CopyPair(staging[:4], weight * 2), CopyPair(staging[4:], torch.randn(4))]
    with torch.enable_grad():
        copy_async(pairs, None)
        copy_async(pairs[:1], None)
    assert not staging.requires_grad and not any(pair.dst.requires_grad for pair in pairs)
    assert torch.equal(staging[:4], (weight * 2).detach())
