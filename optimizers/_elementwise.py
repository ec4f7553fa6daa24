"""Which optimizer classes may be split by element, and how each device runs them."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._step_hooks import step_unhooked, unhooked

__all__ = [
    "IMPL_KEYS",
    "OptimizerSpec",
    "StateKeys",
    "check_elementwise",
    "check_wrappable",
    "constructor_defaults",
    "implementation_kwargs",
    "probe_state_keys",
    "step_sub_optimizer",
    "torch_class_run_as_is",
]

# Every element of these optimizers' update depends only on the same element of the param, grad
# and state (plus scalars shared by the whole param, such as the step count), so a parameter can
# be cut into pieces stepped on different devices and the result is the same.
_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)
# Devices with a fused kernel, per class (torch >= 2.8).
_FUSED_DEVICES: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.Adam: ("cuda", "cpu", "xpu", "mps"),
    torch.optim.AdamW: ("cuda", "cpu", "xpu", "mps"),
    torch.optim.SGD: ("cuda", "cpu", "xpu", "mps"),
    torch.optim.Adagrad: ("cpu",),
}
# Group keys that choose an implementation rather than the math; set per device.
IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def torch_class_run_as_is(
    cls: type, bases: Sequence[type], methods: Sequence[str] = ("step",)
) -> type | None:
    """The nearest of ``bases`` that ``cls`` subclasses without changing ``methods`` (each the
    base's own function; ``step`` without torch's step-hook wrapper), or ``None``."""
    matches = [
        base
        for base in bases
        if issubclass(cls, base)
        and all(
            unhooked(getattr(cls, name, None)) is unhooked(getattr(base, name, None))
            for name in methods
        )
    ]
    return min(matches, key=cls.__mro__.index) if matches else None


def _elementwise_base(cls: type) -> type[torch.optim.Optimizer] | None:
    return torch_class_run_as_is(cls, _ELEMENTWISE)


_WRAPPERS = ("AcceleratedOptimizer", "LightningOptimizer")  # libraries' optimizers around one


def check_wrappable(optimizer: Any) -> None:
    """Raises unless ``optimizer`` is a torch optimizer of an elementwise class (see
    ``check_elementwise``), naming the fix where it wraps one (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    wrapper = type(optimizer).__name__ in _WRAPPERS
    if wrapper and isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        raise TypeError(
            f"the optimizer given is a {type(optimizer).__name__} around a "
            f"{type(inner).__name__}: zero-shard wraps the torch optimizer itself. Wrap it "
            "before handing it to the library that wraps it (zero_shard.wrap(opt, model), then "
            "accelerator.prepare(model, wrapped_opt, ...)), or pass its .optimizer"
        )
    check_elementwise(type(optimizer))


def check_elementwise(cls: Any) -> None:
    """Raises unless ``cls`` is an optimizer class whose update is elementwise.

    Accepted: torch's elementwise optimizers (Adam, AdamW, SGD, Adagrad, Adamax, NAdam, RAdam,
    RMSprop, Rprop, Adadelta, ASGD), subclasses of them that keep their ``step``, and any class
    that declares ``_zero_shard_elementwise = True``. Every class is stepped over flat 1-D pieces
    of the params: a declared class whose step looks at a param's shape (``p.ndim >= 2`` to decay
    matrices only) sees ``ndim == 1`` everywhere; put such choices in the param groups instead. Only torch's own classes have their state
    made at construction (zeros, where their first step would make zeros); a subclass that
    changes its ``step`` or ``_init_group`` makes its state itself, at its first step.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {cls!r}")
    if getattr(cls, "_zero_shard_elementwise", False) or _elementwise_base(cls) is not None:
        return
    names = ", ".join(base.__name__ for base in _ELEMENTWISE)
    raise NotImplementedError(
        f"{cls.__module__}.{cls.__qualname__} is not a known elementwise optimizer: zero-shard "
        f"splits parameters by element between devices and ranks, which changes the result of "
        f"optimizers that look at whole tensors (norms, factored or matrix state). Supported: "
        f"{names}. If your class really is elementwise (each element's update reads only that "
        "element's param, grad and state and the group's options: zero-shard steps it over flat "
        "1-D pieces of the params, so it must not look at a param's shape, dims or norm), set "
        "`_zero_shard_elementwise = True` on it."
    )


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor accepts (lr, betas, ...): its
    class is built again over each device's and rank's share as ``cls(groups, **these)``. A
    class that cannot be built so, or that keeps a setting of its own (an attribute holding a
    number, string or flag) that the build would not give back, is refused: its steps there
    would run with another setting."""
    cls = type(optimizer)
    name = cls.__qualname__
    signature = inspect.signature(cls.__init__)
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in signature.parameters}
    built_as = f"{name}(param_groups, **optimizer.defaults) (the defaults its constructor accepts)"
    try:
        signature.bind(optimizer, [], **kwargs)
    except TypeError as err:
        raise TypeError(
            f"zero-shard builds {name} again over its own share of the params, as {built_as}, "
            f"and that call fails: {err}. Give that constructor argument a default value, or "
            "keep it in the defaults the constructor hands to torch.optim.Optimizer.__init__"
        ) from err
    if cls not in _ELEMENTWISE:  # (torch's own keep every setting in their defaults)
        built = _settings(cls([torch.zeros(1)], **kwargs))
        for key, value in _settings(optimizer).items():
            if key in built and not _same(built[key], value):
                raise TypeError(
                    f"{name}.{key} is {value!r} in the optimizer given, but {built[key]!r} in "
                    f"{built_as}, which zero-shard builds over its own share of the params: its "
                    f"steps there would run with {key}={built[key]!r}. Keep {key!r} in the "
                    "defaults the constructor hands to torch.optim.Optimizer.__init__ (a param "
                    "group option), or set it on the class"
                )
    return kwargs


