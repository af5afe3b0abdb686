"""Learning-rate schedule: linear warmup, then constant, linear, cosine or inverse-square-root decay to min-lr."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(frozen=True)
class LRScheduleConfig:
    """``decay_iters=None`` means decay over the whole run (``--train-iters``), as in Megatron."""

    lr: float = 1e-4
    min_lr: float = 0.0
    decay_style: str = "linear"
    warmup_iters: int = 0
    decay_iters: int | None = None

    def __post_init__(self) -> None:
        require(self.lr > 0, f"--lr={self.lr} must be > 0")
        require(0 <= self.min_lr <= self.lr, f"--min-lr={self.min_lr} must be in [0, --lr={self.lr}]")
        require(
            self.decay_style in LR_DECAY_STYLES,
            f"--lr-decay-style={self.decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}",
        )
        require(self.warmup_iters >= 0, f"--lr-warmup-iters={self.warmup_iters} must be >= 0")
        if self.decay_iters is not None:
            require(
                self.decay_iters > self.warmup_iters,
                f"--lr-decay-iters={self.decay_iters} must be > --lr-warmup-iters={self.warmup_iters}",
            )
