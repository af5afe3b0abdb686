"""The analytic cost model of a GPT: FLOPs and activation bytes of a transformer layer, the embedding and the output
head with the loss -- what ``--pipeline-layer-split auto`` plans with before anything is measured, and what the
logged model TFLOP/s counts (``megatron.training_log.model_flops_per_iteration``).  One function per formula.

Counting follows Megatron: a multiply-add is 2 FLOPs, attention scores and values are counted over the full sequence
(no causal discount).  The backward splits as the zero-bubble runtime runs it: a linear's input gradient (B) and its
weight gradient (W) each cost its forward; attention's score and value products have no weights, so their backward
(twice the forward) is all B.  Element-wise work (norms, softmax, the cross-entropy) is counted at one FLOP per
element and pass -- small next to the matmuls, except in the head, whose logits are vocabulary-wide.

Activation bytes count what autograd saves for the backward as the profiler counts it (distinct storages,
``zb_pipeline.runtime.activation_memory``), tensor by tensor.  The kernels decide much of it, so the layer's byte
formulas take ``on_cuda``: on the CPU, attention dropout sends ``scaled_dot_product_attention`` down its math path
(it keeps the score probabilities) and a dropout keeps its mask in the activations' dtype; on CUDA the fused
attention and dropout keep the inputs, the log-sum-exp and a bool mask (from the kernels' saved tensors, not
measured here).  What selective recompute frees is the core attention's own tensors, which on the fused path are
little: the query, key and value are views of the QKV projection that selective keeps anyway (unless rotated), and
the output is the output projection's input.
"""

from __future__ import annotations

import dataclasses

from megatron.model.config import GPTConfig
from zb_pipeline.schedule.model_costs import ModelCosts, PartCosts, RecomputeOption

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


F32 = 4  # bytes of the statistics kernels keep in fp32 (norms' mean and reciprocal deviation, the log-sum-exp)


def attention_is_fused(config: GPTConfig, *, on_cuda: bool) -> bool:
    """Whether ``scaled_dot_product_attention`` takes a fused kernel (flash or memory-efficient: it keeps its inputs,
    its output and the log-sum-exp) rather than the math path (it keeps the score probabilities): always on CUDA,
    on the CPU only without attention dropout (the CPU flash kernel takes none)."""
    return on_cuda or config.attention_dropout == 0.0


def dropout_mask_bytes(bytes_per_element: int, *, on_cuda: bool) -> int:
    """Bytes a dropout keeps per element for its backward: CUDA's fused dropout a bool mask, the CPU's the scaled
    mask in the activations' dtype."""
    return 1 if on_cuda else bytes_per_element


def layer_io_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What a layer keeps outside its core attention and MLP, per token: its input and the residual sum (the norms'
    inputs), both norms' outputs (the QKV and first MLP linears' inputs) and the attention output (the output
    projection's input; the fused kernel's output is the same storage)."""
    q = config.num_attention_heads * config.kv_channels
    return (4 * config.hidden_size + q) * bytes_per_element


def mlp_saved_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What the MLP keeps between its linears, per token: the activation's input and output (GeLU, squared ReLU;
    SwiGLU: the gate and up projection, the gate's SiLU and the product)."""
    ffn = config.ffn_hidden_size
    return (4 if config.swiglu else 2) * ffn * bytes_per_element


def norm_saved_bytes(config: GPTConfig, bytes_per_element: int, channels: int) -> float:
    """What one norm over ``channels`` keeps besides its input: LayerNorm its fp32 mean and reciprocal deviation,
    RMSNorm its fp32 reciprocal and its normalised input."""
    if config.normalization == "RMSNorm":
        return F32 + channels * bytes_per_element
    return 2 * F32


def hidden_dropout_bytes_per_token(config: GPTConfig, bytes_per_element: int, *, on_cuda: bool) -> float:
    """The masks of the two residual-branch dropouts per token (none without hidden dropout)."""
    if config.hidden_dropout == 0.0:
        return 0.0
    return 2 * config.hidden_size * dropout_mask_bytes(bytes_per_element, on_cuda=on_cuda)