def _settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's public attributes holding plain values (numbers, strings, flags, tuples of
    them), beside the defaults, state and groups every optimizer has."""
    return {
        key: value
        for key, value in vars(optimizer).items()
        if not key.startswith("_")
        and key not in ("defaults", "state", "param_groups")
        and _is_plain(value)
    }


def _is_plain(value: Any) -> bool:
    plain = (bool, int, float, str, type(None))
    return isinstance(value, plain) or (
        isinstance(value, tuple) and all(isinstance(each, plain) for each in value)
    )


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # (NaN equals NaN here)


def implementation_kwargs(cls: type[torch.optim.Optimizer], device_type: str) -> dict[str, Any]:
    """Constructor flags for the fastest correct implementation of ``cls`` on ``device_type``."""
    params = inspect.signature(cls.__init__).parameters
    base = _elementwise_base(cls)
    kwargs: dict[str, Any] = {}
    if "differentiable" in params:
        kwargs["differentiable"] = False
    if "capturable" in params and device_type == "cpu":
        kwargs["capturable"] = False
    if "fused" in params and base is not None and device_type in _FUSED_DEVICES.get(base, ()):
        kwargs["fused"] = True
        if "foreach" in params:
            kwargs["foreach"] = False
    elif "foreach" in params:
        kwargs["foreach"] = device_type != "cpu"
        if "fused" in params:
            kwargs["fused"] = False
    return kwargs


@dataclass(frozen=True)
class OptimizerSpec:
    """How the user's optimizer is constructed: its class and constructor arguments.

    Every sub-optimizer (and the state probe) is built as ``cls(groups, **kwargs)`` plus the
    device's implementation flags, never from the groups alone: some constructors use an argument
    themselves rather than through the param groups (Adagrad fills its ``sum`` state with
    ``initial_accumulator_value`` in ``__init__``), and a sub-optimizer built with the class's
    defaults would start from other values than the user's optimizer.
    """

    cls: type[torch.optim.Optimizer]
    kwargs: Mapping[str, Any]  # constructor keyword arguments, implementation flags left out

    @classmethod
    def of(
        cls, optimizer_cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]
    ) -> OptimizerSpec:
        """The spec of ``optimizer_cls(params, **kwargs)``; ``IMPL_KEYS`` are dropped (each device
        sets its own)."""
        return cls(optimizer_cls, {k: v for k, v in kwargs.items() if k not in IMPL_KEYS})

    def build(
        self, groups: Sequence[dict[str, Any]], impl_kwargs: Mapping[str, Any]
    ) -> torch.optim.Optimizer:
        """``cls`` over ``groups`` (implementation flags in them dropped), with ``impl_kwargs``."""
        clean = [{k: v for k, v in group.items() if k not in IMPL_KEYS} for group in groups]
        return self.cls(clean, **self.kwargs, **impl_kwargs)


@dataclass(frozen=True)
class StateKeys:
    """The per-parameter state an optimizer keeps, learned by stepping it once on a probe."""

    elementwise_keys: tuple[str, ...]  # tensors shaped like the param ("exp_avg", ...)
    scalar_keys: tuple[str, ...]  # one value per param ("step", ...)


def step_sub_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Steps one of the hybrid's own sub-optimizers (without torch's step hooks).

    [Note: SGD's late first steps]
    torch's fused SGD takes a step as a first one (each momentum buffer made from the grad,
    undampened) only when no param of the call has a buffer yet: with some made and some not (a
    param's first grad after the others stepped, a param's state dropped) it fails, and a first
    step it skips on ``found_inf`` keeps the buffers it made with ``empty_like`` (uninitialized:
    the next steps read them). Buffers start at zeros where momentum is on without dampening at
    construction (``init_state``); with dampening, or momentum switched on later (OneCycleLR's
    ``cycle_momentum``), they are made at a param's first step. So a step of a group with momentum
    where some param with a grad has no buffer yet reads the verdict on the host and, finite,
    runs torch's single-tensor path (torch's SGD by default, which makes each missing buffer from
    its grad); not finite, nothing is stepped, as the fused step would leave it.
    """
    if isinstance(optimizer, torch.optim.SGD):
        first = [
            group for group in optimizer.param_groups if _first_steps_unfused(optimizer, group)
        ]
        if first:
            _step_first_steps(optimizer, first)
            return
    step_unhooked(optimizer)


