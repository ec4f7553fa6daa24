"""device_impl="te" / "apex": FusedAdam behind its adapter, against doubles of the real ones.

The doubles (``_fused_adam_doubles``) stand for the uninstallable packages. The adapter is used
only on an accelerator, so the hybrid's tests below build their device share as on one
(``on_accelerator``) while the tensors stay on the CPU; the doubles need no CUDA.
"""

from __future__ import annotations

import io
import itertools
from typing import Any

import pytest
import torch
from _fused_adam_doubles import (
    ApexFusedAdam,
    TransformerEngineFusedAdam,
    install_doubles,
    multi_tensor_adam,
)
from _parity import (
    EXACT,
    OTHER_KERNEL,
    assert_matches,
    fp32_copies,
    groups_of,
    main_weights,
    make_params,
    set_grads,
    train_side_by_side,
)

from optimizers import HybridDeviceOptimizer, OffloadPolicy
from optimizers import _device_part as device_part
from optimizers import _fused_backends as fused_backends
from optimizers._elementwise import OptimizerSpec

IMPLS = ["te", "apex"]
# Adam and AdamW as FusedAdam implements them: no amsgrad, no maximize.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
}


@pytest.fixture
def on_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The doubles stand for apex and TransformerEngine, and the hybrid builds its device share's
    sub-optimizers as for a CUDA device (the only place the adapter is used)."""
    install_doubles(monkeypatch)
    build = fused_backends.build_sub_optimizer

    def build_as_on_cuda(
        spec: OptimizerSpec, groups: list[dict[str, Any]], device_type: str, impl: str = "torch"
    ) -> torch.optim.Optimizer:
        return build(spec, groups, "cuda", impl)

    monkeypatch.setattr(device_part, "build_sub_optimizer", build_as_on_cuda)


def hybrid(
    params: list[torch.Tensor], impl: str, name: str, fraction: float, **kwargs: Any
) -> HybridDeviceOptimizer:
    cls, defaults = OPTIMIZERS[name]
    policy = OffloadPolicy(fraction=fraction, chunk_numel=40, num_threads=2, device_impl=impl)
    return HybridDeviceOptimizer(groups_of(params), cls, policy=policy, **{**defaults, **kwargs})


def reference(refs: list[torch.Tensor], name: str) -> torch.optim.Optimizer:
    cls, defaults = OPTIMIZERS[name]
    return cls(groups_of(refs), **defaults)  # torch's single-tensor loop


def adapters(opt: HybridDeviceOptimizer) -> list[fused_backends.FusedAdamAdapter]:
    return [r.optimizer for r in opt._device.rounds]


@pytest.mark.parametrize(
    ("impl", "name", "fraction", "dtype"),
    list(itertools.product(IMPLS, OPTIMIZERS, [0.0, 0.37], [torch.bfloat16, torch.float32])),
)
def test_parity_with_torch_every_step(
    on_accelerator: None, impl: str, name: str, fraction: float, dtype: torch.dtype
) -> None:
    # Params 0 and 4 miss their grads at step 2: their step counts then lag their groups', as in
    # torch, and FusedAdam must see each param's own count (its bias correction).
    params = make_params(dtype, "cpu")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, impl, name, fraction), reference(refs, name)
    assert all(isinstance(a, fused_backends.FusedAdamAdapter) for a in adapters(opt))
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=5, skip={2: {0, 4}}):
        assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"{impl}, step {step}")
    state = opt.state_dict()["state"]
    for index, ref in enumerate(refs):
        for key, value in ref_opt.state[ref].items():
            torch.testing.assert_close(
                torch.as_tensor(state[index][key]).float(),
                value.float(),
                rtol=OTHER_KERNEL[0],
                atol=OTHER_KERNEL[1],
                msg=f"param {index}, {key}",
            )


@pytest.mark.parametrize("impl", IMPLS)
def test_rounds_each_with_their_own_fused_adam(
    on_accelerator: None, monkeypatch: pytest.MonkeyPatch, impl: str
) -> None:
    # Small rounds ([Note: main grads]): several sub-optimizers, one holding the empty param only.
    monkeypatch.setattr(device_part, "ROUND_NUMEL", 40)
    params = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, impl, "adamw", 0.0), reference(refs, "adamw")
    assert len(adapters(opt)) > 2
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=4, skip={1: {3}}):
        assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"step {step}")


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_params_never_reach_fused_adam(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A group of empty params only (apex reads group["params"][0]) and one ending with an empty
    # param (TransformerEngine #3207): steps as torch's Adam, and counts their steps as it does.
    install_doubles(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    shapes = [[(0,)], [(5,), (3,), (0,)]]
    params = [[torch.randn(s, generator=gen) for s in group] for group in shapes]
    refs = [[p.clone() for p in group] for group in params]
    spec = OptimizerSpec.of(torch.optim.Adam, {"lr": 1e-2})
    hyper = torch.optim.Adam([torch.zeros(1)], lr=1e-2).defaults  # as the hybrid's groups hold
    adapter = fused_backends.build_sub_optimizer(
        spec, [{"params": g, **hyper} for g in params], "cuda", impl
    )
    ref_opt = torch.optim.Adam([{"params": g} for g in refs], lr=1e-2)
    for _ in range(3):
        for param, ref in zip(itertools.chain(*params), itertools.chain(*refs), strict=True):
            param.grad = torch.randn(param.shape, generator=gen)
            ref.grad = param.grad.clone()
        adapter.step()
        ref_opt.step()
    for param, ref in zip(itertools.chain(*params), itertools.chain(*refs), strict=True):
        torch.testing.assert_close(param, ref, rtol=OTHER_KERNEL[0], atol=OTHER_KERNEL[1])
        assert float(adapter.state[param]["step"]) == float(ref_opt.state[ref]["step"]) == 3
    # On the CPU (no FusedAdam kernel there) torch's own optimizer steps.
    on_cpu = fused_backends.build_sub_optimizer(spec, [{"params": params[1]}], "cpu", impl)
    assert type(on_cpu) is torch.optim.Adam


RESUMES = [(0.0, 0.0), (0.0, 0.5), (0.37, 0.0), (0.0, 1.0)]


@pytest.mark.parametrize(("impl", "before", "after"), [(i, *r) for i in IMPLS for r in RESUMES])
def test_state_dict_round_trip_keeps_the_step_count(
    on_accelerator: None, impl: str, before: float, after: float
) -> None:
    # Saved after 3 steps and resumed (into another fraction too): the step count is saved per
    # param and FusedAdam continues from it, so the resumed run is the uninterrupted one.
    params = make_params(torch.bfloat16, "cpu")
    refs = fp32_copies(params)  # drives the same grads only
    opt = hybrid(params, impl, "adamw", before)
    for _ in train_side_by_side(opt, reference(refs, "adamw"), params, refs, steps=3):
        pass
    buffer = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert all(float(state["step"]) == 3 for state in saved["optim"]["state"].values())
    resumed_params = [torch.nn.Parameter(t) for t in saved["model"]]
    resumed = hybrid(resumed_params, impl, "adamw", after)
    resumed.load_state_dict(saved["optim"])
    tol = EXACT if before == after else OTHER_KERNEL
    gen = torch.Generator().manual_seed(99)
    for step in range(3):
        set_grads(params, refs, gen)
        for param, resumed_param in zip(params, resumed_params, strict=True):
            resumed_param.grad = param.grad.clone()
        opt.step()
        resumed.step()
        for index, (a, b) in enumerate(
            zip(main_weights(opt, params), main_weights(resumed, resumed_params), strict=True)
        ):
            torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1], msg=f"step {step}: {index}")
    assert all(float(s["step"]) == 6 for s in resumed.state_dict()["state"].values())


@pytest.mark.parametrize("impl", IMPLS)
def test_state_dict_before_the_first_step_is_torchs(on_accelerator: None, impl: str) -> None:
    # Split params too (fraction 0.37): each shows one torch-shaped dict, zeros and step 0.
    fused = hybrid(make_params(torch.bfloat16, "cpu"), impl, "adamw", 0.37).state_dict()
    plain = hybrid(make_params(torch.bfloat16, "cpu"), "torch", "adamw", 0.37).state_dict()
    assert fused["state"].keys() == plain["state"].keys()
    for index, state in plain["state"].items():
        assert fused["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(fused["state"][index][key]), value), (index, key)


@pytest.mark.parametrize(
    ("impl", "option"), list(itertools.product(IMPLS, ["maximize", "amsgrad"]))
)
def test_options_fused_adam_lacks_are_refused(on_accelerator: None, impl: str, option: str) -> None:
    params = make_params(torch.bfloat16, "cpu")
    message = rf"device_impl='{impl}'.*got {option}=True; use device_impl='torch'"
    with pytest.raises(ValueError, match=message):
        hybrid(params, impl, "adam", 0.37, **{option: True})
    # Set on a group after construction: refused at the step, before either device's share
    # changes (the CPU's share too, at 0.37).
    for fraction in (0.0, 0.37):
        opt = hybrid(params, impl, "adam", fraction)
        opt.param_groups[1][option] = True
        set_grads(params, fp32_copies(params), torch.Generator().manual_seed(0))
        before = main_weights(opt, params)
        with pytest.raises(ValueError, match=message):
            opt.step()
        after = main_weights(opt, params)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), fraction
        opt.param_groups[1][option] = False
        opt.step()


@pytest.mark.parametrize("impl", IMPLS)
def test_found_inf_is_read_by_the_host(on_accelerator: None, impl: str) -> None:
    # FusedAdam has no device-side found_inf input: not skipped on the device, the host reads the
    # flag and skips the step, which leaves params, moments and step counts as they were.
    params, others = make_params(torch.bfloat16, "cpu"), make_params(torch.bfloat16, "cpu")
    opt, plain = hybrid(params, impl, "adamw", 0.37), hybrid(others, impl, "adamw", 0.37)
    assert opt.skips_on_device is False
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        set_grads(params, fp32_copies(params), gen)
        for param, other in zip(params, others, strict=True):
            other.grad = param.grad.clone()
        before = opt.state_dict()
        before = {i: {k: v.clone() for k, v in s.items()} for i, s in before["state"].items()}
        opt.step(found_inf=torch.ones(()))
        for index, state in opt.state_dict()["state"].items():
            assert all(torch.equal(v, before[index][k]) for k, v in state.items()), index
        opt.step(found_inf=torch.zeros(()))
        plain.step()
    for a, b in zip(main_weights(opt, params), main_weights(plain, others), strict=True):
        assert torch.equal(a, b)


def test_doubles_keep_upstreams_hazards() -> None:
    # What the adapter guards against, in the doubles as in upstream.
    for cls in (TransformerEngineFusedAdam, ApexFusedAdam):
        with pytest.raises(RuntimeError, match="AMSGrad"):
            cls([torch.zeros(2)], amsgrad=True)
        param = torch.zeros(2)
        param.grad = torch.ones(2)
        opt = cls([{"params": [param]}], lr=0.1)
        opt.step()
        opt.step()
        assert opt.param_groups[0]["step"] == 2 and "step" not in opt.state[param]
    with pytest.raises(AssertionError, match="zero-element tensor"):
        empty = torch.zeros(0)
        multi_tensor_adam(
            [empty], [empty], [empty], [empty], lr=0.1, betas=(0.9, 0.99), eps=1e-8, step=1,
            adam_w_mode=True, bias_correction=True, weight_decay=0.0,
        )  # fmt: skip
    with pytest.raises(IndexError):
        ApexFusedAdam([{"params": []}, {"params": [torch.zeros(1)]}]).step()
    te = TransformerEngineFusedAdam([torch.zeros(1)])
    te.state[te.param_groups[0]["params"][0]] = {"step": torch.tensor(1.0)}
    with pytest.raises(KeyError, match="step"):
        te.state_dict()


@pytest.mark.cuda
@pytest.mark.parametrize(("impl", "fraction"), list(itertools.product(IMPLS, [0.0, 0.5])))
def test_parity_on_cuda_through_the_real_device_path(
    monkeypatch: pytest.MonkeyPatch, impl: str, fraction: float
) -> None:
    # No device-type override: the hybrid picks the adapter itself for its CUDA share (the
    # doubles run torch ops on CUDA tensors; the real kernels are not here).
    install_doubles(monkeypatch)
    params = make_params(torch.bfloat16, "cuda")
    refs = fp32_copies(params)
    opt, ref_opt = hybrid(params, impl, "adamw", fraction), reference(refs, "adamw")
    assert all(isinstance(a, fused_backends.FusedAdamAdapter) for a in adapters(opt))
    for step in train_side_by_side(opt, ref_opt, params, refs, steps=4, skip={2: {0}}):
        assert_matches(opt, params, refs, tol=OTHER_KERNEL, where=f"{impl}, step {step}")
    assert opt.skips_on_device is False
    before = main_weights(opt, params)
    opt.step(found_inf=torch.ones((), device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(main_weights(opt, params), before, strict=True))
