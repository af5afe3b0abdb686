"""Where the run saves and from where it resumes, what it restores, and how it reacts to preemption."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron's checkpoint flags.

    ``no_load_optim``: restore the model only (optimizer, loss scaler and LR schedule start fresh);
    ``no_load_rng``: keep this run's seeded RNG streams; ``no_save_optim`` / ``no_save_rng``: checkpoints without
    the optimizer state / RNG states (a resume then starts the optimizer fresh / keeps the seeded streams);
    ``use_checkpoint_args``: the model flags come from ``--load``'s checkpoint (``megatron.checkpoint_args``);
    ``finetune``: load the model weights only and start at iteration 0 (implies both).
    ``exit_signal_handler``: on SIGTERM, save at the end of the current iteration, exit.
    """

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_signal_handler: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    use_checkpoint_args: bool = False

    def __post_init__(self) -> None:
        if self.save_interval is not None:
            require(self.save_interval >= 1, f"--save-interval={self.save_interval} must be >= 1")
            # without --save nothing is saved (Megatron accepts it too); megatron.arguments warns once
        require(
            not self.exit_signal_handler or self.save is not None,
            "--exit-signal-handler needs --save DIR (where to write the checkpoint on SIGTERM)",
        )
        require(
            not self.use_checkpoint_args or self.load is not None,
            "--use-checkpoint-args needs --load DIR (the checkpoint whose model flags to use)",
        )
