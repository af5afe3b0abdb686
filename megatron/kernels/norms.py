"""LayerNorm and RMSNorm over the last dimension, with the backward split into B (input gradient) and W (weights).

    LayerNorm: y = (x - mean) * rstd * w + b          rstd = 1 / sqrt(var + eps), statistics over the last dim h
    RMSNorm:   y = x * rstd * w                        rstd = 1 / sqrt(mean(x^2) + eps)

Three kernels, each over row tiles ``[ROWS, BLOCK_H]`` of the flattened ``[N, h]`` input, computing in fp32:

- forward: ``y`` in the input's dtype, and per row ``mean`` and ``rstd`` (fp32, saved for backward);
- B: ``dx = rstd * (w*dy - xhat * mean(xhat * w*dy) - mean(w*dy))`` (RMSNorm: without the last term);
- W: ``dw = sum_rows dy * xhat``, ``db = sum_rows dy``: each program sums a group of rows into one row of an fp32
  ``[groups, h]`` partial, which torch then sums (a deterministic order; the partial is ``groups x h``, small).

The weight gradient goes three ways, as a deferrable linear's does (``zb_pipeline.runtime.deferrable_linear``):
with ``defer`` and a ``WeightGradStore`` bound it is W work queued in the store (holding ``x``, ``dy`` and the row
statistics until W runs); with ``defer`` and no store, or with a ``main_grad``, this module accumulates it into
``main_grad`` (fp32) itself; without ``defer`` it is returned to autograd, like ``torch.nn.functional.layer_norm``.

``layer_norm_reference``/``rms_norm_reference`` are the torch definitions the tests hold the kernels to (the torch
path of ``megatron.model.norms``).
"""

# ruff: noqa: N803  (Triton convention: compile-time tl.constexpr arguments and sizes in capitals)

import torch  # no ``from __future__ import annotations``: Triton 3.1's interpreter needs real tl.constexpr annotations
import torch.nn.functional as F

from megatron.kernels.triton_runtime import block_size, import_triton, interpreting, rows_per_program
from zb_pipeline.runtime.deferrable_linear import accumulate_grad
from zb_pipeline.runtime.weight_grad_store import WeightGradStore

triton, tl = import_triton()

MAX_HIDDEN = 16384  # one row is one tile: wider rows would spill registers (the selection refuses them at start-up)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


