"""What a replicated model's param holds as ``.grad`` once zero-shard has reduced its grad.

[Note: released grads]
At stage 1 and 2 a param's grad is reduced into this rank's shard of it during backward, and the
full-size ``.grad`` is freed: no rank holds the whole reduced grad. Two torch habits then go
wrong with ``.grad = None``: code that reads grads sees none and does nothing
(``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` clips nothing, silently), and
clearing grads the model's way (``model.zero_grad()``, ``p.grad = None``, ``zero_()``) cannot be
told from not clearing them, so the next backward's grads would be added to this one's.

So after each reduction every param of the bucket holds a :class:`ReleasedGrad` instead (whether
this rank had a grad for it or not: the shard holds the grad of all ranks), a tensor of the
grad's shape, dtype and device with no memory; at the step, a param no rank had a grad for gets
``None`` back, as in torch (until then its norm is 0 and scaling it changes nothing, so torch's
clip, which skips ``None`` grads, gets the same total). torch's clipping works on it: norms,
multiplies by one number and clamps go to the optimizer it is linked to, which does them on the
reduced shards ([Note: torch's clip on released grads] in ``_released_ops.py``). Any other use
(reading values, math with it) raises an error that says where the grad went; dtype and device
conversions (``model.half()``) give another placeholder, linked to nothing.

A :class:`GradWatch` per param tells whether its ``.grad`` was cleared since the last reduction,
param by param, as torch's accumulation would see it: it records what ``.grad`` holds if nobody
touched it (the placeholder, or the local grad a backward inside ``no_sync()`` accumulated, with
its version counter) and compares before each accumulation and at the reduction. Not cleared:
the reduction adds to the param's reduced grad; cleared: it writes it. A placeholder zeroed in
place (``zero_grad(set_to_none=False)``) counts as a zero grad: cleared, and stepped, as torch
steps zeros. The placeholder is taken off ``.grad`` by a pre-hook on the param's grad
accumulator, which runs before autograd accumulates a backward's grad there (and not for
``torch.autograd.grad``, which accumulates nothing).

[Note: placeholders held across steps]
torch makes a new ``.grad`` tensor for a backward that finds ``.grad`` None (after a clear to
``None``): a grad someone kept from before keeps its values. zero-shard holds one reduced grad a
param, so the placeholder that stood for the old one cannot go on standing for it: where it is
held outside zero-shard (its reference count says so) when its reduced grad is freed
(``zero_grad``, a forward after ``model.zero_grad()``) or about to be written afresh (a backward
that finds ``.grad`` None, or set by hand to another tensor), it is retired and the param gets a
new one. Reading a retired
placeholder raises; zeroing, scaling or clamping it changes nothing, as on torch's kept tensor;
putting it back into ``.grad`` (grads saved, a diagnostic backward, grads restored) raises at the
next backward or step, since zero-shard cannot step the values it stood for. A placeholder
zeroed in place (``zero_grad(set_to_none=False)``) or accumulated into stays the live one, as
torch's tensor does.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

__all__ = [
    "GradWatch",
    "PlaceholderRemoval",
    "ReducedGrads",
    "ReleasedGrad",
    "Taken",
    "check_unconverted",
    "forget_all",
]

aten = torch.ops.aten
_ZEROING = (aten.zero_.default, aten._foreach_zero_.default)
_ALIASES = (aten.detach.default, aten.alias.default)
# What torch's clipping (clip_grad_norm_, get_total_norm, clip_grads_with_norm_,
# clip_grad_value_) does to each grad, one by one or in multi-tensor calls.
_NORMS = (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar)
_SCALES = (aten.mul_.Tensor, aten.mul_.Scalar, aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar)
_CLAMPS = (
    aten.clamp_.default,
    aten.clamp_min_.default,
    aten.clamp_max_.default,
    aten._foreach_clamp_min_.Scalar,
    aten._foreach_clamp_max_.Scalar,
)


class ReducedGrads(Protocol):
    """What holds the reduced grads that placeholders stand in for (the optimizer's), by the
    index the placeholder was linked with; see [Note: torch's clip on released grads]."""

    def settle(self, indices: list[int]) -> None:
        """Brings the grads up to date with clears made since the reduction (a placeholder held
        elsewhere whose grad was cleared is retired there)."""
        ...

    def norms(self, indices: list[int], norm_type: float) -> list[torch.Tensor]:
        """The global ``norm_type``-norm of each grad (collective), fp32 or fp64."""
        ...

    def scale_(self, indices: list[int], factor: torch.Tensor | float) -> None:
        """Multiplies the grads by ``factor`` (one element)."""
        ...

    def clamp_(self, indices: list[int], low: float | None, high: float | None) -> None:
        """Clamps the grads' elements into ``[low, high]``."""
        ...


class ReleasedGrad(torch.Tensor):
    """Stands in for a param's ``.grad`` reduced into zero-shard's shards; see [Note: released
    grads]. ``zeroed`` records a ``zero_()`` on it (``zero_grad(set_to_none=False)``)."""

    fqn: str
    zeroed: bool
    retired: bool  # it stood for a reduced grad since freed or written afresh ([Note:
    #                placeholders held across steps])
    alias_of: ReleasedGrad | None  # the placeholder this one is a detached alias of (.data)
    index: int  # the grad's index in ``owner``
    owner: weakref.ref[ReducedGrads] | None  # what computes norms of, scales and clamps the
    #                                          reduced grad; None: nothing does (a conversion's)

    @staticmethod
    def __new__(
        cls, param: torch.Tensor, fqn: str, device: torch.device | None = None
    ) -> ReleasedGrad:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, param.shape, dtype=param.dtype, device=device or param.device, requires_grad=False
        )

    def __init__(self, param: torch.Tensor, fqn: str, device: torch.device | None = None) -> None:
        self.fqn = fqn
        self.zeroed = False
        self.retired = False
        self.alias_of = None
        self.index = -1
        self.owner = None

    def link(self, owner: ReducedGrads, index: int) -> None:
        """Norms, scaling and clamping of this placeholder go to ``owner``'s grad ``index``."""
        self.owner = weakref.ref(owner)
        self.index = index

    def alias(self) -> ReleasedGrad:
        """A placeholder for the same reduced grad (``.data``, ``.detach()``): its norms,
        scaling and clamping are this one's, and zeroing it zeroes this one."""
        alias = ReleasedGrad(self, self.fqn)
        alias.alias_of = self if self.alias_of is None else self.alias_of
        alias.index, alias.owner = self.index, self.owner
        return alias

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        retired = [t for t in tensors if isinstance(t, ReleasedGrad) and _root(t).retired]
        if retired:
            return _on_retired(func, args, tensors, retired)
        if func is aten._to_copy.default:  # nn.Module._apply converts grads too
            like = args[0]
            dtype, device = kwargs.get("dtype") or like.dtype, kwargs.get("device") or like.device
            return ReleasedGrad(
                torch.empty(like.shape, dtype=dtype, device="meta"), like.fqn, device
            )
        if func in _ALIASES:  # p.grad.data, p.grad.detach(): the same grad, for what works on it
            return args[0].alias()
        if func in _ZEROING:
            for tensor in tensors:
                if isinstance(tensor, ReleasedGrad):
                    root = tensor if tensor.alias_of is None else tensor.alias_of
                    root.zeroed = True
                else:  # a real grad zeroed in the same multi-tensor call
                    tensor.zero_()
            return args[0] if func is aten.zero_.default else None
        if func in _NORMS or func in _SCALES or func in _CLAMPS:
            bound = _bound(func, args, kwargs)
            if _released_only_in_self(bound):
                return _on_reduced_grads(func, bound)
        released = next(t for t in tensors if isinstance(t, ReleasedGrad))
        raise _read_error(released, func)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ReleasedGrad({self.fqn!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: reduced into zero-shard's shards; see opt.main_grad)"
        )


def _root(released: ReleasedGrad) -> ReleasedGrad:
    return released if released.alias_of is None else released.alias_of


def _on_retired(
    func: Any, args: tuple[Any, ...], tensors: list[torch.Tensor], retired: list[ReleasedGrad]
) -> Any:
    """An op on placeholders retired ([Note: placeholders held across steps]): a write to them
    alone changes nothing (as on the grads torch keeps); anything else raises."""
    writes = _ZEROING + _SCALES + _CLAMPS
    if func in writes and all(isinstance(t, ReleasedGrad) and _root(t).retired for t in tensors):
        return None if func._overloadpacket.__name__.startswith("_foreach") else args[0]
    raise RuntimeError(
        f"the grad of {retired[0].fqn!r} held here stood for a reduced grad that zero-shard has "
        f"since freed or written afresh (a clear, then a backward; attempted: {func}): zero-shard "
        "holds one reduced grad a param, and the placeholder in .grad stands for the current one "
        "only. Read grads between backward and step, or keep copies of their values "
        "(opt.main_grad(param).clone(): this rank's shard, as a DTensor)"
    )


def restored_error(fqn: str) -> RuntimeError:
    """A placeholder retired and then put back into ``.grad``."""
    return RuntimeError(
        f"the .grad of {fqn!r} was set to a grad held from an earlier backward (grads saved, "
        "cleared, and put back): zero-shard reduced that grad into its shards and holds the "
        "current one only, so it cannot step the values it stood for. Keep copies of the values "
        "instead (saved = opt.main_grad(param).clone(): this rank's shard, as a DTensor), and "
        "copy them back after the other backward (opt.main_grad(param).copy_(saved))"
    )


def _read_error(released: ReleasedGrad, func: Any) -> RuntimeError:
    if func is aten._amp_foreach_non_finite_check_and_unscale_.default:
        return RuntimeError(
            f"torch.amp.GradScaler unscaled the grad of {released.fqn!r}, which zero-shard has "
            "taken into its sharded main grads and freed from the model: use "
            "zero_shard.GradScaler(device_type) in its place (the same scale, unscale_, step and "
            "update), which unscales the reduced grads and skips a step with infs or NaNs on every "
            "rank alike; nothing was stepped"
        )
    during_backward = ""
    if torch._C._current_graph_task_id() != -1:  # read by backward itself: a second reducer
        during_backward = (
            " It was read during backward, after zero-shard had reduced it: by a hook, or by a "
            "DistributedDataParallel wrapped around the model after zero_shard.wrap over params "
            "some of which zero-shard does not step (a DDP over zero-shard's params alone, as HF "
            "Trainer and accelerate make, has its sync turned off where the model's forward runs "
            "eagerly), which would reduce the "
            "grads a second time. Give the wrapped optimizer all of DDP's params, or wrap the "
            "model in DDP first and give zero_shard.wrap the DDP model."
        )
    return RuntimeError(
        f"the grad of {released.fqn!r} was reduced over the ranks into zero-shard's shards "
        f"and freed from the model (attempted: {func}).{during_backward} "
        "torch.nn.utils.clip_grad_norm_, get_total_norm, clip_grads_with_norm_ and "
        "clip_grad_value_ work on it (every rank calls them), as do "
        "opt.clip_grad_norm_(max_norm); read a reduced grad with opt.main_grad(param), and "
        "clear grads with opt.zero_grad(), model.zero_grad() or p.grad = None. To train the "
        "model with another optimizer, drop every reference to the ZeroShardOptimizer first (an "
        "LR scheduler holds one too): its hooks go with it"
    )


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by name, defaults filled in."""
    bound = {}
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            bound[argument.name] = args[position]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def _released_only_in_self(bound: dict[str, Any]) -> bool:
    """Whether placeholders appear only as the grads operated on (not as a factor, a bound)."""
    others = tree_flatten([value for name, value in bound.items() if name != "self"])[0]
    return not any(isinstance(value, ReleasedGrad) for value in others)


def _on_reduced_grads(func: Any, bound: dict[str, Any]) -> Any:
    """torch's clipping on placeholders (and real grads beside them in a multi-tensor call): the
    norms, scaling and clamping of the reduced grads they stand for."""
    single = not isinstance(bound["self"], (list, tuple))
    grads = [bound["self"]] if single else list(bound["self"])
    by_owner: dict[int, tuple[ReducedGrads, list[int], list[int]]] = {}  # positions, indices
    for position, grad in enumerate(grads):
        if not isinstance(grad, ReleasedGrad):
            continue
        owner = grad.owner() if grad.owner is not None else None
        if owner is None:
            raise _read_error(grad, func)
        entry = by_owner.setdefault(id(owner), (owner, [], []))
        entry[1].append(position)
        entry[2].append(grad.index)
    for owner, _, indices in by_owner.values():
        owner.settle(indices)
    retired = [g for g in grads if isinstance(g, ReleasedGrad) and _root(g).retired]
    if retired:  # by the clears just applied
        return _on_retired(func, (bound["self"],), grads, retired)
    plain = [grad for grad in grads if not isinstance(grad, ReleasedGrad)]
    if func in _NORMS:
        norms = _norms_of(func, bound, grads, by_owner.values(), plain)
        return norms[0] if single else norms
    if func in _SCALES:
        factor = bound["other"] if "other" in bound else bound["scalar"]
        if isinstance(factor, torch.Tensor) and factor.numel() != 1:
            raise NotImplementedError(
                f"multiplying the released grad of {_first_fqn(grads)!r} by a tensor of shape "
                f"{tuple(factor.shape)} (elementwise) is not supported: only by one number (a "
                f"clip's factor). {_READ_MAIN_GRAD}"
            )
        for owner, _, indices in by_owner.values():
            owner.scale_(indices, factor)
        for grad in plain:
            grad.mul_(factor)
    else:
        low, high = _clamp_bounds(func, bound)
        for owner, _, indices in by_owner.values():
            owner.clamp_(indices, low, high)
        for grad in plain:
            grad.clamp_(min=low, max=high)
    return bound["self"] if single else None


_READ_MAIN_GRAD = (
    "zero-shard reduced the grad over the ranks into its shards; read it with "
    "opt.main_grad(param) (this rank's shard, as a DTensor; .full_tensor() for the whole grad) "
    "and edit it there"
)


def _first_fqn(grads: Sequence[torch.Tensor]) -> str:
    return next(g.fqn for g in grads if isinstance(g, ReleasedGrad))


def _norms_of(
    func: Any,
    bound: dict[str, Any],
    grads: list[torch.Tensor],
    owners: Any,
    plain: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Each grad's norm as torch's op gives it (the grad's dtype unless ``dtype`` says, on its
    device), a placeholder's over the whole reduced grad."""
    norm_type, dtype = float(bound["ord"]), bound["dtype"]
    if bound.get("dim") is not None:
        raise NotImplementedError(
            f"a norm over dims {bound['dim']} of the released grad of {_first_fqn(grads)!r} is "
            "not supported: only over all its elements (as torch's clipping takes it). "
            f"{_READ_MAIN_GRAD}"
        )
    norms: list[torch.Tensor | None] = [None] * len(grads)
    for owner, positions, indices in owners:
        for position, norm in zip(positions, owner.norms(indices, norm_type), strict=True):
            grad = grads[position]
            norms[position] = norm.to(device=grad.device, dtype=dtype or grad.dtype)
    rest = iter([torch.linalg.vector_norm(grad, norm_type, dtype=dtype) for grad in plain])
    result = [next(rest) if norm is None else norm for norm in norms]
    if bound.get("keepdim"):
        result = [norm.reshape((1,) * grad.dim()) for norm, grad in zip(result, grads, strict=True)]
    return result


def _clamp_bounds(func: Any, bound: dict[str, Any]) -> tuple[float | None, float | None]:
    if func is aten.clamp_.default:
        return bound["min"], bound["max"]
    if func is aten.clamp_min_.default:
        return bound["min"], None
    if func is aten.clamp_max_.default:
        return None, bound["max"]
    if func is aten._foreach_clamp_min_.Scalar:
        return bound["scalar"], None
    return None, bound["scalar"]


def check_unconverted(
    param: torch.Tensor, fqn: str, dtype: torch.dtype, device: torch.device
) -> None:
    """Raises unless ``param`` still has the dtype and device it had at wrap, and contiguous
    memory (checked at wrap)."""
    if param.dtype != dtype or param.device != device:
        raise RuntimeError(
            f"param {fqn!r} is {param.dtype} on {param.device} now, but was {dtype} on {device} "
            "when the optimizer was wrapped (model.half(), model.to(...)): the optimizer's shards "
            "and hooks are of the old params. Convert the model before zero_shard.wrap, or wrap "
            "a new optimizer after"
        )
    local = param._local_tensor if isinstance(param, DTensor) else param
    if not local.is_contiguous():
        raise RuntimeError(
            f"param {fqn!r} is not contiguous now (stride {local.stride()}; "
            "model.to(memory_format=torch.channels_last)?), but was when the optimizer was "
            "wrapped: zero-shard gathers each step's update into the params' memory by rows, and "
            "steps contiguous params only; nothing was stepped. Keep the params contiguous: "
            "convert the inputs instead (x.to(memory_format=torch.channels_last): a convolution "
            "of a channels_last input runs channels_last), or make the param contiguous again "
            "(model.to(memory_format=torch.contiguous_format))"
        )


def _version_of(grad: torch.Tensor) -> int:
    """A grad's version counter; a DTensor grad's (tensor parallelism) and its local tensor's
    together, as either may count an in-place write (see [Note: FSDP2 versions])."""
    if isinstance(grad, DTensor):
        return grad._version + grad._local_tensor._version
    return grad._version


class Taken(NamedTuple):
    """A param's grad as a reduction takes it."""

    grad: torch.Tensor | None  # to reduce (None: no new grad here)
    kept: bool  # add it to the reduced grad held, instead of writing it
    zeroed: bool  # a zeroed placeholder: zeros, present where a grad was before


@dataclass
class GradWatch:
    """Whether a param's ``.grad`` was cleared since its grad was last reduced; see [Note: released
    grads]."""

    param: torch.Tensor
    placeholder: ReleasedGrad
    expected: torch.Tensor | None = None  # what .grad holds if nobody cleared it since the last
    #                                       reduction: the placeholder, or the local grad that
    #                                       backwards accumulated since; None: nothing held
    expected_version: int = 0  # expected's version counter then (zero_() bumps it)
    kept: bool = False  # not cleared since the last reduction: the next one adds to it
    dtype: torch.dtype = field(init=False)  # the param's, at wrap
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.dtype, self.device = self.param.dtype, self.param.device

    def renew_if_held(self) -> None:
        """Retires the placeholder where it is held outside zero-shard, for a new one ([Note:
        placeholders held across steps]); one left in ``.grad`` (zeroed in place) stays live."""
        if self.param.grad is self.placeholder:
            return
        if sys.getrefcount(self.placeholder) <= _HELD_ONCE + (self.expected is self.placeholder):
            return
        placeholder = self.placeholder
        placeholder.retired = True
        renewed = self.placeholder = ReleasedGrad(self.param, placeholder.fqn)
        renewed.index, renewed.owner = placeholder.index, placeholder.owner
        if self.expected is placeholder:
            self.expected = renewed

    def _intact(self) -> bool:
        grad = self.param.grad
        if grad is None or grad is not self.expected:
            return False
        if isinstance(grad, ReleasedGrad):
            return not grad.zeroed
        return _version_of(grad) == self.expected_version

    def before_accumulate(self, grad_outputs: Any = None) -> None:
        """A backward is about to accumulate into ``.grad``: judge it, take the placeholder off.
        (A pre-hook on the param's grad accumulator: ``grad_outputs`` is unused.)"""
        self.kept = self.kept and self._intact()
        grad = self.param.grad
        if isinstance(grad, ReleasedGrad):
            if grad is not self.placeholder and _root(grad).retired:
                raise restored_error(self.placeholder.fqn)
            if self.kept and not grad.zeroed:
                self._warn_hooks_on_a_sum()
            self.param.grad = None
        elif sys.getrefcount(self.placeholder) > _HELD_ONCE + (self.expected is self.placeholder):
            # .grad cleared or set by hand: torch's grad from now on is another tensor than the
            # one held, which keeps its values (checked inline: every backward)
            self.renew_if_held()

    def _warn_hooks_on_a_sum(self) -> None:
        """Warns (once a process) where the param has post-accumulate-grad hooks of its user
        (beside zero-shard's own), and this backward adds to a grad reduced before: torch's hooks
        would see the sum of the backwards, but this backward's grad reaches ``.grad`` alone,
        added to the reduced one after them. A warning, not an error: hooks that only observe
        (grad logging, often on one rank) are harmless, and an error on the ranks that have the
        hook would leave the others waiting in a collective (checked only on this path)."""
        global _warned_hooks_on_a_sum
        hooks = self.param._post_accumulate_grad_hooks
        if _warned_hooks_on_a_sum or hooks is None or len(hooks) < 2:
            return
        _warned_hooks_on_a_sum = True
        warnings.warn(
            f"zero-shard: param {self.placeholder.fqn!r} has a post-accumulate-grad hook "
            "(register_post_accumulate_grad_hook), and this backward adds to the grads an "
            "earlier one reduced: torch's hook would see their sum, but here it sees this "
            "backward's grad alone (a hook that changes the grad, a clamp, then changes the "
            "step). Run the backwards before the last inside opt.no_sync(): their grads add up "
            "in .grad, and the hook sees the sum, as in torch",
            RuntimeWarning,
            stacklevel=2,
        )

    def after_accumulate(self) -> None:
        """A backward accumulated into ``.grad`` (inside ``no_sync()``, it stays there)."""
        param = self.param
        if param.dtype != self.dtype or param.device != self.device:  # inline: every backward
            check_unconverted(param, self.placeholder.fqn, self.dtype, self.device)
        grad = self.expected = param.grad
        self.expected_version = grad._version if type(grad) is torch.Tensor else _version_of(grad)

    def take(self) -> Taken:
        """At the reduction: the grad to reduce and whether to add it to the reduced one. A
        zeroed placeholder is a zero grad (without memory), as torch's zeroed ``.grad``."""
        self.kept = self.kept and self._intact()
        grad = self.param.grad
        if grad is None:  # cleared: the reduction writes the grad afresh
            if sys.getrefcount(self.placeholder) > _HELD_ONCE + (self.expected is self.placeholder):
                self.renew_if_held()
        elif isinstance(grad, ReleasedGrad):
            if grad is not self.placeholder and _root(grad).retired:
                raise restored_error(self.placeholder.fqn)
            self.param.grad = None
            if not grad.zeroed:
                return Taken(None, self.kept, zeroed=False)
            zeros = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
            return Taken(zeros, kept=False, zeroed=True)
        return Taken(grad, self.kept, zeroed=False)

    def release(self) -> None:
        """The grad is reduced into the shard: the placeholder stands in for it."""
        self.placeholder.zeroed = False
        self.param.grad = self.placeholder
        self.expected = self.placeholder
        self.kept = True

    def cleared_after_reduction(self) -> bool | None:
        """Between the reduction and the step: True if ``.grad`` was set to None; False if the
        placeholder was zeroed in place; None otherwise (it holds the reduced grad, or a grad
        set by hand, which this step does not use: the reducer warns)."""
        grad = self.param.grad
        if isinstance(grad, ReleasedGrad) and grad is not self.placeholder and _root(grad).retired:
            raise restored_error(self.placeholder.fqn)
        if self.expected is not self.placeholder or self._intact():
            return None
        if self.param.grad is None:
            return True
        return False if self.param.grad is self.placeholder else None

    def drop(self) -> None:
        """No rank had a grad for the param since it was last cleared: ``.grad`` is None, as in
        torch."""
        if self.param.grad is self.placeholder:
            self.param.grad = None
        self.forget()

    def forget(self) -> None:
        """``zero_grad``: no reduced grad is held (a zeroed placeholder stays: a zero grad)."""
        self.expected = None
        self.kept = False

    def written_since_accumulated(self) -> bool:
        """Whether ``.grad`` is the grad a backward left (inside ``no_sync()``, unreduced), and
        was written in place since."""
        grad = self.param.grad
        if grad is None or grad is not self.expected or isinstance(grad, ReleasedGrad):
            return False
        return _version_of(grad) != self.expected_version

    def holds_unreduced_grad(self) -> bool:
        """Whether ``.grad`` holds a grad no reduction took (accumulated inside ``no_sync()``, or
        set by hand)."""
        return self.param.grad is not None and not isinstance(self.param.grad, ReleasedGrad)


def forget_all(watches: list[GradWatch]) -> None:
    """``forget`` for each of ``watches`` (a bucket's reduced grads freed, at ``zero_grad``), in
    one call; placeholders held elsewhere are retired ([Note: placeholders held across steps])."""
    for watch in watches:
        watch.expected = None
        watch.kept = False
        if watch.param.grad is not watch.placeholder and sys.getrefcount(watch.placeholder) > (
            _HELD_ONCE
        ):
            watch.renew_if_held()


class _Holder:
    def __init__(self) -> None:
        self.value = object()


def _count_held_once() -> int:
    """What ``sys.getrefcount(holder.value)`` reads for an object only that attribute holds (the
    call's own reference included, where the interpreter counts it)."""
    holder = _Holder()
    return sys.getrefcount(holder.value)


_HELD_ONCE = _count_held_once()
_warned_hooks_on_a_sum = False  # see GradWatch._warn_hooks_on_a_sum


class PlaceholderRemoval:
    """A hook handle of sorts: when the optimizer's hooks are removed (it was dropped), the
    params' placeholders go too, so that the model outlives it as a plain torch model."""

    def __init__(self, watches: list[GradWatch]) -> None:
        self._watches = watches

    def remove(self) -> None:
        for watch in self._watches:
            watch.drop()
