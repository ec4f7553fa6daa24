"""The optimizer state as DTensors keyed by parameter FQN, and back to one rank's shards; a
torch optimizer's state dict keyed by FQN and back; checks of a saved state dict (or of a
checkpoint's entries) against the live model and optimizer; host-memory copies for a checkpoint
to be read into; the state gathered whole on one rank.

The state dict has the shape of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
for FSDP2 + a torch optimizer: ``{"state": {fqn: {"step", "exp_avg", ...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``; every param-shaped tensor is a DTensor with the param's global
shape and this rank's part (``Shard(0)``, the FSDP2 param's own placements, or a 2-D layout
under tensor parallelism: ``_tp.py``), plus
``main_param`` (fp32) where the model dtype is lower. DCP can then save and reshard it with no
metadata of ours. Scalars (``step``) are plain tensors, as torch keeps them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from optimizers import HybridDeviceOptimizer, ParamState

from ._buckets import ShardedParam
from ._names import canonical_names, saved_name

__all__ = [
    "ShardedStateView",
    "add_state_saved_beyond",
    "check_origin",
    "check_saved_groups",
    "check_saved_model",
    "check_saved_optimizer",
    "create_missing_state",
    "dtensor_on",
    "full_state_dict",
    "keyed_by_fqn",
    "keyed_by_position",
    "load_full_state_dict",
    "local_rows",
    "local_state_dict",
    "named_as_saved",
    "numbers_params",
    "param_fqns",
    "sharded_state",
    "staged",
    "tag_origin",
    "to_dtensor",
]

# The attribute naming the rank whose rows a state-dict DTensor holds, (rank, world size). It
# travels with the DTensor through torch.save / torch.load, not into DCP (which saves the rows).
_ORIGIN = "_zero_shard_origin"


def _dtensor_here(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Any, ...], shape: Any, stride: Any
) -> DTensor:
    """A DTensor of ``shape`` over ``local`` where ``local`` is: ``DTensor.from_local`` would copy
    a host tensor to the mesh's device, as FSDP2's CPU offload avoids the same way."""
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return _over_view(local, DTensorSpec(mesh, placements, tensor_meta=meta))


def _over_view(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor of ``spec`` over ``local``, whose own storage offset is 0 even where ``local`` is
    a view past the start of its storage (a param's rows in a flat buffer of main weights).

    [Note: DTensors over views]
    torch's DTensor takes its local tensor's storage offset. The DTensor itself has no storage,
    so one with an offset has a data pointer that is not null, and code that reads it as a
    tensor with storage fails on torch 2.13 ("Attempted to call copy_() on an invalid python
    storage", "... access the data pointer on an invalid python storage"): ``torch.save`` and
    ``copy.deepcopy`` of ``opt.state_dict()`` of a bf16 model (its ``main_param`` entries), as
    Hugging Face's Trainer and accelerate save, and DCP's staging for ``dcp.async_save``. So the
    DTensor is made over an empty tensor of ``local``'s dtype and device (offset 0) and then
    given ``local``, which it reads from then on: it stays a view of the live state
    (``dcp.load`` writes into it)."""
    if local.storage_offset() == 0:
        return DTensor(local, spec, requires_grad=False)
    tensor = DTensor(local.new_empty(0), spec, requires_grad=False)
    tensor._local_tensor = local
    return tensor


