"""AdamW (decoupled weight decay) in fp32, reading the gradients from ``param.main_grad`` (``--optimizer adam``).

Written out rather than wrapping ``torch.optim.AdamW`` because the gradients live in the data-parallel reducer's
fp32 main-gradient buffers (``param.main_grad``), not in ``param.grad``, and because the distributed optimizer
shards exactly this state. The update is torch's AdamW formula, so the two agree to rounding:

    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Parameters are updated in place (the fp32 main parameters, ``megatron.optimizer.main_params``).
"""

from __future__ import annotations

import math

import torch

from megatron.optimizer.grad_norm import grad_of
from megatron.optimizer.update_rule import UpdateRule


class AdamW(UpdateRule):
    """fp32 AdamW over ``named_params``; ``step(lr)`` applies one update from the current main gradients."""

    state_keys = ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW update with learning rate ``lr`` (parameters without a gradient are left alone)."""
        cfg = self.config
        self.step_count += 1
        t = self.step_count
        b1, b2 = cfg.adam_beta1, cfg.adam_beta2
        step_size = lr / (1.0 - b1**t)
        bc2_sqrt = math.sqrt(1.0 - b2**t)
        for group in self.param_groups:
            for p in group.params:
                g = grad_of(p)
                if g is None:
                    continue
                g = g.float()
                st = self.state_of(p)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if group.weight_decay != 0.0:
                    p.mul_(1.0 - lr * group.weight_decay)
                m.lerp_(g, 1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (v.sqrt() / bc2_sqrt).add_(cfg.adam_eps)
                p.addcdiv_(m, denom, value=-step_size)
