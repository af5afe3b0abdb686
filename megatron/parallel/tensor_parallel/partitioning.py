"""How a parameter is split over the tensor-parallel group, and the gradient fix-up sequence parallelism needs.

A tensor-parallel parameter carries three attributes:

- ``tensor_model_parallel = True``;
- ``partition_dim``: the dimension that is split;
- ``partition_stride``: how many interleaved blocks the full dimension holds.  The full dimension is viewed as
  ``[stride, tp, n]`` and rank ``r`` holds ``[:, r, :]``.  Stride 1 is a contiguous slice; the fused SwiGLU input
  projection ``[gate; up]`` uses stride 2 so that each rank holds matching rows of both halves.

Replicated parameters that only see this rank's *sequence slice* under sequence parallelism (norm weights, the
row-parallel bias) carry ``sequence_parallel = True``: their gradients are partial sums and must be all-reduced over
the tp group before the optimizer step (``allreduce_sequence_parallel_grads``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megatron.parallel.tensor_parallel.mappings import HasTensorParallel
from zb_pipeline import comm


def set_tensor_parallel_attributes(param: torch.Tensor, *, partition_dim: int, stride: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_tensor(full: torch.Tensor, *, dim: int, tp_rank: int, tp_size: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of ``full`` (see module docstring); a copy, contiguous."""
    size = full.shape[dim]
    if size % (stride * tp_size) != 0:
        raise ValueError(f"dimension {dim} of size {size} does not split into {stride} x tp_size={tp_size} blocks")
    n = size // (stride * tp_size)
    blocks = [full.narrow(dim, (s * tp_size + tp_rank) * n, n) for s in range(stride)]
    return torch.cat(blocks, dim=dim).contiguous()


def merge_shards(shards: Sequence[torch.Tensor], *, dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``shard_tensor``: the full tensor from every rank's shard, in rank order."""
    per_block = [s.chunk(stride, dim=dim) for s in shards]  # [rank][stride]
    return torch.cat([per_block[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape of a (possibly tensor-parallel) parameter."""
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], tp: HasTensorParallel) -> int:
    """Sum the gradients (``main_grad`` if present, else ``grad``) of ``sequence_parallel`` parameters over the tp
    group, in one coalesced all-reduce.  Returns the number of gradients reduced."""
    if tp.tp_size == 1:
        return 0
    grads = []
    for p in params:
        if getattr(p, "sequence_parallel", False):
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                grads.append(g)
    if not grads:
        return 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        comm.all_reduce(flat, group=tp.tp_group)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
