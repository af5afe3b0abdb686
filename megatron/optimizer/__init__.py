"""fp32 AdamW over main gradients, the learning-rate schedule and global grad-norm clipping."""

from megatron.optimizer.adamw import AdamW, default_no_weight_decay
from megatron.optimizer.grad_norm import GradStats, clip_grads, grad_of, local_grad_stats, reduce_grad_stats
from megatron.optimizer.lr_scheduler import LRScheduler, learning_rate_at

__all__ = [
    "AdamW",
    "GradStats",
    "LRScheduler",
    "clip_grads",
    "default_no_weight_decay",
    "grad_of",
    "learning_rate_at",
    "local_grad_stats",
    "reduce_grad_stats",
]
