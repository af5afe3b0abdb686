"""The Llama layout (``LlamaForCausalLM``): rotary positions, RMSNorm, SwiGLU, grouped-query attention.

    ours                                        Hugging Face
    embedding.word_embeddings.weight            model.embed_tokens.weight
    layers.i.input_layernorm.weight             model.layers.i.input_layernorm.weight
    layers.i.self_attention.linear_qkv.*        model.layers.i.self_attn.{q,k,v}_proj.*  (split by query group)
    layers.i.self_attention.linear_proj.*       model.layers.i.self_attn.o_proj.*
    layers.i.pre_mlp_layernorm.weight           model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.linear_fc1.*                   model.layers.i.mlp.{gate,up}_proj.*     (rows [gate ; up])
    layers.i.mlp.linear_fc2.*                   model.layers.i.mlp.down_proj.*
    final_layernorm.weight                      model.norm.weight
    output_layer.weight (untied only)           lm_head.weight

Biases (``add_bias_linear``) map to ``attention_bias`` and ``mlp_bias`` together; a Hugging Face model with only one
of them is refused.  Both sides rotate halves, so q/k rows are not permuted.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.config.errors import ConfigError
from megatron.hf.layout_common import COMMON_FIELDS, fuse_qkv, hf_int, require_value, split_qkv, tensor_getter
from megatron.model.config import GPTConfig

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
FEATURES = "rotary positions (every channel), RMSNorm, SwiGLU"
# the GPTConfig fields this layout expresses (rotary_percent < 1 and q/k norms it does not: transformers' Llama has
# neither)
MAPPED_FIELDS = COMMON_FIELDS | {"rotary_base"}


def _layer_pairs(bias: bool) -> list[tuple[str, str]]:
    names = [("input_layernorm.weight", "input_layernorm.weight")]
    names += [("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    for suffix in ("weight", "bias") if bias else ("weight",):
        names += [(f"self_attention.linear_proj.{suffix}", f"self_attn.o_proj.{suffix}")]
        names += [(f"mlp.linear_fc2.{suffix}", f"mlp.down_proj.{suffix}")]
    return names


def unsupported(config: GPTConfig) -> str | None:
    """The first feature of ``config`` the Llama layout cannot express, or None."""
    if config.position_embedding_type != "rope":
        return f"{config.position_embedding_type} position embeddings"
    if config.normalization != "RMSNorm":
        return f"{config.normalization} with rotary positions"
    if not config.swiglu:
        kind = "squared-ReLU" if config.squared_relu else "tanh-GeLU" if config.openai_gelu else "GeLU"
        return f"a {kind} MLP with rotary positions"
    return None


def hf_config(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` values (without dtype and special token ids) of a model in this layout."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_epsilon,
        "rope_theta": float(config.rotary_base),
        "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": config.tied_embeddings,
    }


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our full state dict (vocabulary unpadded) -> Hugging Face tensors."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    out["model.norm.weight"] = state["final_layernorm.weight"]
    bias = config.add_bias_linear
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _layer_pairs(bias):
            out[theirs + b] = state[ours + a]
        for suffix in ("weight", "bias") if bias else ("weight",):
            q, k, v = split_qkv(state[f"{ours}self_attention.linear_qkv.{suffix}"], config)
            out.update({f"{theirs}self_attn.{p}_proj.{suffix}": t for p, t in zip("qkv", (q, k, v))})
            gate, up = state[f"{ours}mlp.linear_fc1.{suffix}"].chunk(2, dim=0)
            out[f"{theirs}mlp.gate_proj.{suffix}"], out[f"{theirs}mlp.up_proj.{suffix}"] = gate, up
    if not config.tied_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return {n: t.contiguous() for n, t in out.items()}


def _rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base of a Llama config (``rope_parameters`` in transformers 5, ``rope_theta`` before)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"the model has rotary scaling (rope_type={kind!r}), which our GPT model does not have")
    partial = float(params.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0)))
    partial = float(hf.get("partial_rotary_factor", partial))
    if partial != 1.0:  # transformers' Llama (5.24) ignores it and rotates every channel: an ambiguous model
        raise ConfigError(
            f"the model has partial rotary embeddings (partial_rotary_factor={partial}), which "
            "transformers' Llama does not apply"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def gpt_config(hf: dict[str, Any], *, seq_length: int | None) -> GPTConfig:
    """Our model config for a Hugging Face Llama ``config.json``; a feature we lack -> ``ConfigError``."""
    require_value(hf, "hidden_act", "silu", "an MLP activation other than SiLU (SwiGLU)", default="silu")
    bias = bool(hf.get("attention_bias", False))
    require_value(hf, "mlp_bias", bias, "biases in attention or the MLP but not both", default=False)
    theta = _rope_theta(hf)
    if theta != int(theta):
        raise ConfigError(f"the model has a fractional rotary base (rope_theta={theta}); ours is an integer")
    heads, hidden = hf_int(hf, "num_attention_heads"), hf_int(hf, "hidden_size")
    positions = hf_int(hf, "max_position_embeddings", 2048)
    return GPTConfig(
        num_layers=hf_int(hf, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf_int(hf, "num_key_value_heads", heads),
        kv_channels=int(hf.get("head_dim") or hidden // heads),
        ffn_hidden_size=hf_int(hf, "intermediate_size"),
        vocab_size=hf_int(hf, "vocab_size"),
        seq_length=seq_length or positions,
        max_position_embeddings=positions,
        position_embedding_type="rope",
        rotary_base=int(theta),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        add_bias_linear=bias,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
    )


def from_hf(tensors: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> our full state dict (vocabulary unpadded)."""
    get = tensor_getter(tensors)

    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight")}
    out["final_layernorm.weight"] = get("model.norm.weight")
    bias = config.add_bias_linear
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _layer_pairs(bias):
            out[ours + a] = get(theirs + b)
        for suffix in ("weight", "bias") if bias else ("weight",):
            q, k, v = (get(f"{theirs}self_attn.{p}_proj.{suffix}") for p in "qkv")
            out[f"{ours}self_attention.linear_qkv.{suffix}"] = fuse_qkv(q, k, v, config)
            gate, up = get(f"{theirs}mlp.gate_proj.{suffix}"), get(f"{theirs}mlp.up_proj.{suffix}")
            out[f"{ours}mlp.linear_fc1.{suffix}"] = torch.cat([gate, up])
    if not config.tied_embeddings:
        out["output_layer.weight"] = get("lm_head.weight")
    return {n: t.contiguous() for n, t in out.items()}


def canonical_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under ``LlamaForCausalLM``'s names (they are already)."""
    return tensors
