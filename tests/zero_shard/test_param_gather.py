"""The param gathers on 2 and 3 CPU processes (gloo), as a new user meets them: stock torch and
Hugging Face models whose forward reads params outside the module that owns them, rank-dependent
forwards and saves, and writes or loads right after ``step()``. Each case trains against
single-process torch AdamW on the same global batch and compares the loss every step and the
params after every forward (which waited for them), at the default buckets and at one param per
bucket; cases that would hang if the waits were missing rely on the harness's timeouts."""

from __future__ import annotations

import contextlib
import copy
import io
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import check_outcome, delayed, run_cases
from _models import LOSS_TOL, assert_params_close, local_slice, mean_over_ranks
from torch import nn
from torch.nn.utils import parametrize

import zero_shard
from optimizers import _host_part
from zero_shard import OffloadPolicy, _gather

CASES = {}
LR = 1e-2
# AdamW's eps well above the grad noise: some params' grads are zero but for rounding (the key
# bias of attention: softmax ignores it), and with a tiny eps Adam would turn that noise, which
# differs between any two summation orders, into whole steps of size lr.
EPS = 1e-3
ONE_PER_BUCKET = 1e-6  # MiB: every param gets a bucket of its own
DEFAULT_BUCKETS = 256.0
STEPS = 4
BATCH, DIM = 12, 8  # the global batch (divides by 2, 3 and 4 ranks) and the feature width


def case(function):  # type: ignore[no-untyped-def]
    CASES[function.__name__] = function
    return function


def offload(fraction: float) -> OffloadPolicy | None:
    return None if fraction == 0 else OffloadPolicy(fraction=fraction, num_threads=1, chunk_numel=8)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 5, DIM, generator=gen), torch.randn(BATCH, 5, DIM, generator=gen)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def train_against_torch(
    rank: int,
    world: int,
    build: Callable[[], nn.Module],
    *,
    bucket_mb: float,
    fraction: float = 0.0,
    data: Callable[[int], tuple[Any, Any]] = batch,
    loss_fn: Callable[[nn.Module, Any, Any], torch.Tensor] | None = None,
    after_step: Callable[[nn.Module, Any, int], None] | None = None,
    ddp: bool = False,
    all_params_read: bool = True,
    units_of: Callable[[nn.Module], Any] | None = None,
    **wrap_options: Any,
) -> None:
    """Trains ``build()`` with zero-shard and with torch AdamW on one process; compares the loss
    every step and, where the forward reads every param (``all_params_read``), the params after
    every forward. ``after_step(model, opt, step)`` runs right after each step, on both (``opt``
    is None for the reference). ``ddp``: zero-shard's model is wrapped in DDP first.
    ``units_of(model)``: ``wrap``'s ``units``."""
    loss_fn = loss_fn or (lambda model, x, y: mse(model(x), y))
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS),
        net,
        offload=offload(fraction),
        bucket_mb=bucket_mb,
        stage=1 if ddp else 2,
        units=None if units_of is None else units_of(model),
        **wrap_options,
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        x, y = data(step)
        loss = loss_fn(net, local_slice(x, rank, world), local_slice(y, rank, world))
        where = f"{type(model).__name__}, step {step}, buckets {bucket_mb}, fraction {fraction}"
        if all_params_read:
            assert_params_close(model, ref, where)  # the forward waited for every param it read
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(mean_over_ranks(loss), ref_loss.detach(), **LOSS_TOL)
        if after_step is not None:
            after_step(model, opt, step)
            after_step(ref, None, step)
    opt.finish_param_sync()
    assert_params_close(model, ref, f"{type(model).__name__}, the end")


def each_layout(rank: int, world: int, build: Callable[[], nn.Module], **options: Any) -> None:
    for bucket_mb in (DEFAULT_BUCKETS, ONE_PER_BUCKET):
        train_against_torch(rank, world, build, bucket_mb=bucket_mb, **options)
    train_against_torch(rank, world, build, bucket_mb=ONE_PER_BUCKET, fraction=0.5, **options)


# -- models whose forward reads params its modules do not own ---------------------------------


def encoder() -> nn.Module:
    # Every default but the sizes and dropout (the ranks' masks would differ from the
    # reference's): each layer's nn.MultiheadAttention reads out_proj.weight itself.
    layer = nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@case
