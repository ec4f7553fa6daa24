"""One process with no process group: ``wrap`` makes a group of one and trains as torch AdamW,
with the params as views of its shard buffers (not held twice), also after ``param.data = ...``
gives a param other memory; under torchrun's environment for more ranks it refuses instead of
training each rank alone.

Each case runs in a fresh interpreter: the process group it makes would outlive it here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

ONE_PROCESS = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from _models import PARAM_TOL, adamw, global_batch, make_model, mse, step_reference
    import zero_shard

    assert not dist.is_initialized()
    model, ref = make_model(), make_model()
    ref_opt = adamw(ref)
    opt = zero_shard.wrap(adamw(model), model, offload=zero_shard.OffloadPolicy(
        fraction=0.5, num_threads=1, chunk_numel=16))
    assert dist.is_initialized() and dist.get_world_size() == 1
    storages = {{p.untyped_storage().data_ptr() for p in model.parameters()}}
    assert len(storages) == 1, "one bucket: the params are views of its shard buffer"
    for step in range(4):
        if step == 2:  # other memory for one param, in both: torch's optimizer steps it
            new = torch.randn(model.mid.weight.shape, generator=torch.Generator().manual_seed(5))
            model.mid.weight.data = new.clone()
            ref.mid.weight.data = new.clone()
        x, y = global_batch(step)
        mse(model(x), y).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        loss = mse(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.finish_param_sync()
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param, ref_param, **PARAM_TOL, msg=f"step {{step}}: {{name}}")
    print("trained as torch")
    """
)


CONVERTED = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from _models import adamw, make_model
    import zero_shard

    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    model.double()  # after wrap: the params leave the shard buffers they were views of
    try:
        opt.step()
    except RuntimeError as err:
        assert "is torch.float64 on cpu now, but was torch.float32" in str(err), err
        print("refused")
    """
)


def run(script: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    environment.update(env)
    command = [sys.executable, "-c", script.format(tests=str(TESTS))]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)


def test_wrap_without_a_process_group_trains_as_torch() -> None:
    result = run(ONE_PROCESS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained as torch" in result.stdout


def test_wrap_refuses_under_a_world_of_several_without_a_group() -> None:
    result = run(ONE_PROCESS, RANK="0", WORLD_SIZE="2")
    assert result.returncode != 0
    assert "WORLD_SIZE=2 but no process group is initialized" in result.stderr


def test_a_model_converted_after_wrap_is_refused_not_put_back() -> None:
    result = run(CONVERTED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused" in result.stdout
