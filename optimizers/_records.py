"""One record per parameter, one per piece of it, one per host chunk: what lives where."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._cpu_kernel import CpuAdamKernel, KernelTable
from ._split import ChunkSpec, PieceSpec

__all__ = [
    "HostChunk",
    "ParamRecord",
    "Piece",
    "collect_grads",
    "flat_grad",
    "flat_param",
    "reload_mains",
]


@dataclass
class Piece:
    """Elements ``spec.start : spec.start + spec.numel`` of one parameter, on one device."""

    spec: PieceSpec
    main: torch.Tensor  # 1-D fp32 leaf handed to the sub-optimizer (a view of a flat buffer,
    #                     or of the model param itself for fp32 params kept on the accelerator)
    grad: torch.Tensor | None  # 1-D fp32 main grad (view of a flat buffer); None: the model's
    #                            own grad is used as is (fp32 params on the accelerator)
    optimizer: torch.optim.Optimizer  # the sub-optimizer that steps `main`
    group: dict  # the sub-optimizer's param group holding `main` (its hyperparameters)
    offset: int | None = None  # host pieces: where the piece starts in its chunk, and so in the
    #                            staging buffer the chunk's grads land in and its weights leave
    #                            from (see [Note: staging ring]); None on the accelerator

    @property
    def state(self) -> dict:
        return self.optimizer.state.get(self.main, {})

    def of_param(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece's elements of ``flat``, a 1-D tensor of the whole param (its grad, ...)."""
        return flat[self.spec.start : self.spec.start + self.spec.numel]

    def in_chunk(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece's elements of ``flat``, a 1-D tensor of its host chunk (staging, ...)."""
        return flat[self.offset : self.offset + self.spec.numel]


@dataclass
class ParamRecord:
    """A model parameter and the pieces its main weight, grad and state are cut into."""

    param: torch.Tensor  # the model's parameter (accelerator, model dtype)
    index: int  # position over all param groups: the key in state_dict()["state"]
    group_index: int
    pieces: list[Piece] = field(default_factory=list)  # element order: accelerator piece first

    @property
    def ignored(self) -> bool:
        """Params with ``requires_grad=False`` at construction get no pieces and never step."""
        return not self.pieces


@dataclass
class HostChunk:
    """Host pieces of one param group and dtype, copied, cast and stepped together."""

    spec: ChunkSpec
    index: int  # position in HostPart.chunks (its staging buffer when each chunk has its own)
    pieces: list[tuple[ParamRecord, Piece]]
    main: torch.Tensor  # 1-D fp32, host
    grad: torch.Tensor | None  # 1-D fp32, host, for low-precision chunks that torch steps; None:
    #                            the grads are read from staging (the kernel, or fp32 params)
    optimizer: torch.optim.Optimizer  # holds the state and hyperparameters in every case
    kernel: CpuAdamKernel | None  # steps the chunk in one pass, in place of optimizer.step();
    #                               None: optimizer.step() (for good once its group asks for an
    #                               option the kernel lacks, see leave_kernel_where_unmet)
    tables: dict[tuple[tuple[int, int], ...], KernelTable] = field(default_factory=dict)  # the
    #       kernel's call for the whole chunk, alone or with the chunks merged after it, keyed by
    #       (chunk index, staging slot) of each; built and used by the worker only
    speculative_table: KernelTable | None = None  # the kernel's call that speculates the chunk's
    #                                               step ([Note: speculative host steps]); worker
    #                                               only


def flat_param(param: torch.Tensor) -> torch.Tensor:
    """The param's storage as a 1-D view (params are checked contiguous at construction)."""
    return param.detach().view(-1)


def reload_mains(mains: torch.Tensor, values: torch.Tensor, *, keep_unchanged: bool) -> None:
    """Sets fp32 main weights from the model's ``values`` (in the model's dtype). With
    ``keep_unchanged``, each element that equals its main weight's rounding keeps its main
    weight: a write that left it as the optimizer set it (weights swapped out for an evaluation
    and back, rows restored around others, a clamp that moved a few elements) carries nothing
    new for it, and reloading would round it to the model's dtype; every other element takes
    its value, as a weight load. Element by element, so that what a write keeps does not depend
    on how the param is cut into pieces (the offload fraction, the ranks). An element a clamp
    left at its rounding keeps its main weight, which may lie up to half a step of the model's
    dtype past the clamp's bound."""
    if keep_unchanged and values.dtype != mains.dtype:
        unchanged = values == mains.to(values.dtype)  # (3 bytes an element, freed at return)
        torch.where(unchanged, mains, values, out=mains)
        return
    mains.copy_(values)


def flat_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The param's grad as a 1-D tensor, or ``None``; a non-contiguous grad is copied once."""
    grad = param.grad
    if grad is None:
        return None
    if grad.is_sparse:
        raise TypeError(
            f"the grad of a param of shape {tuple(param.shape)} is sparse ({grad.layout}); "
            "zero-shard steps dense grads only: build the embedding with sparse=False"
        )
    return grad.view(-1) if grad.is_contiguous() else grad.contiguous().view(-1)


def collect_grads(
    records: Sequence[ParamRecord],
) -> tuple[dict[int, torch.Tensor], ParamRecord | None]:
    """The flat grads of the records that step, by record index, and the first record with a
    grad that never steps (``requires_grad=False`` at construction), if any."""
    grads, ignored = {}, None
    for record in records:
        grad = record.param.grad
        if grad is None:
            continue
        # Inline where the grad is dense and contiguous, as in training's every step; a 1-D
        # one is its own flat view.
        if grad.layout is not torch.strided or not grad.is_contiguous():
            grad = flat_grad(record.param)
        elif grad.dim() != 1:
            grad = grad.view(-1)
        if not record.pieces:  # record.ignored, read inline at every step
            ignored = record if ignored is None else ignored
            continue
        grads[record.index] = grad
    return grads, ignored
