"""SGD with momentum in fp32, reading the gradients from ``param.main_grad`` (``--optimizer sgd``).

Megatron's SGD is ``torch.optim.SGD(momentum=--sgd-momentum, weight_decay=--weight-decay)``: L2 weight decay added
to the gradient (not decoupled as in AdamW), no dampening, no Nesterov, and as for Adam no weight decay on biases
and norm weights.  The same operations in the same order as torch's single-tensor SGD, so the two agree exactly:

    d <- g + wd * p
    buf <- d  (first step)   or   buf <- momentum * buf + d
    p <- p - lr * buf

With ``--sgd-momentum 0`` there is no buffer and ``p <- p - lr * d``.  Multi-tensor: after a parameter's first
step each line is one ``torch._foreach_*`` call per parameter group and device/dtype
(``megatron.optimizer.tensor_lists``), elementwise the same arithmetic.
"""

from __future__ import annotations

import torch

from megatron.optimizer.grad_norm import grad_of
from megatron.optimizer.tensor_lists import by_device_and_dtype
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
            wd = group.weight_decay
            params, grads, bufs = [], [], []
            for p in group.params:
                g = grad_of(p)
                if g is None:
                    continue
                d = g.float()
                st = self.state.get(id(p))
                if momentum != 0.0 and st is None:  # torch starts the buffer as a copy of the first update
                    buf = d.add(p, alpha=wd) if wd != 0.0 else d.clone()  # a new tensor either way
                    self.state[id(p)] = {"momentum_buffer": buf}
                    p.add_(buf, alpha=-lr)
                    continue
                params.append(p)
                grads.append(d)
                if momentum != 0.0:
                    bufs.append(st["momentum_buffer"])  # type: ignore[index]
            if momentum == 0.0:
                for ps, gs in by_device_and_dtype(params, grads):
                    torch._foreach_add_(ps, torch._foreach_add(gs, ps, alpha=wd) if wd != 0.0 else gs, alpha=-lr)
                continue
            for ps, gs, bs in by_device_and_dtype(params, grads, bufs):
                torch._foreach_mul_(bs, momentum)
                torch._foreach_add_(bs, torch._foreach_add(gs, ps, alpha=wd) if wd != 0.0 else gs)
                torch._foreach_add_(ps, bs, alpha=-lr)
