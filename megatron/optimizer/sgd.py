"""SGD with momentum in fp32, reading the gradients from ``param.main_grad`` (``--optimizer sgd``).

Megatron's SGD is ``torch.optim.SGD(momentum=--sgd-momentum, weight_decay=--weight-decay)``: L2 weight decay added
to the gradient (not decoupled as in AdamW), no dampening, no Nesterov, and as for Adam no weight decay on biases
and norm weights.  The same operations in the same order as torch's single-tensor SGD, so the two agree exactly:

    d <- g + wd * p
    buf <- d  (first step)   or   buf <- momentum * buf + d
    p <- p - lr * buf

With ``--sgd-momentum 0`` there is no buffer and ``p <- p - lr * d``.  Multi-tensor: each line is one
``torch._foreach_*`` call per parameter group and device/dtype (``megatron.optimizer.tensor_lists``), elementwise
the same arithmetic.
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
            params, grads = [], []
            for p in group.params:
                g = grad_of(p)
                if g is not None:
                    params.append(p)
                    grads.append(g.float())
            for ps, gs in by_device_and_dtype(params, grads):
                ds = torch._foreach_add(gs, ps, alpha=group.weight_decay) if group.weight_decay != 0.0 else gs
                if momentum != 0.0:
                    ds = self._momentum(ps, ds, momentum)
                torch._foreach_add_(ps, ds, alpha=-lr)

    def _momentum(self, params: list[torch.Tensor], ds: list[torch.Tensor], momentum: float) -> list[torch.Tensor]:
        """``buf <- momentum * buf + d`` per parameter (a copy of ``d`` on its first step, as torch); the buffers."""
        bufs, old_bufs, old_ds = [], [], []
        for p, d in zip(params, ds):
            st = self.state.get(id(p))
            if st is None:  # torch starts the buffer as a copy of the first update
                self.state[id(p)] = st = {"momentum_buffer": d.clone()}
            else:
                old_bufs.append(st["momentum_buffer"])
                old_ds.append(d)
            bufs.append(st["momentum_buffer"])
        if old_bufs:
            torch._foreach_mul_(old_bufs, momentum)
            torch._foreach_add_(old_bufs, old_ds)
        return bufs
