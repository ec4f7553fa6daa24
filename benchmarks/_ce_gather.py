"""An all-gather done by the GPUs' copy engines over NVLink, for the zero_step experiment.

NCCL's all-gather runs as kernels on some of the GPU's SMs; during the forward they compete with
the matmuls (zero_step.md: with overlap, the forward got as much longer as the step got shorter).
Here every rank copies its shard into a buffer in PyTorch's symmetric memory, and every rank
then reads each peer's buffer with a device-to-device copy, which the copy engines carry out (no
SMs). Two barriers (tiny kernels) order it: all shards written before anyone reads, all reads
done before any buffer is written again. It needs peer access between the GPUs (one host,
NVLink) and no multicast. Experimental: the benchmark patches it in for zero-shard's gathers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

__all__ = ["CopyEngineGather"]


class _EventWork:
    """The ``Work`` of a copy-engine gather: waiting makes the current stream wait."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self._event)
        return True


class CopyEngineGather:
    """``launch_all_gather(shard, out, group)`` through symmetric memory and the copy engines."""

    _buffer: torch.Tensor  # 1-D, symmetric memory, the largest shard's size
    _handle: Any  # the _SymmetricMemory of _buffer
    _stream: torch.cuda.Stream

    def __init__(
        self, group: dist.ProcessGroup, max_numel: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, group.group_name)
        self._stream = torch.cuda.Stream(device)

    def __call__(self, shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Any:
        handle, numel = self._handle, shard.numel()
        if numel > self._buffer.numel() or shard.dtype != self._buffer.dtype:
            raise ValueError(f"a shard of {numel} {shard.dtype} does not fit the buffer")
        # Waits for the current stream: the step wrote the shard, earlier reads of out are queued.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self._buffer[:numel].copy_(shard)
            handle.barrier(channel=0)  # every rank's shard is in its buffer
            chunks = out.view(handle.world_size, numel)
            for step in range(handle.world_size):
                peer = (handle.rank + step) % handle.world_size
                chunks[peer].copy_(handle.get_buffer(peer, (numel,), shard.dtype))
            handle.barrier(channel=0)  # every rank read every buffer: they may be written again
            event = torch.cuda.Event()
            event.record()
        return _EventWork(event)