def dtensor_on(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor of ``like``'s layout over ``local`` (a copy of its local tensor, anywhere)."""
    return _dtensor_here(local, like.device_mesh, tuple(like.placements), like.shape, like.stride())


def to_dtensor(sharded: ShardedParam, local: torch.Tensor, *, keep_device: bool = False) -> DTensor:
    """``local`` (this rank's part of a param-shaped tensor) as a DTensor of the param's global
    shape, laid out as ``sharded.layout`` says.

    With ``keep_device`` a host ``local`` stays on the host (state dicts: DCP writes it with no
    device round trip); else it is copied to the mesh's device, where DTensor ops can run.
    """
    layout = sharded.layout
    if keep_device:
        return _dtensor_here(local, layout.mesh, layout.placements, layout.shape, layout.stride)
    tensor = DTensor.from_local(
        local,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=layout.shape,
        stride=layout.stride,
    )
    return _over_view(tensor._local_tensor, tensor._spec)


def local_rows(sharded: ShardedParam, value: Any) -> Any:
    """This rank's part of a param-shaped ``value`` (a full tensor, or a DTensor of any layout):
    the part its shard holds; anything else is returned as it is."""
    layout = sharded.layout
    if isinstance(value, DTensor):
        if value.shape != layout.shape:
            return value
        if value.device_mesh == layout.mesh and tuple(value.placements) == layout.placements:
            return value.to_local()
        value = value.full_tensor()
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape != layout.shape:
        return value
    return value[layout.region()]


def sharded_state(
    sharded: ShardedParam,
    hybrid: HybridDeviceOptimizer,
    *,
    keep_device: bool = False,
    main_alone: bool = False,
) -> dict[str, Any]:
    """The param's state from ``hybrid`` (``main_alone``: as state dicts show it, see
    ``HybridDeviceOptimizer.read_state``), each param-shaped tensor as a DTensor (host state
    kept on the host with ``keep_device``; see ``to_dtensor``). Where a DTensor's local tensor is
    a copy of the state (the hybrid's, or one on the mesh's device), the DTensor and its local
    tensor are watched for edits: an in-place op on a DTensor moves its own version counter, not
    its local tensor's, and one on ``to_local()`` the other way round ([Note: state edits] in
    ``optimizers/_state.py``). Where it is the live state, the DTensor is watched for writes
    while a step is speculated (``HybridDeviceOptimizer.watch_live``)."""
    param = sharded.shard
    local = hybrid.param_state(param, watch=False, main_alone=main_alone)
    copied = hybrid.state_is_copied(param)
    state: dict[str, Any] = {}
    for key, value in local.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
            state[key] = to_dtensor(sharded, value, keep_device=keep_device)
            local_copy = state[key]._local_tensor  # to_local() is a view of it under grad mode
            if copied or local_copy.data_ptr() != value.data_ptr():
                token = object()  # the two alias each other
                hybrid.hand_out(param, key, state[key], local=DTensor.to_local, token=token)
                hybrid.hand_out(param, key, local_copy, token=token)  # edited via to_local()
            else:  # the live state: its in-place ops move the DTensor's counter alone
                hybrid.watch_live(state[key])
        else:
            state[key] = value
            if copied and torch.is_tensor(value):
                hybrid.hand_out(param, key, value)  # the step of a param in pieces
    return state


def _write_state(
    sharded: ShardedParam, hybrid: HybridDeviceOptimizer, key: str, value: Any
) -> None:
    """``optimizer.state[param][key] = value``: this rank's part of ``value`` (a DTensor, a
    tensor of the param's global shape, or a scalar) written into the state; a tensor kept
    watched for later edits, as torch would hold it."""
    local = local_rows(sharded, value)
    hybrid.write_param_state(sharded.shard, key, local, watch=False)
    layout = sharded.layout
    if isinstance(value, DTensor) and tuple(value.placements) == layout.placements:
        hybrid.hand_out(sharded.shard, key, value, local=DTensor.to_local)
    elif torch.is_tensor(value) and not isinstance(value, DTensor):
        hybrid.hand_out(sharded.shard, key, value, local=lambda v: local_rows(sharded, v))


def local_state_dict(
    saved_state: Mapping[str, dict[str, Any]],
    sharded: Sequence[ShardedParam],
    group_sizes: Sequence[int],
    hyperparams: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """A state dict for the rank's HybridDeviceOptimizer (params numbered in ``sharded`` order)
    from ``saved_state`` keyed by FQN, each tensor cut to this rank's rows."""
    state: dict[int, dict[str, Any]] = {}
    for index, record in enumerate(sharded):
        saved = saved_state.get(record.fqn)
        if not saved:
            continue
        for key, value in saved.items():
            shape = getattr(value, "shape", None)
            if torch.is_tensor(value) and value.dim() > 0 and shape != record.layout.shape:
                raise ValueError(
                    f"saved state {key!r} of {record.fqn!r} has shape {tuple(shape)}, but the "
                    f"param has shape {tuple(record.layout.shape)}: the checkpoint is of another "
                    "model"
                )
        state[index] = {key: local_rows(record, value) for key, value in saved.items()}
    groups, start = [], 0
    for size, hyper in zip(group_sizes, hyperparams, strict=True):
        groups.append({**hyper, "params": list(range(start, start + size))})
        start += size
    return {"state": state, "param_groups": groups}


def tag_origin(state: Mapping[str, dict[str, Any]], origin: tuple[int, int]) -> None:
    """Marks every DTensor of ``state`` (FQN -> param state) as holding rank ``origin[0]``'s rows
    of ``origin[1]`` ranks."""
    for param_state in state.values():
        for value in param_state.values():
            if isinstance(value, DTensor):
                setattr(value, _ORIGIN, origin)


def check_origin(state: Mapping[str, Any], origin: tuple[int, int]) -> None:
    """Refuses DTensors that another rank's ``state_dict()`` made (a state dict saved with
    ``torch.save`` on rank 0 and loaded on every rank): they hold that rank's rows."""
    for fqn, param_state in state.items():
        for key, value in param_state.items():
            made_by = getattr(value, _ORIGIN, origin) if isinstance(value, DTensor) else origin
            if tuple(made_by) != tuple(origin):
                raise ValueError(
                    f"state {key!r} of {fqn!r} holds the rows of rank {made_by[0]} (of "
                    f"{made_by[1]}), but this is rank {origin[0]} (of {origin[1]}): "
                    "opt.state_dict() holds each rank's own shards, so one saved on one rank "
                    "cannot be loaded on the others. Save and load on every rank with "
                    "zero_shard.checkpoint.save / load (or torch.distributed.checkpoint), or "
                    "gather a whole one with zero_shard.full_state_dict(opt) and load it with "
                    "zero_shard.load_full_state_dict(opt, state)"
                )


def check_saved_groups(state_dict: Any, group_fqns: Sequence[Sequence[str]]) -> None:
    """Raises ``ValueError`` unless ``state_dict`` has this optimizer's param groups (by FQN, in
    order) and state for its params only."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if any(isinstance(fqn, int) for group in saved_groups for fqn in group["params"]):
        raise ValueError(
            "the state dict keys its params by index, as torch.optim.Optimizer.state_dict() "
            "does; zero-shard keys them by FQN. Load it into the torch optimizer before "
            "wrapping it (wrap takes the state over), or key it by FQN first with "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, torch_opt, "
            "options=StateDictOptions(full_state_dict=True))"
        )
    if len(saved_groups) != len(group_fqns):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, this optimizer has "
            f"{len(group_fqns)}: it was saved from another model or another param-group setup"
        )
    # By name, as torch's set_optimizer_state_dict: a model that registers its params in another
    # order (the same FQNs) lists them in another order.
    for index, (saved, fqns) in enumerate(zip(saved_groups, group_fqns, strict=True)):
        if sorted(saved["params"]) != sorted(fqns):
            missing = sorted(set(fqns) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(fqns))
            repeated = sorted({fqn for fqn in saved["params"] if saved["params"].count(fqn) > 1})
            raise ValueError(
                f"param group {index} of the state dict does not hold this optimizer's params: "
                f"missing {missing[:5]}, unknown {extra[:5]}, repeated {repeated[:5]} (another "
                "model, or another param-group setup)"
            )
        if "lr" not in saved:
            # torch's set_optimizer_state_dict hands a group over without its options where the
            # groups were split otherwise when it was saved; torch's optimizer then fails at its
            # step, and keeping this one's options would train at other hyperparameters.
            raise ValueError(
                f"param group {index} of the state dict holds no options (no 'lr'; it holds "
                f"{sorted(saved)[:6]}): it was saved with the params split into other param "
                "groups. Load it into an optimizer with the param groups it was saved with"
            )
    known = {fqn for fqns in group_fqns for fqn in fqns}
    unknown = sorted(set(state_dict["state"]) - known)
    if unknown:
        raise ValueError(f"the state dict has state for params this model lacks: {unknown[:5]}")


def named_as_saved(state_dict: Mapping[str, Any], known: set[str]) -> Mapping[str, Any]:
    """``state_dict`` with its params' names (the keys of its state, its groups' params) without
    wrappers' segments, where that makes them names of ``known`` (this optimizer's, [Note:
    canonical names] in ``_names.py``); as it is where none does (or it is not a state dict
    keyed by name). A name ``known`` holds stays: a model's own child may be named ``module``."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        return state_dict

    def renamed(key: Any) -> Any:
        if not isinstance(key, str) or key in known:
            return key
        name = saved_name(key)
        return name if name in known else key

    state, groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(state, Mapping) or not all(isinstance(g, Mapping) for g in groups):
        return state_dict
    keys = [*state, *(p for g in groups for p in g.get("params", ()))]
    if all(renamed(key) == key for key in keys):
        return state_dict
    return {
        **state_dict,
        "state": {renamed(key): value for key, value in state.items()},
        "param_groups": [
            {**g, "params": [renamed(p) for p in g["params"]]} if "params" in g else g
            for g in groups
        ],
    }


