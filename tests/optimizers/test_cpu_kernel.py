"""The single-pass CPU Adam kernel: same bits as torch's fused CPU kernel, bf16 rounding,
fallback when it cannot be built, and HybridDeviceOptimizer with and without it."""

from __future__ import annotations

import gc
import itertools
import warnings
import weakref

import pytest
import torch
from _parity import (
    EXACT,
    SAME_KERNEL,
    assert_matches,
    fp32_copies,
    groups_of,
    main_weights,
    make_params,
    train_side_by_side,
)

from offload import page_moves_available
from optimizers import HybridDeviceOptimizer, OffloadPolicy, _cpu_kernel
from optimizers import _host_part as host_part
from optimizers._cpu_kernel import (
    CpuAdamKernel,
    KernelPiece,
    KernelTable,
    load_cpu_adam,
)

NUMEL = 16 * 4099 + 13  # a vector body, and a tail that torch steps one element at a time


def kernel_for(cls: type) -> CpuAdamKernel:
    library = load_cpu_adam()
    if library is None:
        pytest.skip("no C compiler on this machine")
    return CpuAdamKernel(library, cls, num_threads=2)


@pytest.mark.parametrize(
    ("cls", "dtype", "weight_decay", "grad_scale", "grad_factor"),
    [
        *itertools.product(
            [torch.optim.AdamW, torch.optim.Adam],
            [torch.bfloat16, torch.float32],
            [0.0, 0.1],
            [None],
            [None],
        ),
        # A grad scale applied in fp32 to the widened grad, as torch's path scales the fp32
        # main grad (a bf16 multiply first would round the scaled grad to bf16).
        (torch.optim.AdamW, torch.bfloat16, 0.1, 0.3, None),
        (torch.optim.Adam, torch.float32, 0.1, 2.0**-7, None),
        # A grad factor (a clip's) applied in the model dtype first, as `_foreach_mul_` by a
        # factor of the grads' dtype multiplies the grads on the accelerator.
        *itertools.product(
            [torch.optim.AdamW, torch.optim.Adam],
            [torch.bfloat16, torch.float32],
            [0.0, 0.1],
            [None],
            [0.3713],
        ),
        (torch.optim.Adam, torch.bfloat16, 0.1, 2.0**-7, 0.0517),
        (torch.optim.AdamW, torch.float32, 0.1, 0.3, 1e-3),
        # A factor the CPU multiplies by as it is (fp32, not a value of the grads' dtype).
        (torch.optim.AdamW, torch.bfloat16, 0.1, None, "fp32 0.3713"),
    ],
)
def test_same_bits_as_torch_fused_on_the_vector_body(
    cls: type,
    dtype: torch.dtype,
    weight_decay: float,
    grad_scale: float | None,
    grad_factor: float | str | None,
) -> None:
    kernel = kernel_for(cls)
    gen = torch.Generator().manual_seed(0)
    main = torch.randn(NUMEL, generator=gen)
    ref = main.clone().requires_grad_(True)
    ref_opt = cls([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True)
    group = ref_opt.param_groups[0]
    state = {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros(NUMEL),
        "exp_avg_sq": torch.zeros(NUMEL),
    }
    body = NUMEL - NUMEL % 16
    if isinstance(grad_factor, str):  # "fp32 <value>": the factor not rounded to the dtype
        factor = torch.tensor(float(grad_factor.split()[1]))
    else:
        factor = None if grad_factor is None else torch.tensor(grad_factor).to(dtype)
    for step in range(4):
        grad = torch.randn(NUMEL, generator=gen).to(dtype)
        grad[:7] = torch.tensor([0.0, -0.0, 1e-30, 3e-38, -1e-39, 1e30, 65504.0]).to(dtype)
        staging = grad.clone()
        factored = grad if factor is None else torch._foreach_mul([grad], factor)[0]
        ref.grad = factored.float() if grad_scale is None else factored.float() * grad_scale
        kernel.step(
            [KernelPiece(main, staging, state)],
            group,
            grad_scale,
            None if factor is None else factor.item(),
        )
        ref_opt.step()
        torch.testing.assert_close(main, ref.detach(), rtol=SAME_KERNEL[0], atol=SAME_KERNEL[1])
        assert torch.equal(main[:body], ref.detach()[:body]), f"step {step}: weights"
        for key in ("exp_avg", "exp_avg_sq"):
            expected = ref_opt.state[ref][key]
            assert torch.equal(state[key][:body], expected[:body]), f"step {step}: {key}"
        assert torch.equal(state["step"], ref_opt.state[ref]["step"])
        # The model-dtype weight written back is the fp32 weight rounded as torch rounds it.
        assert torch.equal(staging, main.to(dtype)), f"step {step}: staging"


def test_pieces_of_one_call_step_as_torch_steps_each() -> None:
    """One call over pieces of many sizes (empty, shorter than a block, several blocks with a
    tail) at different step counts: each as torch's fused AdamW steps it alone, to the bit on
    the vector body."""
    kernel = kernel_for(torch.optim.AdamW)
    gen = torch.Generator().manual_seed(1)
    sizes = [NUMEL, 0, 5, 3 * 32768 + 7, 16 * 33]
    mains = [torch.randn(n, generator=gen) for n in sizes]
    refs = [m.clone().requires_grad_(True) for m in mains]
    ref_opts = [
        torch.optim.AdamW([r], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        for r in refs
    ]
    states = [
        {"step": torch.tensor(0.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        for n in sizes
    ]
    group = ref_opts[0].param_groups[0]
    for step in range(3):
        chosen = range(len(sizes)) if step else [0, 3]  # the others lag one step behind
        grads = {i: torch.randn(sizes[i], generator=gen).bfloat16() for i in chosen}
        staging = {i: grad.clone() for i, grad in grads.items()}
        kernel.step([KernelPiece(mains[i], staging[i], states[i]) for i in chosen], group)
        for i in chosen:
            refs[i].grad = grads[i].float()
            ref_opts[i].step()
            body = sizes[i] - sizes[i] % 16
            ref_state = ref_opts[i].state[refs[i]]
            assert torch.equal(mains[i][:body], refs[i].detach()[:body]), f"step {step}, piece {i}"
            assert torch.equal(states[i]["exp_avg_sq"][:body], ref_state["exp_avg_sq"][:body])
            torch.testing.assert_close(
                mains[i], refs[i].detach(), rtol=SAME_KERNEL[0], atol=SAME_KERNEL[1]
            )
            assert torch.equal(states[i]["step"], ref_state["step"])
            assert torch.equal(staging[i], mains[i].bfloat16())


def test_a_table_run_step_after_step_is_torch_fused_adamw() -> None:
    """A table built once and run four times, its step counts read and advanced through their
    memory (an fp32 count and an fp64 one, as torch keeps them under a float64 default dtype),
    with the lr changed between runs as a scheduler changes it: each run is torch's fused AdamW
    step, to the bit on the vector body, and the counts are torch's."""
    kernel = kernel_for(torch.optim.AdamW)
    gen = torch.Generator().manual_seed(2)
    sizes = [NUMEL, 3 * 32768 + 7]
    mains = [torch.randn(n, generator=gen) for n in sizes]
    refs = [m.clone().requires_grad_(True) for m in mains]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    group = ref_opt.param_groups[0]
    states = [
        {"step": torch.tensor(0.0, dtype=dtype), "exp_avg": torch.zeros(n),
         "exp_avg_sq": torch.zeros(n)}
        for n, dtype in zip(sizes, [torch.float32, torch.float64], strict=True)
    ]  # fmt: skip
    staging = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    pieces = [KernelPiece(*parts) for parts in zip(mains, staging, states, strict=True)]
    table = KernelTable(kernel, pieces)
    for step in range(4):
        group["lr"] = 1e-2 / (step + 1)
        for ref, slot in zip(refs, staging, strict=True):
            grad = torch.randn(slot.numel(), generator=gen).bfloat16()
            slot.copy_(grad)
            ref.grad = grad.float()
        table.run(group)
        ref_opt.step()
        for i, (main, ref, state) in enumerate(zip(mains, refs, states, strict=True)):
            body = main.numel() - main.numel() % 16
            ref_state = ref_opt.state[ref]
            assert torch.equal(main[:body], ref.detach()[:body]), f"step {step}, piece {i}"
            assert torch.equal(state["exp_avg"][:body], ref_state["exp_avg"][:body])
            assert float(state["step"]) == float(ref_state["step"]) == step + 1
            assert torch.equal(staging[i], main.bfloat16())
    assert table.backs(states)
    replaced = dict(states[1], exp_avg=states[1]["exp_avg"].clone())
    assert not table.backs([states[0], replaced])


class _Twins:
    """Two tables over equal pieces (sizes of a vector body, a tail, several blocks and one of
    whole pages that move; Adam's L2 or AdamW's decay): one runs as the host step does without
    speculation, one speculates; the same grads."""

    def __init__(self, cls: type, dtype: torch.dtype, seed: int) -> None:
        kernel = kernel_for(cls)
        gen = torch.Generator().manual_seed(seed)
        sizes = [NUMEL, 5, 3 * 32768 + 7, (3 << 20) + 11]
        mains = [torch.randn(n, generator=gen) for n in sizes]
        self.states = [
            [{"step": torch.tensor(0.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
             for n in sizes]
            for _ in range(2)
        ]  # fmt: skip
        self.mains = [[m.clone() for m in mains] for _ in range(2)]
        self.staging = [[torch.empty(n, dtype=dtype) for n in sizes] for _ in range(2)]
        self.weights = [torch.empty(n, dtype=dtype) for n in sizes]
        self.plain, self.speculative = (
            KernelTable(
                kernel,
                [
                    KernelPiece(*p)
                    for p in zip(self.mains[i], self.staging[i], self.states[i], strict=True)
                ],
                weights=None if i == 0 else self.weights,
            )
            for i in range(2)
        )
        self.gen = gen

    def new_grads(self) -> None:
        for plain, speculative in zip(*self.staging, strict=True):
            plain.copy_(torch.randn(plain.numel(), generator=self.gen))
            speculative.copy_(plain)

    def live(self, which: int) -> list[torch.Tensor]:
        states = self.states[which]
        return [
            tensor
            for main, state in zip(self.mains[which], states, strict=True)
            for tensor in (main, state["exp_avg"], state["exp_avg_sq"], state["step"])
        ]

    def assert_same(self, where: str) -> None:
        for plain, speculative in zip(self.live(0), self.live(1), strict=True):
            assert torch.equal(plain, speculative), where
        # The plain step's weights replaced its grads in staging; the speculative one's are in
        # their own buffers.
        for slot, weights in zip(self.staging[0], self.weights, strict=True):
            assert torch.equal(slot, weights), where


@pytest.mark.parametrize(
    ("cls", "dtype", "weight_decay"),
    [(torch.optim.AdamW, torch.bfloat16, 0.1), (torch.optim.Adam, torch.bfloat16, 0.1),
     (torch.optim.AdamW, torch.float32, 0.0), (torch.optim.Adam, torch.float32, 0.1)],
)  # fmt: skip
def test_a_speculated_step_committed_redone_or_rolled_back_is_the_step_bit_for_bit(
    cls: type, dtype: torch.dtype, weight_decay: float
) -> None:
    """[Note: speculative kernel steps]: each step is speculated before its arguments are known,
    then committed (the same arguments), redone (a clip's grad factor; the lr a scheduler
    changed; a grad scale; the state written in place after the speculation) or rolled back (a
    skipped step); the twin table steps with the final arguments from the start. Every live
    tensor and every weight written is the same bits, and each live tensor keeps its address (a
    view taken before the steps reads the state after them)."""
    twins = _Twins(cls, dtype, seed=3)
    views = [tensor.view(-1)[1:] for tensor in twins.live(1) if tensor.dim() > 0]
    addresses = [tensor.data_ptr() for tensor in twins.live(1)]
    group = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    rounds = [  # what the step asks for in the end, against the speculated one
        ("commit", None, None, None),
        ("factor", None, 0.37, None),
        ("commit", None, None, None),
        ("lr", None, None, 5e-3),
        ("skip", None, None, None),
        ("scale", 0.5, None, None),
        ("commit", 0.5, None, None),
        ("written", None, None, None),
        ("commit", None, None, None),
    ]
    for step, (kind, scale, factor, lr) in enumerate(rounds):
        twins.new_grads()
        grads = [slot.clone() for slot in twins.staging[1]]
        before = [tensor.clone() for tensor in twins.live(1)]
        twins.speculative.speculate(group, grad_scale=0.5 if kind == "commit" and scale else None)
        # The grads stay in staging; the live state and the counts are as before the step.
        assert all(torch.equal(a, b) for a, b in zip(twins.staging[1], grads, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(twins.live(1), before, strict=True))
        final = dict(group, lr=lr) if lr is not None else group
        where = f"step {step}: {kind}"
        if kind == "skip":
            twins.speculative.roll_back()
            assert all(torch.equal(a, b) for a, b in zip(twins.live(1), before, strict=True)), where
            continue  # (the plain table takes no step)
        if kind == "written":  # a moment rescaled in place after the speculation read it
            for which in (0, 1):
                twins.states[which][3]["exp_avg"].mul_(0.5)
            assert twins.speculative.written_since()
        holds = twins.speculative.holds(final, grad_scale=scale, grad_factor=factor)
        assert holds == (kind in ("commit", "written")), where
        if holds and kind == "commit":
            twins.speculative.commit()
        else:
            twins.speculative.redo(final, grad_scale=scale, grad_factor=factor)
        twins.plain.run(final, grad_scale=scale, grad_factor=factor)
        twins.assert_same(where)
    assert [tensor.data_ptr() for tensor in twins.live(1)] == addresses
    live = [tensor for tensor in twins.live(1) if tensor.dim() > 0]
    assert all(torch.equal(view, t.view(-1)[1:]) for view, t in zip(views, live, strict=True))
    assert any(twin.moves_pages for piece in twins.speculative._twins for twin in piece) == (
        page_moves_available()
    )


def test_a_speculative_table_refuses_calls_out_of_order() -> None:
    twins = _Twins(torch.optim.AdamW, torch.bfloat16, seed=4)
    group = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    for call in (twins.speculative.commit, twins.speculative.roll_back):
        with pytest.raises(RuntimeError, match=r"speculate\(\) comes first"):
            call()
    with pytest.raises(AssertionError, match="speculative table"):
        twins.plain.speculate(group)


def test_a_state_dict_loaded_after_steps_is_the_state_stepped_next() -> None:
    """Loading replaces the state tensors that the kernel's tables (built by the steps before)
    point into: the steps after it must step the loaded state, as an optimizer that never
    stepped before the load does, and the replaced state must not be kept alive."""
    kernel_for(torch.optim.AdamW)
    gen = torch.Generator().manual_seed(5)

    def build(params: list[torch.Tensor]) -> HybridDeviceOptimizer:
        policy = OffloadPolicy(fraction=1.0, chunk_numel=40, num_threads=2)
        return HybridDeviceOptimizer(groups_of(params), policy=policy, lr=1e-2, weight_decay=0.1)

    def step_with_grads(pairs: list[tuple[HybridDeviceOptimizer, list[torch.Tensor]]]) -> None:
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in pairs[0][1]]
        for opt, params in pairs:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            opt.step()

    params = make_params(torch.bfloat16, "cpu")
    opt = build(params)
    assert all(chunk.kernel is not None for chunk in opt._host.chunks)
    for _ in range(3):
        step_with_grads([(opt, params)])
    saved = {
        "state": {
            index: {key: value.clone() for key, value in state.items()}
            for index, state in opt.state_dict()["state"].items()
        },
        "param_groups": opt.state_dict()["param_groups"],
    }
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = build(fresh_params)
    fresh.load_state_dict(saved)
    for _ in range(2):  # the run goes on past the save, then rewinds to it
        step_with_grads([(opt, params)])
    replaced = weakref.ref(opt._host.chunks[0].pieces[0][1].state["exp_avg"])
    opt.load_state_dict(saved)
    gc.collect()
    assert replaced() is None, "the replaced state is still held"
    for step in range(2):
        step_with_grads([(opt, params), (fresh, fresh_params)])
        for index, (a, b) in enumerate(
            zip(main_weights(opt, params), main_weights(fresh, fresh_params), strict=True)
        ):
            torch.testing.assert_close(a, b, rtol=EXACT[0], atol=EXACT[1], msg=f"{step}: {index}")


def test_bf16_rounding_of_special_values_matches_torch() -> None:
    kernel = kernel_for(torch.optim.AdamW)
    bits = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0x3F80_8001,
            0x7F7FFFFF,
            0x00000001,
            0x80000000,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7F800001,
            0xFFFFFFFF,
            0x3F7FFFFF,
        ],
        dtype=torch.int64,
    ).to(torch.int32)  # ties to even, overflow to inf, subnormal, -0, +-inf, NaNs
    main = bits.view(torch.float32).clone()
    expected = main.to(torch.bfloat16)
    staging = torch.zeros(main.numel(), dtype=torch.bfloat16)  # zero grads: the weight stays
    state = {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(main),
        "exp_avg_sq": torch.zeros_like(main),
    }
    group = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    kernel.step([KernelPiece(main, staging, state)], group)
    nan = expected.isnan()
    assert torch.equal(staging.isnan(), nan)
    assert torch.equal(staging[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_no_compiler_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ZERO_SHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    load_cpu_adam.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="single-pass CPU Adam kernel is not available"):
            opt = HybridDeviceOptimizer(make_params(torch.bfloat16, "cpu"), offload_fraction=1.0)
        assert all(chunk.kernel is None for chunk in opt._host.chunks)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            HybridDeviceOptimizer(make_params(torch.bfloat16, "cpu"), offload_fraction=1.0)
        policy = OffloadPolicy(fraction=1.0, cpu_kernel="fused")
        with pytest.raises(RuntimeError, match="could not be built here"):
            HybridDeviceOptimizer(make_params(torch.bfloat16, "cpu"), policy=policy)
    finally:
        load_cpu_adam.cache_clear()


def test_fused_is_refused_where_it_does_not_apply() -> None:
    policy = OffloadPolicy(fraction=1.0, cpu_kernel="fused")
    with pytest.raises(ValueError, match="implements Adam and AdamW without amsgrad"):
        HybridDeviceOptimizer(make_params(torch.bfloat16, "cpu"), torch.optim.SGD, policy=policy)
    with pytest.raises(ValueError, match="implements Adam and AdamW without amsgrad"):
        HybridDeviceOptimizer(make_params(torch.float16, "cpu"), policy=policy)


@pytest.mark.parametrize(
    ("cpu_kernel", "dtype"),
    [("fused", torch.bfloat16), ("torch", torch.bfloat16), ("fused", torch.float32)],
)
def test_hybrid_parity_with_each_cpu_kernel(cpu_kernel: str, dtype: torch.dtype) -> None:
    kernel_for(torch.optim.AdamW)
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)
    policy = OffloadPolicy(fraction=0.6, chunk_numel=40, num_threads=2, cpu_kernel=cpu_kernel)
    opt = HybridDeviceOptimizer(groups_of(params), policy=policy, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(groups_of(refs), lr=1e-2, weight_decay=0.1, fused=True)
    uses_kernel = {chunk.kernel is not None for chunk in opt._host.chunks}
    assert uses_kernel == {cpu_kernel == "fused"}
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")


def merged_sizes(num_jobs: int) -> list[int]:
    """The chunks of each kernel call when every chunk's grads are on the host at once (the
    CPU): up to MERGE_CHUNKS a call and half of those left, so the last two alone."""
    sizes, left = [], num_jobs
    while left > 0:
        sizes.append(max(1, min(host_part.MERGE_CHUNKS, left // 2)))
        left -= sizes[-1]
    return sizes


def test_chunks_on_the_host_step_in_merged_calls_as_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every chunk's grads on the host (the CPU copies at once), the worker steps several
    chunks a call (4, 3, 2, 1, 1 here), one call spanning both param groups (lr and weight decay
    of its own pieces each), the last chunks alone: the same bits as one call a chunk, every
    step, and torch's AdamW. A chunk partly without grads (a param with none) is stepped
    alone."""
    kernel_for(torch.optim.AdamW)
    calls: list[list[tuple[int, int]]] = []
    original = host_part._kernel_table

    def recorded(jobs):  # type: ignore[no-untyped-def]
        calls.append([(job.chunk.index, job.chunk.spec.group_index) for job in jobs])
        return original(jobs)

    monkeypatch.setattr(host_part, "_kernel_table", recorded)
    params, single = make_params(torch.bfloat16, "cpu"), make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)

    def build(group_params: list[torch.Tensor]) -> HybridDeviceOptimizer:
        policy = OffloadPolicy(fraction=1.0, chunk_numel=40, num_threads=2)
        return HybridDeviceOptimizer(
            groups_of(group_params), policy=policy, lr=1e-2, weight_decay=0.1
        )

    opt, one_by_one = build(params), build(single)
    ref_opt = torch.optim.AdamW(groups_of(refs), lr=1e-2, weight_decay=0.1, fused=True)
    num_chunks = len(opt._host.chunks)
    assert num_chunks == 11, num_chunks  # 3 chunks of group 0, then 8 of group 1
    assert merged_sizes(num_chunks) == [4, 3, 2, 1, 1]
    (partial,) = [c.index for c in opt._host.chunks if any(r.index == 4 for r, _ in c.pieces)]
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=4, skip={2: {4}}):
        assert_matches(opt, params, refs, tol=SAME_KERNEL, where=f"step {step}")
        merged, calls[:] = list(calls), []
        for param, other in zip(params, single, strict=True):
            other.grad = None if param.grad is None else param.grad.clone()
        with monkeypatch.context() as inner:
            inner.setattr(host_part, "MERGE_CHUNKS", 1)
            one_by_one.step()
        assert len(calls) == num_chunks, calls  # one call a chunk
        calls.clear()
        for index, (param, other) in enumerate(zip(params, single, strict=True)):
            assert torch.equal(param, other), f"step {step}, param {index}"
        for mine, theirs in zip(
            opt.state_dict()["state"].values(), one_by_one.state_dict()["state"].values(),
            strict=True,
        ):  # fmt: skip
            for name, value in mine.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[name])), name
        if step == 2:  # param 4 has no grad: its chunk is stepped alone, the rest merge
            assert all(len(call) == 1 for call in merged if partial in {i for i, _ in call})
            assert any(len(call) > 1 for call in merged), merged
            assert len(merged) > len(merged_sizes(num_chunks)), merged
            continue
        assert [len(call) for call in merged] == merged_sizes(num_chunks), merged
        assert any(len({group for _, group in call}) == 2 for call in merged), merged
        assert merged[-1] == [(0, 0)]  # the params needed first, stepped last: alone


def test_a_failed_merged_call_fails_each_of_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel call that fails steps none of the chunks merged into it: the step raises its
    error, their params and state stay as they were, the other chunks step, and the next step is
    whole again."""
    kernel_for(torch.optim.AdamW)
    params = make_params(torch.bfloat16, "cpu")
    policy = OffloadPolicy(fraction=1.0, chunk_numel=60, num_threads=2)
    opt = HybridDeviceOptimizer(groups_of(params), policy=policy, lr=1e-2, weight_decay=0.1)
    original = host_part._kernel_table
    failed: list[list[int]] = []

    def failing(jobs):  # type: ignore[no-untyped-def]
        if len(jobs) > 1 and not failed:
            failed.append([job.chunk.index for job in jobs])
            raise MemoryError("the kernel's table could not be allocated (injected)")
        return original(jobs)

    monkeypatch.setattr(host_part, "_kernel_table", failing)
    for param in params:
        param.grad = torch.ones_like(param)
    before = [p.detach().clone() for p in params]
    chunks = opt._host.chunks
    with pytest.raises(MemoryError, match="injected"):
        opt.step()
    (indices,) = failed
    assert len(indices) == merged_sizes(len(chunks))[0]
    for chunk in chunks:
        stepped = chunk.index not in indices
        for record, piece in chunk.pieces:
            flat, was = record.param.detach().view(-1), before[record.index].view(-1)
            start, numel = piece.spec.start, piece.spec.numel
            moved = flat[start : start + numel] != was[start : start + numel]
            assert bool(moved.any()) == (stepped and numel > 0), (chunk.index, record.index)
            assert float(piece.state["step"]) == float(stepped), (chunk.index, record.index)
    opt.step()  # the next step merges and steps every chunk
    assert all(float(p.state["step"]) >= 1 for c in chunks for _, p in c.pieces)


def test_kernel_needs_no_fp32_grad_buffer() -> None:
    kernel_for(torch.optim.AdamW)
    sizes = {}
    for cpu_kernel in ("fused", "torch"):  # (the twins of speculative steps apart)
        policy = OffloadPolicy(fraction=1.0, cpu_kernel=cpu_kernel, speculative=False)
        opt = HybridDeviceOptimizer(make_params(torch.bfloat16, "cpu"), policy=policy)
        sizes[cpu_kernel] = opt.memory_report().host_bytes
    numel = sum(p.numel() for p in make_params(torch.bfloat16, "cpu"))
    assert sizes["torch"] - sizes["fused"] == 4 * numel


def test_build_is_cached_per_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ZERO_SHARD_CACHE_DIR", str(tmp_path))
    compiler = _cpu_kernel.shutil.which("cc") or _cpu_kernel.shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    first = _cpu_kernel._build(compiler)
    stamp = first.stat().st_mtime_ns
    assert _cpu_kernel._build(compiler) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch left behind


@pytest.mark.parametrize("speculative", [False, True])
def test_state_moved_to_shared_memory_is_stepped_where_it_now_lies(speculative: bool) -> None:
    """``share_memory_()`` on a tensor read from ``optimizer.state`` gives it new memory in
    place (the same tensor object): the kernel's tables must not step the memory it left. The
    run equals one without the move, bit for bit, at every step."""
    kernel_for(torch.optim.AdamW)
    sizes = (300_000, 7)
    runs = []
    for moved in (False, True):
        params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n)))
                  for n in sizes]  # fmt: skip
        policy = OffloadPolicy(
            fraction=1.0, host_staging="per_chunk", speculative=speculative, num_threads=1
        )
        opt = HybridDeviceOptimizer(params, torch.optim.AdamW, policy=policy, lr=1e-2)
        trajectory = []
        for step in range(4):
            grads = [torch.randn(n, generator=torch.Generator().manual_seed(100 * step + n))
                     for n in sizes]  # fmt: skip
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            opt.grads_ready({i: p.grad for i, p in enumerate(params)})
            opt.step()
            if moved and step == 1:
                for param in params:
                    for value in opt.state[param].values():
                        value.share_memory_()
            trajectory.append([p.detach().clone() for p in params])
        state = [v.clone() for p in params for v in opt.state[p].values()]
        runs.append((trajectory, state))
    (plain, plain_state), (shared, shared_state) = runs
    for step, (want, got) in enumerate(zip(plain, shared, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"step {step}"
    assert all(torch.equal(a, b) for a, b in zip(plain_state, shared_state, strict=True))
