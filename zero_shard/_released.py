"""What a replicated model's param holds as ``.grad`` once zero-shard has reduced its grad.

[Note: released grads]
At stage 1 and 2 a param's grad is reduced into this rank's shard of it during backward, and the
full-size ``.grad`` is freed: no rank holds the whole reduced grad. Two torch habits then go
wrong with ``.grad = None``: code that reads grads sees none and does nothing
(``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` clips nothing, silently), and
clearing grads the model's way (``model.zero_grad()``, ``p.grad = None``, ``zero_()``) cannot be
told from not clearing them, so the next backward's grads would be added to this one's.

So after each reduction every param of the bucket holds a :class:`ReleasedGrad` instead
(whether this rank had a grad for it or not: the shard holds the grad of all ranks): a tensor of
the grad's shape, dtype and device with no memory. Clearing it is seen (set to ``None``, replaced, or zeroed in place), and
the next reduction then writes the param's reduced grad instead of adding to it, as torch's
next backward writes a cleared ``.grad``. Any other use (a read, an in-place update) raises an
error that says where the grad went. A tensor hook on the param takes the placeholder off
before autograd accumulates the next backward's grad into ``.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["ReleasedGrad"]

_ZEROING = (torch.ops.aten.zero_.default, torch.ops.aten._foreach_zero_.default)


class ReleasedGrad(torch.Tensor):
    """Stands in for a param's ``.grad`` reduced into zero-shard's shards; see [Note: released
    grads]. ``zeroed`` records a ``zero_()`` on it (``zero_grad(set_to_none=False)``)."""

    fqn: str
    zeroed: bool

    @staticmethod
    def __new__(cls, param: torch.Tensor, fqn: str) -> ReleasedGrad:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )

    def __init__(self, param: torch.Tensor, fqn: str) -> None:
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
        tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
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
