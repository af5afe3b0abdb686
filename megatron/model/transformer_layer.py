"""One pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with dropout on each branch.

With ``--fp32-residual-connection`` ``x`` is fp32 while the parameters are bf16/fp16: the norms return the
parameters' dtype and each branch's output is added to the fp32 stream (type promotion keeps it fp32)."""

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
        norm = dict(
            eps=config.norm_epsilon, sequence_parallel=sequence_parallel, zero_centered=config.apply_layernorm_1p
        )
        self.input_layernorm = build_norm(config.normalization, config.hidden_size, **norm)
        self.self_attention = SelfAttention(config, tp=tp, sequence_parallel=sequence_parallel)
        self.pre_mlp_layernorm = build_norm(config.normalization, config.hidden_size, **norm)
        self.mlp = MLP(config, tp=tp, sequence_parallel=sequence_parallel)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism); same shape out
        # kv_cache (inference only): the new tokens attend to the cached ones too
        attention = self.self_attention(self.input_layernorm(x), rotary, attention_mask, kv_cache=kv_cache)
        x = x + self.dropout(attention)
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))
