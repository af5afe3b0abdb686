"""What the GPT-2 and Llama layouts share: the fused QKV rows of our attention, Hugging Face config values.

Our fused QKV projection lays its output rows out group by group (``megatron.model.attention``): for each query
group ``[q heads of the group | k | v]``, each ``head_dim`` rows.  Hugging Face keeps q (heads in order, head ``i``
reading key/value head ``i // heads_per_group``), k and v apart; that is the same head order, so the conversion is
a reshape, never a permutation of heads.  Our rotary embedding rotates halves (dimension ``i`` pairs with
``i + d/2``) like Hugging Face's Llama, so q/k rows need no permutation either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron.config.errors import ConfigError
from megatron.model.config import GPTConfig

# GPTConfig fields both layouts map (sizes, norm epsilon, biases, dropout, init, tying) or check in ``unsupported``
COMMON_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "vocab_size",
        "num_query_groups",
        "ffn_hidden_size",
        "kv_channels",
        "max_position_embeddings",
        "position_embedding_type",
        "normalization",
        "norm_epsilon",
        "swiglu",
        "add_bias_linear",
        "attention_dropout",
        "init_method_std",
        "untie_embeddings_and_output_weights",
    }
)


def split_qkv(fused: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV weight ``[(nq + 2g) d, h]`` (or bias) -> q ``[nq d, ...]``, k and v ``[g d, ...]``."""
    g, d = config.num_query_groups, config.kv_channels
    hpg = config.num_attention_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, hpg + 2, d, *rest)
    q = grouped[:, :hpg].reshape(g * hpg * d, *rest)
    k = grouped[:, hpg].reshape(g * d, *rest)
    v = grouped[:, hpg + 1].reshape(g * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """The inverse of ``split_qkv``."""
    g, d = config.num_query_groups, config.kv_channels
    hpg = config.num_attention_heads // g
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(g, hpg, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return grouped.reshape(g * (hpg + 2) * d, *rest).contiguous()


def require_value(hf: dict[str, Any], key: str, allowed: Any, feature: str, default: Any = None) -> None:
    """``ConfigError`` naming ``feature`` unless ``hf[key]`` (``default`` when absent) is one of ``allowed``."""
    value = hf.get(key, default)
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    if value not in allowed:
        raise ConfigError(f"the model has {feature} ({key}={value!r}), which our GPT model does not have")


def hf_int(hf: dict[str, Any], key: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}; it is not a complete model config")
    return int(value)


def tensor_getter(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get(name)``: the Hugging Face tensor ``name``; ``ConfigError`` when the weights lack it."""

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"the model's weights have no {name!r}; they do not match its config.json")
        return tensors[name]

    return get
