"""One pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with dropout on each branch."""

from __future__ import annotations

import torch

from megatron.model.attention import SelfAttention
from megatron.model.config import GPTConfig
from megatron.model.kv_cache import LayerKVCache
from megatron.model.mlp import MLP
from megatron.model.norms import build_norm
from megatron.parallel.tensor_parallel import HasTensorParallel


class TransformerLayer(torch.nn.Module):
    def __init__(
        self, config: GPTConfig, *, layer_number: int, tp: HasTensorParallel, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.layer_number = layer_number  # global, 0-based
        norm = dict(eps=config.norm_epsilon, sequence_parallel=sequence_parallel)
        self.input_layernorm = build_norm(config.normalization, config.hidden_size, **norm)
        self.self_attention = SelfAttention(config, tp=tp, sequence_parallel=sequence_parallel)
        self.pre_mlp_layernorm = build_norm(config.normalization, config.hidden_size, **norm)
        self.mlp = MLP(config, tp=tp, sequence_parallel=sequence_parallel)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism); same shape out
        # kv_cache (inference only): the new tokens attend to the cached ones too
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rotary, kv_cache))
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))
