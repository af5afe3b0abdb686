"""The GPT-2 layout (``GPT2LMHeadModel``): learned absolute positions, LayerNorm, exact GeLU, biases everywhere.

    ours                                        Hugging Face (Conv1D weights are [in, out]: transposed)
    embedding.word_embeddings.weight            transformer.wte.weight
    embedding.position_embeddings.weight        transformer.wpe.weight
    layers.i.input_layernorm.{weight,bias}      transformer.h.i.ln_1.{weight,bias}
    layers.i.self_attention.linear_qkv.*        transformer.h.i.attn.c_attn.*   (rows [q | k | v], all heads)
    layers.i.self_attention.linear_proj.*       transformer.h.i.attn.c_proj.*
    layers.i.pre_mlp_layernorm.*                transformer.h.i.ln_2.*
    layers.i.mlp.linear_fc1.*                   transformer.h.i.mlp.c_fc.*
    layers.i.mlp.linear_fc2.*                   transformer.h.i.mlp.c_proj.*
    final_layernorm.*                           transformer.ln_f.*
    output_layer.weight (untied only)           lm_head.weight

The MLP activation is ``activation_function``: the exact GeLU is ``"gelu"``, ``--openai-gelu`` (the tanh
approximation, Hugging Face's GPT-2 default and the one the released GPT-2 checkpoints use) is ``"gelu_new"``
(``"gelu_pytorch_tanh"`` is read as the same), ``--squared-relu`` is ``"relu2"``.  Any other activation is refused
on import.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.hf.layout_common import COMMON_FIELDS, fuse_qkv, hf_int, require_value, split_qkv, tensor_getter
from megatron.model.config import GPTConfig

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
FEATURES = "learned absolute positions, LayerNorm, GeLU (or squared ReLU), biases, one key/value head per query head"
# the GPTConfig fields this layout expresses; rotary_base and rotary_percent do nothing with learned positions
MAPPED_FIELDS = COMMON_FIELDS | {"openai_gelu", "squared_relu", "rotary_base", "rotary_percent"}
# activation_function -> (openai_gelu, squared_relu); the first entry of each pair is what export writes
ACTIVATIONS = {
    "gelu": (False, False),
    "gelu_new": (True, False),
    "gelu_pytorch_tanh": (True, False),
    "relu2": (False, True),
}

_LAYER_PAIRS = (  # (ours, theirs, transposed)
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("self_attention.linear_qkv.weight", "attn.c_attn.weight", True),
    ("self_attention.linear_qkv.bias", "attn.c_attn.bias", False),
    ("self_attention.linear_proj.weight", "attn.c_proj.weight", True),
    ("self_attention.linear_proj.bias", "attn.c_proj.bias", False),
    ("pre_mlp_layernorm.weight", "ln_2.weight", False),
    ("pre_mlp_layernorm.bias", "ln_2.bias", False),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight", True),
    ("mlp.linear_fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight", True),
    ("mlp.linear_fc2.bias", "mlp.c_proj.bias", False),
)
_OUTER = (
    ("embedding.word_embeddings.weight", "transformer.wte.weight"),
    ("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    ("final_layernorm.weight", "transformer.ln_f.weight"),
    ("final_layernorm.bias", "transformer.ln_f.bias"),
)


def unsupported(config: GPTConfig) -> str | None:
    """The first feature of ``config`` the GPT-2 layout cannot express, or None."""
    if config.position_embedding_type != "learned_absolute":
        return f"{config.position_embedding_type} position embeddings"
    if config.normalization != "LayerNorm":
        return f"{config.normalization} with learned absolute positions"
    if config.swiglu:
        return "a SwiGLU MLP with learned absolute positions"
    if not config.add_bias_linear:
        return "linear layers without biases (--disable-bias-linear) with learned absolute positions"
    if config.num_query_groups != config.num_attention_heads:
        return f"grouped-query attention (--num-query-groups {config.num_query_groups}) with learned absolute positions"
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        return f"--kv-channels {config.kv_channels} != hidden size / heads with learned absolute positions"
    return None


def hf_config(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` values (without dtype and special token ids) of a model in this layout."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "activation_function": _activation(config),
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.norm_epsilon,
        "initializer_range": config.init_method_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tied_embeddings,
    }


def _activation(config: GPTConfig) -> str:
    return next(name for name, flags in ACTIVATIONS.items() if flags == (config.openai_gelu, config.squared_relu))


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our full state dict (vocabulary unpadded) -> Hugging Face tensors."""
    out = {theirs: state[ours] for ours, theirs in _OUTER}
    for i in range(config.num_layers):
        for ours, theirs, transposed in _LAYER_PAIRS:
            t = state[f"layers.{i}.{ours}"]
            if ours.startswith("self_attention.linear_qkv"):
                t = torch.cat(split_qkv(t, config))  # group-major [q k v] per head -> [q | k | v]
            out[f"transformer.h.{i}.{theirs}"] = t.t() if transposed else t
    if not config.tied_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return {n: t.contiguous() for n, t in out.items()}


def gpt_config(hf: dict[str, Any], *, seq_length: int | None) -> GPTConfig:
    """Our model config for a Hugging Face GPT-2 ``config.json``; a feature we lack -> ``ConfigError``."""
    activation = hf.get("activation_function", "gelu_new")
    require_value(hf, "activation_function", tuple(ACTIVATIONS), "an MLP activation we lack", default="gelu_new")
    openai_gelu, squared_relu = ACTIVATIONS[activation]
    require_value(hf, "scale_attn_weights", True, "unscaled attention scores", default=True)
    require_value(hf, "scale_attn_by_inverse_layer_idx", False, "attention scaled by layer index", default=False)
    require_value(hf, "add_cross_attention", False, "cross-attention", default=False)
    hidden, positions = hf_int(hf, "n_embd"), hf_int(hf, "n_positions", 1024)
    n_inner = hf.get("n_inner")
    return GPTConfig(
        num_layers=hf_int(hf, "n_layer"),
        hidden_size=hidden,
        num_attention_heads=hf_int(hf, "n_head"),
        vocab_size=hf_int(hf, "vocab_size"),
        seq_length=seq_length or positions,
        max_position_embeddings=positions,
        ffn_hidden_size=int(n_inner) if n_inner else 4 * hidden,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        swiglu=False,
        openai_gelu=openai_gelu,
        squared_relu=squared_relu,
        add_bias_linear=True,
        attention_dropout=float(hf.get("attn_pdrop", 0.1)),
        hidden_dropout=float(hf.get("resid_pdrop", 0.1)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
    )


def from_hf(tensors: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (``canonical_names``) -> our full state dict (vocabulary unpadded)."""
    get = tensor_getter(tensors)

    out = {ours: get(theirs) for ours, theirs in _OUTER}
    h = config.hidden_size
    for i in range(config.num_layers):
        for ours, theirs, transposed in _LAYER_PAIRS:
            t = get(f"transformer.h.{i}.{theirs}")
            t = t.t() if transposed else t
            if ours.startswith("self_attention.linear_qkv"):
                q, k, v = t[:h], t[h : 2 * h], t[2 * h :]
                t = fuse_qkv(q, k, v, config)
            out[f"layers.{i}.{ours}"] = t.contiguous()
    if not config.tied_embeddings:
        out["output_layer.weight"] = get("lm_head.weight")
    return {n: t.contiguous() for n, t in out.items()}


def canonical_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under ``GPT2LMHeadModel``'s names (the original GPT-2 files lack the ``transformer.`` prefix)."""
    return {n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": t for n, t in tensors.items()}
