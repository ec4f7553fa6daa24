"""Hugging Face's ``transformers.Trainer`` and ``accelerate.Accelerator`` driving an optimizer
under zero_shard.wrap (offload fraction 0.5), against the same loop with plain torch AdamW: the
params after every run and the grad norms the loops clip by and log, equal. Both clip with
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on the model's placeholders
([Note: torch's clip on released grads]). A tiny ``LlamaForCausalLM`` built from a config:
nothing is downloaded. One process, in a spawn of its own (both libraries keep process-wide
state), and 2 ranks under ``torchrun``, where both wrap the model in DDP after the optimizer
was wrapped ([Note: DDP around a wrapped model]) and each rank trains on its share of the
batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import check_outcome, run_cases

import zero_shard
from zero_shard import OffloadPolicy

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

CASES = {}
STEPS = 4
BATCH = 8
# AdamW at lr 1e-2 carries the grads' rounding (the ranks' reduction order, and the CPU share's
# kernel) into the params at O(lr) a step.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def build_llama() -> torch.nn.Module:
    """Two layers over a 64-token vocabulary; weights large enough that max_norm=1.0 clips."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def token_rows() -> torch.Tensor:
    return torch.randint(0, 64, (STEPS * BATCH, 12), generator=torch.Generator().manual_seed(0))


def optimizer_for(model: torch.nn.Module, wrapped: bool) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if wrapped:
        opt = zero_shard.wrap(opt, model, offload=OffloadPolicy(fraction=0.5, num_threads=1))
    return opt


def finish(opt: Any) -> None:
    """The last step's gathers reach the params (under accelerate, through its wrapper)."""
    inner = getattr(opt, "optimizer", opt)
    if isinstance(inner, zero_shard.ZeroShardOptimizer):
        inner.finish_param_sync()


def assert_same_training(
    runs: dict[bool, tuple[torch.nn.Module, list[float]]], where: str, *, steps: int = STEPS
) -> None:
    (ref, ref_norms), (model, norms) = runs[False], runs[True]
    assert len(norms) == steps and max(ref_norms) > 1.0, (where, ref_norms)  # the clip bites
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0.0, msg=where
    )
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param, ref_param, **TOL, msg=f"{where}: {name}")


class GradNorms(transformers.TrainerCallback):
    """The ``grad_norm`` the Trainer logs each step (what its clip returned)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "grad_norm" in logs:
            self.norms.append(float(logs["grad_norm"]))


@case
def trainer_trains_as_with_torch_adamw(rank: int, world: int) -> None:
    transformers.logging.set_verbosity_error()
    rows = [{"input_ids": ids, "labels": ids} for ids in token_rows()]
    runs = {}
    for wrapped in (False, True):
        model = build_llama()
        opt = optimizer_for(model, wrapped)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        norms = GradNorms()
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                out, per_device_train_batch_size=BATCH, max_steps=STEPS, logging_steps=1,
                report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            )  # fmt: skip
            trainer = transformers.Trainer(
                model, args, train_dataset=rows, optimizers=(opt, scheduler), callbacks=[norms]
            )
            trainer.train()
        finish(opt)
        runs[wrapped] = (model, norms.norms)
    assert_same_training(runs, "Trainer")


def accelerate_runs(
    accumulation: int, *, clip_every_micro_batch: bool = False
) -> dict[bool, tuple[torch.nn.Module, list[float]]]:
    """Plain torch AdamW and zero-shard under ``accelerate.Accelerator.prepare``, with
    ``accumulation`` micro-batches a step in ``accumulate()``, clipped once they are done (or
    after every one)."""
    runs = {}
    for wrapped in (False, True):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
        model = build_llama()
        opt = optimizer_for(model, wrapped)
        loader = torch.utils.data.DataLoader(token_rows(), batch_size=BATCH // accumulation)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        norms = []
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=batch, labels=batch).loss)
                if accelerator.sync_gradients or clip_every_micro_batch:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
                opt.zero_grad()
        finish(opt)
        runs[wrapped] = (accelerator.unwrap_model(model), norms)
    return runs


@case
def accelerate_prepare_and_clip_grad_norm_train_as_with_torch_adamw(rank: int, world: int) -> None:
    runs = accelerate_runs(accumulation=1)
    assert_same_training(runs, "accelerate", steps=STEPS // world)  # the loader's share


@case
def accelerate_accumulation_trains_as_with_torch_adamw(rank: int, world: int) -> None:
    # accumulate() runs the micro-batches before the last under DDP's no_sync(). A clip after
    # the last trains as torch; a clip on every one (sync_gradients left unchecked) would clip
    # each rank's own grads under DDP, which zero-shard has reduced already: at more than one
    # rank it raises on every rank ([Note: DDP around a wrapped model]).
    runs = accelerate_runs(accumulation=2)
    assert_same_training(runs, "accelerate, accumulated", steps=STEPS // world)
    if world > 1:
        with pytest.raises(RuntimeError, match="inside the no_sync"):
            accelerate_runs(accumulation=2, clip_every_micro_batch=True)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cases(CASES, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_hf(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)


@pytest.fixture(scope="module")
def outcomes_under_torchrun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Every case at 2 ranks, launched as users launch them: ``torchrun``, which leaves the
    process group to the libraries (this file's ``__main__``)."""
    out = tmp_path_factory.mktemp("torchrun")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        __file__, str(out),
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=420)
    outcomes: dict[str, str | None] = {name: None for name in CASES}
    for rank in range(2):
        path = out / f"rank{rank}.json"
        found = json.loads(path.read_text()) if path.exists() else {}
        for name in CASES:
            failure = found.get(name, f"rank {rank} did not finish (rc {result.returncode})")
            if failure is not None and outcomes[name] is None:
                outcomes[name] = f"rank {rank}: {failure}\n{result.stderr[-3000:]}"
    return outcomes


@pytest.mark.parametrize("name", list(CASES))
def test_hf_under_torchrun(outcomes_under_torchrun: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes_under_torchrun, name)


if __name__ == "__main__":  # one rank of outcomes_under_torchrun
    warnings.simplefilter("ignore")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict[str, str | None] = {}
    for name, function in CASES.items():
        try:
            function(rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(results))
