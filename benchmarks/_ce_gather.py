"""An all-gather done by the GPUs' copy engines over NVLink, for the zero_step experiment.

NCCL's all-gather runs as kernels on some of the GPU's SMs; during the forward they compete with
the matmuls (zero_step.md: with overlap, the forward got as much longer as the step got shorter).
Here every rank copies its shard into a buffer in PyTorch's symmetric memory, and every rank
then reads each peer's buffer with a device-to-device copy, which the copy engines carry out (no
SMs). Two barriers (tiny kernels) order it: all shards written before anyone reads, all reads
done before any buffer is written again. It needs peer access between the GPUs (one host,
NVLink) and no multicast. Experimental: the benchmark passes it to ``zero_shard.wrap``.
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
    """``all_gather(shard, out, group)`` through symmetric memory and the copy engines, for
    ``zero_shard.wrap(all_gather=...)``. The buffer is made at the first gather, the size of its
    shard, and again for a larger one: every rank gathers the same shards in the same order."""

    _group: dist.ProcessGroup  # the ranks whose buffers are exchanged: the gathers' ranks
    _buffer: torch.Tensor | None  # 1-D, symmetric memory, the largest shard gathered so far
    _handle: Any  # the _SymmetricMemory of _buffer
    _stream: torch.cuda.Stream | None

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._buffer = self._handle = self._stream = None

    def _buffer_for(self, shard: torch.Tensor) -> tuple[torch.Tensor, Any]:
        buffer = self._buffer
        if buffer is None or shard.numel() > buffer.numel() or shard.dtype != buffer.dtype:
            buffer = symm_mem.empty(shard.numel(), dtype=shard.dtype, device=shard.device)
            self._handle = symm_mem.rendezvous(buffer, self._group.group_name)
            self._stream = self._stream or torch.cuda.Stream(shard.device)
            self._buffer = buffer
        return buffer, self._handle

    def __call__(self, shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> Any:
        buffer, handle = self._buffer_for(shard)
        numel = shard.numel()
        # Waits for the current stream: the step wrote the shard, earlier reads of out are queued.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            buffer[:numel].copy_(shard)
            handle.barrier(channel=0)  # every rank's shard is in its buffer
            chunks = out.view(handle.world_size, numel)
            for step in range(handle.world_size):
                peer = (handle.rank + step) % handle.world_size
                chunks[peer].copy_(handle.get_buffer(peer, (numel,), shard.dtype))
            handle.barrier(channel=0)  # every rank read every buffer: they may be written again
            event = torch.cuda.Event()
            event.record()
        return _EventWork(event)
