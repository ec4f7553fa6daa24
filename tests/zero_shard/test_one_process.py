"""One process with no process group: ``wrap`` makes no group (``torch.distributed`` stays
uninitialized through training, torch's clipping and a DCP round trip) and trains as torch
AdamW, each param its own shard (not held twice), also after ``param.data = ...`` gives a param
other memory and after a load into a state dict taken before wrap; a later
``init_process_group`` works, and a wrap after it shards over the group. Under a launcher's
environment for more ranks ``wrap`` refuses instead of training each rank alone, and a wrapper
made alone refuses to step once a group of more ranks exists. On one GPU, a step holds no more
memory than torch's AdamW, between steps and at its peak.

Each case runs in a fresh interpreter: the process group it makes would outlive it here."""

from __future__ import annotations

import os
import socket
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
    assert not dist.is_initialized(), "wrap made a process group"
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
        if step % 2:
            opt.clip_grad_norm_(0.5)
        else:  # torch's own clipping, on the grads' placeholders
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
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

    # A DCP round trip of the optimizer's state, still with no group.
    import tempfile, warnings
    import torch.distributed.checkpoint as dcp
    saved = {{name: param.detach().clone() for name, param in model.named_parameters()}}
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({{"optim": opt.state_dict()}}, checkpoint_id=path)
        state = opt.state_dict()
        dcp.load({{"optim": state}}, checkpoint_id=path)
        opt.load_state_dict(state)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, saved[name], rtol=0, atol=0, msg=name)
    assert not dist.is_initialized(), "a step or a checkpoint made a process group"
    print("no group")

    # full_state_dict is a copy (for torch.save, or kept in memory as the best so far): one step
    # after it changes nothing in it, as at more ranks, where the gather copies.
    full = zero_shard.full_state_dict(opt)
    kept = {{fqn: {{k: v.clone() for k, v in s.items()}} for fqn, s in full["state"].items()}}
    x, y = global_batch(7)
    mse(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    for fqn, param_state in full["state"].items():
        for key, value in param_state.items():
            assert torch.equal(value, kept[fqn][key]), f"{{fqn}} {{key}} changed with the step"
    print("a full copy")

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

    # A 0-dim param (a learned scale, as CLIP's logit_scale) beside the others, with clipping.
    def scaled():
        torch.manual_seed(3)
        net = torch.nn.Linear(15, 2)
        net.scale = torch.nn.Parameter(torch.tensor(1.5))
        return net
    net, ref_net = scaled(), scaled()
    net_opt = zero_shard.wrap(torch.optim.AdamW(net.parameters(), lr=1e-2), net)
    ref_net_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-2)
    for step in range(3):
        x, y = global_batch(step)
        for each, each_opt in ((net, net_opt), (ref_net, ref_net_opt)):
            mse(each(x) * each.scale, y).backward()
            torch.nn.utils.clip_grad_norm_(each.parameters(), 0.5)
            each_opt.step()
            each_opt.zero_grad()
    net_opt.finish_param_sync()
    for (name, param), ref_param in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(param, ref_param, **PARAM_TOL, msg=name)
    print("a 0-dim param")

    # torch's Adagrad makes its state at construction in the params' dtype: wrapped before a
    # step, a bf16 model's fp32 state starts at 0.1, not at its bf16 rounding (0.10009765625).
    bf16 = make_model().to(torch.bfloat16)
    ada = zero_shard.wrap(torch.optim.Adagrad(bf16.parameters(), initial_accumulator_value=0.1),
                          bf16)  # fmt: skip
    assert ada.state, "torch's Adagrad holds state from its construction on"
    for param in bf16.parameters():
        summed = ada.state[param]["sum"].full_tensor()
        assert torch.equal(summed, torch.full(param.shape, 0.1)), summed.flatten()[:3]
    print("fp32 state from the constructor")

    # A loop over the state's keys (as torch's are: no main_param) leaves the main weights.
    bf16 = make_model().to(torch.bfloat16)
    opt16 = zero_shard.wrap(adamw(bf16), bf16)
    mse(bf16(global_batch(0)[0].bfloat16()), global_batch(0)[1]).backward()
    opt16.step()
    opt16.finish_param_sync()
    mains = [opt16.state[param]["main_param"].full_tensor() for param in bf16.parameters()]
    for param in bf16.parameters():
        assert "main_param" not in opt16.state[param], sorted(opt16.state[param])
        for value in opt16.state[param].values():
            value.zero_()
    for param, main in zip(bf16.parameters(), mains, strict=True):
        assert torch.equal(opt16.state[param]["main_param"].full_tensor(), main)
    print("a loop over the state's keys")

    # opt.state.get(p) is torch's defaultdict's: None for a param without state yet (SGD with
    # dampening makes its buffer at the first step), the state after.
    sgd_net = make_model()
    sgd = zero_shard.wrap(torch.optim.SGD(sgd_net.parameters(), lr=0.1, momentum=0.9,
                                          dampening=0.5), sgd_net)  # fmt: skip
    assert sgd.state.get(sgd_net.inp.weight) is None
    assert sgd.state.get(sgd_net.inp.weight, "default") == "default"
    mse(sgd_net(global_batch(0)[0]), global_batch(0)[1]).backward()
    sgd.step()
    assert sorted(sgd.state.get(sgd_net.inp.weight)) == ["momentum_buffer"]
    print("opt.state.get")

    # State the user set before wrap, with every step still 0 (Adagrad's accumulator filled
    # with a value of theirs), is taken over, as torch steps from it. A main_param that a
    # zero-shard state dict left in torch's SGD (torch never steps it) is not: the params have
    # moved on since.
    def adagrad_with_a_sum_set(net: torch.nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.Adagrad(net.parameters(), lr=0.1)
        opt.state[net.inp.weight]["sum"].fill_(5.0)
        return opt

    def sgd_with_a_main_param(net: torch.nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for param in net.parameters():
            opt.state[param]["main_param"] = param.detach() + 1.0
        return opt

    for make_optimizer in (adagrad_with_a_sum_set, sgd_with_a_main_param):
        nets = [make_model(), make_model()]
        opts = [make_optimizer(net) for net in nets]
        opts[0] = zero_shard.wrap(opts[0], nets[0])
        for step in range(2):
            x, y = global_batch(step)
            for each, each_opt in zip(nets, opts, strict=True):
                mse(each(x), y).backward()
                each_opt.step()
                each_opt.zero_grad()
        opts[0].finish_param_sync()
        for (name, param), ref_param in zip(nets[0].named_parameters(), nets[1].parameters()):
            torch.testing.assert_close(param, ref_param, **PARAM_TOL, msg=name)
    print("state set in the torch optimizer before wrap")

    # A wrap that fails after taking the groups (here: building its hybrid) leaves the torch
    # optimizer as it was: its state, and its own state_dict().
    from unittest import mock

    fresh = make_model()
    stepped_opt = adamw(fresh)
    mse(fresh(global_batch(0)[0]), global_batch(0)[1]).backward()
    stepped_opt.step()
    failing = mock.patch.object(zero_shard.ZeroShardOptimizer, "_make_hybrid",
                                side_effect=RuntimeError("out of memory, say"))  # fmt: skip
    try:
        with failing:
            zero_shard.wrap(stepped_opt, fresh)
    except RuntimeError as err:
        kept = err  # the half-built wrapper lives as long as the traceback
        assert len(stepped_opt.state_dict()["state"]) == len(list(fresh.parameters())), kept
    print("a failed wrap leaves it")

    # A group made after wrap: the wrappers made alone still step alone (a group of one), and a
    # new wrap shards over the group.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x, y = global_batch(6)
    mse(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    opt = zero_shard.wrap(adamw(model), model)
    assert opt.mesh.get_group() is not None
    mse(model(x), y).backward()
    opt.step()
    print("a later group")
    """
)

# Each of two processes wraps alone, then they make a group of two: the wrappers made alone
# would never average their grads, so a step refuses.
ALONE_THEN_TWO = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from _models import adamw, make_model
    import zero_shard

    rank, init = int(sys.argv[1]), sys.argv[2]
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model(torch.randn(3, 15)).sum().backward()
    for call in (lambda: opt.clip_grad_norm_(1.0), opt.step, opt.state_dict):
        try:
            call()
        except RuntimeError as err:
            assert "wrapped in one process with no process group" in str(err), err
            assert "group of 2 ranks" in str(err), err
            print("refused")
    dist.destroy_process_group()
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
    # Refused as at more ranks, not put back into the shards: memory of another layout, and
    # memory shared with another param (param.data = another's, an old way to tie weights).
    conv = torch.nn.Conv2d(3, 2, 3)
    opt = zero_shard.wrap(torch.optim.AdamW(conv.parameters()), conv)
    conv.to(memory_format=torch.channels_last)
    try:
        opt.step()
    except RuntimeError as err:
        assert "param 'weight' is not contiguous now" in str(err), err
        print("refused")
    model = make_model()
    opt = zero_shard.wrap(adamw(model), model)
    model.mid.weight.data = model.inp.weight.data.view(-1)[:21].view(3, 7)
    try:
        opt.step()
    except RuntimeError as err:
        assert "share elements since the optimizer was wrapped" in str(err), err
        print("refused")
    """
)


PEAK_MEMORY = textwrap.dedent(
    """
    import torch
    import zero_shard

    BUCKET_MB = 4  # many buckets: the reduced grads of the whole model are 19 times one

    def make():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
        return torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).cuda()

    def measure(wrap, clear):
        base = torch.cuda.memory_allocated()
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        if wrap:
            opt = zero_shard.wrap(opt, model, bucket_mb=BUCKET_MB)
        x = torch.randn(8, 512, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        held, peak = [], 0
        for step in range(4):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            model(x).square().mean().backward()
            if wrap:
                opt.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if clear == "opt":
                opt.zero_grad()
            else:  # the model's way, as Hugging Face's Trainer clears
                model.zero_grad()
            if wrap:
                opt.finish_param_sync()
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated() - base)
        peak = torch.cuda.max_memory_allocated() - base
        out = model(x).sum().item()
        del model, opt
        torch.cuda.empty_cache()
        return held[-1], peak, out

    numel = sum(p.numel() for p in make().parameters())
    torch.cuda.empty_cache()
    torch_held, torch_peak, torch_out = measure(False, "opt")
    print(f"torch AdamW (fused): held {{torch_held / 2**20:.1f}} MiB, peak {{torch_peak / 2**20:.1f}} MiB"
          f" ({{numel * 4 / 2**20:.1f}} MiB of fp32 grads)")
    for clear in ("opt", "model"):
        held, peak, out = measure(True, clear)
        print(f"zero-shard, {{clear}}.zero_grad(): held {{held / 2**20:.1f}} MiB, peak {{peak / 2**20:.1f}} MiB")
        if clear == "opt":  # (the model's way drops the reduced grads at the next forward)
            # After zero_grad the step holds what torch holds: params and two states (the
            # presence flags are a few bytes a bucket).
            assert held <= torch_held + (1 << 20), (clear, held, torch_held)
        # In backward a bucket's grads and its reduced copy stand together until packed: one
        # bucket over torch at most, the whole grads (19 buckets) if the reduced grads were held
        # through the forward.
        assert peak <= torch_peak + BUCKET_MB * 2**20, (clear, peak, torch_peak)
        assert abs(out - torch_out) <= 1e-3 * abs(torch_out), (out, torch_out)
    print("no more than torch")
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
    for said in (
        "trained as torch",
        "no group",
        "a full copy",
        "no second copy",
        "a 0-dim param",
        "fp32 state from the constructor",
        "a failed wrap leaves it",
        "a later group",
    ):
        assert said in result.stdout, (said, result.stdout)


def test_a_wrapper_made_alone_refuses_to_step_in_a_bigger_group() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    script = ALONE_THEN_TWO.format(tests=str(TESTS))
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(rank), init], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for rank in range(2)
    ]  # fmt: skip
    try:  # both to the end (one may end before the other has left the group)
        results = [process.communicate(timeout=300) for process in processes]
    finally:  # a hang, or a failure to communicate: the other is not left running
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, (out, err) in zip(processes, results, strict=True):
        assert process.returncode == 0, err[-3000:]
        assert out.count("refused") == 3, out


@pytest.mark.parametrize("name", ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])
def test_wrap_refuses_under_a_launcher_of_several_without_a_group(name: str) -> None:
    result = run(ONE_PROCESS, **{name: "2"})
    assert result.returncode != 0
    assert f"{name}=2 but no process group is initialized" in result.stderr


def test_a_model_converted_after_wrap_is_refused_not_put_back() -> None:
    result = run(CONVERTED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("refused") == 3, result.stdout


LARGE_PARAMS = textwrap.dedent(
    """
    import torch
    import zero_shard

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(3072, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 3072)
        ).cuda()

    # 4 MB buckets: each weight (9.4M elements) a bucket of its own, packed on the side stream;
    # each bias in a small one, packed on backward's stream (GradReducer._stream_for).
    model, ref = make(), make()
    opt = zero_shard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model, bucket_mb=4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator("cuda").manual_seed(1)
    for step in range(5):
        x = torch.randn(256, 3072, device="cuda", generator=gen)
        for net, optimizer in ((model, opt), (ref, ref_opt)):
            torch.cuda._sleep(20_000_000)  # backward's grads come late on its stream
            net(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            net.zero_grad()
        opt.finish_param_sync()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print("large params follow torch")
    """
)


@pytest.mark.cuda
def test_large_params_at_one_gpu_pack_beside_backward_and_follow_torch() -> None:
    result = run(LARGE_PARAMS)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "large params follow torch" in result.stdout


@pytest.mark.cuda
def test_one_gpu_holds_no_more_than_torch() -> None:
    result = run(PEAK_MEMORY)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "no more than torch" in result.stdout
