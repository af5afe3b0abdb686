"""The input embedding of the first pipeline stage: vocab-parallel word embeddings plus learned positions.

Output layout is ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).  Word embeddings are summed over the
tensor-parallel group first (each rank holds a slice of the vocabulary), then positions are added and the result is
split by sequence under sequence parallelism.  Both tables' whole backward is weight work; it runs in B (see
``VocabParallelEmbedding``: deferring it costs a microbatch's output gradient of memory for a W of one scatter-add).
"""

from __future__ import annotations

import torch

from megatron.model.config import GPTConfig
from megatron.parallel.tensor_parallel import (
    HasTensorParallel,
    VocabParallelEmbedding,
    reduce_from_tp,
    scatter_to_sequence_parallel,
)
from zb_pipeline.runtime.deferrable_linear import deferrable_embedding, mark_deferrable
from zb_pipeline.runtime.weight_grad_store import WeightGradStore


class PositionEmbedding(torch.nn.Module):
    """Learned absolute positions ``[max_positions, h]``, replicated over tensor-parallel ranks."""

    def __init__(self, max_positions: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = mark_deferrable(torch.nn.Parameter(torch.empty(max_positions, hidden_size)))  # [P, h]
        self.weight_grad_store: WeightGradStore | None = None
        self.defer_weight_grad = False

    def forward(
        self, seq_len: int, position_ids: torch.Tensor | None = None, offset: int = 0
    ) -> torch.Tensor:  # -> [s, 1 or b, h]
        store, defer = self.weight_grad_store, self.defer_weight_grad
        if position_ids is not None:  # [b, s]: e.g. restarted after each end-of-document (--reset-position-ids)
            return deferrable_embedding(position_ids.t(), self.weight, store, defer=defer)  # [s, b, h]
        positions = torch.arange(offset, offset + seq_len, device=self.weight.device)  # offset: after a KV cache
        return deferrable_embedding(positions, self.weight, store, defer=defer).unsqueeze(1)


class GPTEmbedding(torch.nn.Module):
    def __init__(self, config: GPTConfig, *, tp: HasTensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(tp.tp_size), config.hidden_size, tp=tp)
        self.position_embeddings = (
            PositionEmbedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.dropout = torch.nn.Dropout(config.hidden_dropout)
        self.fp32_residual = config.fp32_residual_connection

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        # tokens (and position_ids, default offset..offset+s-1): [b, s] int64
        partial = self.word_embeddings(tokens)  # [b, s, h], this rank's vocabulary rows only
        x = reduce_from_tp(partial.transpose(0, 1).contiguous(), self.tp)  # [s, b, h], laid out as such
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(tokens.shape[1], position_ids, offset)  # + [s, 1 or b, h]
        if self.fp32_residual:
            x = x.float()  # the residual stream stays fp32 through the layers (--fp32-residual-connection)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel(x, self.tp)  # [s/tp, b, h]
        return self.dropout(x)
