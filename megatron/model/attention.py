"""Causal self-attention with grouped-query attention (GQA), tensor-parallel over query groups.

The fused QKV projection's output rows are laid out group by group: for each query group g,
``[q heads of g (heads/groups x d) | k_g (d) | v_g (d)]``.  A tensor-parallel rank holds a contiguous run of whole
groups, so its shard is a plain slice of the full weight, whatever the tp size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.config import GPTConfig
from megatron.model.rope import apply_rotary
from megatron.parallel.tensor_parallel import ColumnParallelLinear, HasTensorParallel, RowParallelLinear
from zb_pipeline.runtime.recompute import recompute


class SelfAttention(torch.nn.Module):
    def __init__(self, config: GPTConfig, *, tp: HasTensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        config.check_tensor_parallel(tp.tp_size)
        self.head_dim = config.kv_channels
        self.groups = config.num_query_groups // tp.tp_size  # query groups on this rank
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.dropout_p = config.attention_dropout
        self.recompute_core = False  # selective recomputation (megatron.model.recompute): attend() again at B
        bias = config.add_bias_linear
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, config.qkv_projection_size, tp=tp, bias=bias, sequence_parallel=sequence_parallel
        )
        self.linear_proj = RowParallelLinear(
            config.query_projection_size, config.hidden_size, tp=tp, bias=bias, sequence_parallel=sequence_parallel
        )

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        qkv = self.linear_qkv(x)  # [s, b, groups * (heads_per_group + 2) * d]
        dropout_p = self.dropout_p if self.training else 0.0
        core = _CoreAttention(self.groups, self.heads_per_group, self.head_dim, dropout_p)
        if self.recompute_core:  # F keeps qkv (and rotary) only
            out = recompute(core, qkv, *(rotary or ()), store=self.linear_qkv.weight_grad_store)
        else:
            out = core(qkv, *(rotary or ()))  # [s, b, nq * d]
        return self.linear_proj(out)  # [s, b, h] ([s/tp, b, h] with sequence parallelism)


class _CoreAttention:
    """``attend`` with its sizes bound: ``(qkv, *rotary) -> out`` (the unit selective recomputation re-runs)."""

    def __init__(self, groups: int, heads_per_group: int, head_dim: int, dropout_p: float) -> None:
        self.groups, self.heads_per_group, self.head_dim, self.dropout_p = groups, heads_per_group, head_dim, dropout_p

    def __call__(self, qkv: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        return attend(
            qkv,
            groups=self.groups,
            heads_per_group=self.heads_per_group,
            head_dim=self.head_dim,
            rotary=(rotary[0], rotary[1]) if rotary else None,
            dropout_p=self.dropout_p,
        )


def attend(
    qkv: torch.Tensor,
    *,
    groups: int,
    heads_per_group: int,
    head_dim: int,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    dropout_p: float,
) -> torch.Tensor:
    """Causal attention over a fused QKV projection laid out group by group (module docstring).

    ``qkv``: ``[s, b, groups * (heads_per_group + 2) * head_dim]`` -> ``[s, b, groups * heads_per_group * head_dim]``.
    Shared by ``SelfAttention`` and the Transformer Engine layers (``megatron.kernels.transformer_engine``)."""
    s, b = qkv.shape[0], qkv.shape[1]
    g, hpg, d = groups, heads_per_group, head_dim
    qkv = qkv.view(s, b, g, hpg + 2, d)
    q = qkv[:, :, :, :hpg].reshape(s, b, g * hpg, d)  # [s, b, nq, d]
    k = qkv[:, :, :, hpg]  # [s, b, g, d]
    v = qkv[:, :, :, hpg + 1]  # [s, b, g, d]
    if rotary is not None:
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=hpg > 1)
    return out.permute(2, 0, 1, 3).reshape(s, b, g * hpg * d)  # [b, nq, s, d] -> [s, b, nq * d]
