"""What the trainer prints: Megatron-format iteration and validation lines, start-up and final summaries.

The iteration line keeps Megatron-LM's field names, order and number formats so existing log parsers work::

     iteration       10/     100 | consumed samples:          320 | elapsed time per iteration (ms): 812.3 |
     throughput per GPU (TFLOP/s/GPU): 0.004 | learning rate: 2.999850E-04 | global batch size:    32 |
     lm loss: 6.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
     number of nan iterations:   0 | tokens/s: 5042.1 | model TFLOP/s: 0.016 |

(one line in the log). Only rank 0 prints. TensorBoard (``--tensorboard-dir``) and Weights & Biases
(``--wandb-project``) receive the same scalars when their packages are installed; otherwise a one-line notice says
they were skipped.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TextIO

from megatron.config.logging_config import LoggingConfig
from megatron.model.config import GPTConfig
from megatron.model.cost_model import head_forward_flops_per_token, layer_forward_flops_per_token


@dataclass(frozen=True)
class IterationStats:
    """Averages over the iterations since the previous log line (the loss over every microbatch and dp rank)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_s_per_iter: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float | None
    loss_scale: float
    skipped_iterations: int
    nan_iterations: int
    tokens_per_s: float
    model_tflops: float
    world_size: int
    post_validation: str | None = None  # "validated steps: N | rollbacks: ..." with --enable-optimizer-post-validation
    extra: tuple[tuple[str, str], ...] = ()  # more fields: --log-num-zeros-in-grad, --log-memory-to-tensorboard


def format_iteration_line(s: IterationStats) -> str:
    """One Megatron-format log line (leading space included, as Megatron prints it)."""
    per_gpu = s.model_tflops / max(s.world_size, 1)
    parts = [
        f" iteration {s.iteration:8d}/{s.train_iters:8d} |",
        f" consumed samples: {s.consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {s.elapsed_s_per_iter * 1000.0:.1f} |",
        f" throughput per GPU (TFLOP/s/GPU): {per_gpu:.3f} |",
        f" learning rate: {s.learning_rate:.6E} |",
        f" global batch size: {s.global_batch_size:5d} |",
        f" lm loss: {s.lm_loss:.6E} |",
        f" loss scale: {s.loss_scale:.1f} |",
    ]
    if s.grad_norm is not None:
        parts.append(f" grad norm: {s.grad_norm:.3f} |")
    parts += [f" {name}: {value} |" for name, value in s.extra]
    parts += [
        f" number of skipped iterations: {s.skipped_iterations:3d} |",
        f" number of nan iterations: {s.nan_iterations:3d} |",
        f" tokens/s: {s.tokens_per_s:.1f} |",
        f" model TFLOP/s: {s.model_tflops:.3f} |",
    ]
    if s.post_validation is not None:
        parts.append(f" {s.post_validation} |")
    return "".join(parts)


def format_validation_block(where: str, loss: float) -> str:
    """Megatron's validation report: the loss and its perplexity between two rules of dashes."""
    ppl = math.exp(min(20.0, loss))
    line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * len(line)
    return f"{rule}\n{line}\n{rule}"


def model_flops_per_iteration(config: GPTConfig, *, padded_vocab_size: int, global_batch_size: int) -> float:
    """Matmul FLOPs of one training iteration (forward + backward = 3x forward), counted as Megatron does.

    Per token and layer: QKV and output projections, the attention score and value products over the full
    sequence (no causal discount, as in Megatron), and the MLP (three matrices with SwiGLU); plus the logits.
    The formulas are ``megatron.model.cost_model``'s (the stage planner's too).
    """
    per_token = config.num_layers * layer_forward_flops_per_token(config)
    per_token += head_forward_flops_per_token(config, padded_vocab_size)
    return 3.0 * per_token * config.seq_length * global_batch_size


class TrainingLogger:
    """Rank-0 reporting: log lines, summaries, optional TensorBoard / W&B scalars."""

    def __init__(
        self,
        config: LoggingConfig,
        *,
        rank: int,
        stream: TextIO | None = None,
        run_name: str = "",
        scalar_sink: Any = None,
    ) -> None:
        self.config = config
        self.enabled = rank == 0
        self.stream = stream or sys.stdout
        self.start_time = time.time()
        self._tb: Any = None
        self._wandb: Any = None
        self._sink = scalar_sink  # anything with add_scalar(name, value, step) (TensorBoard's SummaryWriter's call)
        if not self.enabled:
            return
        if config.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=config.tensorboard_dir)
            except ImportError:
                self.print("notice: --tensorboard-dir given but tensorboard is not installed; skipping TensorBoard")
        if config.wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=config.wandb_project, name=config.wandb_exp_name or run_name or None)
            except ImportError:
                self.print("notice: --wandb-project given but wandb is not installed; skipping Weights & Biases")

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        if self._sink is not None:
            for key, value in values.items():
                self._sink.add_scalar(key, value, step)
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def iteration(self, stats: IterationStats) -> None:
        if self.enabled:
            self.print(format_iteration_line(stats))

    @property
    def has_scalar_sink(self) -> bool:
        """Whether a ``scalar_sink`` was passed (pass it on every rank: the loss it is sent is read collectively)."""
        return self._sink is not None

    def iteration_scalars(self, iteration: int, scalars: dict[str, float]) -> None:
        """TensorBoard / W&B scalars of one iteration (the loop calls it every ``--tensorboard-log-interval``)."""
        if self.enabled:
            self._scalars(iteration, scalars)

    def validation(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        self.print(format_validation_block(f"iteration {iteration}", loss))
        self._scalars(iteration, {"lm loss validation": loss, "lm loss validation ppl": math.exp(min(20.0, loss))})

    def startup_summary(
        self,
        *,
        layout: dict[str, Any],
        params_per_stage: Sequence[int],
        model_config: Any,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Print the layout, parameter counts per pipeline stage and the model config."""
        if not self.enabled:
            return
        lines = ["=" * 30 + " ZB-Megatron run " + "=" * 30]
        lines.append("layout: " + ", ".join(f"{k}={v}" for k, v in layout.items()))
        total = sum(params_per_stage)
        for stage, n in enumerate(params_per_stage):
            lines.append(f"parameters on pipeline stage {stage}: {n:,} (summed over its tensor-parallel ranks)")
        lines.append(f"parameters in total: {total:,}")
        lines.append("model config:")
        items = (
            [(f.name, getattr(model_config, f.name)) for f in fields(model_config)]
            if hasattr(model_config, "__dataclass_fields__")
            else sorted(vars(model_config).items())
        )
        for name, value in items:
            lines.append(f"  {name:.<40} {value}")
        for key, value in (extra or {}).items():
            lines.append(f"{key}: {value}")
        lines.append("=" * 77)
        self.print("\n".join(lines))

    def final_summary(self, *, iterations: int, final_loss: float, tokens_per_s: float, extra: dict[str, Any]) -> None:
        if not self.enabled:
            return
        wall = time.time() - self.start_time
        lines = ["=" * 30 + " run summary " + "=" * 34]
        lines.append(f"iterations: {iterations}")
        lines.append(f"final lm loss: {final_loss:.6E}")
        lines.append(f"tokens/s (whole run): {tokens_per_s:.1f}")
        lines.append(f"wall time (s): {wall:.1f}")
        for key, value in extra.items():
            lines.append(f"{key}: {value}")
        lines.append("=" * 77)
        self.print("\n".join(lines))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
