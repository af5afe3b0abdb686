"""The gradient-norm rule: the global norm and the inf/NaN flag, both from one float64 sum of squared gradients.

The synchronised optimizer and post-validation both settle a step with ``grad_stats``.  No separate inf/NaN count
travels with the sum: squares are never negative, so a sum of squares is inf or NaN exactly when some gradient entry
is (infs cannot cancel), and a sum of such sums over ranks keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradStats:
    """The global gradient norm (before clipping; NaN when ``found_nonfinite``) and whether any gradient held
    inf/NaN."""

    norm: float
    found_nonfinite: bool


def grad_stats(sum_squares: float | torch.Tensor) -> GradStats:
    """``GradStats`` from a (reduced) float64 sum of squared gradients; a tensor is read to the host here, once."""
    sq = float(sum_squares)
    if not math.isfinite(sq):
        return GradStats(norm=float("nan"), found_nonfinite=True)
    return GradStats(norm=sq**0.5, found_nonfinite=False)