@triton.jit
def norm_forward_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    N,
    H,
    stride_x,
    stride_y,
    eps,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < N
    col_ok = cols < H
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / H
        xc = tl.where(ok, x - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / H + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _normalized(x, mean_ptr, rstd, rows, row_ok, ok, RMS: tl.constexpr):
    """``xhat`` of the rows ``x`` from the forward's saved ``mean`` (LayerNorm) and ``rstd``; 0 outside ``ok``."""
    if RMS:
        xhat = x * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
    return xhat


@triton.jit
def norm_input_grad_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    mean_ptr,
    rstd_ptr,
    N,
    H,
    stride_x,
    stride_dy,
    stride_dx,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RMS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < N
    col_ok = cols < H
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    xhat = _normalized(x, mean_ptr, rstd, rows, row_ok, ok, RMS)
    wdy = w[None, :] * dy
    c1 = tl.sum(xhat * wdy, axis=1) / H
    if RMS:
        dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
    else:
        c2 = tl.sum(wdy, axis=1) / H
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def norm_weight_grad_kernel(
    x_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    dw_ptr,
    db_ptr,
    N,
    H,
    rows_per_group,
    stride_x,
    stride_dy,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    db = tl.zeros((BLOCK_H,), dtype=tl.float32)
    first = group * rows_per_group
    for r0 in range(first, first + rows_per_group, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        row_ok = (rows < N) & (rows < first + rows_per_group)
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = _normalized(x, mean_ptr, rstd, rows, row_ok, ok, RMS)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    tl.store(dw_ptr + group * H + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(db_ptr + group * H + cols, db, mask=col_ok)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """``[..., h]`` as ``[N, h]`` with unit stride along h (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def norm_forward(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, *, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y [N, h], mean [N] fp32, rstd [N] fp32)`` for ``x2 [N, h]`` (``mean`` is empty for RMSNorm)."""
    n, h = x2.shape
    y = torch.empty_like(x2)
    mean = torch.empty(0 if rms else n, dtype=torch.float32, device=x2.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x2.device)
    bh = block_size(h, lo=16, hi=MAX_HIDDEN)
    rows = rows_per_program(n, bh)
    norm_forward_kernel[(triton.cdiv(n, rows),)](
        x2, weight, weight if bias is None else bias, y, rstd if rms else mean, rstd, n, h, x2.stride(0),
        y.stride(0), eps, ROWS=rows, BLOCK_H=bh, RMS=rms, HAS_BIAS=bias is not None,
        num_warps=_warps(rows * bh),
    )  # fmt: skip
    return y, mean, rstd


def norm_input_grad(
    x2: torch.Tensor, weight: torch.Tensor, dy2: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, *, rms: bool
) -> torch.Tensor:
    """B: ``dx [N, h]`` in the input's dtype."""
    n, h = x2.shape
    dx = torch.empty_like(x2)
    bh = block_size(h, lo=16, hi=MAX_HIDDEN)
    rows = rows_per_program(n, bh)
    norm_input_grad_kernel[(triton.cdiv(n, rows),)](
        x2, weight, dy2, dx, rstd if rms else mean, rstd, n, h, x2.stride(0), dy2.stride(0), dx.stride(0),
        ROWS=rows, BLOCK_H=bh, RMS=rms, num_warps=_warps(rows * bh),
    )  # fmt: skip
    return dx


def norm_weight_grad(
    x2: torch.Tensor, dy2: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, *, rms: bool, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W: ``(dw [h], db [h] | None)`` in fp32."""
    n, h = x2.shape
    if interpreting():
        groups, bh = 1, block_size(h, lo=16, hi=MAX_HIDDEN)
    else:
        groups, bh = max(1, min(512, triton.cdiv(n, 64))), block_size(h, lo=16, hi=256)  # ~64 rows per program
    per_group = triton.cdiv(n, groups)
    rows = block_size(per_group, lo=1, hi=64 if interpreting() else 32)
    dw = torch.empty(groups, h, dtype=torch.float32, device=x2.device)
    db = torch.empty(groups, h, dtype=torch.float32, device=x2.device) if has_bias else dw
    norm_weight_grad_kernel[(groups, triton.cdiv(h, bh))](
        x2, dy2, rstd if rms else mean, rstd, dw, db, n, h, per_group, x2.stride(0), dy2.stride(0),
        ROWS=rows, BLOCK_H=bh, RMS=rms, HAS_BIAS=has_bias, num_warps=4,
    )  # fmt: skip
    return dw.sum(0), db.sum(0) if has_bias else None


def _warps(tile: int) -> int:
    return 4 if tile <= 2048 else 8 if tile <= 8192 else 16


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, store, defer):  # x: [..., h], weight/bias: [h]
        x2 = _rows2d(x)  # [N, h]
        y, mean, rstd = norm_forward(x2, weight, bias, eps, rms=rms)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.store, ctx.defer, ctx.bias_ref = rms, store, defer, bias
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # dy: [..., h]
        x2, weight, mean, rstd = ctx.saved_tensors
        bias, store, rms = ctx.bias_ref, ctx.store, ctx.rms
        dy2 = _rows2d(dy)
        dx = norm_input_grad(x2, weight, dy2, mean, rstd, rms=rms).view(dy.shape) if ctx.needs_input_grad[0] else None
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (need_w or need_b):
            return dx, None, None, None, None, None, None
        to_autograd = not ctx.defer or (store is None and getattr(weight, "main_grad", None) is None)
        if to_autograd:
            dw, db = norm_weight_grad(x2, dy2, mean, rstd, rms=rms, has_bias=need_b)
            dw = dw.to(weight.dtype) if need_w else None
            db = db.to(bias.dtype) if need_b else None
            return dx, dw, db, None, None, None, None

        def norm_weight_grad_work() -> None:
            dw, db = norm_weight_grad(x2, dy2, mean, rstd, rms=rms, has_bias=need_b)
            if need_w:
                accumulate_grad(weight, dw)
            if need_b:
                accumulate_grad(bias, db)

        if store is None:
            norm_weight_grad_work()
        else:
            store.submit(norm_weight_grad_work)
        return dx, None, None, None, None, None, None


def triton_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    store: WeightGradStore | None = None,
    defer: bool = False,
) -> torch.Tensor:
    """LayerNorm of ``x [..., h]`` with the Triton kernels; ``defer``: weight/bias gradients are W work."""
    return _TritonNorm.apply(x, weight, bias, eps, False, store, defer)


def triton_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    store: WeightGradStore | None = None,
    defer: bool = False,
) -> torch.Tensor:
    """RMSNorm of ``x [..., h]`` with the Triton kernels; ``defer``: the weight gradient is W work."""
    return _TritonNorm.apply(x, weight, None, eps, True, store, defer)
