"""What the trainer-level tests share: the profiling window's flags and the rank body that runs ``pretrain``."""

from __future__ import annotations

# Profile iterations 1 and 2 (re-plan, re-split after iteration 2): the window the trainer-level tests use.
WINDOW = ["--zero-bubble-pipeline-timers-start-iter", "1", "--zero-bubble-pipeline-timers-end-iter", "3"]


def pretrain_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    """One rank of ``pretrain`` over ``argv`` (for ``run_multiprocess``): its losses, validation losses and log."""
    import io

    import torch

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    stream = io.StringIO()
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=stream)
    return {
        "losses": list(summary.losses),
        "valid": [v for _, v in summary.validation_losses],
        "log": stream.getvalue(),
    }
