"""One process with no process group: ``wrap`` makes a group of one and trains as torch AdamW,
each param its own shard (not held twice), also after ``param.data = ...`` gives a param other
memory and after a load into a state dict taken before wrap; under a launcher's environment for
more ranks it refuses instead of training each rank alone.

Each case runs in a fresh interpreter: the process group it makes would outlive it here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

ONE_PROCESS = textwrap.dedent(
    """
    import io, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from _models import PARAM_TOL, adamw, global_batch, make_model, mse, step_reference
    import zero_shard

    assert not dist.is_initialized()
    model, ref = make_model(), make_model()
    ref_opt = adamw(ref)
    live, ref_live = model.state_dict(), ref.state_dict()  # views of the params, before wrap
    opt = zero_shard.wrap(adamw(model), model, offload=zero_shard.OffloadPolicy(
        fraction=0.5, num_threads=1, chunk_numel=16))
    assert dist.is_initialized() and dist.get_world_size() == 1
    for step in range(6):
        if step == 2:  # other memory for one param, in both: torch's optimizer steps it
            new = torch.randn(model.mid.weight.shape, generator=torch.Generator().manual_seed(5))
            model.mid.weight.data = new.clone()
            ref.mid.weight.data = new.clone()
        if step == 4:  # a load into the early state dicts: they are still the params' memory
            opt.finish_param_sync()
            for key in ("inp.weight", "out.bias"):
                loaded = torch.randn(live[key].shape, generator=torch.Generator().manual_seed(6))
                live[key].copy_(loaded)
                ref_live[key].copy_(loaded)
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

    # One rank: each param is its shard (no second copy), in its own memory.
    big = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    num = sum(p.numel() for p in big.parameters())
    big_opt = zero_shard.wrap(torch.optim.AdamW(big.parameters()), big)
    per_param = big_opt.memory_report().device_bytes / num
    assert per_param < 12.1, f"{{per_param}} bytes a param: fp32 grad and two states are 12"
    buffer = io.BytesIO()
    torch.save(big[2].bias, buffer)
    assert buffer.tell() < 8 * 1024, f"saving one bias wrote {{buffer.tell()}} bytes"
    print("no second copy")
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
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE")  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k not in launcher}
    environment.update(env)
    command = [sys.executable, "-c", script.format(tests=str(TESTS))]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)


def test_wrap_without_a_process_group_trains_as_torch() -> None:
    result = run(ONE_PROCESS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained as torch" in result.stdout and "no second copy" in result.stdout


@pytest.mark.parametrize("name", ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])
def test_wrap_refuses_under_a_launcher_of_several_without_a_group(name: str) -> None:
    result = run(ONE_PROCESS, **{name: "2"})
    assert result.returncode != 0
    assert f"{name}=2 but no process group is initialized" in result.stderr


def test_a_model_converted_after_wrap_is_refused_not_put_back() -> None:
    result = run(CONVERTED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused" in result.stdout
