"""Validation loss: forward only over ``--eval-iters`` global batches, continuing through the validation split.

Uses the same microbatches and loss as training (``megatron.microbatches``); with pp > 1 a forward-only plan runs
them through the pipeline stages (``megatron.pipeline.trainer_hooks.pipeline_evaluate``).
"""

from __future__ import annotations

import torch

from megatron.microbatches import load_microbatch, mean_over_dp, microbatch_indices, microbatch_loss
from megatron.pipeline.trainer_hooks import pipeline_evaluate
from megatron.trainer_state import Trainer


@torch.no_grad()
def evaluate(tr: Trainer) -> float:
    """Mean validation loss over ``--eval-iters`` global batches (continuing through the validation split)."""
    if tr.pipeline is not None:
        return pipeline_evaluate(tr)
    run, ctx = tr.run, tr.ctx
    m = run.num_microbatches
    tr.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for _ in range(run.training.eval_iters):
        base = tr.consumed_valid_samples
        for k in range(m):
            batch = load_microbatch(tr.valid_data, microbatch_indices(run, ctx.dp_rank, base, k), ctx.device)
            total += microbatch_loss(tr.model, batch).double()
        tr.consumed_valid_samples += run.global_batch_size
    tr.model.train()
    return mean_over_dp(total, m * run.training.eval_iters, ctx)
