"""The microbatches of one global batch: which samples, loading them, their loss, and the mean over data parallel.

Iteration ``it`` (1-based) uses global sample indices ``(it-1)*G .. it*G-1``; microbatch ``k`` of data-parallel rank
``r`` holds ``base + k*b*dp + r*b + j`` for ``j < b`` (Megatron's sampler), so dp = 2 and gradient accumulation over
the same global batch see the same samples and the same mean loss.  Shared by the pp = 1 loop
(``megatron.training_step``, ``megatron.evaluation``) and the pipeline (``megatron.pipeline.trainer_hooks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megatron.data.document_masks import model_inputs
from megatron.data.gpt_dataset import batch_dict
from megatron.data.mock_data import collate
from megatron.parallel.context import ParallelContext
from zb_pipeline import comm

if TYPE_CHECKING:
    from megatron.arguments import RunConfig


def microbatch_indices(run: RunConfig, dp_rank: int, base: int, k: int) -> list[int]:
    """Global sample indices of microbatch ``k`` of ``dp_rank`` in the global batch that starts at ``base``."""
    b = run.training.micro_batch_size
    start = base + k * b * run.dp_size + dp_rank * b
    return list(range(start, start + b))


def load_microbatch(dataset: Any, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The samples ``indices`` of ``dataset`` collated into one batch (``tokens``, ``labels``, ``loss_mask``).

    A dataset that serves raw token rows (``tokens_batch``: GPT, blended and mock data) is collated from them
    (three tensors per microbatch); any other (document masks, cyclic order) from its per-sample dicts.  Both give
    the same batch (tests/test_batch_loading.py)."""
    rows = getattr(dataset, "tokens_batch", None)
    if rows is not None:
        batch = batch_dict(rows(indices))
    else:
        batch = collate([dataset[i] for i in indices])
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def microbatch_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Masked mean of the per-token loss of one microbatch (a scalar)."""
    per_token = model(batch["tokens"], labels=batch["labels"], **model_inputs(batch))  # [b, s] fp32
    mask = batch["loss_mask"]
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def mean_over_dp(total: torch.Tensor, count: int, ctx: ParallelContext) -> float:
    """Average a sum of per-microbatch losses over every microbatch of every data-parallel rank (``count`` per
    rank); an all-reduce over the data-parallel group, in place on ``total``."""
    if ctx.dp_group is not None:
        comm.all_reduce(total, group=ctx.dp_group)
    return float(total) / (count * ctx.dp_size)