def attention_core_saved_bytes_per_token(config: GPTConfig, bytes_per_element: int, *, on_cuda: bool) -> float:
    """What the core attention keeps beyond the QKV projection (which its value, a view, keeps alive), per token --
    what selective recompute frees.  Fused kernel: the log-sum-exp, and the query and key where they are copies
    (rotated, normalised, or a grouped-query attention's query gathered over groups); its output is the output
    projection's input (``layer_io_bytes_per_token``).  Math path: the scaled query and key, and per head a row of
    scores three times (the probabilities, the dropout mask, the dropped probabilities); with grouped-query
    attention the keys repeated to every head (an overcount of a few percent of the layer on the CPU).  With
    ``--qk-layernorm`` the query and key norms' own tensors too.  Exact for fp32 on the CPU, the profiler's
    saved-tensor bytes (``tests/test_activation_bytes.py``)."""
    heads, d, groups = config.num_attention_heads, config.kv_channels, config.num_query_groups
    q, k = heads * d, groups * d
    qk_norms = (heads + groups) * norm_saved_bytes(config, bytes_per_element, d) if config.qk_layernorm else 0.0
    if attention_is_fused(config, on_cuda=on_cuda):
        transformed = config.position_embedding_type == "rope" or config.qk_layernorm
        q_copy = transformed or (groups > 1 and heads > groups)
        return qk_norms + heads * F32 + ((q if q_copy else 0) + (k if transformed else 0)) * bytes_per_element
    mask = dropout_mask_bytes(bytes_per_element, on_cuda=on_cuda) if config.attention_dropout else 0
    k_scaled = q if heads > groups else k  # the math path repeats grouped keys to every head
    scores = heads * config.seq_length * (2 * bytes_per_element + mask)
    return qk_norms + (q + k_scaled) * bytes_per_element + scores


def qkv_projection_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """The fused QKV projection per token: what the core attention keeps of its input, and all selective recompute
    keeps of it."""
    q = config.num_attention_heads * config.kv_channels
    kv = 2 * config.num_query_groups * config.kv_channels
    return (q + kv) * bytes_per_element


def layer_selective_bytes_per_token(config: GPTConfig, bytes_per_element: int, *, on_cuda: bool = False) -> float:
    """What one layer keeps for its backward under selective recompute, per token: everything but the core
    attention's own tensors."""
    e = bytes_per_element
    return (
        layer_io_bytes_per_token(config, e)
        + qkv_projection_bytes_per_token(config, e)
        + mlp_saved_bytes_per_token(config, e)
        + 2 * norm_saved_bytes(config, e, config.hidden_size)
        + hidden_dropout_bytes_per_token(config, e, on_cuda=on_cuda)
    )


def layer_activation_bytes_per_token(config: GPTConfig, bytes_per_element: int, *, on_cuda: bool = False) -> float:
    """What one layer keeps for its backward without recompute, per token: the tensors autograd saves in it, as
    the profiler counts them (distinct storages) -- on ``make train``'s model about Megatron's ``34 s b h`` bytes at
    2 bytes an element (``17 h`` elements) less one ``h``; with attention dropout on the CPU far more (the math
    path keeps the scores)."""
    return layer_selective_bytes_per_token(
        config, bytes_per_element, on_cuda=on_cuda
    ) + attention_core_saved_bytes_per_token(config, bytes_per_element, on_cuda=on_cuda)


def layer_weight_grad_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What one layer holds after its B until its W, per token, whatever the recompute: each deferred weight GEMM's
    operands -- the QKV, output projection and MLP linears' inputs and their output gradients."""
    q = config.num_attention_heads * config.kv_channels
    h, ffn = config.hidden_size, config.ffn_hidden_size
    inputs = h + q + h + ffn
    grads = qkv_projection_bytes_per_token(config, 1) + h + (2 if config.swiglu else 1) * ffn + h
    return (inputs + grads) * bytes_per_element


def full_recompute_transient_bytes_per_token(
    config: GPTConfig, bytes_per_element: int, *, on_cuda: bool = False
) -> float:
    """What B holds while it recomputes a layer under full recompute, above what F kept of it, per token: the
    rebuilt layer's graph, all of it but the input."""
    return layer_activation_bytes_per_token(config, bytes_per_element, on_cuda=on_cuda) - layer_input_bytes_per_token(
        config, bytes_per_element
    )


def attention_core_rebuilt_bytes_per_token(config: GPTConfig, bytes_per_element: int, *, on_cuda: bool) -> float:
    """What selective recompute's replay of the core attention rebuilds, per token: the core's own tensors, and with
    the fused kernel its output too (a new tensor, no longer the output projection's input)."""
    rebuilt = attention_core_saved_bytes_per_token(config, bytes_per_element, on_cuda=on_cuda)
    if attention_is_fused(config, on_cuda=on_cuda):
        rebuilt += config.num_attention_heads * config.kv_channels * bytes_per_element
    return rebuilt


