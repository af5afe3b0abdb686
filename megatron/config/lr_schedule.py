"""Learning-rate schedule: linear warmup, then constant, linear, cosine or inverse-square-root decay to min-lr.

Megatron's two ways of counting (``megatron.optimizer.lr_scheduler`` runs both):

- iterations (``--train-iters``): ``--lr-warmup-iters``, ``--lr-decay-iters`` (default ``--train-iters``);
- samples (``--train-samples``, and any run with ``--rampup-batch-size``): the schedule advances by each step's
  global batch size; ``--lr-warmup-samples``, ``--lr-decay-samples`` (default ``--train-samples``).

``--lr-warmup-fraction F`` (either way) warms up over ``F`` x the decay span instead; ``--lr-warmup-init`` is the
rate the warmup starts from (Megatron's default 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(frozen=True)
class LRScheduleConfig:
    """``decay_iters=None`` / ``decay_samples=None`` mean decay over the whole run, as in Megatron.

    ``sample_based``: the schedule counts samples (``warmup_samples``/``decay_samples``), else iterations
    (``warmup_iters``/``decay_iters``).  ``warmup_fraction`` replaces the warmup count of either unit.
    """

    lr: float = 1e-4
    min_lr: float = 0.0
    decay_style: str = "linear"
    warmup_iters: int = 0
    decay_iters: int | None = None
    warmup_init: float = 0.0
    warmup_fraction: float | None = None
    sample_based: bool = False
    warmup_samples: int = 0
    decay_samples: int | None = None

    def __post_init__(self) -> None:
        require(self.lr > 0, f"--lr={self.lr} must be > 0")
        require(0 <= self.min_lr <= self.lr, f"--min-lr={self.min_lr} must be in [0, --lr={self.lr}]")
        require(
            self.decay_style in LR_DECAY_STYLES,
            f"--lr-decay-style={self.decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}",
        )
        require(self.warmup_iters >= 0, f"--lr-warmup-iters={self.warmup_iters} must be >= 0")
        require(self.warmup_samples >= 0, f"--lr-warmup-samples={self.warmup_samples} must be >= 0")
        require(0 <= self.warmup_init <= self.lr, f"--lr-warmup-init={self.warmup_init} must be in [0, --lr]")
        if self.warmup_fraction is not None:
            require(0 <= self.warmup_fraction < 1, f"--lr-warmup-fraction={self.warmup_fraction} must be in [0, 1)")
            other = "--lr-warmup-samples" if self.sample_based else "--lr-warmup-iters"
            count = self.warmup_samples if self.sample_based else self.warmup_iters
            require(count == 0, f"--lr-warmup-fraction and {other} are alternatives; pass one")
        if self.decay_iters is not None:
            require(
                self.decay_iters > self.warmup_iters,
                f"--lr-decay-iters={self.decay_iters} must be > --lr-warmup-iters={self.warmup_iters}",
            )
        if self.decay_samples is not None:
            require(
                self.decay_samples > self.warmup_samples,
                f"--lr-decay-samples={self.decay_samples} must be > --lr-warmup-samples={self.warmup_samples}",
            )

    def warmup_and_decay(self, total: int) -> tuple[float, int]:
        """(warmup, decay) spans in this schedule's unit, for a run of ``total`` units (iterations or samples)."""
        if self.sample_based:
            decay = self.decay_samples if self.decay_samples is not None else total
            warmup: float = self.warmup_samples
        else:
            decay = self.decay_iters if self.decay_iters is not None else total
            warmup = self.warmup_iters
        if self.warmup_fraction is not None:
            warmup = self.warmup_fraction * decay
        return warmup, decay
