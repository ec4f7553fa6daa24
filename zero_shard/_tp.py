"""Where a param's optimizer state lies over the ranks, with tensor parallelism or without.

[Note: tensor parallelism under zero-shard's sharding]
A tensor-parallel model (``parallelize_module`` over ``mesh["tp"]``) holds each split param as a
DTensor on the tensor-parallel mesh, or, under DDP with ``device_mesh``, as the local tensor DDP
made of it (torch keeps the DTensor's spec on it as ``_st_info``). Replicated over
``mesh["dp"]``, zero-shard shards each param's *local* tensor by rows over ``dp``, reduces and
gathers those local tensors over ``dp`` only, and steps its rows: the optimizer is elementwise,
so it never needs the other tensor-parallel ranks' parts. A param the plan left plain is
replicated over ``tp`` as well.

The state of such a shard is a DTensor on the 2-D mesh of ``dp`` and ``tp`` (in the root mesh's
order), with the param's global shape: ``Shard(0)`` over ``dp`` and the param's own placement
over ``tp`` (``Replicate()`` for a plain one). Where ``tp`` splits dim 0 too and comes second,
``dp`` splits each tensor-parallel part (``_StridedShard(0, split_factor=tp)``), as FSDP2 lays
out the same 2-D params, so that the keys and layouts match FSDP2 + TP + a torch optimizer. Both
split by ``torch.chunk``, so DTensor places each rank's rows where zero-shard holds them; wrap
checks it.

Global norms sum each element once: a shard replicated over ``tp`` counts on ``tp``'s first rank.

[Note: FSDP2 params on a sub-mesh]
Under FSDP2 + TP a param the tensor-parallel plan left plain (torchtitan's norms with sequence
parallelism off) is sharded by ``fully_shard(..., mesh=mesh["dp"])`` on the 1-D ``dp`` mesh alone,
while the planned params lie on the 2-D ``(dp, tp)`` mesh. Such a param is a DTensor on named dims
of the 2-D mesh: each coordinate of the other dims (each ``tp`` rank) holds its own copy of the
same shard and steps it with its own grads, which FSDP2 reduced over ``dp`` only. zero-shard reads
it as replicated over the dims its mesh lacks (``placements_over``): its shard is stepped where
it lies, as torch AdamW steps it; it counts in global norms on those dims' first rank alone (as a
``Replicate()`` placement does, see ``StateLayout.counted_here``); the non-finite checks read every
copy and reduce over the whole 2-D mesh, so an inf in one ``tp`` rank's copy skips the step on
every rank; and its state keeps the param's own 1-D layout, as ``get_optimizer_state_dict`` gives
it for FSDP2 + TP + a torch optimizer (DCP writes one copy). The copies then stay bit-identical
whenever their grads are: the step is elementwise, and the clip's factor and the verdict are the
same on every rank (the device's share and the CPU kernel give the same bits). torch's own
``clip_grad_norm_`` refuses such a model (``torch.stack`` of norms on two meshes); per mesh,
``get_total_norm(...).full_tensor()`` combined, gives the norm ``clip_grad_norm_`` returns here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ._bucket_layout import ShardSpec

__all__ = [
    "StateLayout",
    "as_dtensor",
    "describe_layout",
    "dtensor_layout",
    "joint_mesh",
    "local_tensor",
    "placements_over",
    "rows_layout",
    "tp_mesh_of",
    "tp_spec",
]


def describe_layout(layout: DTensor | DTensorSpec) -> str:
    """A DTensor param's (or a layout's) placements and mesh, for error messages."""
    spec = layout._spec if isinstance(layout, DTensor) else layout
    names = spec.mesh.mesh_dim_names
    return f"placements {tuple(spec.placements)} on a mesh of shape {tuple(spec.mesh.shape)}" + (
        f" {names}" if names else ""
    )


def tp_spec(param: torch.Tensor) -> DTensorSpec | None:
    """The tensor-parallel layout of a param: a DTensor's, or the one DDP kept on a param it
    turned into its local tensor; ``None`` for a plain param."""
    if isinstance(param, DTensor):
        return param._spec
    return getattr(param, "_st_info", None)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The memory a param's rows live in on this rank: a DTensor's local tensor, or the param."""
    return param._local_tensor if isinstance(param, DTensor) else param


