"""Loss scaling for fp16: a fixed scale, or Megatron's dynamic scale with hysteresis.

Dynamic scaling, exactly Megatron's ``DynamicGradScaler``::

    on an overflowing iteration (inf/NaN in the gradients, the step is skipped):
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0: scale = max(scale * backoff_factor, min_scale)
    on a clean iteration:
        growth_tracker += 1
        if growth_tracker == window: growth_tracker = 0; hysteresis_tracker = hysteresis; scale *= growth_factor

So with the default ``--hysteresis 2`` the first overflow after a reset only spends the hysteresis budget, and every
overflow after that halves the scale until ``window`` clean iterations in a row double it and restore the budget.
bf16 and fp32 runs use ``ConstantLossScaler(1.0)``: scaling by 1 changes nothing.
"""

from __future__ import annotations

from megatron.config.precision import PrecisionConfig


class ConstantLossScaler:
    """A fixed scale (``--loss-scale``, or 1 for bf16/fp32)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, found_nonfinite: bool) -> None:
        """A fixed scale does not react to overflow."""

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Megatron's dynamic loss scale (see the module docstring)."""

    dynamic = True

    def __init__(
        self,
        *,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        if not (initial_scale > 0 and min_scale > 0 and growth_interval >= 1 and hysteresis >= 1):
            raise ValueError(f"bad dynamic loss scale settings {initial_scale=} {min_scale=} {growth_interval=}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


LossScaler = ConstantLossScaler | DynamicLossScaler


def build_loss_scaler(config: PrecisionConfig) -> LossScaler:
    """Dynamic scaling for fp16 without ``--loss-scale``; a fixed scale otherwise (1 for bf16/fp32)."""
    if config.fp16 and config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    if config.dynamic_loss_scale:
        return DynamicLossScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return ConstantLossScaler(1.0)
