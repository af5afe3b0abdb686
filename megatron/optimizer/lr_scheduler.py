"""Megatron's learning-rate schedule: linear warmup from ``--lr-warmup-init``, then constant / linear / cosine /
inverse-sqrt decay.

``learning_rate_at(n, ...)`` is the rate after ``n`` completed steps, exactly Megatron's
``OptimizerParamScheduler.get_lr``: iteration 1 runs with ``n = 0`` (so with warmup the first update has rate
``--lr-warmup-init``), warmup reaches ``lr`` at ``n = warmup``, decay reaches ``min_lr`` at ``n = decay`` and stays
there.  A step is an iteration, or -- sample-based schedules (``--train-samples``, ``--rampup-batch-size``) -- a
sample: the scheduler then advances by each step's global batch size.
"""

from __future__ import annotations

import math

from megatron.config.lr_schedule import LRScheduleConfig


def learning_rate_at(num_steps: int, config: LRScheduleConfig, *, train_iters: int) -> float:
    """The learning rate used for the update after ``num_steps`` completed steps; ``train_iters`` is the run's
    length in the schedule's unit (iterations, or samples when ``config.sample_based``)."""
    max_lr, min_lr = config.lr, config.min_lr
    warmup, decay = config.warmup_and_decay(train_iters)
    if warmup > 0 and num_steps <= warmup:
        init = config.warmup_init
        return init + (max_lr - init) * num_steps / warmup
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
    """Holds the step count; ``current_lr`` is the rate of the next update, ``step(n)`` advances ``n`` steps (one
    iteration, or its global batch size for a sample-based schedule).  ``train_iters``: the run's length in steps."""

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
