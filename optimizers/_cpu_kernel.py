"""The single-pass CPU Adam/AdamW kernel (csrc/cpu_adam.c): built on first use, called by ctypes.

torch's fused CPU AdamW needs fp32 grads and writes fp32 weights, so a bf16 model costs two more
passes over host memory per step (grad cast in, weight cast out), and the update itself is bound
by host memory bandwidth, so they cost nearly as much again (docs/benchmarks/offload_step.md
measures them). This kernel reads the bf16 grad
and writes the bf16 weight inside its one pass. It is built with the host's C compiler into a
per-user cache the first time it is needed; without a compiler zero-shard warns once and uses
torch's kernel and the casts.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from offload import PageTwin, ThreadBudget, anonymous_ranges

from ._elementwise import torch_class_run_as_is
from ._policy import CpuKernel
from ._split import ChunkSpec

__all__ = [
    "CpuAdamKernel",
    "KernelPiece",
    "KernelTable",
    "fused_kernel_applies",
    "load_cpu_adam",
    "select_cpu_kernel",
    "unmet_option",
]

_SOURCE = Path(__file__).parent / "csrc" / "cpu_adam.c"
_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
)
_CACHE_ENV = "ZERO_SHARD_CACHE_DIR"
_ENTRIES = tuple(
    f"zero_shard_adam{mode}_{dtype}" for mode in ("", "_from") for dtype in ("bf16", "f32")
)


class _AdamArgs(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_float)
        for name in (
            "one_minus_beta1",
            "beta2",
            "one_minus_beta2",
            "eps",
            "l2",
            "decay",
            "step_size",
            "bc2_sqrt",
            "grad_factor",
            "grad_scale",
        )
    ]


class _AdamPiece(ctypes.Structure):
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("staging", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("args", _AdamArgs),
        ("from_param", ctypes.c_void_p),
        ("from_exp_avg", ctypes.c_void_p),
        ("from_exp_avg_sq", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
    ]


def _fields(args: _AdamArgs) -> tuple[float, ...]:
    return tuple(getattr(args, name) for name, _ in _AdamArgs._fields_)


class KernelPiece(NamedTuple):
    """One piece for the kernel: its fp32 main weight, its staging slots (model-dtype grad in,
    weight out) and torch's per-param state (``step``, ``exp_avg``, ``exp_avg_sq``)."""

    main: torch.Tensor
    staging: torch.Tensor
    state: dict[str, Any]