def selective_recompute_transient_bytes_per_token(
    config: GPTConfig, bytes_per_element: int, *, on_cuda: bool = False
) -> float:
    """What B holds while it recomputes a layer's core attention, above what F kept of the layer, per token (may be
    negative: then it holds less than before B).  By then the MLP, the pre-MLP norm and the output projection have
    run their backward: the MLP's inner tensors (but the second linear's input, an operand of its W), the residual
    sum, the norm's own tensors and the dropout masks are gone, the three linears' output gradients wait for W; the
    core's graph is rebuilt (with the fused kernel its output too, a new tensor)."""
    e = bytes_per_element
    h, ffn = config.hidden_size, config.ffn_hidden_size
    rebuilt = attention_core_rebuilt_bytes_per_token(config, e, on_cuda=on_cuda)
    grads = (h + (2 if config.swiglu else 1) * ffn + h) * e
    freed = (
        mlp_saved_bytes_per_token(config, e)
        - ffn * e
        + h * e
        + norm_saved_bytes(config, e, h)
        + hidden_dropout_bytes_per_token(config, e, on_cuda=on_cuda)
    )
    return rebuilt + grads - freed


def selective_recompute_bw_transient_bytes_per_token(
    config: GPTConfig, bytes_per_element: int, *, on_cuda: bool = False
) -> float:
    """``selective_recompute_transient_bytes_per_token`` inside a fused BW, whose W work runs as it goes: by the
    core's recompute the MLP, the pre-MLP norm and the output projection have freed all they kept (the linears'
    inputs too) and hold no gradients."""
    e = bytes_per_element
    h, q = config.hidden_size, config.num_attention_heads * config.kv_channels
    rebuilt = attention_core_rebuilt_bytes_per_token(config, e, on_cuda=on_cuda)
    freed = (
        mlp_saved_bytes_per_token(config, e)
        + (2 * h + q) * e
        + norm_saved_bytes(config, e, h)
        + hidden_dropout_bytes_per_token(config, e, on_cuda=on_cuda)
    )
    return rebuilt - freed


def head_activation_bytes_per_token(config: GPTConfig, padded_vocab_size: int, bytes_per_element: int) -> float:
    """What the head keeps for its backward, per token: the final norm's input, its own tensors and its output (the
    output layer's input), the fp32 softmax of the logits (the loss's backward) and the labels (int64)."""
    e = bytes_per_element
    return 2 * config.hidden_size * e + norm_saved_bytes(config, e, config.hidden_size) + 4.0 * padded_vocab_size + 8


def head_weight_grad_bytes_per_token(config: GPTConfig, padded_vocab_size: int, bytes_per_element: int) -> float:
    """What the head holds after its B until its W, per token: the output layer's input and the fp32 logits'
    gradient."""
    return config.hidden_size * bytes_per_element + 4.0 * padded_vocab_size


def embedding_activation_bytes_per_token(
    config: GPTConfig, bytes_per_element: int, *, micro_batch_size: int, on_cuda: bool = False
) -> float:
    """What the embedding keeps for its backward, per token: the token ids (int64), the learned positions' ids (one
    per position, shared by the microbatch's sequences) and the embedding dropout's mask."""
    positions = 8.0 / micro_batch_size if config.position_embedding_type == "learned_absolute" else 0.0
    mask = config.hidden_size * dropout_mask_bytes(bytes_per_element, on_cuda=on_cuda) if config.hidden_dropout else 0
    return 8.0 + positions + mask


def layer_input_bytes_per_token(config: GPTConfig, bytes_per_element: int) -> float:
    """What F keeps of a layer under full recompute, per token: its input (B re-runs the layer from it)."""
    return config.hidden_size * bytes_per_element