def _first_steps_unfused(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    if not (group.get("fused") and group["momentum"] != 0):
        return False
    state = optimizer.state
    return any(
        p.grad is not None and "momentum_buffer" not in state.get(p, ()) for p in group["params"]
    )


def _step_first_steps(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and bool(found_inf.item()):  # the fused steps would skip too
        return
    optimizer.found_inf = None  # (finite: the unfused path takes none)
    for group in groups:
        group["fused"] = False
    try:
        step_unhooked(optimizer)
    finally:
        for group in groups:
            group["fused"] = True
        optimizer.found_inf = found_inf


def probe_state_keys(spec: OptimizerSpec, hyperparams: dict[str, Any]) -> StateKeys:
    """Steps the optimizer once on a small CPU probe with the hyperparameters of one param group
    and sorts the state it creates.

    Raises ``NotImplementedError`` if any state is neither param-shaped nor a scalar (such an
    optimizer is not elementwise whatever it declares).
    """
    cls = spec.cls
    probe = torch.zeros(3, 2)
    probe.grad = torch.full_like(probe, 1e-3)
    group = {k: v for k, v in hyperparams.items() if k != "params"}
    group["params"] = [probe]
    optimizer = spec.build([group], implementation_kwargs(cls, "cpu"))
    step_unhooked(optimizer)
    elementwise, scalars = [], []
    for key, value in optimizer.state[probe].items():
        if torch.is_tensor(value) and value.shape == probe.shape:
            elementwise.append(key)
        elif (torch.is_tensor(value) and value.dim() == 0) or isinstance(value, (int, float)):
            scalars.append(key)
        else:
            raise NotImplementedError(
                f"{cls.__qualname__} keeps state {key!r} of shape "
                f"{tuple(getattr(value, 'shape', ()))} for a param of shape {tuple(probe.shape)}: "
                "not elementwise, so it cannot be split between devices"
            )
    return StateKeys(tuple(elementwise), tuple(scalars))
