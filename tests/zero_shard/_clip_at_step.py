"""One case for the CPU (gloo, 2 and 3 ranks) and the GPUs (NCCL): a plain model's clip applied
at the step ([Note: clip at the step]) against the clip multiplying the grads first."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _models import adamw, global_batch, local_slice, make_model, mse

import zero_shard
from zero_shard import OffloadPolicy


def _clip_runs(fraction: float, staging: str, device: torch.device) -> list[Any]:
    """Two bf16 models and wrapped optimizers alike, the second with the clip multiplying the
    grads before the step and every grad copied at the step (white-box: the path DDP and FSDP2
    models take), the first as a plain model is wrapped."""
    runs = []
    for clip_at_step in (True, False):
        model = make_model().to(device, torch.bfloat16)
        offload = OffloadPolicy(fraction=fraction, chunk_numel=16, host_staging=staging)
        opt = zero_shard.wrap(adamw(model), model, offload=offload, bucket_mb=0.0002)
        assert opt.kind.clip is not None
        # Only per-chunk staging hands reduced grads over in backward's hooks.
        assert (opt.kind.reducer._early is not None) == (staging == "per_chunk")
        if not clip_at_step:
            opt.kind.clip = opt.kind.reducer._clip = opt.kind.reducer._early = None
        scaler = zero_shard.GradScaler(device.type, init_scale=16.0)
        runs.append((model, opt, scaler))
    return runs


def _count_copies(opt: Any) -> list[int]:
    """Counts the D2H copies the optimizer's host part queues from now on."""
    copies = [0]
    engine = opt._hybrid._host.engine
    d2h = engine.d2h

    def counted(pairs: Any, **kwargs: Any) -> Any:
        copies[0] += 1
        return d2h(pairs, **kwargs)

    engine.d2h = counted
    return copies


def _chunks_reduced_last(opt: Any) -> int:
    """The CPU's chunks holding a piece of a param of the bucket reduced last: their grads are
    copied at the step, the others' by backward."""
    indices = {i for i, s in enumerate(opt._sharded) if s.bucket == 0}
    host = opt._hybrid._host
    return len({c.index for i in indices for c in host._chunks_of.get(i, ())})


def check_clip_at_step(device: torch.device, rank: int, world: int) -> None:
    """Through accumulation (also after a clip), two clips, GradScaler's unscale and each way of
    clearing grads, the params are the same bits as with the clip multiplying the grads first;
    with per-chunk staging a plain step finds every chunk's grads copied to the host by backward
    but those of the bucket reduced last."""
    by_backward = 0  # chunks a plain step found copied by backward
    for fraction, staging in ((1.0, "per_chunk"), (0.5, "per_chunk"), (1.0, "bounded")):
        runs = _clip_runs(fraction, staging, device)
        copies = _count_copies(runs[0][1])
        for step in range(10):
            kind = step % 5  # 1: accumulation over two backwards; 2: two clips; 3: a scaler;
            #                  4: a backward after the clip (it adds to the clipped grads)
            for model, opt, scaler in runs:
                x, y = (t.to(device, torch.bfloat16) for t in global_batch(step))
                every = 2 if kind in (1, 4) else 1
                for micro in range(every):
                    part = local_slice(x, rank, world)[micro::every]
                    target = local_slice(y, rank, world)[micro::every]
                    loss = mse(model(part), target)
                    (scaler.scale(loss) if kind == 3 else loss).backward()
                    if kind == 4 and micro == 0:
                        opt.clip_grad_norm_(0.05)
                if kind == 3:
                    scaler.unscale_(opt)
                opt.clip_grad_norm_(0.05)
                if kind == 2:
                    opt.clip_grad_norm_(0.02)
                before = copies[0]
                if kind == 3:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if opt is runs[0][1] and staging == "per_chunk" and kind == 0:
                    at_step, last = copies[0] - before, _chunks_reduced_last(opt)
                    assert at_step == last, f"{fraction} step {step}: {at_step} copied, {last}"
                    by_backward += len(opt._hybrid._host.chunks) - last
                (opt if step % 2 else model).zero_grad()
                opt.finish_param_sync()
            for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
                assert torch.equal(a, b), f"{fraction}/{staging} step {step}"
        assert copies[0] > 0
    counted = torch.tensor([by_backward], device=device)
    dist.all_reduce(counted)  # some rank's chunks hold no piece of the bucket reduced last
    assert int(counted) > 0
