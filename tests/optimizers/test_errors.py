"""Bad input gets an error that names the value and the fix."""

from __future__ import annotations

import copy
import importlib.util
import math
import pickle
from typing import Any

import pytest
import torch
from _parity import groups_of, make_params

from optimizers import HybridDeviceOptimizer, OffloadPolicy
from optimizers._cpu_kernel import fused_kernel_applies
from optimizers._elementwise import OptimizerSpec
from optimizers._fused_backends import build_sub_optimizer
from optimizers._step_hooks import unhooked


def params() -> list[torch.nn.Parameter]:
    return make_params(torch.bfloat16, "cpu")


@pytest.mark.parametrize("fraction", [1.5, -0.1, math.nan, math.inf])
def test_fraction_out_of_range(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"offload fraction must be in \[0, 1\].*got"):
        HybridDeviceOptimizer(params(), offload_fraction=fraction)
    with pytest.raises(ValueError, match="offload fraction must be in"):
        OffloadPolicy(fraction=fraction)


def test_fraction_of_wrong_type() -> None:
    with pytest.raises(TypeError, match="got '0.5'"):
        HybridDeviceOptimizer(params(), offload_fraction="0.5")


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.Adafactor, torch.optim.SparseAdam])
def test_non_elementwise_class(cls: type) -> None:
    with pytest.raises(NotImplementedError, match=cls.__name__):
        HybridDeviceOptimizer(params(), cls, lr=1e-3)


def test_non_elementwise_optimizer_wrapped_is_refused_as_such() -> None:
    """Muon builds only over 2-D params: wrapping one is refused for what it is (its class is not
    elementwise), before zero-shard builds its class again over a probe param."""
    matrices = [torch.nn.Parameter(torch.randn(4, 6)) for _ in range(2)]
    with pytest.raises(NotImplementedError, match="Muon is not a known elementwise"):
        HybridDeviceOptimizer.wrap(torch.optim.Muon(matrices, lr=1e-3))


