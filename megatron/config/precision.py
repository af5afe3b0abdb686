"""Numeric precision of the model and the loss scaling that fp16 needs (Megatron's flags and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.config.errors import require


@dataclass(frozen=True)
class PrecisionConfig:
    """``--bf16`` / ``--fp16``: model parameters and activations in half precision, fp32 main params and grads.

    Loss scaling (fp16 only, as in Megatron): ``loss_scale`` set means a fixed scale; otherwise the scale is dynamic,
    starts at ``initial_loss_scale``, halves after ``hysteresis`` overflowing iterations (never below
    ``min_loss_scale``) and doubles after ``loss_scale_window`` clean iterations in a row.
    """

    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    check_for_nan_in_loss_and_grad: bool = False

    def __post_init__(self) -> None:
        require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive; pick one")
        if self.loss_scale is not None:
            require(self.loss_scale > 0, f"--loss-scale={self.loss_scale} must be > 0")
        require(self.initial_loss_scale > 0, f"--initial-loss-scale={self.initial_loss_scale} must be > 0")
        require(self.min_loss_scale > 0, f"--min-loss-scale={self.min_loss_scale} must be > 0")
        require(
            self.min_loss_scale <= self.initial_loss_scale,
            f"--min-loss-scale={self.min_loss_scale} must be <= --initial-loss-scale={self.initial_loss_scale}",
        )
        require(self.loss_scale_window >= 1, f"--loss-scale-window={self.loss_scale_window} must be >= 1")
        require(self.hysteresis >= 1, f"--hysteresis={self.hysteresis} must be >= 1")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.fp16 and self.loss_scale is None

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