def transformer_encoder(rank: int, world: int) -> None:
    each_layout(rank, world, encoder)


class Attentions(nn.Module):
    """Repeated nn.MultiheadAttention blocks: each one is a unit whose forward reads its child
    ``out_proj`` by attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.MultiheadAttention(DIM, 2, batch_first=True) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x, x, x, need_weights=False)[0]
        return x


@case
def multihead_attention_reads_out_proj(rank: int, world: int) -> None:
    each_layout(rank, world, Attentions)


class FunctionalBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM)
        self.low = nn.Linear(DIM, 2)  # 2 rows: an empty shard on the third of 3 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The child's weight used by the parent, the child never called.
        h = torch.tanh(F.linear(x, self.fc.weight, self.fc.bias)) * self.gate(x)
        return x + h + self.low(h).sum(-1, keepdim=True)


class TiedFunctional(nn.Module):
    """Blocks reading their children functionally, and a head tied to the input projection,
    applied with F.linear from the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList(FunctionalBlock() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM, bias=False)
        self.head.weight = self.embed.weight
        self.nothing = nn.Parameter(torch.zeros(0, DIM))  # 0 rows: no rank holds any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.nothing.sum()
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.head.weight)


@case
def weights_read_functionally_and_tied(rank: int, world: int) -> None:
    each_layout(rank, world, TiedFunctional)


class Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(0, 1)


def parametrized() -> nn.Module:
    layers = [nn.Linear(DIM, DIM) for _ in range(4)]
    parametrize.register_parametrization(layers[0], "weight", Symmetric())
    torch.nn.utils.parametrizations.weight_norm(layers[1])
    torch.nn.utils.parametrizations.orthogonal(layers[2])
    with pytest.warns(FutureWarning):  # deprecated, still common: a forward pre-hook of its own
        torch.nn.utils.weight_norm(layers[3])
    # The layers are the units (a Sequential of Linears): each computes its weight first thing.
    return nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2], layers[3])


@case
def parametrizations_and_weight_norm_hooks(rank: int, world: int) -> None:
    each_layout(rank, world, parametrized)


def hf_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (BATCH, 9), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@case
def hugging_face_llama(rank: int, world: int) -> None:
    pytest.importorskip("transformers")
    each_layout(rank, world, hf_llama, data=token_batch, loss_fn=lm_loss)


# -- ranks doing different things ---------------------------------------------------------------


