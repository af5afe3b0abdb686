"""Vocabulary-parallel cross-entropy that never holds a full-vocabulary fp32 softmax.

Rank r holds logits ``[N, V/tp]`` (any dtype) for vocabulary ids ``[r*V/tp, (r+1)*V/tp)``.  Forward reads them once,
``BLOCK_V`` columns at a time, keeping per row an online maximum ``m``, the sum of exponentials ``s`` relative to it,
and the target's logit ``t`` if this rank holds the target (0 otherwise):

    m' = max(m, max(chunk)),  s' = s * exp(m - m') + sum(exp(chunk - m'))

The ranks combine their ``(m, s, t)`` with three all-reduces of ``[N]`` tensors
(``megatron.parallel.tensor_parallel.cross_entropy.combine_softmax_stats``, the same collectives as the torch path),
giving ``lse = log(sum_v exp(logit_v))`` and ``loss = lse - logit_target``.  Backward writes, chunk by chunk,

    d logits[n, v] = (exp(logit[n, v] - lse[n]) - [v == target[n]]) * d loss[n]

straight into a gradient in the logits' dtype.  What is saved is the logits themselves (in their own dtype) and two
``[N]`` vectors: the torch path saves an fp32 softmax ``[N, V/tp]`` (twice the bytes of bf16 logits) and builds it
from an fp32 copy of the logits.  Padded vocabulary columns (ids >= ``vocab_size``) take no part (probability 0).

``reference_cross_entropy`` is the torch definition the tests hold the kernel to (single rank, unpadded).
"""

# ruff: noqa: N803  (Triton convention: compile-time tl.constexpr arguments and sizes in capitals)

import torch  # no ``from __future__ import annotations``: Triton 3.1's interpreter needs real tl.constexpr annotations
import torch.nn.functional as F

from megatron.kernels.triton_runtime import block_size, import_triton, interpreting
from megatron.parallel.tensor_parallel.cross_entropy import combine_softmax_stats
from megatron.parallel.tensor_parallel.mappings import HasTensorParallel

triton, tl = import_triton()


def reference_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-row loss ``[N]`` (fp32) of ``logits [N, V]`` against ``target [N]``."""
    return F.cross_entropy(logits.float(), target, reduction="none")


@triton.jit
def softmax_stats_kernel(
    logits_ptr,
    target_ptr,
    max_ptr,
    sum_ptr,
    tlogit_ptr,
    N,
    V,
    valid,
    stride_n,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per row: the maximum and the sum of exponentials (relative to it) over the first ``valid`` of this rank's
    ``V`` columns, and the logit at the local ``target`` column (-1: not on this rank)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((ROWS,), dtype=tl.float32)
    t = tl.zeros((ROWS,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < valid)[None, :]
        x = tl.load(logits_ptr + rows[:, None] * stride_n + cols[None, :], mask=ok, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: keep exp() at 0
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
        t += tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), axis=1)
    tl.store(max_ptr + rows, m, mask=row_ok)
    tl.store(sum_ptr + rows, s, mask=row_ok)
    tl.store(tlogit_ptr + rows, t, mask=row_ok)


@triton.jit
def cross_entropy_grad_kernel(
    logits_ptr,
    target_ptr,
    lse_ptr,
    dloss_ptr,
    grad_ptr,
    N,
    V,
    valid,
    stride_n,
    stride_grad,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    in_slice = row_ok[:, None] & (cols < V)[None, :]
    ok = row_ok[:, None] & (cols < valid)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_n + cols[None, :], mask=ok, other=float("-inf"))
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    dloss = tl.load(dloss_ptr + rows, mask=row_ok, other=0.0)
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    p = tl.exp(x.to(tl.float32) - lse[:, None])
    g = (p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * dloss[:, None]
    tl.store(grad_ptr + rows[:, None] * stride_grad + cols[None, :], g.to(grad_ptr.dtype.element_ty), mask=in_slice)


def _blocks(n: int, v: int) -> tuple[int, int]:
    """(ROWS, BLOCK_V): under the interpreter one program covers everything it can (each costs ~1 ms)."""
    if interpreting():
        return block_size(n, lo=1, hi=64), block_size(v, lo=16, hi=128)
    return 1, block_size(v, lo=16, hi=4096)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size):  # logits: [..., V/tp], target: [...] int64
        local_v = logits.shape[-1]
        start = tp.tp_rank * local_v
        valid = local_v if vocab_size is None else max(0, min(local_v, vocab_size - start))
        logits2 = logits.reshape(-1, local_v)
        if logits2.stride(-1) != 1:
            logits2 = logits2.contiguous()
        n = logits2.shape[0]
        flat_target = target.reshape(-1)
        outside = (flat_target < start) | (flat_target >= start + valid)
        local_target = (flat_target - start).masked_fill(outside, -1).contiguous()  # [N], -1: not here
        stats = [torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3)]
        rows, bv = _blocks(n, local_v)
        softmax_stats_kernel[(triton.cdiv(n, rows),)](
            logits2, local_target, *stats, n, local_v, valid, logits2.stride(0), ROWS=rows, BLOCK_V=bv, num_warps=8
        )
        lse, target_logit = combine_softmax_stats(*stats, tp)  # [N] each, over the tensor-parallel group
        ctx.save_for_backward(logits2, local_target, lse)
        ctx.valid, ctx.shape = valid, logits.shape
        return (lse - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss: [...]
        logits2, local_target, lse = ctx.saved_tensors
        n, local_v = logits2.shape
        grad = torch.empty_like(logits2)
        rows, bv = _blocks(n, local_v)
        grid = (triton.cdiv(n, rows), triton.cdiv(local_v, bv))
        dloss = grad_loss.reshape(-1).to(torch.float32).contiguous()
        cross_entropy_grad_kernel[grid](
            logits2, local_target, lse, dloss, grad, n, local_v, ctx.valid, logits2.stride(0), grad.stride(0),
            ROWS=rows, BLOCK_V=bv, num_warps=8,
        )  # fmt: skip
        return grad.view(ctx.shape), None, None, None


def fused_vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp: HasTensorParallel, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from vocabulary-split logits ``[..., V/tp]``; see the module docstring."""
    return _FusedVocabParallelCrossEntropy.apply(logits, target, tp, vocab_size)