def _cpu_signature() -> str:
    """The host CPU's model and flags: -march=native code is only valid on the same kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    root = os.environ.get(_CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "zero_shard"
    )
    return Path(root)


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [source, compiler.encode(), " ".join(_FLAGS).encode(), _cpu_signature().encode()]
        )
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_adam_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks building at once never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, target)
    return target


@cache
def load_cpu_adam() -> ctypes.CDLL | None:
    """The built kernel library, or ``None`` (with one warning) if it cannot be built here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        reason = "no C compiler found (set CC)"
    else:
        try:
            library = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.CalledProcessError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            reason = f"building it with {compiler} failed: {detail.strip()[:300]}"
        else:
            for name in _ENTRIES:
                function = getattr(library, name)
                function.argtypes = [ctypes.POINTER(_AdamPiece), ctypes.c_int64, ctypes.c_int]
                function.restype = ctypes.c_int
            return library
    warnings.warn(
        f"zero-shard's single-pass CPU Adam kernel is not available ({reason}); using torch's "
        "fused CPU AdamW with separate bf16<->fp32 casts, which is slower. Set "
        "OffloadPolicy(cpu_kernel='torch') to silence this.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fused_kernel_applies(cls: type, group: dict[str, Any], dtype: torch.dtype) -> bool:
    """Whether the kernel computes exactly what ``cls`` would for this group and model dtype."""
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    # A subclass that changes the step, or the state its first step makes, is stepped as it says.
    adams = (torch.optim.AdamW, torch.optim.Adam)
    if torch_class_run_as_is(cls, adams, ("step", "_init_group")) is None:
        return False
    return unmet_option(group) is None


def unmet_option(group: dict[str, Any]) -> str | None:
    """The first option of ``group`` the kernel does not implement, as ``key=value`` (amsgrad,
    maximize, capturable, a hyperparameter that is not a plain number); ``None``: none."""
    for key in ("amsgrad", "maximize", "capturable"):
        if group.get(key):
            return f"{key}={group[key]!r}"
    for key in ("lr", "eps", "weight_decay"):
        if not _is_number(group.get(key)):
            return f"{key}={group.get(key)!r}"
    betas = group.get("betas", (None, None))
    if not all(_is_number(beta) for beta in betas):
        return f"betas={betas!r}"
    return None


def _check_buffers(main: torch.Tensor, staging: torch.Tensor, state: dict[str, Any]) -> None:
    """The kernel writes through raw pointers: every buffer must be what it assumes."""
    numel = main.numel()
    for name, tensor in (
        ("main", main),
        ("exp_avg", state["exp_avg"]),
        ("exp_avg_sq", state["exp_avg_sq"]),
    ):
        if (
            type(tensor) is not torch.Tensor  # a subclass's data_ptr() is not its elements'
            or tensor.dtype != torch.float32
            or not tensor.is_contiguous()
            or tensor.numel() != numel
            or tensor.device.type != "cpu"
        ):
            raise AssertionError(
                f"expected {name} as a contiguous fp32 CPU tensor of {numel} elements, got a "
                f"{type(tensor).__name__} {tensor.dtype}, {tuple(tensor.shape)} on {tensor.device}"
            )
    if (
        staging.dtype not in (torch.bfloat16, torch.float32)
        or not staging.is_contiguous()
        or staging.numel() != numel
    ):
        raise AssertionError(f"expected a contiguous bf16/fp32 staging of {numel} elements")


class CpuAdamKernel:
    """Steps host pieces of Adam/AdamW with the single-pass kernel, torch's state kept as is."""

    library: ctypes.CDLL
    decoupled: bool  # AdamW's weight decay (Adam's L2 otherwise)
    num_threads: int

    def __init__(self, library: ctypes.CDLL, cls: type, num_threads: int) -> None:
        self.library = library
        self.decoupled = issubclass(cls, torch.optim.AdamW)
        self.num_threads = num_threads

    def step(
        self,
        pieces: Sequence[KernelPiece],
        group: dict[str, Any],
        grad_scale: float | None = None,
        grad_factor: float | None = None,
    ) -> None:
        """One Adam step of every piece (of one param group and model dtype), with the grads in
        their staging (first multiplied by ``grad_factor``, if given, the fp32 product rounded to
        the model dtype; then by ``grad_scale`` in fp32, if given); the new weights go there
        too.

        One call steps them all (a chunk of many small params costs one call, one GIL release,
        not one each). The state is torch's per-param state, updated in place, so ``state_dict``
        and torch's own step can take over at any point. Steps that repeat on the same pieces
        build a :class:`KernelTable` once and run it instead.
        """
        if pieces:
            KernelTable(self, pieces).run(group, grad_scale, grad_factor)

    def coefficients(
        self,
        step: float,
        group: dict[str, Any],
        grad_scale: float | None,
        grad_factor: float | None = None,
    ) -> _AdamArgs:
        """The coefficients of a step numbered ``step`` (counted from 1) for ``group``."""
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        weight_decay = group["weight_decay"]
        decoupled = bool(group.get("decoupled_weight_decay", self.decoupled))
        return _AdamArgs(  # in double, rounded to float once: as torch's fused kernel does
            one_minus_beta1=1.0 - beta1,
            beta2=beta2,
            one_minus_beta2=1.0 - beta2,
            eps=eps,
            l2=0.0 if decoupled else weight_decay,
            decay=1.0 - lr * weight_decay if decoupled else 1.0,
            step_size=lr / (1.0 - beta1**step),
            bc2_sqrt=math.sqrt(1.0 - beta2**step),
            grad_factor=1.0 if grad_factor is None else grad_factor,
            grad_scale=1.0 if grad_scale is None else grad_scale,
        )


def _count_of(step: torch.Tensor) -> ctypes.c_float | ctypes.c_double:
    """The step count's own memory as a ctypes number: read and advanced with no torch call."""
    count_type = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}.get(step.dtype)
    if count_type is None or step.device.type != "cpu" or step.numel() != 1:
        raise AssertionError(
            f"expected the step count as one fp32/fp64 CPU element, got {step.dtype}, "
            f"{tuple(step.shape)} on {step.device}"
        )
    return count_type.from_address(step.data_ptr())


class _Pointed(NamedTuple):
    """The tensors one table entry points into (held, so that the pointers stay valid)."""

    main: torch.Tensor
    staging: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    weights: torch.Tensor | None  # speculative tables: where the new weights go


