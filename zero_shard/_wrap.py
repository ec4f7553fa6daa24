"""``zero_shard.wrap``: the public entry point, which builds a :class:`ZeroShardOptimizer`."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ._optimizer import ZeroShardOptimizer

__all__ = ["wrap"]


def wrap(optimizer: torch.optim.Optimizer, model: nn.Module, **options: Any) -> ZeroShardOptimizer:
    """Shards ``optimizer`` over the data-parallel ranks, optionally offloading to the CPU.

    Call it on every rank, after ``init_process_group`` and after the model is on its device.
    In one process with no process group (a one-GPU script, not under torchrun) it makes no
    group and runs no collective; a later ``init_process_group`` works, and a wrap after it
    shards over that group.
    The wrapper shares the optimizer's param-group dicts (an LR scheduler built on either one
    drives both) and takes its state over, if any (emptying the optimizer's ``state``); step
    only the wrapper. One live wrapper per param: a later ``wrap`` over a param (re-creating the
    optimizer after unfreezing layers, as torch users do) takes it over, on every rank alike:
    the wrapper that held it is retired (its hooks removed; its ``step()`` raises) once the new
    one is built, as a new torch optimizer replaces an old one.

    As DDP does, a plain model's params and buffers are broadcast from the mesh's first rank at
    wrap, so replicas start equal whatever each rank initialized. Buffers are not synchronized
    after that: each rank's running statistics (BatchNorm) follow its own batches, as under
    ``DistributedDataParallel(broadcast_buffers=False)``; use ``nn.SyncBatchNorm`` for statistics
    over the global batch. A ``DistributedDataParallel`` wrapped around a plain model after
    ``wrap`` (HF Trainer and accelerate do so on several processes) has its gradient sync turned
    off when it runs the model: zero-shard reduces the grads ([Note: DDP around a wrapped model]).

    Grads behave as in torch: backward adds to them until they are cleared, by ``opt.zero_grad()``,
    ``model.zero_grad()`` or ``p.grad = None``. A plain model's grads are reduced into this
    rank's shards during backward and freed from the model, whose ``.grad`` then holds a
    placeholder without memory. Clip with :meth:`ZeroShardOptimizer.clip_grad_norm_` or with
    torch's own ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, ``get_total_norm``
    + ``clip_grads_with_norm_`` or ``clip_grad_value_`` (any norm type, any subset of the
    params; on every rank: the norms take one all-reduce), which give torch's result on the
    unsharded model; read a reduced grad with :meth:`ZeroShardOptimizer.main_grad`. Reading the
    placeholder's values (``p.grad.sum()``, ``p.grad + 1``) raises an error that says so. A DDP
    or FSDP2 model keeps its reduced grads, and torch's clipping works there as usual.

    Args:
        optimizer: a torch optimizer of an elementwise class (AdamW, Adam, SGD, ...) over the
            model's params, with its param groups (per-group lr, weight decay...).
        model: the model those params belong to: a plain module (replicated on every rank), a
            ``DistributedDataParallel``, or an FSDP2 (``fully_shard``) model.
        offload: how much of each rank's optimizer state moves to the CPU; ``None`` (default)
            keeps everything on the accelerator. ``OffloadPolicy(fraction=1.0)`` moves it all.
            An FSDP2 model sharded with ``CPUOffloadPolicy`` keeps its params and grads on the
            host: pass ``OffloadPolicy(fraction=1.0)`` (another fraction is refused); the step
            then runs there, in place on FSDP2's params (no copies, no staging), on the rank's
            CPU threads (``num_threads``), while norms and non-finite checks are reduced over the
            mesh's accelerator.
        mesh: the 1-D data-parallel ``DeviceMesh``, over all ranks or a dim of a mesh that is
            (``mesh["dp"]``); default: all ranks of the default group, or a DDP model's process
            group. Under FSDP2 the params' own mesh is used: with tensor parallelism the 2-D
            ``(dp, tp)`` one, and a param the plan left plain, which FSDP2 shards on
            ``mesh["dp"]`` alone, is taken as replicated over ``tp`` ([Note: FSDP2 params on a
            sub-mesh]).
        stage: 2 (default) reduce-scatters grads during backward so each rank keeps only its
            shard; 1 all-reduces them and keeps the local shard. A DDP model's grads, reduced by
            DDP, are used as they are.
        overlap_param_gather: gather the updated params in the background after ``step()``
            returns, while the next forward runs (each unit's forward pre-hook waits for the
            params it may read), instead of before ``step()`` returns. Default True. The gathers
            are issued by the optimizer, in one order on every rank, on a process group of their
            own: ranks may run different modules, or save on rank 0 alone. Params written
            between ``step()`` and their wait raise an error: call ``finish_param_sync()``
            before writing params after a step (weight constraints). Under ``torch.compile``
            the waits are graph breaks; where breaks are refused (``fullgraph=True``) the
            overlap turns off at the first trace, and with ``False`` the waits stay out of the
            compiled code: whole graphs ([Note: compiled models] in
            ``zero_shard/_compiled.py``). Wrap before a compiled model's first call.
        bucket_mb: MiB of (unsharded) params reduced and gathered together; default 256
            (docs/benchmarks/zero_step.md). Each bucket in flight holds a full-size buffer.
        nonfinite: a step whose grads hold an inf or NaN is skipped with a warning (``"skip"``,
            default) or raises (``"raise"``); either way nothing changes. With ``"skip"`` and an
            optimizer torch has a fused kernel for (Adam, AdamW, SGD), the skip is decided on the
            accelerator and the host does not wait for backward to end at ``step()``; the
            warning, and ``num_skipped_steps``, then come at the next ``step()`` (or when
            ``num_skipped_steps`` is read). fp16 loss scaling with :class:`zero_shard.GradScaler`
            skips and backs off as torch's GradScaler does.
        stale_params: model params written outside the optimizer since it last set them (weights
            loaded into the model after wrapping, as fine-tuning does) have older fp32 main
            weights: ``"reload"`` (default) reloads those from the params at the next step or
            ``state_dict()`` and logs once (a low-precision param that holds exactly what the
            optimizer set keeps its main weights: weights swapped out for an evaluation and
            back lose nothing); ``"error"`` raises there instead. Detected by the
            params' version counters, which in-place writes (``load_state_dict``, ``copy_``,
            ``torch.nn.init``) bump; a write through ``.data`` is not seen. The ranks agree at
            each step in one small all-reduce, read by the host: a plain or DDP model's param
            written on any rank is reloaded on every rank from its own copy (rank 0 loads
            weights, then broadcasts them: a collective bumps no counter), or every rank raises.
            Under FSDP2 both the DTensor's counter and its local tensor's are watched (a DCP load
            in place writes the local tensors); each rank reloads its own shards, and only
            ``"error"`` costs the all-reduce, so that every rank raises.
        units: the modules whose forward waits for the gathered params of their whole subtree,
            as one picks ``fully_shard`` targets: module classes (``[TransformerBlock]``) or
            modules of the model (``list(model.layers)``), each with a forward of its own (an
            ``nn.ModuleList`` is refused: it is never called). The root waits for every param no
            unit holds. Default ``None``: the repeated blocks, i.e. children of
            ``nn.ModuleList`` / ``nn.Sequential`` containers that share their class with a
            sibling and have a forward (transformer layers; lists of lists and bare modules
            holding blocks are looked through), outermost where they nest. Every other module
            waits for the params of its own subtree, and until a unit has run once the modules
            above it wait for its params too: a unit that is never called costs overlap, not
            exactness. A forward that reads the params of a unit that ran before, outside that
            unit's forward and before it runs, needs a coarser unit; ``units=[]`` makes the root
            the only one (exact for any model; the gathers then no longer overlap the forward).
            Ignored under FSDP2.
        all_gather: replaces the all-gather of the updated params (an experiment's own, e.g.
            one over symmetric memory): called as ``all_gather(shard, out, group)`` with each
            bucket's shard, its rank-major output and zero-shard's gather group, on the thread
            that issues the gathers (inside its stream), as
            ``dist.all_gather_into_tensor(out, shard, group=group, async_op=True)``; it returns
            a handle whose ``wait()`` makes that thread's current stream see ``out``. Default
            ``None``: that call. Not called where the data-parallel mesh has one rank (its
            shard is the whole bucket). Refused under FSDP2, which gathers its params itself
            (``FSDPModule.set_custom_all_gather``).

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        >>> opt = zero_shard.wrap(opt, model, offload=zero_shard.OffloadPolicy(fraction=0.5))
        >>> loss(model(batch)).backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    """
    return ZeroShardOptimizer(optimizer, model, **options)


# The options are defined once, by the class's constructor: wrap shows them as its own.
wrap.__signature__ = inspect.signature(ZeroShardOptimizer).replace(  # type: ignore[attr-defined]
    return_annotation=ZeroShardOptimizer
)
