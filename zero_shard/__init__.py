"""zero-shard: ZeRO-style optimizer sharding for PyTorch with exact, overlapped CPU offload.

The data-parallel front (``zero_shard.wrap``) is being built; today the package re-exports the
single-rank building block, :class:`optimizers.HybridDeviceOptimizer`, and its policy.
"""

from optimizers import HybridDeviceOptimizer, MemoryReport, OffloadPolicy

__version__ = "0.1.0"

__all__ = ["HybridDeviceOptimizer", "MemoryReport", "OffloadPolicy", "__version__"]
