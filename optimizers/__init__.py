"""One rank's hybrid GPU/CPU optimizer (knows no process group)."""

from ._elementwise import check_elementwise, constructor_defaults
from ._hybrid import HybridDeviceOptimizer, MemoryReport
from ._policy import OffloadPolicy

__all__ = [
    "HybridDeviceOptimizer",
    "MemoryReport",
    "OffloadPolicy",
    "check_elementwise",
    "constructor_defaults",
]
