"""The GPT decoder as pipeline stages: ``GPTStage`` holds a contiguous run of layers, plus the embedding on the
first stage and the final norm, output head and loss on the last.  One stage holding everything is the whole model.

    tokens [b, s] -> embedding -> [s, b, h] -> layers -> final norm -> output head -> logits [s, b, V/tp]
                  -> vocab-parallel cross-entropy -> per-token loss [b, s]

(With sequence parallelism the hidden states between layers are ``[s/tp, b, h]``; with ``--fp32-residual-connection``
they are fp32 whatever the parameters' dtype.)  Every stage takes the microbatch's optional ``position_ids [b, s]``
(``--reset-position-ids``: learned positions on the first stage, RoPE on every stage) and ``attention_mask
[b, 1, s, s]`` (``--reset-attention-mask``; True = masked out): a pipeline hands them to every stage, not only the
first.

Tied embeddings: the output head uses the word-embedding table.  If the first and last stage are the same module it is
one tensor; otherwise the last stage holds its own copy (tagged ``shared_embedding``) whose global name is the
embedding's, so it is initialised identically; keeping the two copies equal (summing their gradients) is the pipeline
runtime's job.

Global names: a stage names its layers ``layers.<local index>`` like any module; ``global_name`` maps them to the
whole model's numbering, which is what initialisation (and checkpoints) key on.

Inference: ``forward(tokens, kv_cache=KVCache(...))`` runs the new tokens at positions ``kv_cache.length ..``
against the cached keys and values (``megatron.model.kv_cache``; ``megatron.generation`` decodes with it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from megatron.config.errors import require
from megatron.config.parallel import split_layers
from megatron.model.config import GPTConfig
from megatron.model.embedding import GPTEmbedding
from megatron.model.init import initialize_parameters
from megatron.model.kv_cache import KVCache
from megatron.model.norms import build_norm
from megatron.model.rope import RotaryEmbedding
from megatron.model.transformer_layer import TransformerLayer
from megatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    HasTensorParallel,
    TPContext,
    vocab_parallel_cross_entropy,
)
from zb_pipeline.runtime.recompute import recompute
from zb_pipeline.runtime.weight_grad_store import WeightGradStore

WORD_EMBEDDING = "embedding.word_embeddings.weight"
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")


class GPTStage(torch.nn.Module):
    """Layers ``layer_range`` of the GPT decoder, with the embedding if ``pre_process`` and the head and loss if
    ``post_process``.  Parameters are initialised from ``seed`` (see ``megatron.model.init``)."""

    def __init__(
        self,
        config: GPTConfig,
        *,
        layer_range: range,
        pre_process: bool,
        post_process: bool,
        tp: HasTensorParallel | None = None,
        sequence_parallel: bool = False,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        tp = TPContext() if tp is None else tp
        config.check_tensor_parallel(tp.tp_size)
        if sequence_parallel:
            config.check_sequence_parallel(tp.tp_size)
        require(
            layer_range.step == 1 and 0 <= layer_range.start <= layer_range.stop <= config.num_layers,
            f"layer range {layer_range} is not a run of layers of a {config.num_layers}-layer model",
        )
        self.config, self.tp, self.sequence_parallel = config, tp, sequence_parallel
        self.layer_range, self.pre_process, self.post_process = layer_range, pre_process, post_process
        self.embedding = GPTEmbedding(config, tp=tp, sequence_parallel=sequence_parallel) if pre_process else None
        self.rotary = (
            RotaryEmbedding(config.kv_channels, base=config.rotary_base, rotary_dim=config.rotary_dim)
            if config.position_embedding_type == "rope"
            else None
        )
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, layer_number=n, tp=tp, sequence_parallel=sequence_parallel) for n in layer_range
        )
        self.final_layernorm = None
        self.output_layer = None
        self.cross_entropy_kernel = None  # a fused vocab-parallel cross-entropy (megatron.kernels.select); None: torch
        # Runs (start, stop) of local layers recomputed at backward, and what F keeps of a run's input
        # (megatron.model.recompute.apply_recompute sets them; () : none)
        self.recompute_segments: tuple[tuple[int, int], ...] = ()
        self.recompute_options: dict = {}
        self.weight_grad_store: WeightGradStore | None = None  # bound by the runtime; recompute reports to it
        self.shares_embedding_in_stage = post_process and pre_process and config.tied_embeddings
        if post_process:
            self.final_layernorm = build_norm(
                config.normalization,
                config.hidden_size,
                eps=config.norm_epsilon,
                sequence_parallel=sequence_parallel,
                zero_centered=config.apply_layernorm_1p,
            )
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                config.padded_vocab_size(tp.tp_size),
                tp=tp,
                bias=False,
                sequence_parallel=sequence_parallel,
            )
            self.output_layer.vocab_rows = True  # initialised like a vocabulary table (zero padding rows)
            if self.shares_embedding_in_stage:
                del self.output_layer.weight  # the head reads the word-embedding table
                self.output_layer.weight = None
            elif config.tied_embeddings:
                self.output_layer.weight.shared_embedding = True
        self.reset_parameters(seed)

    # -- names and initialisation ------------------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """The whole-model name of a parameter of this stage (layer indices offset; tied head -> embedding)."""
        if self.config.tied_embeddings and local_name == "output_layer.weight":
            return WORD_EMBEDDING
        m = _LAYER_NAME.match(local_name)
        if m:
            return f"layers.{int(m.group(1)) + self.layer_range.start}.{local_name[m.end() :]}"
        return local_name

    def reset_parameters(self, seed: int) -> None:
        initialize_parameters(self, seed=seed, config=self.config, tp=self.tp, global_name=self.global_name)

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``inputs``: token ids ``[b, s]`` on the first stage, else hidden states ``[s, b, h]`` (``[s/tp, b, h]``
        with sequence parallelism).  Returns hidden states, or on the last stage the logits ``[s, b, V/tp]``, or the
        per-token loss ``[b, s]`` (fp32) when ``labels [b, s]`` are given.  ``position_ids [b, s]`` (default
        ``0..s-1``) and ``attention_mask [b, 1, s, s]`` (bool, True = masked out; default causal): module docstring.
        ``kv_cache`` (inference, this stage's own): the inputs are the tokens after the cached ones."""
        if kv_cache is not None:
            return self._forward_cached(inputs, kv_cache)
        if self.pre_process:
            seq_len = inputs.shape[1]
            x = self.embedding(inputs, position_ids)  # [s, b, h]
        else:
            x = inputs
            seq_len = x.shape[0] * (self.tp.tp_size if self.sequence_parallel else 1)
        rotary = None
        if self.rotary is not None:
            rotary = self.rotary(seq_len, device=x.device, dtype=x.dtype, position_ids=position_ids)
        x = self._layers(x, rotary, attention_mask)
        return self._head(x, labels)

    def _forward_cached(self, inputs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Inference over the tokens at positions ``kv_cache.length ..`` (no sequence parallelism)."""
        offset = kv_cache.length
        x = self.embedding(inputs, offset=offset) if self.pre_process else inputs  # [s, b, h]
        s = x.shape[0]
        rotary = None
        if self.rotary is not None:  # the table for the cache's whole length, sliced to these positions
            cos, sin = self.rotary(kv_cache.max_length, device=x.device, dtype=x.dtype)
            rotary = cos[offset : offset + s], sin[offset : offset + s]
        for layer in self.layers:
            x = layer(x, rotary, kv_cache=kv_cache.layer(layer.layer_number))
        kv_cache.advance(s)
        return self._head(x, None)

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        weight = self.embedding.word_embeddings.weight if self.shares_embedding_in_stage else None
        logits = self.output_layer(x, weight)  # [s, b, V/tp]
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(
            logits, labels.t(), self.tp, vocab_size=self.config.vocab_size, kernel=self.cross_entropy_kernel
        )
        return loss.t()  # [b, s]

    def _layers(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The transformer layers in order; each run in ``recompute_segments`` keeps only its input for backward."""
        done = 0
        for start, stop in self.recompute_segments:
            x = _LayerRun(self.layers[done:start], attention_mask)(x, *(rotary or ()))
            run = _LayerRun(self.layers[start:stop], attention_mask)
            x = recompute(run, x, *(rotary or ()), store=self.weight_grad_store, **self.recompute_options)
            done = stop
        return _LayerRun(self.layers[done:], attention_mask)(x, *(rotary or ()))


class _LayerRun:
    """Layers applied in order to ``(x, *rotary)`` under one attention mask (None: causal): the function a
    recomputed run re-runs at backward."""

    def __init__(self, layers: Sequence[torch.nn.Module], attention_mask: torch.Tensor | None = None) -> None:
        self.layers = list(layers)
        self.attention_mask = attention_mask

    def __call__(self, x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        rot = (rotary[0], rotary[1]) if rotary else None
        for layer in self.layers:
            x = layer(x, rot, self.attention_mask)
        return x


def stage_layer_ranges(
    num_layers: int,
    num_stages: int,
    *,
    first: int | None = None,
    last: int | None = None,
    allow_padding: bool = False,
) -> list[range]:
    """Contiguous layer ranges of ``num_stages`` (virtual) stages, first to last.

    ``first``/``last`` fix the first/last stage's layer count (``--decoder-first/last-pipeline-num-layers``); the
    rest must split evenly unless ``allow_padding`` (``--allow-padding-num-layers``), which gives the last stages
    fewer layers.
    """
    sizes = split_layers(num_layers, num_stages, first=first, last=last, allow_padding=allow_padding)
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def build_gpt_stages(
    config: GPTConfig,
    num_stages: int,
    *,
    stages: Sequence[int] | None = None,
    tp: HasTensorParallel | None = None,
    sequence_parallel: bool = False,
    seed: int = 1234,
    first: int | None = None,
    last: int | None = None,
    allow_padding: bool = False,
    ranges: Sequence[range] | None = None,
) -> list[GPTStage]:
    """Build the (virtual) stages ``stages`` (default: all) of a model split into ``num_stages``; ``ranges``: each
    stage's layers when the split is known already (a pipeline layout), else from ``first``/``last``/padding."""
    if ranges is None:
        ranges = stage_layer_ranges(config.num_layers, num_stages, first=first, last=last, allow_padding=allow_padding)
    if len(ranges) != num_stages:
        raise ValueError(f"{len(ranges)} layer ranges given for {num_stages} stages")
    wanted = range(num_stages) if stages is None else stages
    return [
        GPTStage(
            config,
            layer_range=ranges[s],
            pre_process=s == 0,
            post_process=s == num_stages - 1,
            tp=tp,
            sequence_parallel=sequence_parallel,
            seed=seed,
        )
        for s in wanted
    ]


def build_gpt_model(
    config: GPTConfig, *, tp: HasTensorParallel | None = None, sequence_parallel: bool = False, seed: int = 1234
) -> GPTStage:
    """The whole model as one stage."""
    return GPTStage(
        config,
        layer_range=range(config.num_layers),
        pre_process=True,
        post_process=True,
        tp=tp,
        sequence_parallel=sequence_parallel,
        seed=seed,
    )
