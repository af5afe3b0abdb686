"""The whole loop in one process: Megatron-format log lines, validation, --exit-interval, summaries, learning."""

import io
import re

import torch

from megatron.arguments import parse_run_config
from megatron.microbatches import microbatch_indices
from megatron.model.config import GPTConfig
from megatron.training import pretrain
from megatron.training_log import IterationStats, format_iteration_line, model_flops_per_iteration

# Megatron-LM's training_log line, field by field (what existing log parsers match).
MEGATRON_LINE = re.compile(
    r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \|"
    r" throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| learning rate: \d\.\d{6}E[+-]\d\d \|"
    r" global batch size: +(\d+) \| lm loss: (\d\.\d{6}E[+-]\d\d) \| loss scale: 1\.0 \| grad norm: [\d.]+ \|"
    r" number of skipped iterations: +0 \| number of nan iterations: +0 \|"
    r" tokens/s: [\d.]+ \| model TFLOP/s: [\d.]+ \|$"
)

ARGV = [
    "--model-config", "gpt-tiny", "--seq-length", "32", "--vocab-size", "128", "--mock-data",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "40", "--lr", "5e-3",
    "--lr-warmup-iters", "2", "--log-interval", "5", "--eval-interval", "10", "--eval-iters", "2",
    "--exit-interval", "30", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


def test_pretrain_logs_validates_exits_and_learns():
    torch.set_num_threads(1)
    out = io.StringIO()
    summary = pretrain(parse_run_config(ARGV), stream=out)
    text = out.getvalue()
    lines = [m for m in (MEGATRON_LINE.match(line) for line in text.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [5, 10, 15, 20, 25, 30]  # --exit-interval 30 stops the run
    assert all(int(m.group(2)) == 40 and int(m.group(4)) == 8 for m in lines)
    assert [int(m.group(3)) for m in lines] == [8 * int(m.group(1)) for m in lines]
    assert summary.iterations == 30 and len(summary.losses) == 30
    assert float(lines[-1].group(5)) < float(lines[0].group(5)) - 0.3, "mock data should be learnable"
    assert [it for it, _ in summary.validation_losses] == [10, 20, 30]
    assert text.count("validation loss at iteration") == 3 and "lm loss PPL:" in text
    assert "exiting program at iteration 30" in text
    for needle in (
        "layout: world=1, tp=1, pp=1, dp=1",
        "parameters on pipeline stage 0:",
        "num_layers",
        "final lm loss:",
    ):
        assert needle in text


def test_samples_follow_megatrons_sampler():
    run = parse_run_config([*ARGV, "--global-batch-size", "8"], world_size=2)  # dp 2, b 2 -> 2 microbatches
    assert run.num_microbatches == 2
    got = {(r, k): microbatch_indices(run, r, 16, k) for r in range(2) for k in range(2)}
    assert got == {(0, 0): [16, 17], (1, 0): [18, 19], (0, 1): [20, 21], (1, 1): [22, 23]}


def test_log_line_format_is_megatrons():
    stats = IterationStats(
        iteration=7, train_iters=100, consumed_samples=224, elapsed_s_per_iter=0.5, learning_rate=3e-4,
        global_batch_size=32, lm_loss=6.25, grad_norm=1.5, loss_scale=1.0, skipped_iterations=0, nan_iterations=0,
        tokens_per_s=1000.0, model_tflops=0.004, world_size=4,
    )  # fmt: skip
    line = format_iteration_line(stats)
    assert line.startswith(" iteration        7/     100 | consumed samples:          224 |")
    assert (
        "| learning rate: 3.000000E-04 | global batch size:    32 | lm loss: 6.250000E+00 | loss scale: 1.0 |" in line
    )
    assert MEGATRON_LINE.match(line)


def test_model_flops_count():
    # One layer, h=4, heads=1 (kv 4), ffn 16, s=2, V=8, batch 1: per token 2*4*12 + 2*2*2*4 + 2*4*4 + 2*4*16*2 + 2*4*8
    config = GPTConfig(
        num_layers=1, hidden_size=4, num_attention_heads=1, num_query_groups=1, kv_channels=4, ffn_hidden_size=16,
        swiglu=False, seq_length=2, vocab_size=8,
    )  # fmt: skip
    flops = model_flops_per_iteration(config, padded_vocab_size=8, global_batch_size=1)
    assert flops == 3 * 2 * (96 + 32 + 32 + 256 + 64)


def test_save_interval_without_save_is_accepted_with_a_warning():
    # Megatron accepts it (nothing is saved); issue 23 asked for the same, with one warning line
    run = parse_run_config([*ARGV, "--save-interval", "5"])
    assert run.checkpoint.save is None and any("--save-interval 5 without --save" in w for w in run.warnings)
