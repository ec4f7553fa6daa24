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
``None`` back, as in torch. Any use of it other than clearing (a read, an in-place update) raises
an error that says where the grad went; dtype and device conversions (``model.half()``) give
another placeholder.

A :class:`GradWatch` per param tells whether its ``.grad`` was cleared since the last reduction,
param by param, as torch's accumulation would see it: it records what ``.grad`` holds if nobody
touched it (the placeholder, or the local grad a backward inside ``no_sync()`` accumulated, with
its version counter) and compares before each accumulation and at the reduction. Not cleared:
the reduction adds to the param's reduced grad; cleared: it writes it. A placeholder zeroed in
place (``zero_grad(set_to_none=False)``) counts as a zero grad: cleared, and stepped, as torch
steps zeros. The placeholder is taken off ``.grad`` by a pre-hook on the param's grad
accumulator, which runs before autograd accumulates a backward's grad there (and not for
``torch.autograd.grad``, which accumulates nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

__all__ = [
    "GradWatch",
    "PlaceholderRemoval",
    "ReleasedGrad",
    "Taken",
    "check_unconverted",
    "forget_all",
]

_ZEROING = (torch.ops.aten.zero_.default, torch.ops.aten._foreach_zero_.default)


class ReleasedGrad(torch.Tensor):
    """Stands in for a param's ``.grad`` reduced into zero-shard's shards; see [Note: released
    grads]. ``zeroed`` records a ``zero_()`` on it (``zero_grad(set_to_none=False)``)."""

    fqn: str
    zeroed: bool

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
        if func is torch.ops.aten._to_copy.default:  # nn.Module._apply converts grads too
            like = args[0]
            dtype, device = kwargs.get("dtype") or like.dtype, kwargs.get("device") or like.device
            return ReleasedGrad(
                torch.empty(like.shape, dtype=dtype, device="meta"), like.fqn, device
            )
        if func in _ZEROING:
            for tensor in tensors:
                if isinstance(tensor, ReleasedGrad):
                    tensor.zeroed = True
                else:  # a real grad zeroed in the same multi-tensor call
                    tensor.zero_()
            return args[0] if func is torch.ops.aten.zero_.default else None
        released = next(t for t in tensors if isinstance(t, ReleasedGrad))
        raise RuntimeError(
            f"the grad of {released.fqn!r} was reduced over the ranks into zero-shard's shards "
            f"and freed from the model (attempted: {func}). Clip with opt.clip_grad_norm_("
            "max_norm) (torch.nn.utils.clip_grad_norm_ cannot see sharded grads), read a reduced "
            "grad with opt.main_grad(param), and clear grads with opt.zero_grad(), "
            "model.zero_grad() or p.grad = None"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ReleasedGrad({self.fqn!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: reduced into zero-shard's shards; see opt.main_grad)"
        )


def check_unconverted(
    param: torch.Tensor, fqn: str, dtype: torch.dtype, device: torch.device
) -> None:
    """Raises unless ``param`` still has the dtype and device it had at wrap."""
    if param.dtype != dtype or param.device != device:
        raise RuntimeError(
            f"param {fqn!r} is {param.dtype} on {param.device} now, but was {dtype} on {device} "
            "when the optimizer was wrapped (model.half(), model.to(...)): the optimizer's shards "
            "and hooks are of the old params. Convert the model before zero_shard.wrap, or wrap "
            "a new optimizer after"
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
        if isinstance(self.param.grad, ReleasedGrad):
            self.param.grad = None

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
        if isinstance(grad, ReleasedGrad):
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

    def holds_unreduced_grad(self) -> bool:
        """Whether ``.grad`` holds a grad no reduction took (accumulated inside ``no_sync()``, or
        set by hand)."""
        return self.param.grad is not None and not isinstance(self.param.grad, ReleasedGrad)


def forget_all(watches: list[GradWatch]) -> None:
    """``forget`` for each of ``watches`` (a bucket's, at ``zero_grad``), in one call."""
    for watch in watches:
        watch.expected = None
        watch.kept = False


class PlaceholderRemoval:
    """A hook handle of sorts: when the optimizer's hooks are removed (it was dropped), the
    params' placeholders go too, so that the model outlives it as a plain torch model."""

    def __init__(self, watches: list[GradWatch]) -> None:
        self._watches = watches

    def remove(self) -> None:
        for watch in self._watches:
            watch.drop()
