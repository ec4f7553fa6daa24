"""Host memory and host<->device transfers: pinned blocks, a memory guard, streams, threads.

This layer knows no optimizer and no process group.
"""

from ._copy_engine import CopyEngine, CopyPair, copy_async
from ._flag import HostFlag
from ._gil import SwitchInterval, check_switch_interval, switch_interval
from ._host_memory import available_after, check_host_memory, format_bytes, local_world_size
from ._page_moves import PageTwin, anonymous_ranges, page_moves_available
from ._phases import phase
from ._pinned import HostBufferRequest, HostBuffers
from ._streams import (
    current_stream,
    record_event,
    side_stream,
    use_device,
    use_stream,
    wait_event,
    wait_for_event,
    wait_stream,
)
from ._threads import ThreadBudget, intra_op_threads, resolve_thread_budget, usable_cores

__all__ = [
    "CopyEngine",
    "CopyPair",
    "HostBufferRequest",
    "HostBuffers",
    "HostFlag",
    "PageTwin",
    "SwitchInterval",
    "ThreadBudget",
    "anonymous_ranges",
    "available_after",
    "check_host_memory",
    "check_switch_interval",
    "copy_async",
    "current_stream",
    "format_bytes",
    "intra_op_threads",
    "local_world_size",
    "page_moves_available",
    "phase",
    "record_event",
    "resolve_thread_budget",
    "side_stream",
    "switch_interval",
    "usable_cores",
    "use_device",
    "use_stream",
    "wait_event",
    "wait_for_event",
    "wait_stream",
]
