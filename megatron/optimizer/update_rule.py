"""``UpdateRule``: what every optimizer algorithm (AdamW, SGD) shares -- parameter groups, per-parameter state,
step count, gradient zeroing and a state dict keyed by parameter name.

An update rule reads each parameter's gradient from ``param.main_grad`` (``grad_of``) and updates the parameter in
place in fp32.  ``MainParamOptimizer`` runs it over the fp32 main parameters (whole, or this rank's shards with the
distributed optimizer); everything it does per step is elementwise, so sharding does not change the result.

Its state is ``state[id(param)] = {key: fp32 tensor shaped like param}`` with the keys ``state_keys``: that is all
that post-validation's snapshot/restore copies and checkpoints store, so a new rule needs no change there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megatron.config.optimizer import OptimizerConfig
from megatron.optimizer.tensor_lists import by_device_and_dtype


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: no weight decay on biases and on 1-D parameters (norm weights)."""
    return name.endswith(".bias") or param.dim() == 1


@dataclass
class ParamGroup:
    params: list[torch.nn.Parameter]
    weight_decay: float
    names: list[str] = field(default_factory=list)


class UpdateRule:
    """Base class: groups ``named_params`` into decayed and not-decayed; subclasses implement ``step(lr)``."""

    state_keys: tuple[str, ...] = ()  # the per-parameter state tensors, in checkpoint order

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

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def state_of(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """``p``'s state, created as fp32 zeros on first use."""
        st = self.state.get(id(p))
        if st is None:
            st = {k: torch.zeros_like(p, dtype=torch.float32) for k in self.state_keys}
            self.state[id(p)] = st
        return st

    def zero_grad(self) -> None:
        """Zero the gradients the optimizer reads (main_grad buffers in place, or drop ``.grad``)."""
        mains = []
        for p in self.params:
            main = getattr(p, "main_grad", None)
            if main is not None:
                mains.append(main)
            p.grad = None
        for (group,) in by_device_and_dtype(mains):
            torch._foreach_zero_(group)

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