class Experts(nn.Module):
    """Mixture-of-experts style: each rank's rows go through their own expert only, then a
    collective inside forward (a load statistic, as routers all-reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        h = self.experts[expert](torch.tanh(self.inp(x)))
        load = h.detach().abs().mean().reshape(1)
        dist.all_reduce(load)  # on other ranks, a gather of another expert may come first
        return self.out(h)


@case
def each_rank_runs_its_own_expert_with_a_collective_in_forward(rank: int, world: int) -> None:
    per_rank = BATCH // world

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == per_rank:  # this rank's rows
            return mse(model(x, expert=rank), y)
        # The reference: rank r's rows through expert r, the mean of the ranks' losses.
        rows = [slice(r * per_rank, (r + 1) * per_rank) for r in range(world)]
        losses = [mse(model(x[s], expert=r), y[s]) for r, s in enumerate(rows)]
        return torch.stack(losses).mean()

    for bucket_mb in (DEFAULT_BUCKETS, ONE_PER_BUCKET):
        # The other ranks' experts are not read here, and need not be current after forward.
        train_against_torch(
            rank, world, Experts, bucket_mb=bucket_mb, loss_fn=loss, all_params_read=False
        )


@case
def state_dict_on_rank_0_alone_then_barrier(rank: int, world: int) -> None:
    # torch.save(model.state_dict()) on rank 0 only, right after a step, then a barrier: the
    # state_dict hook only waits, so rank 0 cannot issue a gather the others never will.
    def save_on_rank_0(model: nn.Module, opt: Any, step: int) -> None:
        if opt is None:
            return
        if rank == 0:
            saved = model.state_dict()
            part = model.layers[1].state_dict()  # a submodule's, too
            for name, value in part.items():
                assert torch.equal(value, saved[f"layers.1.{name}"])
        dist.barrier()

    for bucket_mb in (DEFAULT_BUCKETS, ONE_PER_BUCKET):
        train_against_torch(rank, world, encoder, bucket_mb=bucket_mb, after_step=save_on_rank_0)


@case
def ddp_over_a_subgroup_wraps_on_its_ranks_only(rank: int, world: int) -> None:
    # An RL-style layout: one model trained by some ranks while the others do other work; only
    # the model's ranks call wrap, which must not wait for the others.
    members = list(range(max(world - 1, 1)))
    subgroup = dist.new_group(members)  # every rank makes it, as new_group requires
    if rank in members:
        torch.manual_seed(0)
        model = TiedFunctional()
        torch.manual_seed(0)
        ref = TiedFunctional()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=subgroup)
        opt = zero_shard.wrap(
            torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), ddp, stage=1,
            bucket_mb=ONE_PER_BUCKET, offload=offload(0.5),
        )  # fmt: skip
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
        for step in range(STEPS):
            x, y = (t[: len(members) * 2] for t in batch(step))  # 2 rows a member
            loss = mse(ddp(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
            assert_params_close(model, ref, f"DDP over ranks {members}, step {step}")
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = mse(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=subgroup)
            torch.testing.assert_close(mean / len(members), ref_loss.detach(), **LOSS_TOL)
        opt.finish_param_sync()
    dist.barrier()


# -- writes and loads right after step() -------------------------------------------------------


def clamp_weights(model: nn.Module, opt: Any, step: int) -> None:
    if opt is not None:
        opt.finish_param_sync()
    with torch.no_grad():
        for param in model.parameters():
            param.clamp_(-0.3, 0.3)


@case
def weight_constraint_after_finish_param_sync(rank: int, world: int) -> None:
    for bucket_mb in (DEFAULT_BUCKETS, ONE_PER_BUCKET):
        train_against_torch(
            rank, world, TiedFunctional, bucket_mb=bucket_mb, after_step=clamp_weights
        )


def stepped(
    rank: int, world: int, bucket_mb: float = ONE_PER_BUCKET, **options: Any
) -> tuple[nn.Module, Any]:
    """A model and its optimizer right after a step, its update on its way to the params."""
    torch.manual_seed(0)
    model = TiedFunctional()
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), model, bucket_mb=bucket_mb,
        **options,
    )  # fmt: skip
    x, y = batch(0)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()
    return model, opt


@case
def writes_right_after_step_without_finish_param_sync_raise(rank: int, world: int) -> None:
    x = local_slice(batch(1)[0], rank, world)
    model, opt = stepped(rank, world)
    with torch.no_grad():
        model.blocks[1].fc.weight.clamp_(-0.3, 0.3)  # the update may not have landed yet
    with pytest.raises(RuntimeError, match=r"blocks\.1\.fc\.weight.*finish_param_sync"):
        model(x)
    # The same with the param in a bucket of several (the error named it, not another one).
    model, opt = stepped(rank, world, bucket_mb=64)
    with torch.no_grad():
        model.blocks[1].fc.weight.clamp_(-0.3, 0.3)
    with pytest.raises(RuntimeError, match=r"blocks\.1\.fc\.weight.*finish_param_sync"):
        model(x)
    # A load through copy_, then reload_model_params: the same error, at the reload.
    model, opt = stepped(rank, world, offload=offload(0.5))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.full_like(param, 0.1))
    with pytest.raises(RuntimeError, match=r"were written after step\(\).*finish_param_sync"):
        opt.reload_model_params()


@case
def memory_given_right_after_step_without_finish_param_sync_raises(rank: int, world: int) -> None:
    # param.data = t moves no version counter: the gather, held until after it here, must not
    # write the update into t (the values given would be lost) but refuse, as for other writes.
    release = threading.Event()

    def held_gather(shard: torch.Tensor, out: torch.Tensor, group: Any) -> Any:
        release.wait(60)
        return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)

    model, _opt = stepped(rank, world, all_gather=held_gather)  # (held: its hooks wait)
    given = torch.full_like(model.blocks[1].fc.weight, 0.1)
    model.blocks[1].fc.weight.data = given
    release.set()
    with pytest.raises(RuntimeError, match=r"blocks\.1\.fc\.weight.*finish_param_sync"):
        model(local_slice(batch(1)[0], rank, world))
    assert torch.equal(given, torch.full_like(given, 0.1)), "the gather wrote into the memory given"


def _into_buffers(model: nn.Module, buffers: list[bytearray]) -> None:
    """Gives each param memory in its buffer (made once: the same address every time), holding
    its values as they are."""
    for param, buffer in zip(model.parameters(), buffers, strict=True):
        memory = torch.frombuffer(buffer, dtype=param.dtype)[: param.numel()].view_as(param)
        memory.copy_(param.detach())
        param.data = memory


@case
def memory_given_anew_at_the_same_address_is_taken_as_written(rank: int, world: int) -> None:
    # .data = moves no version counter, so a param given other memory is found by its memory:
    # model.half() for an evaluation, then model.float(), may hand a param memory at its old
    # address (the allocator reuses it), holding the values rounded to fp16; torch steps from
    # those. Here the same address is certain: each param's memory lies in a buffer of the
    # test's, given once (step 1) and again after an fp16 round trip (step 3).
    for fraction in (0.0, 0.5):
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(
                nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
            )
        model, ref = models
        opt = zero_shard.wrap(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), model,
                              offload=offload(fraction), bucket_mb=ONE_PER_BUCKET)  # fmt: skip
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
        buffers = [bytearray(p.numel() * p.element_size() + 64) for p in model.parameters()]
        for step in range(6):
            if step in (1, 3):
                opt.finish_param_sync()
                if step == 3:  # an fp16 evaluation's round trip
                    for net in (model, ref):
                        net.half()
                        net.float()
                _into_buffers(model, buffers)
                _into_buffers(ref, [bytearray(b) for b in buffers])
                if step == 1:
                    given = [p.data_ptr() for p in model.parameters()]
                assert [p.data_ptr() for p in model.parameters()] == given
            x, y = batch(step)
            mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            mse(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.finish_param_sync()
            assert_params_close(model, ref, f"fraction {fraction}, step {step}")


@case
def memory_given_anew_at_the_same_address_right_after_step_raises(rank: int, world: int) -> None:
    # As above, with the gather of the step's update held until after memory was given anew at
    # the param's address (an fp16 round trip without finish_param_sync()): refused at the wait,
    # and the update is not written into the memory given.
    release, held = threading.Event(), [False]

    def held_gather(shard: torch.Tensor, out: torch.Tensor, group: Any) -> Any:
        if held[0]:
            release.wait(60)
        return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)

    model, opt = stepped(rank, world, all_gather=held_gather)
    opt.finish_param_sync()
    buffers = [bytearray(p.numel() * p.element_size() + 64) for p in model.parameters()]
    _into_buffers(model, buffers)
    given = [p.data_ptr() for p in model.parameters()]
    x, y = batch(1)
    mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    held[0] = True
    opt.step()  # its gathers wait
    values = [p.detach().half().float() for p in model.parameters()]
    for param, value in zip(model.parameters(), values, strict=True):
        param.data = value
    _into_buffers(model, buffers)
    assert [p.data_ptr() for p in model.parameters()] == given
    held[0] = False
    release.set()
    with pytest.raises(RuntimeError, match=r"were written after step\(\).*finish_param_sync"):
        opt.finish_param_sync()
    for param, value in zip(model.parameters(), values, strict=True):
        assert torch.equal(param.detach(), value), "the update was written into the memory given"


@case
def params_copied_to_an_equal_device_and_a_state_dict_round_trip_train_as_torch(
    rank: int, world: int
) -> None:
    # accelerate on CPUs, after wrap: model.to(torch.device("cpu", 0)) copies every param (torch's
    # "cpu:0" is not a CPU tensor's "cpu") into memory given with .data =, then the optimizer's
    # state dict goes round. The load takes the params as they are: no write is raised after it.
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(TiedFunctional())
    model, ref = models
    opt = zero_shard.wrap(
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), model, bucket_mb=ONE_PER_BUCKET
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    before = [p.data for p in model.parameters()]  # held: no new copy can take their memory
    model.to(torch.device("cpu", 0))
    moved = [
        p.data_ptr() != old.data_ptr() for p, old in zip(model.parameters(), before, strict=True)
    ]
    del before
    assert sum(moved) == len(moved) - 1, moved  # all but `nothing` (no elements, no memory)
    opt.load_state_dict(opt.state_dict())
    for step in range(STEPS):
        x, y = batch(step)
        mse(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.finish_param_sync()
    assert_params_close(model, ref, "after the steps")


@case
def a_failed_gather_raises_at_every_wait(rank: int, world: int) -> None:
    # Every rank fails alike (one rank alone would leave the others' gathers to time out).
    def failing(*args: Any) -> None:
        raise RuntimeError("injected gather failure")

    model, opt = stepped(rank, world, all_gather=failing)
    with pytest.raises(RuntimeError, match="injected gather failure"):
        model(local_slice(batch(1)[0], rank, world))
    with pytest.raises(RuntimeError, match="injected gather failure"):
        opt.finish_param_sync()  # the later buckets were never gathered: they say so too
    # A gather that returns no handle says so at the wait, on every rank.
    model, opt = stepped(rank, world, all_gather=lambda shard, out, group: None)
    with pytest.raises(TypeError, match=r"all_gather returned NoneType, not a handle with wait"):
        model(local_slice(batch(1)[0], rank, world))


@case
def a_given_all_gather_gathers_every_bucket(rank: int, world: int) -> None:
    # wrap(all_gather=...) replaces the gathers (an experiment's own): called once per bucket and
    # step, on zero-shard's gather group, and the result is torch's (each_layout: with offload).
    calls: list[tuple[int, int]] = []

    def counted(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Any:
        calls.append((shard.numel(), dist.get_world_size(group)))
        return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)

    each_layout(rank, world, TiedFunctional, all_gather=counted)
    num_params = len(list(TiedFunctional().parameters()))
    one_per_bucket = 2 * STEPS * num_params  # two of the three layouts: a bucket per param
    assert len(calls) > one_per_bucket, calls
    assert all(size == world for _, size in calls), calls
    calls.clear()
    train_against_torch(rank, world, TiedFunctional, bucket_mb=ONE_PER_BUCKET, all_gather=counted)
    assert len(calls) == STEPS * num_params, (len(calls), STEPS, num_params)


@case
def optimizer_load_state_dict_right_after_step_keeps_the_update(rank: int, world: int) -> None:
    # A twin that finished its step gives the state dict; loaded right after our step (whose
    # update is still on its way to the params), the main weights must be the updated ones.
    twin = [None, None]

    def load_twins_state(model: nn.Module, opt: Any, step: int) -> None:
        if opt is None:
            return
        twin_model, twin_opt = twin
        x, y = batch(step)
        mse(twin_model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        twin_opt.step()
        twin_opt.zero_grad()
        zero_shard.load_full_state_dict(opt, zero_shard.full_state_dict(twin_opt))

    torch.manual_seed(0)
    twin[0] = encoder()
    twin[1] = zero_shard.wrap(
        torch.optim.AdamW(twin[0].parameters(), lr=LR, eps=EPS), twin[0], bucket_mb=ONE_PER_BUCKET
    )
    train_against_torch(rank, world, encoder, bucket_mb=ONE_PER_BUCKET, after_step=load_twins_state)


@case
def model_load_state_dict_right_after_step_lands_on_the_update(rank: int, world: int) -> None:
    torch.manual_seed(7)
    other = {k: v.clone() for k, v in encoder().state_dict().items()}

    def load_weights(model: nn.Module, opt: Any, step: int) -> None:
        if step == 1:
            model.load_state_dict(other)

    train_against_torch(rank, world, encoder, bucket_mb=ONE_PER_BUCKET, after_step=load_weights)


# -- units -------------------------------------------------------------------------------------


@case
def units_given_as_classes_modules_or_none(rank: int, world: int) -> None:
    choices = [
        lambda model: [FunctionalBlock],
        lambda model: list(model.blocks),
        lambda model: [],  # the root alone
        lambda model: [nn.Linear, FunctionalBlock],  # nested: the blocks cover their Linears
    ]
    for units_of in choices:
        train_against_torch(
            rank, world, TiedFunctional, bucket_mb=ONE_PER_BUCKET, units_of=units_of
        )


@case
def a_submodule_called_on_its_own_waits_for_its_params(rank: int, world: int) -> None:
    # The head runs outside model(...): its own pre-hook waits (the root's never fires).
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for block in model.blocks:
            h = block(h)
        return mse(model.head(model.norm(h)), y)

    train_against_torch(rank, world, TiedFunctional, bucket_mb=ONE_PER_BUCKET, loss_fn=loss)


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    # As users group them: the norms and biases of every layer in a group of their own.
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


@contextlib.contextmanager
def cpu_steps_held() -> Any:
    """Every CPU chunk step waits until the event yielded is set (for at most a minute)."""
    held = threading.Event()
    step_chunk = _host_part._step_chunk

    def step_when_released(*args: Any, **kwargs: Any) -> Any:
        if not held.wait(timeout=60):
            raise AssertionError("the CPU step was held for a minute")
        return step_chunk(*args, **kwargs)

    _host_part._step_chunk = step_when_released
    try:
        yield held
    finally:
        _host_part._step_chunk = step_chunk


def run_first_layers(model: nn.Module, x: torch.Tensor, ran: threading.Event) -> None:
    model.layers[1](model.layers[0](x))
    ran.set()


@case
def the_first_layers_run_while_the_cpu_steps_the_last(rank: int, world: int) -> None:
    # At fraction 0.5 the CPU takes the last two of four layers whole (not the norms of every
    # layer, which the optimizer's groups list after the weights), and the next forward's first
    # two layers run while the CPU step is held; training follows torch's.
    def build() -> nn.Module:
        layer = nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()
    opt = zero_shard.wrap(
        torch.optim.AdamW(decay_groups(model), lr=LR, eps=EPS),
        model,
        offload=OffloadPolicy(fraction=0.5, num_threads=1),
    )
    ref_opt = torch.optim.AdamW(decay_groups(ref), lr=LR, eps=EPS)
    for step in range(STEPS):
        x, y = batch(step)
        local_x = local_slice(x, rank, world)
        loss = mse(model(local_x), local_slice(y, rank, world))
        assert_params_close(model, ref, f"step {step}")
        loss.backward()
        with cpu_steps_held() as held:
            opt.step()
            ran = threading.Event()
            first = threading.Thread(target=run_first_layers, args=(model, local_x, ran))
            first.start()
            ran_held = ran.wait(timeout=20)
            held.set()
            first.join()
        assert ran_held, f"step {step}: the first layers waited for the CPU step of the last"
        opt.zero_grad()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = mean_over_ranks(loss) if world > 1 else loss.detach()
        torch.testing.assert_close(mean_loss, ref_loss.detach(), **LOSS_TOL)
    opt.finish_param_sync()
    assert_params_close(model, ref, "the end")


def test_one_process_runs_the_first_layers_while_the_cpu_steps_the_last() -> None:
    the_first_layers_run_while_the_cpu_steps_the_last(0, 1)  # no process group


@case
def bad_units_are_refused_on_every_rank(rank: int, world: int) -> None:
    model = TiedFunctional()
    with pytest.raises(
        ValueError, match="class MultiheadAttention, but the model has no submodule"
    ):
        zero_shard.wrap(torch.optim.AdamW(model.parameters()), model, units=[nn.MultiheadAttention])
    with pytest.raises(ValueError, match="not a submodule of the model"):
        zero_shard.wrap(torch.optim.AdamW(model.parameters()), model, units=[nn.Linear(2, 2)])
    with pytest.raises(
        TypeError, match="units must hold nn.Module classes or modules, got 'blocks'"
    ):
        zero_shard.wrap(torch.optim.AdamW(model.parameters()), model, units=["blocks"])


# -- module trees whose containers never run ----------------------------------------------------


def sleepy_all_gather(seconds: float) -> Callable[..., Any]:
    """``wrap(all_gather=...)`` that issues each bucket's gather ``seconds`` late on rank 0 (so on
    every rank): a forward that did not wait for a bucket reads the weights of the step before."""

    def gather(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Any:
        if dist.get_rank() == 0:
            time.sleep(seconds)
        return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)

    return gather


class ReadsChildWeights(nn.Module):
    """A block that reads its children's weights itself: nn.MultiheadAttention reads its
    out_proj's, and the block its fc's."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x, x, x, need_weights=False)[0]
        return h + torch.tanh(F.linear(h, self.fc.weight, self.fc.bias))


