"""The analytic cost model of a GPT: FLOPs and activation bytes of a transformer layer, the embedding and the output
head with the loss -- what ``--pipeline-layer-split auto`` plans with before anything is measured, and what the
logged model TFLOP/s counts (``megatron.training_log.model_flops_per_iteration``).  One function per formula.

Counting follows Megatron: a multiply-add is 2 FLOPs, attention scores and values are counted over the full sequence
(no causal discount).  The backward splits as the zero-bubble runtime runs it: a linear's input gradient (B) and its
weight gradient (W) each cost its forward; attention's score and value products have no weights, so their backward
(twice the forward) is all B.  Element-wise work (norms, softmax, the cross-entropy) is counted at one FLOP per
element and pass -- small next to the matmuls, except in the head, whose logits are vocabulary-wide.
"""

from __future__ import annotations

from megatron.model.config import GPTConfig
from zb_pipeline.schedule.stage_planner import ModelCosts, PartCosts, RecomputeOption

GFLOP = 1e9  # the planner's time unit: costs are in GFLOPs (only their ratios matter to the split)


def layer_linear_flops_per_token(config: GPTConfig) -> float:
    """Forward FLOPs of one layer's weight matmuls per token: QKV, the attention output projection, the MLP."""
    h = config.hidden_size
    q = config.num_attention_heads * config.kv_channels
    kv = 2 * config.num_query_groups * config.kv_channels
    ffn = config.ffn_hidden_size
    return 2 * h * (q + kv) + 2 * q * h + 2 * h * ffn * (2 if config.swiglu else 1) + 2 * ffn * h


def attention_core_flops_per_token(config: GPTConfig) -> float:
    """Forward FLOPs of the attention scores and the weighted values per token (full sequence, as Megatron)."""
    return 2 * 2 * config.seq_length * config.num_attention_heads * config.kv_channels


def layer_forward_flops_per_token(config: GPTConfig) -> float:
    """Forward matmul FLOPs of one transformer layer per token."""
    return layer_linear_flops_per_token(config) + attention_core_flops_per_token(config)


def head_forward_flops_per_token(config: GPTConfig, padded_vocab_size: int) -> float:
    """Forward matmul FLOPs of the output head per token: the logits."""
    return 2.0 * config.hidden_size * padded_vocab_size


def loss_flops_per_token(padded_vocab_size: int) -> float:
    """The cross-entropy's element-wise work per token and pass (max, exp, sum, the target's log-probability)."""
    return 4.0 * padded_vocab_size


def embedding_flops_per_token(config: GPTConfig) -> float:
    """The embedding's work per token and pass: one hidden-size row read (forward) or accumulated (weight grad)."""
    return float(config.hidden_size)


def layer_activation_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """Activations one layer keeps for its backward, per token: Megatron's ``34 s b h`` at 2 bytes an element,
    without the ``5 a s^2 b`` of stored attention scores (scaled_dot_product_attention keeps none)."""
    return 17.0 * config.hidden_size * bytes_per_element


def head_activation_bytes_per_token(config: GPTConfig, padded_vocab_size: int, bytes_per_element: int) -> float:
    """The head keeps its normalised input and the fp32 logits (softmax) for the loss's backward, per token."""
    return config.hidden_size * bytes_per_element + 4.0 * padded_vocab_size


def layer_input_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What F keeps of a layer under full recompute, per token: its input (B re-runs the layer from it)."""
    return config.hidden_size * bytes_per_element


def attention_core_saved_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What the core attention keeps for its backward without recompute, per token: the rotated query, the key and
    value (for grouped-query attention, their groups) and its output (the fused attention keeps no scores)."""
    q = config.num_attention_heads * config.kv_channels
    kv = 2 * config.num_query_groups * config.kv_channels
    return (2 * q + kv) * bytes_per_element


def qkv_projection_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What selective recompute keeps instead of the core attention's tensors, per token: the QKV projection."""
    q = config.num_attention_heads * config.kv_channels
    kv = 2 * config.num_query_groups * config.kv_channels
    return (q + kv) * bytes_per_element


def recompute_options(
    config: GPTConfig, *, micro_batch_size: int, bytes_per_element: int
) -> tuple[RecomputeOption, ...]:
    """``--recompute-granularity auto``'s choices for one layer and microbatch: selective re-runs the core attention
    in B and keeps the QKV projection instead of the core's tensors; full re-runs the whole layer's forward and
    keeps its input.  After B a pending W holds its GEMMs' operands whatever the choice, modelled as the layer's
    activations without recompute (``mem_f + mem_b`` is the same for every option)."""
    tokens = config.seq_length * micro_batch_size
    scale = tokens / GFLOP
    held = layer_activation_bytes_per_token(config, bytes_per_element) * tokens
    core = attention_core_flops_per_token(config)
    selective = (
        held
        - (
            attention_core_saved_bytes_per_token(config, bytes_per_element)
            - qkv_projection_bytes_per_token(config, bytes_per_element)
        )
        * tokens
    )
    full = layer_input_bytes_per_token(config, bytes_per_element) * tokens
    return (
        RecomputeOption("selective", b_extra=core * scale, mem_f=selective, mem_b=held - selective),
        RecomputeOption("full", b_extra=layer_forward_flops_per_token(config) * scale, mem_f=full, mem_b=held - full),
    )


def model_costs(
    config: GPTConfig,
    *,
    padded_vocab_size: int,
    micro_batch_size: int,
    bytes_per_element: int = 4,
    recompute: tuple[RecomputeOption, ...] = (),
) -> ModelCosts:
    """The stage planner's per-part costs for one microbatch (GFLOPs, bytes).  ``recompute``: the options a stage
    may take (the recompute work's measured or modelled effect; none by default)."""
    tokens = config.seq_length * micro_batch_size
    lin, core = layer_linear_flops_per_token(config), attention_core_flops_per_token(config)
    head, loss = head_forward_flops_per_token(config, padded_vocab_size), loss_flops_per_token(padded_vocab_size)
    emb = embedding_flops_per_token(config)
    scale = tokens / GFLOP
    return ModelCosts(
        num_layers=config.num_layers,
        layer=PartCosts(
            f=(lin + core) * scale,
            b=(lin + 2 * core) * scale,
            w=lin * scale,
            mem_f=layer_activation_bytes_per_token(config, bytes_per_element) * tokens,
        ),
        embedding=PartCosts(f=emb * scale, b=0.0, w=emb * scale, mem_f=8.0 * tokens),  # keeps the token ids
        head=PartCosts(
            f=(head + loss) * scale,
            b=(head + loss) * scale,
            w=head * scale,
            mem_f=head_activation_bytes_per_token(config, padded_vocab_size, bytes_per_element) * tokens,
        ),
        recompute=recompute,
    )
