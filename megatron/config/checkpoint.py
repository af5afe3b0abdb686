"""Where and when the run saves and from where it resumes."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None

    def __post_init__(self) -> None:
        if self.save_interval is not None:
            require(self.save_interval >= 1, f"--save-interval={self.save_interval} must be >= 1")
            require(self.save is not None, "--save-interval needs --save DIR (where to write checkpoints)")
