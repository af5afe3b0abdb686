"""SGD with momentum in fp32, reading the gradients from ``param.main_grad`` (``--optimizer sgd``).

Megatron's SGD is ``torch.optim.SGD(momentum=--sgd-momentum, weight_decay=--weight-decay)``: L2 weight decay added
to the gradient (not decoupled as in AdamW), no dampening, no Nesterov, and as for Adam no weight decay on biases
and norm weights.  The same operations in the same order as torch's single-tensor SGD, so the two agree exactly:

    d <- g + wd * p
    buf <- d  (first step)   or   buf <- momentum * buf + d
    p <- p - lr * buf

With ``--sgd-momentum 0`` there is no buffer and ``p <- p - lr * d``.
"""

from __future__ import annotations

import torch

from megatron.optimizer.grad_norm import grad_of
from megatron.optimizer.update_rule import UpdateRule


class SGD(UpdateRule):
    """fp32 SGD with momentum over ``named_params``; ``step(lr)`` applies one update from the main gradients."""

    state_keys = ("momentum_buffer",)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One SGD update with learning rate ``lr`` (parameters without a gradient are left alone)."""
        momentum = self.config.sgd_momentum
        self.step_count += 1
        for group in self.param_groups:
            for p in group.params:
                g = grad_of(p)
                if g is None:
                    continue
                d = g.float()
                if group.weight_decay != 0.0:
                    d = d.add(p, alpha=group.weight_decay)
                if momentum != 0.0:
                    st = self.state.get(id(p))
                    if st is None:  # torch starts the buffer as a copy of the first update
                        self.state[id(p)] = st = {"momentum_buffer": d.clone()}
                    else:
                        st["momentum_buffer"].mul_(momentum).add_(d)
                    d = st["momentum_buffer"]
                p.add_(d, alpha=-lr)