def as_dtensor(param: torch.Tensor) -> DTensor:
    """A param DDP turned into its local tensor, as the DTensor it was, over the same memory (no
    copy: a write into it is a write into the param, seen by its version counter)."""
    spec = param._st_info  # type: ignore[attr-defined]
    return DTensor(param.detach(), spec, requires_grad=False)


@dataclass(frozen=True)
class StateLayout:
    """How a param's state tensors lie over the ranks: as a DTensor of the param's global shape
    on ``mesh`` with ``placements``."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def region(self) -> tuple[slice, ...]:
        """Where this rank's part lies in the full tensor, one slice per dim (torch's offsets)."""
        shape, offset = compute_local_shape_and_global_offset(
            self.shape, self.mesh, self.placements
        )
        return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))

    def counted_here(self, dims: Sequence[int]) -> bool:
        """Whether this rank's part counts in a sum over mesh ``dims``: each element once, so a
        part replicated over one of them counts on that dim's first rank (a dim of one rank
        needs no group to tell: a one-process mesh has none)."""
        return all(
            self.mesh.size(dim) == 1 or self.mesh.get_local_rank(dim) == 0
            for dim in dims
            if self.placements[dim].is_replicate()
        )


def dtensor_layout(param: DTensor) -> StateLayout:
    """The layout of an FSDP2 param's state: the param's own."""
    return StateLayout(param.device_mesh, tuple(param.placements), param.shape, param.stride())


def placements_over(param: DTensor, mesh: DeviceMesh) -> tuple[Placement, ...] | None:
    """The param's placements over each dim of ``mesh``, where its own mesh is ``mesh`` or named
    dims of it (``mesh["dp"]``): its own on those dims, ``Replicate()`` on the others (see
    [Note: FSDP2 params on a sub-mesh]); ``None`` where its mesh is neither."""
    own = param.device_mesh
    if own == mesh:
        return tuple(param.placements)
    names, all_names = own.mesh_dim_names, mesh.mesh_dim_names
    if not names or not all_names or not set(names) <= set(all_names) or own.ndim >= mesh.ndim:
        return None
    dims = [all_names.index(name) for name in names]
    if dims != sorted(dims) or mesh[tuple(names)] != own:
        return None
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for dim, placement in zip(dims, param.placements, strict=True):
        placements[dim] = placement
    return tuple(placements)


def tp_mesh_of(params: Sequence[tuple[torch.Tensor, str]]) -> DeviceMesh | None:
    """The one tensor-parallel mesh of ``params`` (param, FQN), or ``None`` without tensor
    parallelism. Refuses a param laid out on a mesh of more than one dim, a partial one, and
    params on different meshes."""
    mesh, first = None, ""
    for param, fqn in params:
        spec = tp_spec(param)
        if spec is None:
            continue
        if spec.mesh.ndim != 1 or any(p.is_partial() for p in spec.placements):
            raise ValueError(
                f"param {fqn!r} has {describe_layout(spec)}: zero-shard shards a tensor-parallel "
                "param over the data-parallel mesh when it is split or replicated over one "
                "tensor-parallel mesh dim (parallelize_module over mesh['tp'])"
            )
        if mesh is None:
            mesh, first = spec.mesh, fqn
        elif spec.mesh != mesh:
            raise ValueError(
                f"params {first!r} and {fqn!r} are tensor-parallel over different meshes "
                f"({mesh} and {spec.mesh}); zero-shard supports one tensor-parallel mesh dim"
            )
    return mesh


def joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D mesh of ``dp_mesh`` and ``tp_mesh`` (dims in their root mesh's order): where the
    state of a tensor-parallel model sharded over ``dp`` lies."""
    root = dp_mesh._get_root_mesh()
    names = (dp_mesh.mesh_dim_names or (None,))[0], (tp_mesh.mesh_dim_names or (None,))[0]
    root_names = root.mesh_dim_names or ()
    if tp_mesh._get_root_mesh() != root or not set(names) <= set(root_names):
        raise ValueError(
            f"the data-parallel mesh {dp_mesh} and the tensor-parallel mesh {tp_mesh} must be "
            "two named dims of one mesh: build it with init_device_mesh(device_type, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')), parallelize over mesh['tp'] and pass mesh['dp'] (to "
            "zero_shard.wrap, or to DDP as device_mesh)"
        )
    if names[0] == names[1]:
        raise ValueError(
            f"mesh is the tensor-parallel dim {names[1]!r} itself; pass the data-parallel dim "
            f"(mesh['dp']), or mesh=None"
        )
    ordered = tuple(sorted(names, key=root_names.index))
    return root if tuple(root_names) == ordered else root[ordered]


