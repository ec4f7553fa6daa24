"""What moves to the CPU and how: the offload policy."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CPU_KERNELS", "DEVICE_IMPLS", "OffloadPolicy"]

DEVICE_IMPLS = ("torch", "apex", "te")
CPU_KERNELS = ("auto", "fused", "torch")


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
        num_threads: CPU threads for the CPU optimizer on this rank; ``None`` picks usable
            cores / ranks on this host (torchrun's ``OMP_NUM_THREADS=1`` is overridden).
        chunk_numel: elements per pipelined chunk: the copy of chunk k+1, the CPU step of chunk k
            and the copy back of chunk k-1 overlap. Default 16M (64 MiB of fp32).
        device_impl: the accelerator's Adam/AdamW kernel: ``"torch"`` (fused, default),
            ``"apex"`` or ``"te"`` (FusedAdam from apex or TransformerEngine, if installed).
        cpu_kernel: the CPU's Adam/AdamW kernel. ``"fused"``: zero-shard's single-pass kernel,
            which reads bf16 grads and writes bf16 weights inside the update (built with the
            host's C compiler on first use; the same bits as torch's fused kernel). ``"torch"``:
            torch's fused CPU AdamW with separate casts. ``"auto"`` (default): ``"fused"`` where it
            applies (Adam/AdamW without amsgrad or maximize, bf16 or fp32 params) and builds,
            else ``"torch"``. Other optimizers always use torch's kernels.
        d2h_during_backward: send each offloaded grad to the host from a post-accumulate-grad
            hook as soon as backward produces it, instead of at ``step()`` (faster: the copy
            leaves the step, see docs/benchmarks/offload_step.md). Only for training loops whose
            grads are final when backward returns, or change only through operations that bump
            the grad's version counter: a new ``.grad``, accumulation over several backward
            passes, ``torch.nn.utils.clip_grad_norm_`` and other ordinary in-place ops are
            detected and sent again. Not detected: ``GradScaler.unscale_`` (fp16 AMP),
            ``dist.all_reduce(p.grad)``, writes through ``p.grad.data``; the step would use the
            grads as backward left them. Default False.

    Example:
        >>> OffloadPolicy(fraction=0.5, num_threads=8).fraction
        0.5
    """

    fraction: float = 1.0
    pin_memory: bool = True
    num_threads: int | None = None
    chunk_numel: int = 1 << 24
    device_impl: str = "torch"
    cpu_kernel: str = "auto"
    d2h_during_backward: bool = False

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"offload fraction must be a float in [0, 1], got {fraction!r}")
        if math.isnan(fraction) or not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"offload fraction must be in [0, 1] (0 = all on the accelerator, 1 = all on "
                f"the CPU), got {fraction}"
            )
        for name in ("pin_memory", "d2h_during_backward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        threads = self.num_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"num_threads must be a positive integer or None, got {threads!r}")
        chunk = self.chunk_numel
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_numel must be a positive integer, got {chunk!r}")
        if self.cpu_kernel not in CPU_KERNELS:
            raise ValueError(f"cpu_kernel must be one of {CPU_KERNELS}, got {self.cpu_kernel!r}")
        if self.device_impl not in DEVICE_IMPLS:
            raise ValueError(f"device_impl must be one of {DEVICE_IMPLS}, got {self.device_impl!r}")
