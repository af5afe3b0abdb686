"""The analytic activation bytes of one transformer layer (``megatron.model.cost_model``) against what the profiler
measures (its saved-tensor bytes: distinct storages autograd saved in the graph F built, parameters excluded), per
layer and token, without recompute, with selective and with full recompute; and what a layer's pending W holds after
B and what a recomputing B (or fused BW) holds while it recomputes (``zb_pipeline.runtime.activation_memory``).

A layer's bytes are measured as the difference between a stage of two layers and one of one layer (the stage's own
tensors, e.g. RoPE tables, cancel), on tiny CPU models: with dropout (the CPU's math attention path, which keeps the
scores) and without (its fused kernel), with RoPE, grouped-query attention, SwiGLU with RMSNorm and q/k norms.
Tolerance fixed before measuring: 5% of the measured bytes.
"""

from __future__ import annotations

import contextlib

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
    held = cost_model.layer_weight_grad_bytes_per_token(config, 4) * tokens
    assert costs.layer.mem_f + costs.layer.mem_b == pytest.approx(held)
    for option in (selective, full):
        assert option.mem_f + option.mem_b == pytest.approx(held)


def _backward_bytes(config: GPTConfig, recompute: dict, num_layers: int, *, fused: bool) -> tuple[float, float]:
    """One microbatch's F and B (``fused``: BW) through a middle stage of ``num_layers`` layers, as the profiler
    accounts them: (what waits for W after B, what B held above the sum before it while it recomputed)."""
    from zb_pipeline.runtime.activation_memory import ActivationMemory
    from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store
    from zb_pipeline.schedule.ir import Kind

    torch.manual_seed(0)
    stage = GPTStage(config, layer_range=range(1, 1 + num_layers), pre_process=False, post_process=False)
    apply_recompute(stage, RecomputeConfig(**recompute))
    store = WeightGradStore()
    bind_weight_grad_store(stage, store)
    stage.weight_grad_store = store
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    memory = ActivationMemory("saved-tensors", device="cpu", param_ptrs=params)
    key, kind = (0, 0), Kind.BW if fused else Kind.B
    store.on_submit.append(lambda work: memory.hold_work(key, work))
    store.on_recompute.append(memory.recomputed)
    x = torch.randn(config.seq_length, BATCH, config.hidden_size, requires_grad=True)
    memory.begin_iteration()
    y = stage(x)
    memory.hold_root(key, y)
    memory.after_action(Kind.F, key, memory.before_action(Kind.F, key))
    before = memory.before_action(kind, key)
    with contextlib.nullcontext() if fused else store.defer(*key):
        torch.autograd.backward([y], [torch.randn_like(y)])
    memory.after_action(kind, key, before)
    held = memory.resident(key) if not fused else 0.0
    return held, memory.transient.get((kind, 0), [0.0])[0]


@pytest.mark.parametrize("model", ["dropout", "no dropout", "swiglu rmsnorm qk-norm"])
def test_analytic_weight_grad_and_transient_bytes_match_the_measured(model: str) -> None:
    """What a layer holds for its W after B (the same under every choice), and what a recomputing B or BW of one
    layer holds above the sum before it (``RecomputeOption.transient``/``transient_bw``; 0 when it holds less):
    analytic against measured, within 5%."""
    config = _config(MODELS[model])
    tokens = config.seq_length * BATCH
    options = dict(
        zip(("selective", "full"), cost_model.recompute_options(config, micro_batch_size=BATCH, bytes_per_element=4))
    )
    held = cost_model.layer_weight_grad_bytes_per_token(config, 4) * tokens
    for choice, recompute in RECOMPUTE.items():
        one, _ = _backward_bytes(config, recompute, 1, fused=False)
        two, _ = _backward_bytes(config, recompute, 2, fused=False)
        assert abs(held - (two - one)) <= TOL * (two - one), (model, choice, held, two - one)
        if choice == "none":
            continue
        option = options[choice]
        for fused, predicted in ((False, option.transient), (True, option.transient_bw)):
            measured = _backward_bytes(config, recompute, 1, fused=fused)[1]
            error = abs(max(predicted, 0.0) - measured)
            assert error <= TOL * max(measured, 0.01 * held), (model, choice, fused, predicted, measured)