class _Twins(NamedTuple):
    """Where a speculative step writes one piece's new state, each moved into the live tensor
    when the step stands (see [Note: page moves] in offload/_page_moves.py)."""

    main: PageTwin
    exp_avg: PageTwin
    exp_avg_sq: PageTwin


def _check_weights(weights: torch.Tensor, staging: torch.Tensor) -> None:
    """The speculative step's weights are written through a raw pointer too."""
    if (
        weights.dtype != staging.dtype
        or not weights.is_contiguous()
        or weights.numel() != staging.numel()
        or weights.device.type != "cpu"
    ):
        raise AssertionError(
            f"expected weights as a contiguous {staging.dtype} CPU tensor of {staging.numel()} "
            f"elements, got {weights.dtype}, {tuple(weights.shape)} on {weights.device}"
        )


class KernelTable:
    """The kernel's call over fixed pieces: the C table of their buffers filled in once, then
    run step after step.

    A run sets each piece's coefficients for its step count, calls the kernel and advances the
    counts. The counts are read and advanced through their memory (ctypes), not through torch
    ops: every torch op releases the GIL, and on the host step's worker each release may wait
    for the thread that queues the forward meanwhile. A run then releases the GIL once, for the
    kernel itself. The table holds every tensor it points into, so its pointers stay valid;
    ``backs`` says whether the same state tensors are still the pieces' (a loaded state dict
    replaces them).

    [Note: speculative kernel steps]
    A speculative table (made with ``weights``) may take a step before its grad factor and
    verdict are known: ``speculate`` steps as ``run`` would with no grad factor, but from the
    live state into twins of it (``PageTwin``), the new weights into their own buffer, so the
    live state, the step counts and the grads in staging are left as they were. Then ``holds``
    says whether the step asked for in the end is that one (the coefficients of every piece the
    same to the bit, so the results are too): ``commit`` moves the twins into the live state
    (pages, not a copy: [Note: page moves] in offload/_page_moves.py) and advances the counts;
    else ``redo`` takes the step again from the live state into the twins, with the final
    arguments, and commits it, or ``roll_back`` forgets it (a skipped step). Every path ends
    bit-identical to ``run`` with the final arguments (tests/optimizers/test_cpu_kernel.py). A
    write to the live state after the speculation began (``written_since``) is in the state a
    redo reads.
    """

    _kernel: CpuAdamKernel
    _function: Any  # the C entry point for the staging dtype, in place
    _from: Any  # the same, from the live state into the twins (speculative tables only)
    _entries: ctypes.Array  # one _AdamPiece per piece, pointers filled in
    _entries_out: ctypes.Array | None  # the same for _from; None: not a speculative table
    _held: list[_Pointed]  # per piece
    _pointed: list[tuple[int, ...]]  # per piece: the addresses of its state, as the C table holds
    _twins: list[_Twins]  # per piece; empty: not a speculative table
    _counts: list[ctypes.c_float | ctypes.c_double]  # per piece: its step count, in place
    _speculated: list[tuple[float, ...]] | None  # each piece's coefficients of the speculated
    #                                              step; None: no step speculated
    _steps: list[float]  # the step counts the speculated step takes
    _versions: tuple[int, ...]  # the state's version counters as the speculation began

    def __init__(
        self,
        kernel: CpuAdamKernel,
        pieces: Sequence[KernelPiece],
        weights: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if not pieces:
            raise AssertionError("expected at least one piece for a kernel table")
        if weights is not None and len(weights) != len(pieces):
            raise AssertionError(f"expected {len(pieces)} weights buffers, got {len(weights)}")
        dtype = pieces[0].staging.dtype
        self._held, self._counts, self._twins = [], [], []
        ranges = anonymous_ranges() if weights is not None else []
        for position, piece in enumerate(pieces):
            _check_buffers(piece.main, piece.staging, piece.state)
            if piece.staging.dtype != dtype:
                raise AssertionError(
                    f"expected every staging in {dtype}, got {piece.staging.dtype}"
                )
            piece_weights = None if weights is None else weights[position]
            if piece_weights is not None:
                _check_weights(piece_weights, piece.staging)
            state = piece.state
            held = _Pointed(
                piece.main,
                piece.staging,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                piece_weights,
            )
            self._held.append(held)
            self._counts.append(_count_of(held.step))
            if weights is not None:
                self._twins.append(
                    _Twins(
                        *(PageTwin(t, ranges) for t in (held.main, held.exp_avg, held.exp_avg_sq))
                    )
                )
        self._kernel = kernel
        self._pointed = self._pointers()
        self._entries = (_AdamPiece * len(pieces))(*map(_entry, self._held))
        self._entries_out = None
        if weights is not None:
            out = map(_entry_out, self._held, self._twins)
            self._entries_out = (_AdamPiece * len(pieces))(*out)
        library, name = kernel.library, "bf16" if dtype == torch.bfloat16 else "f32"
        self._function = getattr(library, f"zero_shard_adam_{name}")
        self._from = getattr(library, f"zero_shard_adam_from_{name}")
        self._speculated = None
        self._steps, self._versions = [], ()

    @property
    def num_twin_bytes(self) -> int:
        """Bytes the twins hold once written (a speculative table's)."""
        return sum(twin.num_bytes for twins in self._twins for twin in twins)

    def backs(self, states: Sequence[dict[str, Any]]) -> bool:
        """Whether ``states`` (the pieces' state dicts, in order) hold the tensors it reads, in
        the memory it points into (``share_memory_()`` gives a tensor new memory in place)."""
        return (
            len(states) == len(self._held)
            and all(
                state.get("exp_avg") is held.exp_avg
                and state.get("exp_avg_sq") is held.exp_avg_sq
                and state.get("step") is held.step
                for state, held in zip(states, self._held, strict=True)
            )
            and self._pointers() == self._pointed
        )

    def _pointers(self) -> list[tuple[int, ...]]:
        return [
            (h.main.data_ptr(), h.exp_avg.data_ptr(), h.exp_avg_sq.data_ptr(), h.step.data_ptr())
            for h in self._held
        ]

    def run(
        self,
        group: dict[str, Any] | Sequence[dict[str, Any]],
        grad_scale: float | None = None,
        grad_factor: float | None = None,
    ) -> None:
        """One Adam step of every piece; see :meth:`CpuAdamKernel.step`. ``group``: the param
        group of every piece, or a list of each piece's (a table over chunks of several
        groups)."""
        # The counts this step takes, read before anything changes: a failure leaves them.
        steps = [count.value + 1.0 for count in self._counts]
        self._call(self._function, self._entries, self._args(group, steps, grad_scale, grad_factor))
        self._advance(steps)
        self._speculated = None

    def speculate(
        self, group: dict[str, Any] | Sequence[dict[str, Any]], grad_scale: float | None = None
    ) -> None:
        """A step as :meth:`run` takes it with no grad factor, into the twins and the weights
        buffers, the live state left as it is (see [Note: speculative kernel steps])."""
        entries = self._require_speculative()
        steps = [count.value + 1.0 for count in self._counts]
        args = self._args(group, steps, grad_scale, None)
        # Before the call: a write that lands while the kernel reads the state shows as one.
        self._versions = self.versions()
        self._call(self._from, entries, args)
        self._speculated = [_fields(each) for each in args]
        self._steps = steps

    def versions(self) -> tuple[int, ...]:
        """The version counters of the state tensors it steps: the kernel writes through raw
        pointers and moves none, so a change is someone else's write."""
        return tuple(
            tensor._version
            for held in self._held
            for tensor in (held.main, held.exp_avg, held.exp_avg_sq, held.step)
        )

    def written_since(self) -> bool:
        """Whether the state was written by another hand since the speculation began."""
        self._require_speculated()
        return self.versions() != self._versions

    def holds(
        self,
        group: dict[str, Any] | Sequence[dict[str, Any]],
        grad_scale: float | None = None,
        grad_factor: float | None = None,
    ) -> bool:
        """Whether the speculated step is the step these arguments ask for: each piece's
        coefficients the same to the bit."""
        speculated = self._require_speculated()
        steps = [count.value + 1.0 for count in self._counts]
        args = self._args(group, steps, grad_scale, grad_factor)
        return all(_fields(each) == fields for each, fields in zip(args, speculated, strict=True))

    def redo(
        self,
        group: dict[str, Any] | Sequence[dict[str, Any]],
        grad_scale: float | None = None,
        grad_factor: float | None = None,
    ) -> None:
        """The speculated step taken again from the live state and the grads in staging, with
        these arguments, and committed; the weights go to the weights buffers."""
        self._require_speculated()
        entries = self._require_speculative()
        steps = [count.value + 1.0 for count in self._counts]
        self._call(self._from, entries, self._args(group, steps, grad_scale, grad_factor))
        self._steps = steps
        self.commit()

    def roll_back(self) -> None:
        """Forgets the speculated step: it wrote nothing the live state or the counts hold."""
        self._require_speculated()
        self._speculated = None

    def commit(self) -> None:
        """The speculated step stands (``holds`` said so): the twins are moved into the live
        state and the counts advanced."""
        self._require_speculated()
        for twins in self._twins:
            for twin in twins:
                twin.move_into_live()
        self._advance(self._steps)
        self._speculated = None

    def _require_speculated(self) -> list[tuple[float, ...]]:
        if self._speculated is None:
            raise RuntimeError("no step was speculated: speculate() comes first")
        return self._speculated

    def _require_speculative(self) -> ctypes.Array:
        if self._entries_out is None:
            raise AssertionError("expected a speculative table: one made with weights=...")
        return self._entries_out

    def _args(
        self,
        group: dict[str, Any] | Sequence[dict[str, Any]],
        steps: Sequence[float],
        grad_scale: float | None,
        grad_factor: float | None,
    ) -> list[_AdamArgs]:
        groups = [group] * len(self._held) if isinstance(group, dict) else group
        if len(groups) != len(self._held):
            raise AssertionError(f"expected {len(self._held)} param groups, got {len(groups)}")
        args_of: dict[tuple[int, float], _AdamArgs] = {}
        args = []
        for step, piece_group in zip(steps, groups, strict=True):
            key = (id(piece_group), step)
            each = args_of.get(key)
            if each is None:
                each = args_of[key] = self._kernel.coefficients(
                    step, piece_group, grad_scale, grad_factor
                )
            args.append(each)
        return args

    def _call(self, function: Any, entries: ctypes.Array, args: Sequence[_AdamArgs]) -> None:
        for entry, each in zip(entries, args, strict=True):
            entry.args = each
        if function(entries, len(entries), self._kernel.num_threads) != 0:
            raise MemoryError(  # nothing was stepped
                f"the CPU Adam kernel could not allocate its table of {len(entries)} pieces"
            )

    def _advance(self, steps: Sequence[float]) -> None:
        for count, step in zip(self._counts, steps, strict=True):
            count.value = step  # rounded to the count's dtype, as torch's `step += 1` is


def _entry(held: _Pointed) -> _AdamPiece:
    """In place: the live state read and written."""
    return _AdamPiece(
        held.main.data_ptr(),
        held.exp_avg.data_ptr(),
        held.exp_avg_sq.data_ptr(),
        held.staging.data_ptr(),
        held.main.numel(),
        _AdamArgs(),
        0,
        0,
        0,
        0,
    )


def _entry_out(held: _Pointed, twins: _Twins) -> _AdamPiece:
    """From the live state (the entry's ``from_`` pointers, read) into the twins (written)."""
    if held.weights is None:
        raise AssertionError("expected a weights buffer for a speculative table")
    return _AdamPiece(
        twins.main.twin.data_ptr(),
        twins.exp_avg.twin.data_ptr(),
        twins.exp_avg_sq.twin.data_ptr(),
        held.staging.data_ptr(),
        held.main.numel(),
        _AdamArgs(),
        held.main.data_ptr(),
        held.exp_avg.data_ptr(),
        held.exp_avg_sq.data_ptr(),
        held.weights.data_ptr(),
    )


def select_cpu_kernel(
    mode: CpuKernel,
    cls: type[torch.optim.Optimizer],
    groups: Sequence[dict[str, Any]],
    chunks: Iterable[ChunkSpec],
    threads: ThreadBudget | None,
) -> CpuAdamKernel | None:
    """The single-pass kernel for ``cls``'s CPU chunks if ``mode`` (``OffloadPolicy.cpu_kernel``)
    asks for it and it applies to one of them (their param ``groups``); ``None``: torch's."""
    if mode == "torch" or threads is None:
        return None
    if not any(fused_kernel_applies(cls, groups[c.group_index], c.dtype) for c in chunks):
        if mode == "fused":
            raise ValueError(
                f"cpu_kernel='fused' implements Adam and AdamW without amsgrad, maximize or "
                f"tensor hyperparameters, for bf16 and fp32 params; this optimizer is "
                f"{cls.__name__} with those options unmet. Use cpu_kernel='auto' or 'torch'"
            )
        return None
    library = load_cpu_adam()
    if library is None:
        if mode == "fused":
            raise RuntimeError(
                "cpu_kernel='fused' but the kernel could not be built here (see the warning); "
                "install a C compiler or use cpu_kernel='auto' or 'torch'"
            )
        return None
    return CpuAdamKernel(library, cls, threads.num_threads)
