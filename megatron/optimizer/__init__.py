"""fp32 AdamW over main gradients and main parameters, loss scaling, the learning-rate schedule, global clipping and
the distributed (ZeRO-1) optimizer."""

from megatron.optimizer.adamw import AdamW, default_no_weight_decay
from megatron.optimizer.distributed import DistributedOptimizer
from megatron.optimizer.grad_norm import GradStats, clip_grads, grad_of, local_grad_stats, reduce_grad_stats
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler
from megatron.optimizer.lr_scheduler import LRScheduler, learning_rate_at
from megatron.optimizer.main_params import MainParamOptimizer, MainShard, StepOutcome, assemble_pieces

__all__ = [
    "AdamW",
    "ConstantLossScaler",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "GradStats",
    "LRScheduler",
    "MainParamOptimizer",
    "MainShard",
    "StepOutcome",
    "assemble_pieces",
    "build_loss_scaler",
    "clip_grads",
    "default_no_weight_decay",
    "grad_of",
    "learning_rate_at",
    "local_grad_stats",
    "reduce_grad_stats",
]
