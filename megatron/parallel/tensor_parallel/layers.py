"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

All of them are deferrable-weight-gradient layers (``weight_grad_store`` attribute; see
``zb_pipeline.runtime.deferrable_linear``): during a zero-bubble B they compute only input gradients and leave the
weight gradients for W.  Parameters are created empty: ``megatron.model.init`` fills them from the seed and each
parameter's global name, so a shard equals the slice of the full tensor whatever the tp size.

Sequence parallelism: a column-parallel layer all-gathers its ``[s/tp, b, h]`` input; the gathered tensor is what
the linear saves for backward, so W reuses it and does not repeat the all-gather (W stays free of collectives, at the
cost of holding the full-sequence input between B and W).  A row-parallel layer reduce-scatters its output.

``wgrad_fn`` (``None``: torch) is the weight-gradient computation W uses when the weight has a ``main_grad``; the one
place that sets it is ``megatron.kernels.select`` (the fused W kernel; off with ``--no-gradient-accumulation-fusion``).
"""

from __future__ import annotations

import torch

from megatron.parallel.tensor_parallel.mappings import (
    HasTensorParallel,
    copy_to_tp,
    gather_from_sequence_parallel,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
)
from megatron.parallel.tensor_parallel.partitioning import set_tensor_parallel_attributes
from zb_pipeline.runtime.deferrable_linear import (
    WeightGradFn,
    deferrable_bias_add,
    deferrable_embedding,
    deferrable_linear,
    mark_deferrable,
)
from zb_pipeline.runtime.weight_grad_store import WeightGradStore


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts != 0:
        raise ValueError(f"{what}={total} must be divisible by {parts} (tensor-parallel size x stride)")
    return total // parts


def _param(shape: tuple[int, ...], device, dtype) -> torch.nn.Parameter:
    return mark_deferrable(torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))


class ColumnParallelLinear(torch.nn.Module):
    """``y = x A^T + b`` with ``A`` split by output rows: rank r computes ``y[..., r-th block]``.

    Input ``[s, b, in]`` (``[s/tp, b, in]`` with sequence parallelism), output ``[s, b, out/tp]`` (or the full
    ``[s, b, out]`` with ``gather_output``).  ``partition_stride`` > 1 splits each of that many stacked blocks of
    the output separately (e.g. the fused SwiGLU ``[gate; up]`` projection).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp: HasTensorParallel,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_stride: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel cannot both be set")
        self.input_size, self.output_size = input_size, output_size
        self.tp, self.gather_output, self.sequence_parallel = tp, gather_output, sequence_parallel
        _divide(output_size, tp.tp_size * partition_stride, "output_size")
        local = output_size // tp.tp_size
        self.weight = _param((local, input_size), device, dtype)  # [out/tp, in]
        set_tensor_parallel_attributes(self.weight, partition_dim=0, stride=partition_stride)
        self.bias = _param((local,), device, dtype) if bias else None  # [out/tp]
        if self.bias is not None:
            set_tensor_parallel_attributes(self.bias, partition_dim=0, stride=partition_stride)
        self.weight_grad_store: WeightGradStore | None = None
        self.wgrad_fn: WeightGradFn | None = None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, *, add_bias: bool = True) -> torch.Tensor:
        """``weight`` overrides ``self.weight`` (the tied output head passes the word embedding); ``add_bias=False``
        leaves the bias to the caller (a fused bias + activation)."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, self.tp)  # [s/tp, b, in] -> [s, b, in]
        else:
            x = copy_to_tp(x, self.tp)  # [s, b, in]
        w = self.weight if weight is None else weight
        bias = self.bias if add_bias else None
        y = deferrable_linear(x, w, bias, self.weight_grad_store, wgrad_fn=self.wgrad_fn)  # [s, b, out/tp]
        if self.gather_output:
            y = gather_from_tp(y, self.tp)  # [s, b, out]
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(torch.nn.Module):
    """``y = x A^T + b`` with ``A`` split by input columns: rank r holds ``x[..., r-th block]`` and a partial sum.

    Input ``[s, b, in/tp]``, output ``[s, b, out]`` (``[s/tp, b, out]`` with sequence parallelism).  The bias is
    replicated and added after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp: HasTensorParallel,
        bias: bool = True,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp, self.sequence_parallel = tp, sequence_parallel
        local = _divide(input_size, tp.tp_size, "input_size")
        self.weight = _param((output_size, local), device, dtype)  # [out, in/tp]
        set_tensor_parallel_attributes(self.weight, partition_dim=1)
        self.bias = _param((output_size,), device, dtype) if bias else None  # [out], replicated
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True
        self.weight_grad_store: WeightGradStore | None = None
        self.wgrad_fn: WeightGradFn | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, in/tp]
        store, wgrad_fn = self.weight_grad_store, self.wgrad_fn
        if self.tp.tp_size == 1:  # no reduction: the bias add joins the linear's autograd node (same kernels)
            return deferrable_linear(x, self.weight, self.bias, store, wgrad_fn=wgrad_fn, separate_bias=True)
        y = deferrable_linear(x, self.weight, None, store, wgrad_fn=wgrad_fn)  # partial [s, b, out]
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.tp)  # [s/tp, b, out]
        else:
            y = reduce_from_tp(y, self.tp)  # [s, b, out]
        if self.bias is not None:
            y = deferrable_bias_add(y, self.bias, store)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows: rank r holds rows ``[r*V/tp, (r+1)*V/tp)``.

    ``forward(ids [b, s])`` returns this rank's *partial* embeddings ``[b, s, h]`` (zero for ids outside its rows);
    the caller sums them over tp (all-reduce, or a reduce-scatter under sequence parallelism), which is where the
    layout change to ``[s, b, h]`` also happens.  The whole backward of a lookup is weight work (ids carry no gradient).
    It runs in B unless ``defer_weight_grad`` is set: deferring it to W would hold each microbatch's ``[b, s, h]``
    output gradient until then, so the first stage would hold more per microbatch after B than after F.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: HasTensorParallel,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        local = _divide(num_embeddings, tp.tp_size, "padded vocabulary size")
        self.vocab_start = tp.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = _param((local, embedding_dim), device, dtype)  # [V/tp, h]
        set_tensor_parallel_attributes(self.weight, partition_dim=0)
        self.weight_grad_store: WeightGradStore | None = None
        self.defer_weight_grad = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s] int64
        store, defer = self.weight_grad_store, self.defer_weight_grad
        if self.tp.tp_size == 1:
            return deferrable_embedding(ids, self.weight, store, defer=defer)  # [b, s, h]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # [b, s]
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = deferrable_embedding(local_ids, self.weight, store, defer=defer)  # [b, s, h]
        return partial.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, tp={self.tp.tp_size}"
