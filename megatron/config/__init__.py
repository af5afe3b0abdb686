"""Small per-component configs, each validating itself; ``megatron.arguments`` maps Megatron's flags onto them.

The model's own config is ``megatron.model.GPTConfig``; named sizes and YAML model files live in ``model_sizes``.
"""

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.errors import ConfigError, require
from megatron.config.logging_config import LoggingConfig
from megatron.config.lr_schedule import LRScheduleConfig
from megatron.config.model_sizes import MODEL_SIZES, load_model_config
from megatron.config.optimizer import OptimizerConfig
from megatron.config.parallel import ParallelConfig, split_layers
from megatron.config.training import TrainingConfig

__all__ = [
    "MODEL_SIZES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LRScheduleConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainingConfig",
    "load_model_config",
    "require",
    "split_layers",
]
