"""Autograd-aware communication for tensor parallelism over one tensor-parallel (tp) group.

Each function is a pair of collectives, one in forward and its adjoint in backward:

| function                                | forward                          | backward                          |
|-----------------------------------------|----------------------------------|-----------------------------------|
| ``copy_to_tp``                          | identity                         | all-reduce                        |
| ``reduce_from_tp``                      | all-reduce                       | identity                          |
| ``scatter_to_tp``                       | keep own slice of the last dim   | all-gather the last dim           |
| ``gather_from_tp``                      | all-gather the last dim          | keep own slice of the last dim    |
| ``scatter_to_sequence_parallel``        | keep own slice of dim 0 (seq)    | all-gather dim 0                  |
| ``gather_from_sequence_parallel``       | all-gather dim 0                 | reduce-scatter dim 0              |
| ``reduce_scatter_to_sequence_parallel`` | reduce-scatter dim 0             | all-gather dim 0                  |

Activations are laid out ``[s, b, h]`` so that sequence-parallel slices of dim 0 are contiguous.  The group comes
from a ``tp`` object with ``tp_size``, ``tp_rank`` and ``tp_group`` attributes (``ParallelContext`` has them;
``TPContext`` is the minimal stand-alone one).  With ``tp_size == 1`` every function is the identity and no
collective is issued, so no process group is needed.  Every collective goes through ``zb_pipeline.comm``, which
refuses an activation that is not on the tensor-parallel group's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zb_pipeline import comm


class HasTensorParallel(Protocol):
    tp_size: int
    tp_rank: int
    tp_group: Any


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel part of a ``ParallelContext``: enough for the layers, usable without one."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")


# -- raw collectives (no autograd) ---------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group=tp.tp_group)
    return x


def split_along(x: torch.Tensor, dim: int, tp: HasTensorParallel) -> torch.Tensor:
    size = x.shape[dim]
    if size % tp.tp_size != 0:
        raise ValueError(f"dimension {dim} of size {size} does not split over tp_size={tp.tp_size}")
    part = size // tp.tp_size
    return x.narrow(dim, tp.tp_rank * part, part).contiguous()


def all_gather_along(x: torch.Tensor, dim: int, tp: HasTensorParallel) -> torch.Tensor:
    x = x.contiguous()
    if dim == 0:
        out = torch.empty((x.shape[0] * tp.tp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(out, x, group=tp.tp_group)
        return out
    parts = [torch.empty_like(x) for _ in range(tp.tp_size)]
    comm.all_gather(parts, x, group=tp.tp_group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim0(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    x = x.contiguous()
    if x.shape[0] % tp.tp_size != 0:
        raise ValueError(f"sequence length {x.shape[0]} does not split over tp_size={tp.tp_size}")
    out = torch.empty((x.shape[0] // tp.tp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, x, group=tp.tp_group)
    return out


# -- autograd functions --------------------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce(x.clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return split_along(x, -1, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, -1, ctx.tp), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather_along(x, -1, tp)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, -1, ctx.tp), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return split_along(x, 0, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 0, ctx.tp), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather_along(x, 0, tp)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.tp), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return reduce_scatter_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 0, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """Enter a tensor-parallel region: forward identity, backward all-reduce of the input gradient."""
    return x if tp.tp_size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: forward all-reduce, backward identity."""
    return x if tp.tp_size == 1 else _ReduceFromTP.apply(x, tp)


def scatter_to_tp(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """Keep this rank's slice of the last dimension (backward: all-gather)."""
    return x if tp.tp_size == 1 else _ScatterToTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """All-gather the last dimension (backward: keep own slice)."""
    return x if tp.tp_size == 1 else _GatherFromTP.apply(x, tp)


def scatter_to_sequence_parallel(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """``[s, b, h] -> [s/tp, b, h]``, this rank's sequence slice (backward: all-gather)."""
    return x if tp.tp_size == 1 else _ScatterToSP.apply(x, tp)


def gather_from_sequence_parallel(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """``[s/tp, b, h] -> [s, b, h]`` (backward: reduce-scatter, since the consumer is tensor-parallel)."""
    return x if tp.tp_size == 1 else _GatherFromSP.apply(x, tp)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, tp: HasTensorParallel) -> torch.Tensor:
    """Partial ``[s, b, h]`` summed over tp and split: ``-> [s/tp, b, h]`` (backward: all-gather)."""
    return x if tp.tp_size == 1 else _ReduceScatterToSP.apply(x, tp)
