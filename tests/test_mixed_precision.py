"""bf16/fp16 with fp32 main params and grads: accuracy against fp32, Megatron's loss-scale semantics, inf/NaN skips.

Accuracy bound fixed before measuring: the mean loss over steps 40-50 of a bf16 or fp16 run is within 3% of the
fp32 run's (same seed, same data, dropout off). fp16 starts at --initial-loss-scale 4096 (Megatron's default 2**32
would spend the first ~20 iterations skipping overflows down to a usable scale).
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from megatron.arguments import parse_run_config
from megatron.config.errors import RunAbortedError
from megatron.config.precision import PrecisionConfig
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler
from megatron.parallel.context import ParallelContext
from megatron.training import pretrain
from megatron.training_setup import setup
from megatron.training_step import forward_backward, optimizer_step, train_step

ACCURACY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "64", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "50", "--lr", "5e-3", "--lr-warmup-iters", "2", "--eval-iters", "0", "--log-interval", "50",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "3",
]  # fmt: skip
SMALL = [*ACCURACY, "--train-iters", "6"]
REL_BOUND = 0.03


def _mean_40_50(extra: list[str]) -> float:
    torch.set_num_threads(1)
    losses = pretrain(parse_run_config([*ACCURACY, *extra]), stream=io.StringIO()).losses
    return sum(losses[39:50]) / 11


@pytest.fixture(scope="module")
def fp32_mean() -> float:
    return _mean_40_50([])


def test_bf16_within_3_percent_of_fp32(fp32_mean):
    assert abs(_mean_40_50(["--bf16"]) - fp32_mean) <= REL_BOUND * fp32_mean


@pytest.mark.slow
def test_fp16_within_3_percent_of_fp32(fp32_mean):
    assert abs(_mean_40_50(["--fp16", "--initial-loss-scale", "4096"]) - fp32_mean) <= REL_BOUND * fp32_mean


def test_dynamic_scaler_follows_megatron_counters():
    s = DynamicLossScaler(initial_scale=1024.0, min_scale=64.0, growth_interval=3, hysteresis=2)
    trace = []
    for overflow in [True, True, True, False, False, False, True, False, True, True, True, True, True]:
        s.update(overflow)
        trace.append((s.scale, s.growth_tracker, s.hysteresis_tracker))
    assert trace == [
        (1024.0, 0, 1),  # first overflow only spends the hysteresis budget
        (512.0, 0, 0),  # second halves
        (256.0, 0, -1),  # budget exhausted: every further overflow halves
        (256.0, 1, -1),
        (256.0, 2, -1),
        (512.0, 0, 2),  # a full window of clean steps doubles and restores the budget
        (512.0, 0, 1),
        (512.0, 1, 1),
        (256.0, 0, 0),
        (128.0, 0, -1),
        (64.0, 0, -2),
        (64.0, 0, -3),  # never below --min-loss-scale
        (64.0, 0, -4),
    ]
    restored = DynamicLossScaler(initial_scale=1.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_scaler_choice_and_defaults():
    run = parse_run_config([*SMALL, "--fp16"])
    assert (run.precision.initial_loss_scale, run.precision.min_loss_scale) == (2.0**32, 1.0)
    assert (run.precision.loss_scale_window, run.precision.hysteresis) == (1000, 2)
    assert isinstance(build_loss_scaler(run.precision), DynamicLossScaler)
    fixed = build_loss_scaler(PrecisionConfig(fp16=True, loss_scale=128.0))
    assert isinstance(fixed, ConstantLossScaler) and fixed.scale == 128.0
    assert build_loss_scaler(PrecisionConfig(bf16=True)).scale == 1.0


def _trainer(extra: list[str]):
    torch.set_num_threads(1)
    return setup(parse_run_config([*SMALL, *extra]), ParallelContext.single())


def _poisoned_step(tr):
    """One iteration whose gradients hold an inf (forced overflow), then the optimizer step."""
    forward_backward(tr)
    tr.optimizer.params[0].main_grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in tr.optimizer.params]
    lr_steps = tr.scheduler.num_steps
    [settled] = optimizer_step(tr)
    skipped = settled.skipped
    unchanged = all(torch.equal(a, p) for a, p in zip(before, tr.optimizer.params))
    tr.iteration += 1
    return skipped, unchanged, tr.scheduler.num_steps == lr_steps


def test_fp16_forced_overflow_skips_exactly_that_step_hysteresis_1():
    tr = _trainer(["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"])
    assert not train_step(tr).skipped
    assert tr.optimizer.loss_scale == 1024.0
    skipped, unchanged, lr_frozen = _poisoned_step(tr)
    assert skipped and unchanged and lr_frozen
    assert tr.optimizer.loss_scale == 512.0
    res = train_step(tr)
    assert not res.skipped and res.loss_scale == 512.0 and tr.optimizer.loss_scale == 512.0


def test_fp16_default_hysteresis_needs_two_overflows():
    tr = _trainer(["--fp16", "--initial-loss-scale", "1024"])
    assert _poisoned_step(tr)[0] and tr.optimizer.loss_scale == 1024.0
    assert _poisoned_step(tr)[0] and tr.optimizer.loss_scale == 512.0
    assert not train_step(tr).skipped and tr.optimizer.loss_scale == 512.0


def _nan_hook(tr):
    tr.model.final_layernorm.weight.register_hook(lambda g: torch.full_like(g, float("nan")))


def test_bf16_nan_grad_counts_a_nan_iteration():
    tr = _trainer(["--bf16"])
    _nan_hook(tr)
    before = [p.detach().clone() for p in tr.optimizer.params]
    res = train_step(tr)
    assert res.skipped and res.nan and tr.nan_iterations == 1 and tr.skipped_iterations == 1
    assert math.isnan(res.grad_stats.norm)
    assert all(torch.equal(a, p) for a, p in zip(before, tr.optimizer.params))


def test_check_for_nan_in_loss_and_grad_stops_the_run():
    tr = _trainer(["--bf16", "--check-for-nan-in-loss-and-grad"])
    _nan_hook(tr)
    with pytest.raises(RunAbortedError, match="inf/NaN in the gradients at iteration 1"):
        train_step(tr)


def test_main_params_are_fp32_and_model_is_half():
    tr = _trainer(["--bf16"])
    assert all(p.dtype == torch.bfloat16 for p in tr.model.parameters())
    assert all(s.main.dtype == torch.float32 and s.grad.dtype == torch.float32 for s in tr.optimizer.shards)
    train_step(tr)
    for s in tr.optimizer.shards:  # the model holds the rounded main parameters
        assert torch.equal(s.param, s.main.to(torch.bfloat16).view_as(s.param))
