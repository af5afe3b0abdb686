"""``Trainer``: the mutable state of one training run on one rank.

Built by ``megatron.training_setup.setup``; read and advanced by the step (``megatron.training_step``), the
evaluation (``megatron.evaluation``), checkpoints (``megatron.checkpointing``), the loop (``megatron.training``)
and, with pp > 1, the pipeline hooks (``megatron.pipeline.trainer_hooks``).  It lives in a module of its own so
that all of them can name it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.arguments import RunConfig
from megatron.model.config import GPTConfig
from megatron.optimizer import LRScheduler, MainParamOptimizer
from megatron.parallel.context import ParallelContext
from megatron.parallel.data_parallel import DataParallelReducer
from megatron.pipeline.post_validated_step import SettledStep


@dataclass
class Trainer:
    """Mutable state of one run on one rank."""

    run: RunConfig
    ctx: ParallelContext
    model_config: GPTConfig
    model: torch.nn.Module
    reducer: DataParallelReducer
    optimizer: MainParamOptimizer
    scheduler: LRScheduler
    train_data: Any
    valid_data: Any | None
    iteration: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    losses: list[float] = field(default_factory=list)
    # training_step.StepResult of the iterations whose loss is not read back yet (training_step.settle_losses)
    pending_results: list[Any] = field(default_factory=list)
    pipeline: Any = None  # megatron.pipeline.GPTPipeline when pp > 1 (then ``model`` is this rank's stages)
    replanner: Any = None  # the plan re-planned from profiled costs (megatron.pipeline.trainer_hooks.attach_replanner)
    # --enable-optimizer-post-validation with pp > 1 (megatron.pipeline.post_validated_step.PostValidatedStep)
    post_validation: Any = None
    # Called with (trainer, SettledStep) once a step's outcome is final, in iteration order (tests record state).
    step_listeners: list[Callable[[Trainer, SettledStep], None]] = field(default_factory=list)
    train_loader: Any = None  # megatron.data.loader.MicrobatchLoader, built on the first iteration

    @property
    def consumed_train_samples(self) -> int:
        return self.run.batches.consumed_before(self.iteration)