class Stages(nn.Module):
    """Stages of blocks: an nn.ModuleList of nn.ModuleLists, neither of which is ever called."""

    def __init__(self, block: Callable[[], nn.Module] = ReadsChildWeights) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(block() for _ in range(2)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x


class Levels(nn.Module):
    """Levels as bare nn.Modules (a namespace, never called) holding blocks and a projection,
    as taming-transformers' encoder builds them."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        for _ in range(2):
            level = nn.Module()
            level.block = nn.ModuleList(ReadsChildWeights() for _ in range(2))
            level.proj = nn.Linear(DIM, DIM)
            self.down.append(level)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for level in self.down:
            for block in level.block:
                x = block(x)
            x = level.proj(x)
        return x


def stock_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, batch_first=True)


class Bypassed(nn.Module):
    """A block its parent never calls: the parent runs its child and reads its gate itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ReadsChildWeights()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the parent calls the children of this block, never the block")


class CallsAroundBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Bypassed() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.inner(x) * block.gate
        return x


class EnteredByAMethod(nn.Module):
    """Trained through ``loss``, never ``forward``: it reads its own ``scale`` before any of its
    submodules runs (CLIP's towers and temperature, a loss method on the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.blocks = nn.ModuleList(FunctionalBlock() for _ in range(2))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        for block in self.blocks:
            h = block(h)
        return mse(h, y)


@case
def a_model_entered_by_a_registered_method_reads_its_params_updated(rank: int, world: int) -> None:
    def build() -> nn.Module:
        model = EnteredByAMethod()
        zero_shard.register_forward_method(model, "loss")  # before wrap: looked up at each call
        return model

    for fraction in (0.0, 0.5):
        train_against_torch(
            rank, world, build, bucket_mb=DEFAULT_BUCKETS, fraction=fraction,
            loss_fn=lambda model, x, y: model.loss(x, y), all_params_read=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"no method 'los' to register"):
        zero_shard.register_forward_method(EnteredByAMethod(), "los")
    model = EnteredByAMethod()  # not registered: said at wrap
    with pytest.warns(RuntimeWarning, match=r"no forward of its own.*register_forward_method"):
        opt = zero_shard.wrap(torch.optim.AdamW(model.parameters()), model)
    zero_shard.register_forward_method(model, "loss")  # after wrap
    x, y = (local_slice(t, rank, world) for t in batch(0))
    model.loss(x, y).backward()
    opt.step()
    # A copy (an EMA model) calls its own method on its own params, and the model pickles.
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for param in ema.parameters():
            param.zero_()
    zeros = EnteredByAMethod()
    with torch.no_grad():
        for param in zeros.parameters():
            param.zero_()
    assert torch.equal(ema.loss(x, y), zeros.loss(x, y))
    torch.save(model, io.BytesIO())


def eval_matches_torch(rank: int, world: int) -> Callable[[nn.Module, Any, int], None]:
    """``after_step`` that runs the model in eval mode (``nn.TransformerEncoderLayer``'s fast
    path) right after each step, zero-shard's first, and compares the outputs."""
    outputs: list[torch.Tensor] = []

    def evaluate(model: nn.Module, opt: Any, step: int) -> None:
        x = local_slice(batch(50 + step)[0], rank, world)
        model.eval()
        with torch.no_grad():
            outputs.append(model(x))
        model.train()
        if opt is None:
            ours, ref = outputs[-2:]
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5, msg=f"eval, step {step}")

    return evaluate


