"""Loop-level settings: batch sizes, iteration counts, evaluation and exit cadence, the seed."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import ConfigError, require


@dataclass(frozen=True)
class TrainingConfig:
    """What one run does. ``global_batch_size=None`` means micro-batch x data-parallel size (no accumulation)."""

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    train_iters: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: int | None = None
    seed: int = 1234
    manual_gc: bool = False  # megatron.garbage_collection
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    # --train-samples (then ``train_iters`` is derived from it) and --rampup-batch-size START INCR SAMPLES
    train_samples: int | None = None
    rampup_batch_size: tuple[int, int, int] | None = None
    exit_duration_in_mins: float | None = None  # stop (saving first) once this much wall time has passed

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 1, f"--micro-batch-size={self.micro_batch_size} must be >= 1")
        if self.global_batch_size is not None:
            require(self.global_batch_size >= 1, f"--global-batch-size={self.global_batch_size} must be >= 1")
        require(self.train_iters >= 1, f"--train-iters={self.train_iters} must be >= 1")
        require(self.eval_interval >= 1, f"--eval-interval={self.eval_interval} must be >= 1")
        require(self.eval_iters >= 0, f"--eval-iters={self.eval_iters} must be >= 0 (0 disables validation)")
        if self.exit_interval is not None:
            require(self.exit_interval >= 1, f"--exit-interval={self.exit_interval} must be >= 1")
        if self.exit_duration_in_mins is not None:
            require(self.exit_duration_in_mins > 0, f"--exit-duration-in-mins={self.exit_duration_in_mins} must be > 0")
        require(self.seed >= 0, f"--seed={self.seed} must be >= 0")
        require(
            self.manual_gc_interval >= 0,
            f"--manual-gc-interval={self.manual_gc_interval} must be >= 0 (0: no periodic full collection)",
        )
        if not self.manual_gc:
            require(
                self.manual_gc_interval == 0 and self.manual_gc_eval,
                "--manual-gc-interval and --no-manual-gc-eval only apply with --manual-gc; add --manual-gc",
            )

    def resolved_global_batch_size(self, dp_size: int) -> int:
        return self.global_batch_size if self.global_batch_size is not None else self.micro_batch_size * dp_size

    def num_microbatches(self, dp_size: int) -> int:
        """Microbatches each data-parallel rank runs per iteration (gradient accumulation steps)."""
        gbs = self.resolved_global_batch_size(dp_size)
        per_step = self.micro_batch_size * dp_size
        if gbs % per_step != 0:
            raise ConfigError(
                f"--global-batch-size={gbs} is not divisible by --micro-batch-size x data-parallel size = "
                f"{self.micro_batch_size} x {dp_size} = {per_step}; use a multiple of {per_step}"
            )
        return gbs // per_step
