"""zero-shard: ZeRO-style optimizer sharding for PyTorch with exact, overlapped CPU offload.

``zero_shard.wrap(optimizer, model, offload=zero_shard.OffloadPolicy(fraction=...))`` shards an
elementwise torch optimizer over the data-parallel ranks; the single-rank building block,
:class:`optimizers.HybridDeviceOptimizer`, is re-exported for one-process use.
"""

from optimizers import HybridDeviceOptimizer, MemoryReport, OffloadPolicy

from . import checkpoint
from ._hooks import register_forward_method
from ._optimizer import ZeroShardOptimizer
from ._scaler import GradScaler
from ._wrap import wrap
from .checkpoint import full_state_dict, load_full_state_dict

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "HybridDeviceOptimizer",
    "MemoryReport",
    "OffloadPolicy",
    "ZeroShardOptimizer",
    "__version__",
    "checkpoint",
    "full_state_dict",
    "load_full_state_dict",
    "register_forward_method",
    "wrap",
]