class AcceleratedOptimizer(torch.optim.Optimizer):
    """A stand-in for accelerate's: a torch optimizer around one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups


def test_an_optimizer_around_a_torch_optimizer_is_refused_naming_the_order() -> None:
    inner = torch.optim.AdamW(params(), lr=1e-3)
    with pytest.raises(TypeError, match=r"AcceleratedOptimizer around a AdamW.*before handing it"):
        HybridDeviceOptimizer.wrap(AcceleratedOptimizer(inner))


def test_subclass_that_changes_step_is_refused_unless_marked() -> None:
    class Custom(torch.optim.AdamW):
        def step(self, closure=None):  # type: ignore[override]
            return super().step(closure)

    with pytest.raises(NotImplementedError, match="Custom"):
        HybridDeviceOptimizer(params(), Custom)

    class Marked(Custom):
        _zero_shard_elementwise = True

    HybridDeviceOptimizer(params(), Marked)


def test_subclass_that_keeps_step_is_taken_whichever_class_was_built_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch wraps a class's step (its hooks) when the first instance of it or of a class below
    # it is built: a subclass built before its bases runs a wrapper of its own around the same
    # step. As if no Adam had been built in this process yet:
    adamw_step = torch.optim.AdamW.__dict__.get("step")
    monkeypatch.setattr(torch.optim.Adam, "step", unhooked(torch.optim.Adam.step))
    if adamw_step is not None:
        monkeypatch.delattr(torch.optim.AdamW, "step")

    class Plain(torch.optim.AdamW):
        pass

    try:
        for cls in (Plain, torch.optim.AdamW):
            cls(params(), lr=1e-3)
            assert "step" in cls.__dict__  # (its own wrapper)
            HybridDeviceOptimizer.wrap(Plain(params(), lr=1e-3))
            group = torch.optim.AdamW(params()).param_groups[0]
            assert fused_kernel_applies(Plain, group, torch.bfloat16)
    finally:
        if adamw_step is None and "step" in torch.optim.AdamW.__dict__:
            del torch.optim.AdamW.step  # (the wrapper made here)

    class WarmAdamW(Plain):  # another first step: torch's, stepping its state as it makes it
        def _init_group(self, *args: Any) -> Any:
            return super()._init_group(*args)

    assert not fused_kernel_applies(WarmAdamW, group, torch.bfloat16)


def test_subclass_whose_constructor_needs_what_its_defaults_lack() -> None:
    class Scaled(torch.optim.AdamW):
        def __init__(self, params: Any, scale: float, lr: float = 1e-3) -> None:
            super().__init__(params, lr=lr * scale)

    with pytest.raises(TypeError, match=r"builds .*Scaled again .*'scale'.*default value"):
        HybridDeviceOptimizer.wrap(Scaled(params(), 2.0))


def test_subclass_with_a_setting_its_defaults_lack_is_refused() -> None:
    # Built again from its defaults over each share, it would step with init_sq=0.0 there.
    class Hidden(torch.optim.Adam):
        def __init__(self, params: Any, lr: float = 1e-3, init_sq: float = 0.0) -> None:
            super().__init__(params, lr=lr)
            self.init_sq = init_sq

    with pytest.raises(TypeError, match=r"Hidden.init_sq is 4.0 .* but 0.0 .* Keep 'init_sq'"):
        HybridDeviceOptimizer.wrap(Hidden(params(), init_sq=4.0))
    HybridDeviceOptimizer.wrap(Hidden(params()))  # (the same as built again: taken)

    class Kept(torch.optim.Adam):  # the setting in its defaults: built again with it
        def __init__(self, params: Any, lr: float = 1e-3, init_sq: float = 0.0) -> None:
            super().__init__(params, lr=lr)
            self.defaults["init_sq"] = self.init_sq = init_sq

    HybridDeviceOptimizer.wrap(Kept(params(), init_sq=4.0))


def test_not_an_optimizer_class() -> None:
    with pytest.raises(TypeError, match="optimizer_cls must be a torch.optim.Optimizer subclass"):
        HybridDeviceOptimizer(params(), torch.nn.Linear)


def test_duplicate_params() -> None:
    p = params()
    with pytest.raises(ValueError, match=r"shape \(7, 15\) appears twice in param group 0"):
        HybridDeviceOptimizer([p[0], p[1], p[0]])
    with pytest.raises(ValueError, match=r"shape \(7, 15\) is in param groups 0 and 1; put each"):
        HybridDeviceOptimizer([{"params": [p[0]]}, {"params": [p[0], p[1]]}])


def test_meta_params() -> None:
    meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="meta device; materialize the model"):
        HybridDeviceOptimizer([meta])


def test_complex_float64_and_non_contiguous_params() -> None:
    with pytest.raises(TypeError, match="complex params"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="is torch.float64; zero-shard keeps fp32 main weights"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    frozen = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64), requires_grad=False)
    HybridDeviceOptimizer([torch.nn.Parameter(torch.zeros(3)), frozen])  # never stepped: taken
    strided = torch.nn.Parameter(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="not contiguous"):
        HybridDeviceOptimizer([strided])


def test_bad_hyperparameters_come_from_the_class() -> None:
    with pytest.raises(ValueError, match="Invalid learning rate"):
        HybridDeviceOptimizer(params(), torch.optim.AdamW, lr=-1.0)


def test_fraction_given_twice() -> None:
    with pytest.raises(ValueError, match="pass the offload fraction once"):
        HybridDeviceOptimizer(params(), offload_fraction=0.5, policy=OffloadPolicy(fraction=0.5))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_threads", 0, "num_threads must be a positive integer or None, got 0"),
        ("chunk_numel", 0, "chunk_numel must be a positive integer, got 0"),
        ("device_impl", "cuda", "device_impl must be one of"),
        ("gil_switch_interval", 0.0, "gil_switch_interval must be a positive number .*got 0.0"),
    ],
)
def test_bad_policy(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadPolicy(**{field: value})


@pytest.mark.skipif(importlib.util.find_spec("apex") is not None, reason="apex is installed here")
def test_missing_fused_backend() -> None:
    # Neither apex nor TransformerEngine is installed in CI or on the GPU machines.
    group = [{"params": params()[:1], "lr": 1e-3}]
    with pytest.raises(ImportError, match="needs apex.optimizers, which is not installed"):
        build_sub_optimizer(OptimizerSpec.of(torch.optim.AdamW, {}), group, "cuda", "apex")
    with pytest.raises(ValueError, match="Adam and AdamW only, got SGD"):
        build_sub_optimizer(OptimizerSpec.of(torch.optim.SGD, {}), group, "cuda", "te")

    class WarmAdam(torch.optim.Adam):  # a first step of its own: not FusedAdam's math
        def _init_group(self, *args: Any) -> Any:
            return super()._init_group(*args)

    with pytest.raises(ValueError, match="Adam and AdamW only, got WarmAdam; use device_impl="):
        build_sub_optimizer(OptimizerSpec.of(WarmAdam, {}), group, "cuda", "apex")


def test_add_param_group_after_construction() -> None:
    opt = HybridDeviceOptimizer(params()[:2])
    with pytest.raises(NotImplementedError, match="build a new one"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_load_state_dict_mismatches() -> None:
    p = params()
    opt = HybridDeviceOptimizer(groups_of(p), offload_fraction=0.5)
    good = opt.state_dict()
    with pytest.raises(ValueError, match="has 1 param groups, this optimizer has 2"):
        opt.load_state_dict({"state": {}, "param_groups": good["param_groups"][:1]})
    fewer = [dict(g) for g in good["param_groups"]]
    fewer[1]["params"] = fewer[1]["params"][:-1]
    with pytest.raises(ValueError, match="param group 1 has 2 params in the state dict and 3"):
        opt.load_state_dict({"state": good["state"], "param_groups": fewer})
    other = HybridDeviceOptimizer(groups_of(make_params(torch.bfloat16, "cpu")))
    wrong = other.state_dict()
    wrong["state"][3] = {**wrong["state"][3], "exp_avg": torch.zeros(4, 4)}
    before = {k: v.clone() for k, v in opt.state_dict()["state"][3].items()}
    with pytest.raises(ValueError, match=r"'exp_avg' of param 3 has shape \(4, 4\).*\(16, 16\)"):
        opt.load_state_dict(wrong)
    after = opt.state_dict()["state"][3]
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed state"
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})


def test_copies_and_pickles_are_refused_naming_the_state_dict() -> None:
    opt = HybridDeviceOptimizer(params(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-3)
    for copy_of in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict"):
            copy_of(opt)


@pytest.mark.parametrize("index", [99, -1, 1.0, True])
def test_grads_ready_for_no_param_is_refused(index: object) -> None:
    opt = HybridDeviceOptimizer(params(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-3)
    with pytest.raises(ValueError, match=rf"param {index!r}; the params are numbered 0 to"):
        opt.grads_ready({index: torch.zeros(3)})
