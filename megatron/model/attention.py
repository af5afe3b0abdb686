"""Causal self-attention with grouped-query attention (GQA), tensor-parallel over query groups.

The fused QKV projection's output rows are laid out group by group: for each query group g,
``[q heads of g (heads/groups x d) | k_g (d) | v_g (d)]``.  A tensor-parallel rank holds a contiguous run of whole
groups, so its shard is a plain slice of the full weight, whatever the tp size.

With a ``LayerKVCache`` (inference only) the new tokens' keys and values are appended to the cache and the queries
attend to every cached position up to their own (``attend_cached``); without one the code path is the training one.
Optional, with Megatron's meaning: ``--qk-layernorm`` normalises each query and key head over its ``d`` channels
(one ``[d]`` weight shared by all heads, before RoPE); an explicit ``attention_mask [b, 1, s, s]`` (bool, True =
masked out, Megatron's convention; ``--reset-attention-mask`` builds it from document ids) replaces the implicit
causal mask.  Under tensor parallelism each rank normalises only its own heads, so the q/k norm weights' gradients
are partial sums: they are tagged ``sequence_parallel`` and summed over the tensor-parallel group like the
sequence-parallel norms'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.config import GPTConfig
from megatron.model.kv_cache import LayerKVCache
from megatron.model.norms import build_norm
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
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            norm = dict(eps=config.norm_epsilon, zero_centered=config.apply_layernorm_1p)
            # tagged sequence_parallel: each tp rank sees only its heads, so the gradients are summed over tp
            partial = tp.tp_size > 1
            self.q_layernorm = build_norm(config.normalization, self.head_dim, sequence_parallel=partial, **norm)
            self.k_layernorm = build_norm(config.normalization, self.head_dim, sequence_parallel=partial, **norm)
        self.linear_proj = RowParallelLinear(
            config.query_projection_size, config.hidden_size, tp=tp, bias=bias, sequence_parallel=sequence_parallel
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        qkv = self.linear_qkv(x)  # [s, b, groups * (heads_per_group + 2) * d]
        if kv_cache is not None:
            shape = dict(groups=self.groups, heads_per_group=self.heads_per_group, head_dim=self.head_dim)
            norms = dict(q_norm=self.q_layernorm, k_norm=self.k_layernorm)
            return self.linear_proj(attend_cached(qkv, kv_cache, rotary=rotary, **shape, **norms))
        dropout_p = self.dropout_p if self.training else 0.0
        core = _CoreAttention(
            self.groups,
            self.heads_per_group,
            self.head_dim,
            dropout_p,
            q_norm=self.q_layernorm,
            k_norm=self.k_layernorm,
            attention_mask=attention_mask,
        )
        if self.recompute_core:  # F keeps qkv (and rotary) only
            out = recompute(core, qkv, *(rotary or ()), store=self.linear_qkv.weight_grad_store)
        else:
            out = core(qkv, *(rotary or ()))  # [s, b, nq * d]
        return self.linear_proj(out)  # [s, b, h] ([s/tp, b, h] with sequence parallelism)


class _CoreAttention:
    """``attend`` with its sizes, q/k norms and mask bound: ``(qkv, *rotary) -> out`` (the unit selective
    recomputation re-runs)."""

    def __init__(
        self,
        groups: int,
        heads_per_group: int,
        head_dim: int,
        dropout_p: float,
        *,
        q_norm: torch.nn.Module | None = None,
        k_norm: torch.nn.Module | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        self.groups, self.heads_per_group, self.head_dim, self.dropout_p = groups, heads_per_group, head_dim, dropout_p
        self.q_norm, self.k_norm, self.attention_mask = q_norm, k_norm, attention_mask

    def __call__(self, qkv: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        return attend(
            qkv,
            groups=self.groups,
            heads_per_group=self.heads_per_group,
            head_dim=self.head_dim,
            rotary=(rotary[0], rotary[1]) if rotary else None,
            dropout_p=self.dropout_p,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            attention_mask=self.attention_mask,
        )


def attend(
    qkv: torch.Tensor,
    *,
    groups: int,
    heads_per_group: int,
    head_dim: int,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    dropout_p: float,
    q_norm: torch.nn.Module | None = None,
    k_norm: torch.nn.Module | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a fused QKV projection laid out group by group (module docstring): causal, or as
    ``attention_mask [b, 1, s, s]`` (True = masked out) says.

    ``qkv``: ``[s, b, groups * (heads_per_group + 2) * head_dim]`` -> ``[s, b, groups * heads_per_group * head_dim]``.
    Shared by ``SelfAttention`` and the Transformer Engine layers (``megatron.kernels.transformer_engine``)."""
    s, b = qkv.shape[0], qkv.shape[1]
    hpg = heads_per_group
    q, k, v = _split_heads(
        qkv, groups=groups, heads_per_group=hpg, head_dim=head_dim, rotary=rotary, q_norm=q_norm, k_norm=k_norm
    )
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=hpg > 1)
    else:  # SDPA's boolean mask says who takes part: the opposite of Megatron's
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, dropout_p=dropout_p, enable_gqa=hpg > 1
        )
    return out.permute(2, 0, 1, 3).reshape(s, b, groups * hpg * head_dim)  # [b, nq, s, d] -> [s, b, nq * d]


def attend_cached(
    qkv: torch.Tensor,
    cache: LayerKVCache,
    *,
    groups: int,
    heads_per_group: int,
    head_dim: int,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    q_norm: torch.nn.Module | None = None,
    k_norm: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``attend`` for new tokens at positions ``cache.offset ..``: their keys and values join the cache and each
    query sees every cached position up to its own (no dropout: inference)."""
    s, b = qkv.shape[0], qkv.shape[1]
    hpg, offset = heads_per_group, cache.offset
    q, k, v = _split_heads(
        qkv, groups=groups, heads_per_group=hpg, head_dim=head_dim, rotary=rotary, q_norm=q_norm, k_norm=k_norm
    )
    k, v = cache.append(k, v)  # [b, g, offset + s, d]
    mask = None
    if offset > 0 and s > 1:  # query i (position offset + i) sees keys 0 .. offset + i
        mask = torch.ones(s, offset + s, dtype=torch.bool, device=q.device).tril(diagonal=offset)
    causal = offset == 0 and s > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hpg > 1)
    return out.permute(2, 0, 1, 3).reshape(s, b, groups * hpg * head_dim)


def _split_heads(
    qkv: torch.Tensor,
    *,
    groups: int,
    heads_per_group: int,
    head_dim: int,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    q_norm: torch.nn.Module | None = None,
    k_norm: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection ``[s, b, ...]`` -> q ``[b, nq, s, d]``, k and v ``[b, g, s, d]``, rotated."""
    s, b = qkv.shape[0], qkv.shape[1]
    g, hpg, d = groups, heads_per_group, head_dim
    qkv = qkv.view(s, b, g, hpg + 2, d)
    q = qkv[:, :, :, :hpg].reshape(s, b, g * hpg, d)  # [s, b, nq, d]
    k = qkv[:, :, :, hpg]  # [s, b, g, d]
    v = qkv[:, :, :, hpg + 1]  # [s, b, g, d]
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)  # over each head's d channels
    if rotary is not None:
        cos, sin = (t.to(q.dtype) for t in rotary)  # tables follow the compute dtype (fp32 residual stream)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    return q, k, v
