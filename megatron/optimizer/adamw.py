"""AdamW (decoupled weight decay) in fp32, reading the gradients from ``param.main_grad`` (``--optimizer adam``).

Written out rather than wrapping ``torch.optim.AdamW`` because the gradients live in the data-parallel reducer's
fp32 main-gradient buffers (``param.main_grad``), not in ``param.grad``, and because the distributed optimizer
shards exactly this state. The update is torch's AdamW formula, so the two agree to rounding:

    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Multi-tensor: each line is one ``torch._foreach_*`` call per parameter group and device/dtype
(``megatron.optimizer.tensor_lists``), the operations of the per-tensor loop in the same order, so every element
sees the same arithmetic (bit-identical on the CPU; tests/test_optimizer_multi_tensor.py keeps the loop as the
reference).  Parameters are updated in place (the fp32 main parameters, ``megatron.optimizer.main_params``).
"""

from __future__ import annotations

import math

import torch

from megatron.optimizer.grad_norm import grad_of
from megatron.optimizer.tensor_lists import by_device_and_dtype, mul_
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
            params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
            for p in group.params:
                g = grad_of(p)
                if g is None:
                    continue
                st = self.state_of(p)
                params.append(p)
                grads.append(g.float())
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
            for ps, gs, ms, vs in by_device_and_dtype(params, grads, exp_avgs, exp_avg_sqs):
                if group.weight_decay != 0.0:
                    mul_(ps, 1.0 - lr * group.weight_decay)
                torch._foreach_lerp_(ms, gs, 1.0 - b1)
                torch._foreach_mul_(vs, b2)
                torch._foreach_addcmul_(vs, gs, gs, value=1.0 - b2)
                denoms = torch._foreach_sqrt(vs)
                torch._foreach_div_(denoms, bc2_sqrt)
                torch._foreach_add_(denoms, cfg.adam_eps)
                torch._foreach_addcdiv_(ps, ms, denoms, value=-step_size)
