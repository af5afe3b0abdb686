"""fp32 update rules (AdamW, SGD; ``--optimizer``) over main gradients and main parameters, loss scaling, the
learning-rate schedule, global clipping and the distributed (ZeRO-1) optimizer."""

from megatron.optimizer.adamw import AdamW
from megatron.optimizer.distributed import DistributedOptimizer
from megatron.optimizer.grad_norm import GradStats, clip_grads, grad_of, local_grad_stats, reduce_grad_stats
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler
from megatron.optimizer.lr_scheduler import LRScheduler, learning_rate_at
from megatron.optimizer.main_params import MainParamOptimizer, MainShard, StepOutcome, assemble_pieces
from megatron.optimizer.registry import UPDATE_RULES, build_update_rule, optimizer_names
from megatron.optimizer.sgd import SGD
from megatron.optimizer.update_rule import UpdateRule, default_no_weight_decay

__all__ = [
    "AdamW",
    "ConstantLossScaler",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "GradStats",
    "LRScheduler",
    "MainParamOptimizer",
    "MainShard",
    "SGD",
    "StepOutcome",
    "UPDATE_RULES",
    "UpdateRule",
    "assemble_pieces",
    "build_loss_scaler",
    "build_update_rule",
    "clip_grads",
    "default_no_weight_decay",
    "grad_of",
    "learning_rate_at",
    "local_grad_stats",
    "optimizer_names",
    "reduce_grad_stats",
]
