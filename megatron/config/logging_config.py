"""What the run reports and where: log-line cadence, TensorBoard, Weights & Biases."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    tensorboard_log_interval: int = 1  # iterations between TensorBoard / W&B scalars
    log_num_zeros_in_grad: bool = False  # "num zeros" field in the log line (and scalar)
    log_memory_to_tensorboard: bool = False  # memory fields in the log line (and scalars)

    def __post_init__(self) -> None:
        require(self.log_interval >= 1, f"--log-interval={self.log_interval} must be >= 1")
        require(
            self.tensorboard_log_interval >= 1,
            f"--tensorboard-log-interval={self.tensorboard_log_interval} must be >= 1",
        )
