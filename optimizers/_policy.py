"""What moves to the CPU and how: the offload policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from offload import check_switch_interval

__all__ = [
    "CpuKernel",
    "DelayedUpdate",
    "DeviceImpl",
    "HostStaging",
    "OffloadPolicy",
    "StagingKind",
]

DeviceImpl = Literal["torch", "apex", "te"]
CpuKernel = Literal["auto", "fused", "torch"]
HostStaging = Literal["auto", "bounded", "per_chunk"]
StagingKind = Literal["bounded", "per_chunk"]  # HostStaging with "auto" resolved


@dataclass(frozen=True)
class DelayedUpdate:
    """The one-step delayed update as the optimizer runs it (``OffloadPolicy.delayed_update``).

    Its CPU step runs while the main thread queues the next forward and backward and autograd's
    thread runs backward: ``CORES_KEPT_FREE`` of the rank's cores are left to them. Its weights
    wait in staging until the next step, so it takes a buffer per chunk and copies no grads
    early (see [Note: staging ring])."""

    warmup: int  # the first this many updates are exact
    CORES_KEPT_FREE: ClassVar[int] = 2
    STAGING: ClassVar[StagingKind] = "per_chunk"

    def delays(self, num_updates: int) -> bool:
        """Whether the step after ``num_updates`` updates is delayed: its warm-up is over."""
        return num_updates >= self.warmup


@dataclass(frozen=True)
class OffloadPolicy:
    """How much optimizer work and memory moves to the CPU, and how it is moved.

    Args:
        fraction: share of the elements (of all parameters, counted element by element) whose
            fp32 main weights, grads and optimizer state live and are stepped on the CPU.
            0 keeps everything on the accelerator, 1 moves everything. The last parameters are
            offloaded first. Default 1.0.
        pin_memory: stage the host copies in pinned memory (fast, asynchronous copies). If
            pinning fails, pageable memory is used with a warning. Default True.
        num_threads: CPU threads for the CPU optimizer on this rank; ``None``: the
            ``OMP_NUM_THREADS`` you set, else usable cores / ranks on this host (torchrun's own
            ``OMP_NUM_THREADS=1`` does not count), less ``DelayedUpdate.CORES_KEPT_FREE`` under a
            delayed update.
        chunk_numel: elements per pipelined chunk: the copy of chunk k+1, the CPU step of chunk k
            and the copy back of chunk k-1 overlap. Each chunk is at most one call of the CPU
            kernel, whose threads may have gone to sleep since the last one: fewer, larger chunks
            pay fewer wake-ups (docs/benchmarks/e2e.md compares chunk sizes).
            Chunks whose grads are on the host already share a call (up to 4). Default 64M
            (256 MiB of fp32).
        device_impl: the accelerator's Adam/AdamW kernel: ``"torch"`` (fused, default),
            ``"apex"`` or ``"te"`` (FusedAdam from apex or TransformerEngine, if installed).
        cpu_kernel: the CPU's Adam/AdamW kernel. ``"fused"``: zero-shard's single-pass kernel,
            which reads bf16 grads and writes bf16 weights inside the update (built with the
            host's C compiler on first use; the same bits as torch's fused kernel). ``"torch"``:
            torch's fused CPU AdamW with separate casts. ``"auto"`` (default): ``"fused"`` where it
            applies (Adam/AdamW without amsgrad or maximize, bf16 or fp32 params) and builds,
            else ``"torch"``. Other optimizers always use torch's kernels. A param group given
            such an option after construction (``maximize=True``, a tensor lr) is stepped with
            torch's kernel from that step on, with a warning.
        delayed_update: with ``fraction=1.0``, the one-step delayed update of DeepSpeed's
            ZeRO-Offload: the CPU's step with the grads of step k runs during the forward and
            backward of step k+1, and its weights reach the params at step k+1's ``step()``. So
            the params lag the optimizer by one step: the grads of step k+1 are computed at the
            weights of step k-1 (those of step 1 and 2 at the initial weights). The rest is as
            without it: clipping and the non-finite skip apply to each step's own grads, and
            the state and main weights are those torch's optimizer would hold after the same
            updates. Code that needs the params to hold every update applies the one in flight
            first: ``finish_param_sync()``, the optimizer's ``state_dict()`` /
            ``load_state_dict()`` / ``reload_model_params()``, and a model's ``state_dict()`` /
            ``load_state_dict()`` under ``zero_shard.wrap`` do it (it waits for the CPU step);
            a forward does not (it runs on the lagging weights by design); reading the state
            (``opt.state``) waits for the CPU step but keeps the lag. Under ``zero_shard.wrap``
            only for a plain model that zero-shard shards (not DDP, not FSDP2), on one process
            only. Default False.
        delayed_update_warmup: with ``delayed_update=True``, the first this many updates are
            exact (each one's weights reach the params before the next forward) and the delay
            starts after them, as the ZeRO-Offload paper warms up before its delayed update: the
            loss falls fastest in the first steps, where grads taken at weights two updates old
            cost the most (docs/benchmarks/e2e.md). Updates are counted as the state counts them:
            a skipped step (non-finite grads) is not one, and a loaded state dict sets the count
            to its state's ``step``, so a resumed run goes on as the run it resumes (an optimizer
            whose state keeps no ``step``, such as SGD, counts from 0 again after a load). The
            warm-up steps keep a staging buffer per chunk, as the delayed ones do, so they run
            somewhat slower than steps without ``delayed_update``. Default 0.
        host_staging: the host buffers that grads land in and weights leave from, in the model
            dtype. ``"per_chunk"``: a buffer per chunk (2 bytes a param of bf16): every grad is
            copied by the time the step starts, and the grads may be written again once
            ``HostStep.wait_grads_copied()`` (a stream wait) is passed; grads said to be final
            before the step (``grads_ready``: ``zero_shard.wrap`` of a plain model says so as
            backward reduces each bucket but the last) are copied then, while backward runs on,
            so the CPU step starts as soon as backward ends and its kernels do not share the
            host's memory with those copies (the fastest full offload, docs/benchmarks/e2e.md).
            ``"bounded"``: 4 buffers of the largest chunk's size, taken in turn (512 MiB of bf16 at
            the default chunks), so the host holds little more than the fp32 weight and the states
            of each param; a chunk's grads are copied once an earlier chunk's step has freed a
            buffer, so the grads a step was given are read until the step is complete (``step()``
            completes it before it returns; after ``launch_step()`` they must not be written in
            place before it is). ``"auto"`` (default): ``"per_chunk"`` where the host keeps at least
            a quarter of its memory available once every rank on it has taken what its CPU share
            needs with a buffer per chunk, else ``"bounded"`` (so the largest model a host can train
            is bounded staging's); ``"bounded"`` also where the host-memory check is off
            (``ZERO_SHARD_SKIP_HOST_MEMORY_CHECK=1``: the host's report is not trusted). The choice
            is logged (logger ``zero_shard``, INFO); ``HybridDeviceOptimizer.host_staging`` and
            ``memory_report()`` say it. A delayed update always uses ``"per_chunk"`` (without early
            copies: its weights wait in the buffers through the next backward); so does
            ``zero_shard.wrap`` for a DDP model, whose grads are the model's own and may be zeroed
            in place right after ``step()``.
        gil_switch_interval: seconds. While the CPU's share of a step is in flight, the
            interpreter's GIL switch interval (``sys.setswitchinterval``) is shortened to this if
            it is longer, and put back once the step is complete (unless changed meanwhile). The
            worker takes the GIL back after each chunk's kernel; with Python's default of 5 ms it
            may wait that long for a thread running Python (the next forward), chunk after
            chunk. ``None`` leaves the interval alone. Default 0.0005.
        speculative: step each chunk on the single-pass kernel as soon as its grads are copied
            to the host during backward (a plain model's, with ``host_staging="per_chunk"`` and
            no delayed update), before the clip factor and the inf/NaN verdict are known, into
            twins of its state; at the step the result stands (the twins' pages are moved into
            the state, on Linux 5.7+; copied elsewhere), is redone from the state, or is
            forgotten (a skipped step): the same bits as without it, also where the state was
            written in place meanwhile. Costs 12 bytes of host memory per offloaded element for
            the twins, plus the new weights' own buffer (2 bytes of bf16, pinned); the
            host-memory check and ``memory_report()`` count them. ``"auto"``: on where it applies,
            the process is its host's only rank (``LOCAL_WORLD_SIZE``; with more, each rank's
            speculated steps take the cores that drive the backwards: measured slower), and the
            host keeps at least a quarter of its memory available with it (as
            ``host_staging="auto"`` decides; the choice is logged, logger ``zero_shard``, INFO).
            ``True``: on where it applies, and a warning where it cannot (bounded staging, a
            delayed update, no chunk on the kernel, a DDP or FSDP2 model). Only chunks whose
            grads reach the host before backward ends speculate: under ``zero_shard.wrap``, not
            those of the first bucket, reduced last (a model of one bucket never speculates, its
            twins held all the same). Default ``False``: it
            pays where the CPU's share outlasts backward (a full offload at 1B on one GPU:
            0.81-0.94x the iteration without it, median 0.88x) and costs where the host drives a short
            backward (303M on two GPUs: 1.04-1.14x at fraction 1, 1.26-1.52x at 0.5; see
            docs/benchmarks/e2e.md).

    Example:
        >>> OffloadPolicy(fraction=0.5, num_threads=8).fraction
        0.5
    """

    fraction: float = 1.0
    pin_memory: bool = True
    num_threads: int | None = None
    chunk_numel: int = 1 << 26
    device_impl: DeviceImpl = "torch"
    cpu_kernel: CpuKernel = "auto"
    delayed_update: bool = False
    delayed_update_warmup: int = 0
    host_staging: HostStaging = "auto"
    gil_switch_interval: float | None = 0.0005
    speculative: bool | Literal["auto"] = False

    @property
    def delay(self) -> DelayedUpdate | None:
        """``delayed_update`` and its warm-up as one value; ``None``: every update is exact."""
        return DelayedUpdate(self.delayed_update_warmup) if self.delayed_update else None

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"offload fraction must be a float in [0, 1], got {fraction!r}")
        if math.isnan(fraction) or not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"offload fraction must be in [0, 1] (0 = all on the accelerator, 1 = all on "
                f"the CPU), got {fraction}"
            )
        for name in ("pin_memory", "delayed_update"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.speculative, bool) and self.speculative != "auto":
            raise TypeError(f"speculative must be 'auto', True or False, got {self.speculative!r}")
        if self.delayed_update and fraction != 1.0:
            raise ValueError(
                f"delayed_update=True delays the CPU's step, so it needs fraction=1.0 (everything "
                f"on the CPU), got fraction={fraction}: the accelerator's share would update at "
                "once while the CPU's lagged. Use fraction=1.0, or delayed_update=False"
            )
        warmup = self.delayed_update_warmup
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"delayed_update_warmup must be an integer >= 0, got {warmup!r}")
        if warmup and not self.delayed_update:
            raise ValueError(
                f"delayed_update_warmup={warmup} counts the exact steps before a delayed update, "
                "so it needs delayed_update=True; set delayed_update=True, or leave the warmup at 0"
            )
        threads = self.num_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"num_threads must be a positive integer or None, got {threads!r}")
        chunk = self.chunk_numel
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_numel must be a positive integer, got {chunk!r}")
        # The mode strings are checked here once; the code past it switches on checked values.
        modes = (
            ("cpu_kernel", CpuKernel),
            ("host_staging", HostStaging),
            ("device_impl", DeviceImpl),
        )
        for name, kind in modes:
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"{name} must be one of {get_args(kind)}, got {getattr(self, name)!r}"
                )
        check_switch_interval(self.gil_switch_interval)
