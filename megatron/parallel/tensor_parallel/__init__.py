"""Tensor parallelism: communication mappings, parallel layers, vocab-parallel cross-entropy, partition metadata."""

from megatron.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.parallel.tensor_parallel.mappings import (
    HasTensorParallel,
    TPContext,
    copy_to_tp,
    gather_from_sequence_parallel,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tp,
)
from megatron.parallel.tensor_parallel.partitioning import (
    allreduce_sequence_parallel_grads,
    full_shape,
    is_tensor_parallel,
    merge_shards,
    set_tensor_parallel_attributes,
    shard_tensor,
)

__all__ = [
    "ColumnParallelLinear",
    "HasTensorParallel",
    "RowParallelLinear",
    "TPContext",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tp",
    "full_shape",
    "gather_from_sequence_parallel",
    "gather_from_tp",
    "is_tensor_parallel",
    "merge_shards",
    "reduce_from_tp",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "scatter_to_tp",
    "set_tensor_parallel_attributes",
    "shard_tensor",
    "vocab_parallel_cross_entropy",
]