def rows_layout(
    param: torch.Tensor, fqn: str, spec: ShardSpec, dp_mesh: DeviceMesh, joint: DeviceMesh | None
) -> StateLayout:
    """The layout of a param's state when zero-shard shards its local tensor by ``spec``'s rows
    over ``dp_mesh`` (see [Note: tensor parallelism under zero-shard's sharding])."""
    tp = tp_spec(param)
    # A 0-dim param is every rank's ([Note: 0-dim params] in _bucket_layout.py).
    dp_placement: Placement = Replicate() if spec.replicated else Shard(0)
    if joint is None:
        if tp is not None:
            raise AssertionError(f"expected a joint mesh for tensor-parallel param {fqn!r}")
        return StateLayout(dp_mesh, (dp_placement,), param.shape, param.stride())
    dp_name = dp_mesh.mesh_dim_names[0]  # type: ignore[index]
    dp_dim = joint.mesh_dim_names.index(dp_name)  # type: ignore[union-attr]
    tp_dim = 1 - dp_dim
    tp_placement: Placement = Replicate() if tp is None else tp.placements[0]
    shape = param.shape if tp is None else tp.shape
    stride = param.stride() if tp is None else tp.stride
    splits_rows = isinstance(tp_placement, Shard) and tp_placement.dim in (0, -len(shape))
    if splits_rows and dp_dim < tp_dim and joint.size(tp_dim) > 1:
        dp_placement = _StridedShard(0, split_factor=joint.size(tp_dim))
    placements: list[Any] = [None, None]
    placements[dp_dim], placements[tp_dim] = dp_placement, tp_placement
    layout = StateLayout(joint, tuple(placements), shape, tuple(stride))
    if not spec.replicated:
        _check_rows_where_torch_puts_them(layout, tp, spec, fqn)
    return layout


def _check_rows_where_torch_puts_them(
    layout: StateLayout, tp: DTensorSpec | None, spec: ShardSpec, fqn: str
) -> None:
    if tp is None:
        start, other = [0] * len(layout.shape), list(layout.shape[1:])
    else:
        local_shape, start = compute_local_shape_and_global_offset(tp.shape, tp.mesh, tp.placements)
        start, other = list(start), list(local_shape[1:])
    start[0] += spec.start_row
    expected = tuple(
        slice(first, first + size)
        for first, size in zip(start, [spec.num_rows, *other], strict=True)
    )
    got = layout.region()
    same = all(
        (a.start, a.stop) == (b.start, b.stop) or a.stop - a.start == b.stop - b.start == 0
        for a, b in zip(got, expected, strict=True)
    )
    if not same:  # torch.chunk's rows both times: DTensor places them the same (tested)
        raise AssertionError(
            f"expected param {fqn!r}'s rows where DTensor places {layout.placements} "
            f"({got}), got {expected}"
        )