def recompute_options(
    config: GPTConfig, *, micro_batch_size: int, bytes_per_element: int, on_cuda: bool = False
) -> tuple[RecomputeOption, ...]:
    """``--recompute-granularity auto``'s choices for one layer and microbatch: selective re-runs the core attention
    in B and keeps the QKV projection instead of the core's tensors; full re-runs the whole layer's forward and
    keeps its input.  After B a pending W holds its GEMMs' operands whatever the choice (``mem_f + mem_b`` is the
    same for every option); while B (a fused BW) recomputes a layer it holds ``transient`` (``transient_bw``) above
    what F kept of it.
    ``on_cuda``: the stages run on a GPU (its attention kernel and dropout keep less)."""
    e, tokens = bytes_per_element, config.seq_length * micro_batch_size
    scale = tokens / GFLOP
    held = layer_weight_grad_bytes_per_token(config, e) * tokens
    selective = layer_selective_bytes_per_token(config, e, on_cuda=on_cuda) * tokens
    full = layer_input_bytes_per_token(config, e) * tokens
    full_transient = full_recompute_transient_bytes_per_token(config, e, on_cuda=on_cuda) * tokens
    return (
        RecomputeOption(
            "selective",
            b_extra=attention_core_flops_per_token(config) * scale,
            mem_f=selective,
            mem_b=held - selective,
            transient=selective_recompute_transient_bytes_per_token(config, e, on_cuda=on_cuda) * tokens,
            transient_bw=selective_recompute_bw_transient_bytes_per_token(config, e, on_cuda=on_cuda) * tokens,
        ),
        RecomputeOption(
            "full",
            b_extra=layer_forward_flops_per_token(config) * scale,
            mem_f=full,
            mem_b=held - full,
            transient=full_transient,
            transient_bw=full_transient,
        ),
    )


def explicit_recompute_option(
    config: GPTConfig,
    *,
    granularity: str,
    method: str | None,
    num_layers: int | None,
    micro_batch_size: int,
    bytes_per_element: int,
    on_cuda: bool = False,
) -> RecomputeOption:
    """The option of an explicit ``--recompute-granularity`` (every stage takes it; the stage planner plans the split
    with it in force, ``ModelCosts.fixed_recompute``): selective, or full in runs of ``--recompute-num-layers``
    (uniform) or of a stage's first ``--recompute-num-layers`` layers (block) -- ``recompute_options``' own with the
    run or the block (``RecomputeOption.run``/``block``)."""
    selective, full = recompute_options(
        config, micro_batch_size=micro_batch_size, bytes_per_element=bytes_per_element, on_cuda=on_cuda
    )
    if granularity == "selective":
        return selective
    n = num_layers or 1
    if method == "block":
        return dataclasses.replace(full, name=f"full-block-{n}", block=n)
    return full if n == 1 else dataclasses.replace(full, name=f"full-uniform-{n}", run=n)


def model_costs(
    config: GPTConfig,
    *,
    padded_vocab_size: int,
    micro_batch_size: int,
    bytes_per_element: int = 4,
    recompute: tuple[RecomputeOption, ...] = (),
    on_cuda: bool = False,
) -> ModelCosts:
    """The stage planner's per-part costs for one microbatch (GFLOPs, bytes).  ``recompute``: the options a stage
    may take (the recompute work's measured or modelled effect; none by default); ``on_cuda``: the stages run on a
    GPU."""
    tokens = config.seq_length * micro_batch_size
    lin, core = layer_linear_flops_per_token(config), attention_core_flops_per_token(config)
    head, loss = head_forward_flops_per_token(config, padded_vocab_size), loss_flops_per_token(padded_vocab_size)
    emb = embedding_flops_per_token(config)
    scale = tokens / GFLOP
    e = bytes_per_element
    emb_bytes = embedding_activation_bytes_per_token(config, e, micro_batch_size=micro_batch_size, on_cuda=on_cuda)
    layer_bytes = layer_activation_bytes_per_token(config, e, on_cuda=on_cuda)  # per token, as the rest
    head_bytes = head_activation_bytes_per_token(config, padded_vocab_size, e)
    return ModelCosts(
        num_layers=config.num_layers,
        layer=PartCosts(
            f=(lin + core) * scale,
            b=(lin + 2 * core) * scale,
            w=lin * scale,
            mem_f=layer_bytes * tokens,
            mem_b=(layer_weight_grad_bytes_per_token(config, e) - layer_bytes) * tokens,
        ),
        embedding=PartCosts(
            f=emb * scale,
            b=0.0,
            w=emb * scale,
            mem_f=emb_bytes * tokens,
            mem_b=-emb_bytes * tokens,  # B frees it all: its W reads the token ids, the microbatch's own input
        ),
        head=PartCosts(
            f=(head + loss) * scale,
            b=(head + loss) * scale,
            w=head * scale,
            mem_f=head_bytes * tokens,
            mem_b=(head_weight_grad_bytes_per_token(config, padded_vocab_size, e) - head_bytes) * tokens,
        ),
        recompute=recompute,
    )
