"""One rank's hybrid GPU/CPU optimizer (knows no process group)."""

from ._checks import check_param_kind
from ._elementwise import check_elementwise, check_wrappable, constructor_defaults
from ._grad_factor import scale_grads_
from ._group_options import GroupsAtBuild
from ._host_step import HostStep
from ._hybrid import HybridDeviceOptimizer, MemoryReport
from ._policy import OffloadPolicy
from ._speculation import SpeculationCounts
from ._state import ParamState, check_saved_keys, state_to_take_over, torch_state
from ._state_dict_hooks import (
    load_state_dict_with_hooks,
    share_state_dict_hooks,
    state_dict_with_hooks,
)
from ._step_hooks import has_step_post_hooks, share_step_hooks

__all__ = [
    "GroupsAtBuild",
    "HostStep",
    "HybridDeviceOptimizer",
    "MemoryReport",
    "OffloadPolicy",
    "ParamState",
    "SpeculationCounts",
    "check_elementwise",
    "check_param_kind",
    "check_saved_keys",
    "check_wrappable",
    "constructor_defaults",
    "has_step_post_hooks",
    "load_state_dict_with_hooks",
    "scale_grads_",
    "share_state_dict_hooks",
    "share_step_hooks",
    "state_dict_with_hooks",
    "state_to_take_over",
    "torch_state",
]
