"""Cross-entropy over logits split by vocabulary across the tensor-parallel group.

Rank r holds logits ``[..., V/tp]`` for vocabulary ids ``[r*V/tp, (r+1)*V/tp)``.  The loss needs the global
max (for stability), the global sum of exponentials and the target's logit, which lives on one rank: three
all-reduces over ``[...]``-sized tensors, never the ``[..., V]`` logits.

Padding: the vocabulary is padded (``--make-vocab-size-divisible-by`` x tp) and the padded size depends on tp.
Passing the true ``vocab_size`` masks the padded columns out of the softmax, so the loss, and therefore the model,
do not depend on the tensor-parallel layout.

A fused kernel (``megatron.kernels.cross_entropy``, chosen by ``megatron.kernels.select``) is passed in as ``kernel``;
it combines its per-rank statistics with ``combine_softmax_stats``, so the collectives stay in this module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.parallel.tensor_parallel.mappings import HasTensorParallel
from zb_pipeline import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size):  # logits: [..., V/tp], target: [...] int64
        local_v = logits.shape[-1]
        start = tp.tp_rank * local_v
        ctx.logits_dtype = logits.dtype
        logits = logits.to(torch.float32, copy=True)  # our own fp32 copy, modified in place below
        if vocab_size is not None and start + local_v > vocab_size:
            logits[..., max(vocab_size - start, 0) :] = float("-inf")
        reduce = tp.tp_size > 1

        logits_max = logits.amax(dim=-1)  # [...]
        if reduce:
            comm.all_reduce(logits_max, op="max", group=tp.tp_group)
        logits.sub_(logits_max.unsqueeze(-1))  # in place: logits is our own fp32 copy

        outside = (target < start) | (target >= start + local_v)  # [...]
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        if reduce:
            comm.all_reduce(target_logit, group=tp.tp_group)

        exp = logits.exp_()  # [..., V/tp]
        sum_exp = exp.sum(dim=-1)  # [...]
        if reduce:
            comm.all_reduce(sum_exp, group=tp.tp_group)
        loss = sum_exp.log() - target_logit  # [...]

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss: [...]
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # reuse: the saved softmax is not needed after this
        hit = (~outside).to(grad.dtype).unsqueeze(-1)  # [..., 1]
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def combine_softmax_stats(
    local_max: torch.Tensor, local_sum_exp: torch.Tensor, target_logit: torch.Tensor, tp: HasTensorParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-sum-exp, target logit)`` over the whole vocabulary from each rank's ``[...]`` statistics of its slice:
    its maximum, its sum of ``exp(logit - local_max)`` and the target's logit (0 where another rank holds it).
    Three all-reduces over tp, as in the unfused path; the arguments are consumed (reduced in place)."""
    if tp.tp_size > 1:
        global_max = local_max.clone()
        comm.all_reduce(global_max, op="max", group=tp.tp_group)
        local_sum_exp.mul_(torch.exp(local_max - global_max))  # a slice of padding only: max -inf, sum 0
        comm.all_reduce(local_sum_exp, group=tp.tp_group)
        comm.all_reduce(target_logit, group=tp.tp_group)
    else:
        global_max = local_max
    return local_sum_exp.log() + global_max, target_logit


CrossEntropyKernel = Callable[[torch.Tensor, torch.Tensor, HasTensorParallel, "int | None"], torch.Tensor]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: HasTensorParallel,
    *,
    vocab_size: int | None = None,
    kernel: CrossEntropyKernel | None = None,
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from vocabulary-split logits ``[..., V/tp]`` and global target ids ``[...]``.

    ``vocab_size`` (the unpadded size) masks padded vocabulary columns out of the softmax.  ``kernel``: a fused
    implementation of the same function (``kernel(logits, target, tp, vocab_size)``) instead of the torch one.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on leading dims")
    if kernel is not None:
        return kernel(logits, target, tp, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size)
