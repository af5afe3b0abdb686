"""``--optimizer``: the update rules by name, and the one place that turns a name into one.

Adding an optimizer is one ``UpdateRule`` subclass (its ``step`` and ``state_keys``) and one entry here; the flag's
choices, the mixed-precision/main-parameter path, the distributed optimizer, post-validation's snapshot/restore
and checkpoints all work from the rule's state dictionary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megatron.config.errors import ConfigError
from megatron.config.optimizer import OptimizerConfig
from megatron.optimizer.adamw import AdamW
from megatron.optimizer.sgd import SGD
from megatron.optimizer.update_rule import UpdateRule, default_no_weight_decay

UpdateRuleFactory = Callable[..., UpdateRule]  # (named_params, config, *, no_weight_decay) -> UpdateRule

UPDATE_RULES: dict[str, UpdateRuleFactory] = {
    "adam": AdamW,  # Megatron's default: Adam with decoupled weight decay (AdamW)
    "sgd": SGD,
}


def optimizer_names() -> tuple[str, ...]:
    """The values ``--optimizer`` accepts, default first."""
    return tuple(UPDATE_RULES)


def build_update_rule(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    config: OptimizerConfig,
    *,
    no_weight_decay: Callable[[str, torch.nn.Parameter], bool] = default_no_weight_decay,
) -> UpdateRule:
    """The update rule ``config.optimizer`` names, over ``named_params``."""
    factory = UPDATE_RULES.get(config.optimizer)
    if factory is None:
        raise ConfigError(f"--optimizer {config.optimizer!r} is not one of {', '.join(UPDATE_RULES)}")
    return factory(named_params, config, no_weight_decay=no_weight_decay)
