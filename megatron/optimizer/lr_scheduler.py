"""Megatron's learning-rate schedule: linear warmup from 0, then constant / linear / cosine / inverse-sqrt decay.

``learning_rate_at(n, ...)`` is the rate after ``n`` completed iterations, exactly Megatron's
``OptimizerParamScheduler.get_lr`` with ``init_lr = 0``: iteration 1 runs with ``n = 0`` (so with warmup the first
update has rate 0), warmup reaches ``lr`` at ``n = warmup_iters``, decay reaches ``min_lr`` at ``n = decay_iters`` and
stays there.
"""

from __future__ import annotations

import math

from megatron.config.lr_schedule import LRScheduleConfig


def learning_rate_at(num_steps: int, config: LRScheduleConfig, *, train_iters: int) -> float:
    """The learning rate used for the update after ``num_steps`` completed iterations."""
    max_lr, min_lr = config.lr, config.min_lr
    warmup = config.warmup_iters
    decay = config.decay_iters if config.decay_iters is not None else train_iters
    if warmup > 0 and num_steps <= warmup:
        return max_lr * num_steps / warmup
    style = config.decay_style
    if style == "constant":
        return max_lr
    if style == "inverse-square-root":
        w = max(warmup, 1)
        return max(min_lr, max_lr * math.sqrt(w) / math.sqrt(max(num_steps, 1)))
    if num_steps > decay:
        return min_lr
    if decay <= warmup:
        return min_lr
    ratio = (num_steps - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # the config validates the style; this guards direct construction with a bad value
        raise ValueError(f"unknown lr decay style {style!r}")
    return min_lr + coeff * (max_lr - min_lr)


class LRScheduler:
    """Holds the iteration count; ``current_lr`` is the rate of the next update, ``step()`` advances one iteration."""

    def __init__(self, config: LRScheduleConfig, *, train_iters: int, num_steps: int = 0) -> None:
        self.config = config
        self.train_iters = train_iters
        self.num_steps = num_steps

    @property
    def current_lr(self) -> float:
        return learning_rate_at(self.num_steps, self.config, train_iters=self.train_iters)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` iterations; returns the new current rate."""
        self.num_steps += increment
        return self.current_lr

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_steps = int(state["num_steps"])
