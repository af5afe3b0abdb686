"""AdamW (decoupled weight decay) in fp32, reading the gradients from ``param.main_grad``.

Written out rather than wrapping ``torch.optim.AdamW`` because the gradients live in the data-parallel reducer's
fp32 main-gradient buffers (``param.main_grad``), not in ``param.grad``, and because the distributed optimizer (a
later issue) shards exactly this state. The update is torch's AdamW formula, so the two agree to rounding:

    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Parameters are updated in place; they are fp32 here (mixed precision with separate fp32 main parameters comes with
the mixed-precision issue).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megatron.config.optimizer import OptimizerConfig
from megatron.optimizer.grad_norm import grad_of


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: no weight decay on biases and on 1-D parameters (norm weights)."""
    return name.endswith(".bias") or param.dim() == 1


@dataclass
class ParamGroup:
    params: list[torch.nn.Parameter]
    weight_decay: float
    names: list[str] = field(default_factory=list)


class AdamW:
    """fp32 AdamW over ``named_params``; ``step(lr)`` applies one update from the current main gradients."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        config: OptimizerConfig,
        *,
        no_weight_decay: Callable[[str, torch.nn.Parameter], bool] = default_no_weight_decay,
    ) -> None:
        self.config = config
        decay = ParamGroup([], config.weight_decay)
        plain = ParamGroup([], 0.0)
        seen: set[int] = set()
        for name, p in named_params:
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            group = plain if no_weight_decay(name, p) else decay
            group.params.append(p)
            group.names.append(name)
        self.param_groups = [g for g in (decay, plain) if g.params]
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        self.step_count = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g.params]

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
                st = self.state.get(id(p))
                if st is None:
                    st = {
                        "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                        "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
                    }
                    self.state[id(p)] = st
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if group.weight_decay != 0.0:
                    p.mul_(1.0 - lr * group.weight_decay)
                m.lerp_(g, 1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (v.sqrt() / bc2_sqrt).add_(cfg.adam_eps)
                p.addcdiv_(m, denom, value=-step_size)

    def zero_grad(self) -> None:
        """Zero the gradients the optimizer reads (main_grad buffers in place, or drop ``.grad``)."""
        for p in self.params:
            main = getattr(p, "main_grad", None)
            if main is not None:
                main.zero_()
            p.grad = None

    def state_dict(self) -> dict[str, object]:
        """Optimizer state keyed by parameter name (tensors and plain data only)."""
        states: dict[str, dict[str, torch.Tensor]] = {}
        for group in self.param_groups:
            for name, p in zip(group.names, group.params):
                if id(p) in self.state:
                    states[name] = {k: v.clone() for k, v in self.state[id(p)].items()}
        return {"step": self.step_count, "state": states}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step_count = int(state["step"])  # type: ignore[arg-type]
        saved: dict[str, dict[str, torch.Tensor]] = state["state"]  # type: ignore[assignment]
        for group in self.param_groups:
            for name, p in zip(group.names, group.params):
                if name in saved:
                    self.state[id(p)] = {k: v.clone().to(p.device) for k, v in saved[name].items()}
