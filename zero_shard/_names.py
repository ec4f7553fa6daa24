"""Param names, as torch's state-dict functions give them.

[Note: canonical names]
An optimizer state dict names each param by its FQN in the model. Wrappers that torch puts
around modules add segments to ``named_parameters()``: ``torch.compile(model)`` nests the model
under ``_orig_mod``, activation checkpointing (``checkpoint_wrapper``) each wrapped block under
``_checkpoint_wrapped_module``, DDP under ``module``. ``get_optimizer_state_dict`` drops those
segments, so that a checkpoint names a param alike with the wrappers on or off, and FSDP2 with
torch's AdamW names it so; zero-shard names the params the same way (``canonical_names``). A
state dict handed to a load may come with the segments still in (one made from
``named_parameters()`` by hand): ``saved_name`` drops them from its keys.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["canonical_names", "is_compiled", "module_state_key", "saved_name"]

_CHECKPOINT_SEGMENT = "_checkpoint_wrapped_module"
_COMPILED_SEGMENT = "_orig_mod"


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(model)``'s module (its model under ``_orig_mod``)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def _dropped(module: nn.Module, segment: str) -> bool:
    """Whether ``segment``, the name of a child of ``module``, is a wrapper's own: left out of
    the name, as ``get_optimizer_state_dict`` leaves it out."""
    if segment == _CHECKPOINT_SEGMENT:
        return True
    if segment == _COMPILED_SEGMENT:
        return is_compiled(module)
    return segment == "module" and isinstance(module, nn.parallel.DistributedDataParallel)


def _canonical(model: nn.Module, name: str) -> str:
    *path, leaf = name.split(".")
    kept = []
    module = model
    for segment in path:
        if not _dropped(module, segment):
            kept.append(segment)
        module = module._modules[segment]  # not getattr: a parametrized module computes it
    return ".".join([*kept, leaf])


def canonical_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` for every param of ``model`` (the first name of a param shared
    under several), without wrappers' segments ([Note: canonical names]). Where two params would
    take one name, every param keeps its ``named_parameters()`` name."""
    raw = {}
    for name, param in model.named_parameters():
        raw.setdefault(id(param), name)
    names = {key: _canonical(model, name) for key, name in raw.items()}
    if len(set(names.values())) != len(names):
        return raw
    return names


def module_state_key(name: str) -> str:
    """The key ``module.state_dict()`` gives the param that ``named_parameters()`` calls
    ``name``: activation checkpointing's segment left out (its wrapper's state-dict hook drops
    it), the others kept (a compiled model's state dict keeps ``_orig_mod``)."""
    return name.replace(f"{_CHECKPOINT_SEGMENT}.", "")


def saved_name(name: str) -> str:
    """A saved param name without wrappers' segments (``_checkpoint_wrapped_module``,
    ``_orig_mod``), as ``canonical_names`` would give it."""
    if _CHECKPOINT_SEGMENT not in name and _COMPILED_SEGMENT not in name:
        return name
    dropped = (_CHECKPOINT_SEGMENT, _COMPILED_SEGMENT)
    *path, leaf = name.split(".")
    return ".".join([*(segment for segment in path if segment not in dropped), leaf])
