"""The analytic activation bytes of one transformer layer (``megatron.model.cost_model``) against what the profiler
measures (its saved-tensor bytes: distinct storages autograd saved in the graph F built, parameters excluded), per
layer and token, without recompute, with selective and with full recompute.

A layer's bytes are measured as the difference between a stage of two layers and one of one layer (the stage's own
tensors, e.g. RoPE tables, cancel), on tiny CPU models: with dropout (the CPU's math attention path, which keeps the
scores) and without (its fused kernel), with RoPE, grouped-query attention, SwiGLU with RMSNorm and q/k norms.
Tolerance fixed before measuring: 5% of the measured bytes.
"""

from __future__ import annotations

import pytest
import torch

from megatron.config.recompute import RecomputeConfig
from megatron.model import cost_model
from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTStage
from megatron.model.recompute import apply_recompute
from zb_pipeline.runtime.activation_memory import graph_saved_tensors, storage_key

TOL = 0.05
BATCH = 2
RECOMPUTE = {
    "none": {},
    "selective": {"granularity": "selective"},
    "full": {"granularity": "full", "method": "uniform", "num_layers": 1},
}
NO_DROPOUT = {"attention_dropout": 0.0, "hidden_dropout": 0.0}
MODELS = {
    "dropout": {},  # tests/test_recompute_memory.py's model
    "no dropout": NO_DROPOUT,  # like make train's
    "rope": {"position_embedding_type": "rope", **NO_DROPOUT},
    "gqa": {"num_attention_heads": 4, "num_query_groups": 2, **NO_DROPOUT},
    "swiglu rmsnorm qk-norm": {"swiglu": True, "normalization": "RMSNorm", "qk_layernorm": True, "hidden_dropout": 0.0},
}


def _config(overrides: dict) -> GPTConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=2, vocab_size=120, seq_length=16)
    return GPTConfig(**{**base, **overrides})


def _saved_bytes(config: GPTConfig, recompute: dict, num_layers: int) -> int:
    """The saved-tensor bytes of one microbatch's F through a middle stage of ``num_layers`` layers."""
    torch.manual_seed(0)
    stage = GPTStage(config, layer_range=range(1, 1 + num_layers), pre_process=False, post_process=False)
    apply_recompute(stage, RecomputeConfig(**recompute))
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    x = torch.randn(config.seq_length, BATCH, config.hidden_size, requires_grad=True)
    found: list[torch.Tensor] = []
    graph_saved_tensors(stage(x), found)
    storages = dict(storage_key(t) for t in found)
    return sum(n for ptr, n in storages.items() if ptr not in params)


def _analytic(config: GPTConfig, choice: str) -> float:
    if choice == "none":
        return cost_model.layer_activation_bytes_per_token(config, 4, on_cuda=False)
    if choice == "selective":
        return cost_model.layer_selective_bytes_per_token(config, 4, on_cuda=False)
    return cost_model.layer_input_bytes_per_token(config, 4)


@pytest.mark.parametrize("model", list(MODELS))
def test_analytic_layer_bytes_match_the_measured(model: str) -> None:
    config = _config(MODELS[model])
    tokens = config.seq_length * BATCH
    for choice, recompute in RECOMPUTE.items():
        measured = (_saved_bytes(config, recompute, 2) - _saved_bytes(config, recompute, 1)) / tokens
        predicted = _analytic(config, choice)
        assert measured > 0 and abs(predicted - measured) <= TOL * measured, (model, choice, predicted, measured)


def test_recompute_options_take_the_layer_bytes() -> None:
    """The planner's options carry the same bytes per microbatch, and after B every option holds what no recompute
    holds."""
    config = _config({})
    tokens = config.seq_length * BATCH
    costs = cost_model.model_costs(
        config,
        padded_vocab_size=128,
        micro_batch_size=BATCH,
        recompute=cost_model.recompute_options(config, micro_batch_size=BATCH, bytes_per_element=4),
    )
    selective, full = costs.recompute
    assert costs.layer.mem_f == cost_model.layer_activation_bytes_per_token(config, 4) * tokens
    assert selective.mem_f == cost_model.layer_selective_bytes_per_token(config, 4) * tokens
    assert full.mem_f == cost_model.layer_input_bytes_per_token(config, 4) * tokens
    for option in (selective, full):
        assert option.mem_f + option.mem_b == costs.layer.mem_f