@case
def containers_that_never_run_are_looked_through(rank: int, world: int) -> None:
    # The default units are the blocks inside the lists and levels, which run; every read of a
    # child's weight waits, with the gathers issued late on purpose.
    late = sleepy_all_gather(0.01)
    for build in (Stages, Levels):
        for fraction in (0.0, 0.5):
            train_against_torch(
                rank, world, build, bucket_mb=ONE_PER_BUCKET, fraction=fraction, all_gather=late
            )
    stock = lambda: Stages(stock_layer)  # noqa: E731
    train_against_torch(
        rank, world, stock, bucket_mb=ONE_PER_BUCKET, all_gather=late,
        after_step=eval_matches_torch(rank, world),
    )  # fmt: skip


@case
def a_unit_that_never_runs_is_waited_for_by_the_module_above(rank: int, world: int) -> None:
    late = sleepy_all_gather(0.01)
    for units_of in (None, lambda model: list(model.blocks)):
        # It costs the overlap, and says so once, after three forwards.
        with pytest.warns(
            RuntimeWarning, match=r"units \['blocks.0', 'blocks.1'\] \(2 in all\) have"
        ):
            train_against_torch(
                rank, world, CallsAroundBlocks, bucket_mb=ONE_PER_BUCKET, all_gather=late,
                units_of=units_of,
            )  # fmt: skip


