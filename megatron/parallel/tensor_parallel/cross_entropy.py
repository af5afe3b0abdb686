"""Cross-entropy over logits split by vocabulary across the tensor-parallel group.

Rank r holds logits ``[..., V/tp]`` for vocabulary ids ``[r*V/tp, (r+1)*V/tp)``.  The loss needs the global
max (for stability), the global sum of exponentials and the target's logit, which lives on one rank: three
all-reduces over ``[...]``-sized tensors, never the ``[..., V]`` logits.

Padding: the vocabulary is padded (``--make-vocab-size-divisible-by`` x tp) and the padded size depends on tp.
Passing the true ``vocab_size`` masks the padded columns out of the softmax, so the loss, and therefore the model,
do not depend on the tensor-parallel layout.
"""

from __future__ import annotations

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


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp: HasTensorParallel, *, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from vocabulary-split logits ``[..., V/tp]`` and global target ids ``[...]``.

    ``vocab_size`` (the unpadded size) masks padded vocabulary columns out of the softmax.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on leading dims")
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size)
