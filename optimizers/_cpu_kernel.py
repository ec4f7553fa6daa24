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

from offload import ThreadBudget

from ._elementwise import torch_class_run_as_is
from ._policy import CpuKernel
from ._split import ChunkSpec

__all__ = [
    "CpuAdamKernel",
    "KeptPiece",
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
    f"zero_shard_adam{mode}_{dtype}" for mode in ("", "_keep", "_from") for dtype in ("bf16", "f32")
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
        ("kept_param", ctypes.c_void_p),
        ("kept_exp_avg", ctypes.c_void_p),
        ("kept_exp_avg_sq", ctypes.c_void_p),
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


class KeptPiece(NamedTuple):
    """Where a speculative step keeps one piece's state from before it (fp32, the piece's numel
    each) and writes its new weights (the staging's dtype), so that the grads stay in staging."""

    main: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    weights: torch.Tensor


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
    kept: KeptPiece | None


def _check_kept(kept: KeptPiece, main: torch.Tensor, staging: torch.Tensor) -> None:
    """The kept buffers are written through raw pointers too."""
    numel = main.numel()
    for name, tensor, dtype in (
        ("kept main", kept.main, torch.float32),
        ("kept exp_avg", kept.exp_avg, torch.float32),
        ("kept exp_avg_sq", kept.exp_avg_sq, torch.float32),
        ("weights", kept.weights, staging.dtype),
    ):
        if (
            tensor.dtype != dtype
            or not tensor.is_contiguous()
            or tensor.numel() != numel
            or tensor.device.type != "cpu"
        ):
            raise AssertionError(
                f"expected {name} as a contiguous {dtype} CPU tensor of {numel} elements, got "
                f"{tensor.dtype}, {tuple(tensor.shape)} on {tensor.device}"
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
    With ``kept`` buffers a step may be taken before its grad factor and verdict are known:
    ``speculate`` steps as ``run`` would with no grad factor, writing the state before the step
    to the kept buffers and the new weights to their own buffer, so the grads stay in staging.
    Then ``holds`` says whether the step asked for in the end is that one (the coefficients of
    every piece the same to the bit, so the results are too): it stands as it is; else ``redo``
    takes it again from the kept state and the grads, as ``run`` would have from the start, or
    ``roll_back`` copies the kept state back (a skipped step). Every path ends bit-identical to
    ``run`` with the final arguments (tests/optimizers/test_cpu_kernel.py).
    """

    _kernel: CpuAdamKernel
    _function: Any  # the C entry point for the staging dtype, in place
    _keep: Any  # the same, keeping the state before the step (kept tables only)
    _from: Any  # the same, stepping from the kept state (kept tables only)
    _entries: ctypes.Array  # one _AdamPiece per piece, pointers filled in
    _held: list[_Pointed]  # per piece
    _counts: list[ctypes.c_float | ctypes.c_double]  # per piece: its step count, in place
    _speculated: list[tuple[float, ...]] | None  # each piece's coefficients of the speculated
    #                                              step; None: no step speculated
    _counts_before: list[float]  # the step counts before the speculated step
    _versions: tuple[int, ...]  # the state's version counters right after the speculation

    def __init__(
        self,
        kernel: CpuAdamKernel,
        pieces: Sequence[KernelPiece],
        kept: Sequence[KeptPiece] | None = None,
    ) -> None:
        if not pieces:
            raise AssertionError("expected at least one piece for a kernel table")
        if kept is not None and len(kept) != len(pieces):
            raise AssertionError(f"expected {len(pieces)} kept pieces, got {len(kept)}")
        dtype = pieces[0].staging.dtype
        self._held, self._counts = [], []
        for position, piece in enumerate(pieces):
            _check_buffers(piece.main, piece.staging, piece.state)
            if piece.staging.dtype != dtype:
                raise AssertionError(
                    f"expected every staging in {dtype}, got {piece.staging.dtype}"
                )
            kept_piece = None if kept is None else kept[position]
            if kept_piece is not None:
                _check_kept(kept_piece, piece.main, piece.staging)
            state = piece.state
            held = _Pointed(
                piece.main,
                piece.staging,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                kept_piece,
            )
            self._held.append(held)
            self._counts.append(_count_of(held.step))
        self._kernel = kernel
        self._entries = (_AdamPiece * len(pieces))(*map(_entry, self._held))
        library, name = kernel.library, "bf16" if dtype == torch.bfloat16 else "f32"
        self._function = getattr(library, f"zero_shard_adam_{name}")
        self._keep = getattr(library, f"zero_shard_adam_keep_{name}")
        self._from = getattr(library, f"zero_shard_adam_from_{name}")
        self._speculated = None
        self._counts_before, self._versions = [], ()

    def backs(self, states: Sequence[dict[str, Any]]) -> bool:
        """Whether ``states`` (the pieces' state dicts, in order) hold the tensors it reads."""
        return len(states) == len(self._held) and all(
            state.get("exp_avg") is held.exp_avg
            and state.get("exp_avg_sq") is held.exp_avg_sq
            and state.get("step") is held.step
            for state, held in zip(states, self._held, strict=True)
        )

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
        self._call(self._function, self._args(group, steps, grad_scale, grad_factor))
        self._advance(steps)
        self._speculated = None

    def speculate(
        self, group: dict[str, Any] | Sequence[dict[str, Any]], grad_scale: float | None = None
    ) -> None:
        """A step as :meth:`run` takes it with no grad factor, the state before it kept and the
        weights written to the kept pieces' ``weights`` (see [Note: speculative kernel steps])."""
        self._require_kept()
        before = [count.value for count in self._counts]
        steps = [value + 1.0 for value in before]
        args = self._args(group, steps, grad_scale, None)
        self._call(self._keep, args)
        self._advance(steps)
        self._speculated = [_fields(each) for each in args]
        self._counts_before = before
        self._versions = self.versions()

    def versions(self) -> tuple[int, ...]:
        """The version counters of the state tensors it steps: the kernel writes through raw
        pointers and moves none, so a change is someone else's write."""
        return tuple(
            tensor._version
            for held in self._held
            for tensor in (held.main, held.exp_avg, held.exp_avg_sq, held.step)
        )

    def written_since(self) -> bool:
        """Whether the state was written by another hand since the speculation."""
        if self._speculated is None:
            raise RuntimeError("no step was speculated: speculate() comes first")
        return self.versions() != self._versions

    def holds(
        self,
        group: dict[str, Any] | Sequence[dict[str, Any]],
        grad_scale: float | None = None,
        grad_factor: float | None = None,
    ) -> bool:
        """Whether the speculated step is the step these arguments ask for: each piece's
        coefficients the same to the bit."""
        if self._speculated is None:
            raise RuntimeError("no step was speculated: speculate() comes first")
        steps = [count.value for count in self._counts]  # (the speculated step's numbers)
        args = self._args(group, steps, grad_scale, grad_factor)
        return all(
            _fields(each) == speculated
            for each, speculated in zip(args, self._speculated, strict=True)
        )

    def redo(
        self,
        group: dict[str, Any] | Sequence[dict[str, Any]],
        grad_scale: float | None = None,
        grad_factor: float | None = None,
    ) -> None:
        """The speculated step taken again from the kept state and the grads in staging, with
        these arguments; the weights go to the kept pieces' ``weights``."""
        if self._speculated is None:
            raise RuntimeError("no step was speculated: speculate() comes first")
        steps = [count.value for count in self._counts]
        self._call(self._from, self._args(group, steps, grad_scale, grad_factor))
        self._speculated = None

    def roll_back(self, *, keep_written: bool = False) -> None:
        """Undoes the speculated step: the kept state copied back, the counts as before it
        (``keep_written``: not into the tensors someone else wrote since, a load's values)."""
        if self._speculated is None:
            raise RuntimeError("no step was speculated: speculate() comes first")
        now = iter(self.versions())
        then = iter(self._versions)
        with torch.no_grad():
            for held, before in zip(self._held, self._counts_before, strict=True):
                kept = _kept_of(held)
                pairs = ((held.main, kept.main), (held.exp_avg, kept.exp_avg),
                         (held.exp_avg_sq, kept.exp_avg_sq), (held.step, None))  # fmt: skip
                for (live, saved), version, speculated in zip(pairs, now, then, strict=False):
                    if keep_written and version != speculated:
                        continue
                    if saved is None:
                        _count_of(live).value = before  # (a count past 2**24 gains nothing)
                    else:
                        # Through an alias with a counter of its own: the state's counters say
                        # whether someone else wrote it, and a group's pieces share theirs.
                        _uncounted(live).copy_(saved)
        self._speculated = None

    def commit(self) -> None:
        """The speculated step stands (``holds`` said so)."""
        if self._speculated is None:
            raise RuntimeError("no step was speculated: speculate() comes first")
        self._speculated = None

    def _require_kept(self) -> None:
        if any(held.kept is None for held in self._held):
            raise AssertionError("expected kept buffers: a table made with kept=...")

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

    def _call(self, function: Any, args: Sequence[_AdamArgs]) -> None:
        for entry, each in zip(self._entries, args, strict=True):
            entry.args = each
        if function(self._entries, len(self._entries), self._kernel.num_threads) != 0:
            raise MemoryError(  # nothing was stepped
                f"the CPU Adam kernel could not allocate its table of {len(self._entries)} pieces"
            )

    def _advance(self, steps: Sequence[float]) -> None:
        for count, step in zip(self._counts, steps, strict=True):
            count.value = step  # rounded to the count's dtype, as torch's `step += 1` is


def _uncounted(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory with a version counter of its own (writes through it move none of
    ``tensor``'s)."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


def _kept_of(held: _Pointed) -> KeptPiece:
    if held.kept is None:
        raise AssertionError("expected kept buffers")
    return held.kept


def _entry(held: _Pointed) -> _AdamPiece:
    kept = held.kept
    pointers = (0, 0, 0, 0) if kept is None else (
        kept.main.data_ptr(), kept.exp_avg.data_ptr(), kept.exp_avg_sq.data_ptr(),
        kept.weights.data_ptr(),
    )  # fmt: skip
    return _AdamPiece(
        held.main.data_ptr(),
        held.exp_avg.data_ptr(),
        held.exp_avg_sq.data_ptr(),
        held.staging.data_ptr(),
        held.main.numel(),
        _AdamArgs(),
        *pointers,
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