@case
def units_without_a_forward_are_refused_on_every_rank(rank: int, world: int) -> None:
    model = Stages()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="ModuleList, which has no forward of its own"):
        zero_shard.wrap(adamw, model, units=[model.stages])
    with pytest.raises(ValueError, match="ModuleList, which has no forward of its own"):
        zero_shard.wrap(adamw, model, units=[nn.ModuleList])
    levels = Levels()
    with pytest.raises(ValueError, match="Module, which has no forward of its own"):
        zero_shard.wrap(torch.optim.AdamW(levels.parameters()), levels, units=[levels.down[0]])


# -- a race test for the waits ---------------------------------------------------------------


def slow_gathers(seconds: float) -> contextlib.AbstractContextManager:
    """Every bucket's copy into the params comes ``seconds`` later: a forward that did not wait
    for it would read old weights."""
    # Private: the race test slows the gather's copy itself; no public hook reaches it.
    return delayed(_gather, "unpack_params", lambda: time.sleep(seconds))


class Blocks(nn.Module):
    """Three blocks (the units) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tie_the_first_block_to_the_last(model: nn.Module, opt: Any, step: int) -> None:
    if step == 0:
        model.blocks[0][0].weight = model.blocks[2][0].weight


@case
def weights_tied_after_wrap_are_waited_for(rank: int, world: int) -> None:
    # A param of the optimizer set on another unit's module after wrap is read there before the
    # units' planned waits reach its bucket: the forwards wait for every bucket from then on
    # ([Note: params registered after wrap]), with a warning; torch's numbers every step.
    with slow_gathers(0.02 if rank == 0 else 0.0):
        for fraction in (0.0, 0.5):
            with pytest.warns(RuntimeWarning, match="set as 'weight' of a Linear .* after wrap"):
                train_against_torch(
                    rank, world, Blocks, bucket_mb=ONE_PER_BUCKET, fraction=fraction,
                    after_step=tie_the_first_block_to_the_last,
                )  # fmt: skip
    # Two wrappers over one model (the blocks', then the head's): the one holding the param is
    # told, whichever wrapped last.
    model = Blocks()
    blocks_opt = zero_shard.wrap(torch.optim.AdamW(model.blocks.parameters()), model)
    head_opt = zero_shard.wrap(torch.optim.SGD(model.head.parameters(), lr=LR), model)
    with pytest.warns(RuntimeWarning, match="set as 'weight' of a Linear .* after wrap"):
        tie_the_first_block_to_the_last(model, blocks_opt, 0)
    assert head_opt is not None  # alive through the tie


def read_state(model: nn.Module, opt: Any, step: int) -> None:
    """Reads the optimizer state while the step's CPU share and gathers are in flight."""
    if opt is not None:
        for param in model.parameters():
            assert int(opt.state[param]["step"]) == step + 1


@case
def forward_waits_for_slow_gathers(rank: int, world: int) -> None:
    with slow_gathers(0.02 if rank == 0 else 0.0):
        for fraction in (0.0, 1.0):
            train_against_torch(
                rank, world, TiedFunctional, bucket_mb=ONE_PER_BUCKET, fraction=fraction,
                after_step=read_state,
            )  # fmt: skip
        # A DDP model, with a save on rank 0 alone between step and forward.
        train_against_torch(
            rank, world, encoder, bucket_mb=ONE_PER_BUCKET, fraction=0.5, ddp=True,
            after_step=lambda model, opt, step: rank == 0 and model.state_dict(),
        )  # fmt: skip


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def outcomes(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return run_cases(CASES, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_distributed(outcomes: dict[str, str | None], name: str) -> None:
    check_outcome(outcomes, name)