def keyed_by_fqn(state_dict: Mapping[str, Any], fqns: Sequence[str]) -> dict[str, Any]:
    """A torch optimizer's state dict, its params numbered by their position over its param
    groups (as ``torch.optim.Optimizer.state_dict()`` numbers them), keyed by FQN instead, as
    ``get_optimizer_state_dict`` keys it. ``fqns``: the FQN of each position."""

    def fqn(index: Any) -> str:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(fqns):
            raise ValueError(
                f"the optimizer state numbers its params, and holds param {index!r}, but this "
                f"optimizer has {len(fqns)} params (0 to {len(fqns) - 1}): it was saved from "
                "another model or another param-group setup"
            )
        return fqns[index]

    return {
        "state": {fqn(index): value for index, value in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": [fqn(index) for index in group["params"]]}
            for group in state_dict["param_groups"]
        ],
    }


def keyed_by_position(
    state_dict: Mapping[str, Any], group_fqns: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """The inverse of ``keyed_by_fqn``, for ``torch.optim.Optimizer.load_state_dict``: a state
    dict keyed by FQN (one whose groups hold ``group_fqns``' params, in any order: see
    ``check_saved_groups``) with each param numbered by its position in ``group_fqns`` (the
    optimizer's groups) and each group listing them in the optimizer's order. Torch matches
    params by position; so numbered, they match by FQN."""
    flat = [fqn for fqns in group_fqns for fqn in fqns]
    position = {fqn: index for index, fqn in enumerate(flat)}
    groups, start = [], 0
    for group, fqns in zip(state_dict["param_groups"], group_fqns, strict=True):
        groups.append({**group, "params": list(range(start, start + len(fqns)))})
        start += len(fqns)
    state = {position[fqn]: value for fqn, value in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}


def _names(keys: list[str], prefix: str) -> str:
    names = sorted(key.removeprefix(prefix) for key in keys)
    return f"{names[:5]}{' ...' if len(names) > 5 else ''} ({len(names)} in all)"


def check_saved_model(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the FQNs unless the checkpoint at ``path`` (``saved``: its
    metadata's entries) holds this model's entries, no others, with this model's shapes."""
    expected = {f"model.{fqn}": value for fqn, value in model_state.items()}
    # Entries that are not tensors (a module's extra state) may be saved as several keys.
    containers = tuple(f"{key}." for key, value in expected.items() if not torch.is_tensor(value))
    missing = [
        key
        for key, value in expected.items()
        if key not in saved
        and (torch.is_tensor(value) or not any(k.startswith(f"{key}.") for k in saved))
    ]
    if missing:
        raise ValueError(
            f"the checkpoint at {path} has no {_names(missing, 'model.')} of this model: it is "
            "of another model, or of this one under other names (a DDP model's names start with "
            "'module.'). Load it into the model it was saved from"
        )
    unknown = [
        key
        for key in saved
        if key.startswith("model.") and key not in expected and not key.startswith(containers)
    ]
    if unknown:
        raise ValueError(
            f"the checkpoint at {path} holds {_names(unknown, 'model.')} that this model lacks: "
            "it is of another model. Load it into the model it was saved from"
        )
    for key, value in expected.items():
        size = getattr(saved.get(key), "size", None)
        if torch.is_tensor(value) and size is not None and tuple(size) != tuple(value.shape):
            raise ValueError(
                f"the checkpoint at {path} holds {key.removeprefix('model.')!r} of shape "
                f"{tuple(size)}, but this model's has shape {tuple(value.shape)}: the checkpoint "
                "is of another model"
            )


def add_state_saved_beyond(
    path: Path,
    saved: Mapping[str, Any],
    optim_state: dict[str, Any],
    records: Sequence[ShardedParam],
    names: Sequence[str | int],
) -> None:
    """Adds to ``optim_state`` (the layout a load reads into; ``names``: how it and the
    checkpoint name each of ``records``) the state the checkpoint holds and this optimizer has
    not made: state made at a param's first step (SGD with dampening, NAdam, ASGD, a param no
    step gave a grad yet), or an option switched on after wrap. Each entry is zeros laid out as
    the param's state, which DCP reads into, so that the load restores it rather than leave it
    out. fp32 main weights are not added: without them in the layout, they come from the model."""
    held: dict[str, dict[str, Any]] = {}
    for flat, metadata in saved.items():
        if flat.startswith("optim.state."):
            name, key = flat.removeprefix("optim.state.").rsplit(".", 1)
            held.setdefault(name, {})[key] = metadata
    for record, name in zip(records, names, strict=True):
        for key, metadata in held.get(str(name), {}).items():
            entry = optim_state["state"].get(name, {})
            if key in entry or key == "main_param":
                continue
            size = tuple(getattr(metadata, "size", (-1,)))
            dtype = getattr(getattr(metadata, "properties", None), "dtype", None)
            if isinstance(metadata, BytesStorageMetadata):  # an object (a Python number)
                entry[key] = 0  # (DCP puts the saved object in its place)
            elif dtype is not None and size == ():  # a scalar (a 0-dim param's state too)
                entry[key] = torch.zeros((), dtype=dtype)
            elif dtype is not None and size == tuple(record.layout.shape):
                zeros = torch.zeros(record.shard.shape, dtype=dtype)
                entry[key] = to_dtensor(record, zeros, keep_device=True)
            else:
                raise ValueError(
                    f"the checkpoint at {path} holds optimizer state {key!r} for param "
                    f"{record.fqn!r} of shape {size}, which this optimizer does not hold and "
                    f"cannot place (the param has shape {tuple(record.layout.shape)}): it is "
                    "of another model, or of another optimizer class"
                )
            optim_state["state"][name] = entry


def check_saved_optimizer(path: Path, saved: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the FQNs unless the checkpoint holds state of the shapes this
    optimizer has, in as many param groups."""
    if not any(key.startswith("optim.") for key in saved):
        raise ValueError(
            f"the checkpoint at {path} holds no optimizer state (it was saved with "
            "optimizer=None); load it with optimizer=None, then call opt.reload_model_params()"
        )
    held_state = (
        key for key in saved if key.startswith("optim.state.") and not key.endswith(".main_param")
    )
    if not optim_state["state"] and any(held_state):
        raise ValueError(
            f"the checkpoint at {path} holds optimizer state, but this optimizer has none to load "
            "it into: it is of another optimizer class, or one whose state is created at its "
            "first step (SGD with dampening, NAdam, ASGD, ...): take one step, then load"
        )
    num_groups = len({key.split(".")[2] for key in saved if key.startswith("optim.param_groups.")})
    if num_groups != len(optim_state["param_groups"]):
        raise ValueError(
            f"the checkpoint at {path} has {num_groups} optimizer param groups, this optimizer "
            f"has {len(optim_state['param_groups'])}: it was saved from another model or another "
            "param-group setup"
        )
    for index, group in enumerate(optim_state["param_groups"]):
        lacking = sorted(o for o in group if f"optim.param_groups.{index}.{o}" not in saved)
        if lacking:
            raise ValueError(
                f"the checkpoint at {path} has no option {lacking} in param group {index}, which "
                "this optimizer's class has: it was saved by another optimizer class (or "
                "another torch version's). Load it into an optimizer of the class that saved it"
            )
    for fqn, param_state in optim_state["state"].items():
        for key, value in param_state.items():
            flat = f"optim.state.{fqn}.{key}"
            if flat not in saved:
                held = sorted(
                    {k.rsplit(".", 1)[1] for k in saved if k.startswith(f"optim.state.{fqn}.")}
                )
                raise ValueError(
                    f"the checkpoint at {path} has no optimizer state {key!r} for param {fqn!r} "
                    f"(it holds {held} for it; this optimizer holds {sorted(param_state)}): it is "
                    "of another model, or of another optimizer class"
                )
            size = getattr(saved[flat], "size", None)
            if torch.is_tensor(value) and size is not None and tuple(size) != tuple(value.shape):
                raise ValueError(
                    f"the checkpoint at {path} holds optimizer state {key!r} of {fqn!r} of shape "
                    f"{tuple(size)}, but the param has shape {tuple(value.shape)}: the checkpoint "
                    "is of another model"
                )


def param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The FQN of each param of a torch optimizer, in the order its state dict numbers them (as
    ``get_optimizer_state_dict`` names them: without DDP's ``module.`` or other wrappers'
    segments, [Note: canonical names] in ``_names.py``)."""
    names = canonical_names(model)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        if id(param) not in names:
            raise ValueError(
                f"the optimizer holds a param of shape {tuple(param.shape)} that is not a param "
                "of the model: checkpoints name optimizer state by the param's FQN in the model. "
                "Pass the model the optimizer was built for"
            )
    return [names[id(param)] for param in params]


def numbers_params(saved: Mapping[str, Any], optim_state: dict[str, Any]) -> bool:
    """Whether the checkpoint numbers the optimizer's params (as a torch optimizer's own
    ``state_dict()`` does) where ``optim_state`` names them."""
    fqns = [fqn for group in optim_state["param_groups"] for fqn in group["params"]]
    position = {fqn: index for index, fqn in enumerate(fqns)}
    named = numbered = 0
    for fqn, param_state in optim_state["state"].items():
        for key in param_state:
            named += f"optim.state.{fqn}.{key}" in saved
            numbered += f"optim.state.{position[fqn]}.{key}" in saved
    return numbered > named


def staged(value: Any) -> Any:
    """``value`` (a state dict) with every tensor replaced by an empty one in host memory, of its
    shape and dtype (a DTensor: of its layout, over such a local tensor): DCP reads into these,
    and the live tensors are written only once every rank has read its part whole. A 0-dim
    tensor (a step count, a tensor lr) keeps its device, as a read in place would."""
    if isinstance(value, DTensor):
        local = value.to_local()
        return dtensor_on(value, torch.empty(local.shape, dtype=local.dtype))
    if torch.is_tensor(value):
        return (
            torch.empty_like(value)
            if value.dim() == 0
            else torch.empty(value.shape, dtype=value.dtype)
        )
    if isinstance(value, dict):
        return {key: staged(item) for key, item in value.items()}
    if isinstance(value, list):
        return [staged(item) for item in value]
    return value


class ShardedStateView(MutableMapping):
    """``optimizer.state`` of a ZeroShardOptimizer: model param -> its state as DTensors, built
    on access (views of the live state where a shard is in one piece, else copies). Edits reach
    the state as in torch ([Note: state edits] in ``optimizers/_state.py``): in place, by key,
    a dict assigned to a param, ``del``/``pop``/``clear``, and ``optimizer.state = {}``. Its
    truth value is a torch optimizer's, as the hybrid's ``StateView`` says."""

    def __init__(self, sharded: Sequence[ShardedParam], hybrid: HybridDeviceOptimizer) -> None:
        self._sharded = list(sharded)
        self._hybrid = weakref.ref(hybrid)

    def __bool__(self) -> bool:
        return self._hybrid().state_started

    def _record(self, param: object) -> ShardedParam | None:
        for record in self._sharded:
            if record.param is param:
                return record
        return None  # a frozen param (or another tensor): no state, as torch's defaultdict shows

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        record = self._record(param)
        if record is None:
            return {}
        hybrid = self._hybrid()
        return ParamState(
            sharded_state(record, hybrid),
            lambda key, value: _write_state(record, hybrid, key, value),
        )

    def __setitem__(self, param: torch.Tensor, value: Mapping[str, Any]) -> None:
        record = self._record(param)
        if not isinstance(value, Mapping):
            raise TypeError(f"optimizer.state[param] must be a dict, got {type(value).__name__}")
        if record is None or record.shard not in self._hybrid().state:
            if value:
                raise KeyError(
                    "the param is not stepped by this optimizer (frozen at wrap, or not in its "
                    "param groups) or has no state yet: it takes none"
                )
            return
        hybrid = self._hybrid()
        if not value:
            hybrid.reset_param_state([record.shard])
            return
        keys = set(hybrid.param_state(record.shard)) - {"main_param"}
        if set(value) - {"main_param"} != keys:
            raise ValueError(
                f"optimizer.state[param] = dict with keys {sorted(value)}: the param's state has "
                f"{sorted(keys)}; assign every key, or assign keys one by one "
                "(optimizer.state[param][key] = value), or {} to drop it"
            )
        self[param].update({key: value[key] for key in keys})

    def __delitem__(self, param: torch.Tensor) -> None:
        if param not in self:
            raise KeyError("the param has no optimizer state to drop")
        self._hybrid().reset_param_state([self._record(param).shard])

    def clear(self) -> None:
        hybrid = self._hybrid()
        hybrid.reset_param_state([r.shard for r in self._sharded if r.shard in hybrid.state])
        hybrid.state_started = False  # torch's is empty now; alike on every rank (not by shards)

    def replace(self, value: Mapping[Any, Any]) -> None:
        """``optimizer.state = value``: an empty mapping drops every param's state (see
        ``StateView.replace``)."""
        if isinstance(value, Mapping) and not value:
            self.clear()
            return
        raise TypeError(
            "optimizer.state can only be replaced by an empty dict (which drops every param's "
            "state: the next step starts it afresh, as in torch); edit optimizer.state[param] "
            "instead, or load a state dict with load_state_dict(...)"
        )

    def get(self, param: Any, default: Any = None) -> Any:
        """As torch's ``defaultdict.get``: ``default`` for a param without state."""
        return self[param] if param in self else default

    def __contains__(self, param: object) -> bool:
        hybrid = self._hybrid()
        return any(r.param is param and r.shard in hybrid.state for r in self._sharded)

    def __iter__(self) -> Iterator[torch.Tensor]:
        hybrid = self._hybrid()  # whether a shard has state, without building it
        return iter([r.param for r in self._sharded if r.shard in hybrid.state])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def create_missing_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Creates the state of a torch optimizer's params that have none (it has not stepped yet),
    for a checkpoint to be loaded into, as torch's ``set_optimizer_state_dict`` does: one step
    with zero grads at lr 0, which leaves the params as they are. Returns those params."""
    groups = optimizer.param_groups
    params = [param for group in groups for param in group["params"]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return []
    grads = [param.grad for param in params]
    lrs = [group.get("lr") for group in groups]
    try:
        for param in params:  # only the params without state step
            param.grad = None
        for param in missing:
            param.grad = torch.zeros_like(param)
        for group, lr in zip(groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = torch.zeros_like(lr) if torch.is_tensor(lr) else 0.0
        optimizer.step()
    except BaseException:
        for param in missing:  # as it was
            optimizer.state.pop(param, None)
        raise
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        for group, lr in zip(groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
    return [param for param in missing if optimizer.state.get(param)]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _full(value: Any, keep: bool) -> Any:
    if not isinstance(value, DTensor):
        return value.detach().cpu().clone() if torch.is_tensor(value) and keep else value
    mesh = value.device_mesh
    local = value.to_local().to(mesh.device_type)  # a CPU-resident shard on a GPU mesh
    whole = DTensor.from_local(
        local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    ).full_tensor()
    if not keep:
        return None
    whole = whole.cpu()
    if whole.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        whole = whole.clone()  # a mesh of one rank: the full tensor is the live state itself
    return whole


def full_state_dict(optimizer: torch.optim.Optimizer, *, rank: int = 0) -> dict[str, Any]:
    """The optimizer's state dict with every DTensor gathered into a full CPU tensor, on rank
    ``rank`` (``{}`` elsewhere): for ``torch.save``. Collective: every rank calls it.

    Args:
        optimizer: a :class:`ZeroShardOptimizer` (or any optimizer whose state dict holds
            DTensors or plain tensors).
        rank: the rank that receives the full state dict; default 0.

    Example::

        state = zero_shard.full_state_dict(opt)
        if dist.get_rank() == 0:
            torch.save(state, "optim.pt")
    """
    keep = _rank() == rank
    state = optimizer.state_dict()
    full = {
        fqn: {key: _full(value, keep) for key, value in param_state.items()}
        for fqn, param_state in state["state"].items()
    }
    if not keep:
        return {}
    return {"state": full, "param_groups": state["param_groups"]}


def load_full_state_dict(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None, *, rank: int = 0
) -> None:
    """Loads a state dict from ``full_state_dict`` (or a consolidated one of the same shape),
    given on rank ``rank`` only; it is broadcast to the others. Collective: every rank calls it.

    Args:
        optimizer: the optimizer to load into (a :class:`ZeroShardOptimizer`).
        state_dict: the full state dict on rank ``rank``; ignored (``None`` is fine) elsewhere.
        rank: the rank that holds it; default 0.
    """
    box = [state_dict if _rank() == rank else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=rank)
    if box[0] is None:
        raise ValueError(f"load_full_state_dict needs the state dict on rank {rank}, got None")
    optimizer.load_state_dict(box[0])
