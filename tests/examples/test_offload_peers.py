"""``train_gpt.py --optimizer torchao-offload | fsdp2-offload``: the offload peers in the example's
loop. FSDP2's CPUOffloadPolicy runs on the CPU (gloo), so its wiring is checked against plain
AdamW here; torchao's CPUOffloadOptimizer needs CUDA, so on the CPU only its refusals and import
message are checked, and the GPU tests run it (skipped when torchao does not import: CI does not
install it)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import offload_peers  # noqa: E402
import train_gpt  # noqa: E402

TINY = ["--preset", "tiny", "--quiet", "--seed", "3", "--eval-every", "0"]
# fsdp2-offload at one rank on the CPU, fp32 (no cast per unit): the same fused AdamW kernel on
# the same numbers as plain AdamW (the one shard is the whole tensor, the one-rank reduce-scatter
# a copy, one norm); measured equal to the last bit over these steps, asserted at 1e-6.
ONE_RANK_RTOL = 1e-6
# On CUDA: fused CPU AdamW on the host against fused CUDA AdamW, the kernels' rounding only (as
# tests/examples/test_megatron_hdo.py): losses within 1e-3 over ten steps.
CUDA_RTOL = 1e-3


def losses(run: dict) -> list[float]:
    return [record["loss"] for record in run["steps"]]


@pytest.mark.parametrize(
    ("flags", "world_size", "message"),
    [
        (["--optimizer", "megatron-hdo", "--device", "cpu"], 1, "needs --device cuda, got cpu"),
        (["--optimizer", "megatron-hdo", "--device", "cuda", "--dtype", "fp16"], 1,
         "takes --dtype bf16 or fp32"),
        (["--optimizer", "megatron-hdo", "--device", "cuda"], 2,
         "runs in one process (it shards nothing), got 2 ranks"),
        (["--optimizer", "megatron-hdo", "--device", "cuda", "--checkpoint-dir", "ckpt"], 1,
         "for --optimizer zero-shard only"),
        (["--optimizer", "torchao-offload", "--device", "cpu"], 1, "needs --device cuda, got cpu"),
        (["--optimizer", "torchao-offload", "--device", "cuda"], 2, "runs in one process"),
        (["--optimizer", "torchao-offload", "--device", "cuda", "--dtype", "fp16"], 1,
         "takes --dtype bf16 or fp32"),
        (["--optimizer", "fsdp2-offload", "--device", "cpu", "--dtype", "fp16"], 1,
         "takes --dtype bf16 or fp32"),
        (["--optimizer", "fsdp2-offload", "--device", "cpu", "--checkpoint-dir", "c"], 1,
         "for --optimizer zero-shard only"),
        (["--fsdp2-cpu-offload", "--device", "cpu", "--offload-fraction", "0.5"], 1,
         "--fsdp2-cpu-offload runs with --optimizer zero-shard --offload-fraction 1"),
        (["--fsdp2-cpu-offload", "--device", "cpu", "--optimizer", "adamw"], 1,
         "--fsdp2-cpu-offload runs with --optimizer zero-shard --offload-fraction 1"),
    ],
)  # fmt: skip
def test_refuses_what_it_cannot_run(
    flags: list[str],
    world_size: int,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit):
        train_gpt.parse_args(flags)
    assert message in capsys.readouterr().err


def test_says_how_to_install_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    offload_peers.import_torchao_offload.cache_clear()
    monkeypatch.setattr(offload_peers, "TORCHAO_MODULES", ("no_such_module_for_zero_shard",))
    try:
        with pytest.raises(ImportError, match="no_such_module_for_zero_shard.*pip install torchao"):
            offload_peers.import_torchao_offload()
    finally:
        offload_peers.import_torchao_offload.cache_clear()


def test_fsdp2_offload_follows_plain_adamw_on_cpu(tmp_path: Path) -> None:
    """One rank, fp32: the fully_shard-ed GPT with its shards on the host and AdamW over them
    trains as plain AdamW does; the log says it honours clipping and counts AdamW's state."""
    flags = [*TINY, "--device", "cpu", "--steps", "5"]
    runs = {
        name: train_gpt.main([*flags, "--optimizer", name, "--out", str(tmp_path / name)])
        for name in ("adamw", "fsdp2-offload")
    }
    got, want = runs["fsdp2-offload"], runs["adamw"]
    assert losses(got) == pytest.approx(losses(want), rel=ONE_RANK_RTOL)
    norms = [[record["grad_norm"] for record in run["steps"]] for run in (got, want)]
    assert norms[0] == pytest.approx(norms[1], rel=ONE_RANK_RTOL)
    assert max(norms[1]) > 1.0  # the clip acted on some step
    assert got["summary"]["clipping"]["honoured"] is True
    assert want["summary"]["clipping"] == {
        "max_norm": 1.0, **train_gpt.dataclasses.asdict(train_gpt.CLIPPING["adamw"])
    }  # fmt: skip
    memory, num_params = got["summary"]["memory"], got["config"]["num_params"]
    # AdamW's two fp32 moments over the one rank's shards (the whole model) and the step counts.
    assert 8 * num_params <= memory["optimizer_host_bytes"] < 8 * num_params + 4096
    assert memory["optimizer_device_bytes"] == 0


@pytest.mark.cuda
def test_torchao_offload_follows_plain_adamw_on_cuda(tmp_path: Path) -> None:
    """fp32 params, no autocast, a clip too loose to act (torchao's host step would not see it):
    torchao's host copies stepped by fused CPU AdamW follow fused CUDA AdamW, under the same LR
    schedule (LambdaLR over its param groups)."""
    try:
        offload_peers.import_torchao_offload()
    except ImportError as err:
        pytest.skip(str(err))
    flags = [*TINY, "--device", "cuda", "--steps", "10", "--dtype", "fp32", "--clip", "1e6"]
    runs = {
        name: train_gpt.main([*flags, "--optimizer", name, "--out", str(tmp_path / name)])
        for name in ("adamw", "torchao-offload")
    }
    got, want = runs["torchao-offload"], runs["adamw"]
    assert [r["lr"] for r in got["steps"]] == [r["lr"] for r in want["steps"]]
    assert losses(got) == pytest.approx(losses(want), rel=CUDA_RTOL)
    assert got["summary"]["clipping"]["honoured"] is False
    memory = got["summary"]["memory"]
    # Host: fp32 copies of the large params and of their grads, and their AdamW moments.
    assert memory["optimizer_host_bytes"] >= 12 * got["config"]["num_params"]


@pytest.mark.cuda
def test_fsdp2_offload_trains_in_bf16_on_cuda(tmp_path: Path) -> None:
    """The benchmark's configuration: fp32 shards on the host, bf16 forward and backward; and
    zero-shard stepping the same FSDP2 model's host shards follows FSDP2 + torch AdamW."""
    flags = [*TINY, "--device", "cuda", "--steps", "5"]
    run = train_gpt.main([*flags, "--optimizer", "fsdp2-offload", "--out", str(tmp_path / "f")])
    assert all(math.isfinite(loss) for loss in losses(run))
    assert run["summary"]["last_loss"] < run["summary"]["first_loss"]
    assert run["summary"]["memory"]["optimizer_device_bytes"] == 0
    ours = train_gpt.main(
        [*flags, "--offload-fraction", "1", "--fsdp2-cpu-offload", "--out", str(tmp_path / "z")]
    )
    assert losses(ours) == pytest.approx(losses(run), rel=CUDA_RTOL)
    assert ours["summary"]["clipping"]["honoured"] is True
