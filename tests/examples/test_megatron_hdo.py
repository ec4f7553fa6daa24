"""``train_gpt.py --optimizer megatron-hdo``: Megatron-Core's HybridDeviceOptimizer in the example's
loop. It needs CUDA, so on the CPU only the refusals (with the other peers', in
test_offload_peers.py), the import and the loop's wiring (with a stand-in optimizer) are checked;
the GPU tests run it and skip when megatron-core does not import (CI does not install it)."""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import megatron_hdo  # noqa: E402
import train_gpt  # noqa: E402

TINY = ["--preset", "tiny", "--quiet", "--seed", "3", "--eval-every", "0"]


def import_or_skip() -> type:
    try:
        return megatron_hdo.import_hybrid_device_optimizer()
    except ImportError as err:
        pytest.skip(str(err))


def test_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    megatron_hdo.import_hybrid_device_optimizer.cache_clear()
    monkeypatch.setattr(megatron_hdo, "PACKAGE", "no_such_package_for_zero_shard_tests")
    try:
        with pytest.raises(ImportError, match="pip install megatron-core"):
            megatron_hdo.import_hybrid_device_optimizer()
    finally:
        megatron_hdo.import_hybrid_device_optimizer.cache_clear()


def test_loads_and_takes_the_options_used() -> None:
    """With megatron-core installed (its package import may fail; the module then loads alone),
    the class takes every option ``build_hybrid_device_optimizer`` passes."""
    hdo_cls = import_or_skip()
    assert issubclass(hdo_cls, torch.optim.Optimizer)
    options = set(inspect.signature(hdo_cls.__init__).parameters)
    used = {"offload_fraction", "cpu_optimizer_cls", "gpu_optimizer_cls", "param_update_in_fp32",
            "overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads", "pin_cpu_params"}  # fmt: skip
    assert used <= options


class StandIn(torch.optim.AdamW):
    """Fused AdamW with the one attribute ``megatron_hdo.memory_bytes`` reads."""

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self]


def test_loop_wiring_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The ``megatron-hdo`` branch of the loop (model dtype, groups, schedule, clipping, timing,
    memory), with fused AdamW standing in for Megatron's optimizer: fp32 params, so it trains
    exactly like ``--optimizer adamw --dtype fp32``."""
    built = {}

    def build(groups: list[dict], **kwargs: object) -> torch.optim.Optimizer:
        built.update(kwargs)
        return StandIn(groups, lr=kwargs["lr"], betas=kwargs["betas"], fused=True)

    monkeypatch.setattr(train_gpt.megatron_hdo, "build_hybrid_device_optimizer", build)
    flags = [*TINY, "--steps", "4", "--dtype", "fp32", "--offload-fraction", "0.25"]
    args = train_gpt.parse_args([*flags, "--optimizer", "megatron-hdo", "--device", "cuda"])
    args.device, args.out = "cpu", tmp_path / "hdo"  # past the CUDA check, onto the CPU
    with train_gpt.process_group("cpu") as ranks:
        stand_in = train_gpt.train(args, ranks)
    reference = train_gpt.main([*flags, "--optimizer", "adamw", "--device", "cpu",
                                "--out", str(tmp_path / "adamw")])  # fmt: skip

    assert built == {"offload_fraction": 0.25, "lr": args.lr, "betas": (0.9, 0.95)}
    assert stand_in["config"]["optimizer"] == "megatron-hdo"
    assert (tmp_path / "hdo" / "log.json").exists()
    got = [record["loss"] for record in stand_in["steps"]]
    assert got == [record["loss"] for record in reference["steps"]]
    memory = stand_in["summary"]["memory"]
    num_params = stand_in["config"]["num_params"]
    # AdamW's two fp32 moments (the params are the model's own, not counted) and the step counts.
    assert 8 * num_params <= memory["optimizer_host_bytes"] < 8 * num_params + 4096
    assert memory["optimizer_device_bytes"] == 0


@pytest.mark.cuda
def test_follows_plain_adamw_on_cuda(tmp_path: Path) -> None:
    """fp32 params, fraction 0.5: Megatron's GPU share is torch's fused CUDA AdamW on the params
    themselves, its CPU share fused CPU AdamW on fp32 host copies; plain AdamW is fused CUDA
    AdamW on all of them. Same arithmetic up to the kernels' rounding: losses within 1e-3."""
    import_or_skip()
    flags = [*TINY, "--device", "cuda", "--steps", "10", "--dtype", "fp32"]
    runs = {
        name: train_gpt.main([*flags, *extra, "--out", str(tmp_path / name)])
        for name, extra in (
            ("adamw", ["--optimizer", "adamw"]),
            ("hdo", ["--optimizer", "megatron-hdo", "--offload-fraction", "0.5"]),
        )
    }
    want = [record["loss"] for record in runs["adamw"]["steps"]]
    got = [record["loss"] for record in runs["hdo"]["steps"]]
    assert got == pytest.approx(want, rel=1e-3)


@pytest.mark.cuda
def test_bf16_full_offload_on_cuda(tmp_path: Path) -> None:
    """bf16 params at fraction 1: every fp32 master, grad and moment is on the host."""
    import_or_skip()
    flags = [*TINY, "--device", "cuda", "--steps", "5", "--offload-fraction", "1"]
    run = train_gpt.main([*flags, "--optimizer", "megatron-hdo", "--out", str(tmp_path)])
    losses = [record["loss"] for record in run["steps"]]
    assert all(math.isfinite(loss) for loss in losses)
    assert run["summary"]["last_loss"] < run["summary"]["first_loss"]
    memory = run["summary"]["memory"]
    assert memory["optimizer_device_bytes"] == 0
    assert memory["optimizer_host_bytes"] >= 16 * run["config"]["num_params"]
