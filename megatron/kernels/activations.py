"""Bias + GeLU and bias + SwiGLU: the MLP's activation fused with the first linear's bias add.

    bias_gelu:   out = gelu(y + b)                                    y: [N, f],  b: [f] | None   (exact erf GeLU,
                 or its tanh approximation, --openai-gelu: triton_bias_gelu(..., approximate="tanh"))
    bias_swiglu: out = silu(g) * u   with [g ; u] = y + b             y: [N, 2f], b: [2f] | None, out: [N, f]

``y`` is the first linear's output without its bias (``ColumnParallelLinear(..., add_bias=False)``), so the bias add,
the activation and (in backward) their derivatives are one pass each over ``y``, computed in fp32.  Backward returns
``dz = d out / d(y + b)`` in ``y``'s dtype (B); the bias gradient ``sum_rows dz`` is weight work, handled like a
deferrable linear's bias (``zb_pipeline.runtime.deferrable_linear``): queued in the ``WeightGradStore`` as W when one
is bound and deferring, accumulated into ``main_grad`` (fp32) when the bias has one, else returned to autograd.  The
queued work holds ``dz``, the very tensor the first linear's W work holds as its output gradient: no extra memory.

What is saved for backward is ``y`` alone (torch's unfused SwiGLU also keeps ``silu(g)``).

``bias_gelu_reference``/``bias_swiglu_reference`` are the torch definitions (the torch path of ``megatron.model.mlp``).
"""

# ruff: noqa: N803  (Triton convention: compile-time tl.constexpr arguments and sizes in capitals)

import torch  # no ``from __future__ import annotations``: Triton 3.1's interpreter needs real tl.constexpr annotations
import torch.nn.functional as F

from megatron.kernels.triton_runtime import block_size, import_triton, rows_per_program
from zb_pipeline.runtime.deferrable_linear import accumulate_grad
from zb_pipeline.runtime.weight_grad_store import WeightGradStore

triton, tl = import_triton()


def bias_gelu_reference(y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    return F.gelu(y if bias is None else y + bias, approximate=approximate)


def bias_swiglu_reference(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    gate, up = (y if bias is None else y + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def gelu_terms(z):
    """(gelu(z), gelu'(z)) for the exact GeLU z * Phi(z)."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return z * cdf, cdf + z * pdf


@triton.jit
def gelu_tanh_terms(z):
    """(gelu(z), gelu'(z)) for the tanh approximation 0.5 z (1 + tanh(k (z + 0.044715 z^3))), k = sqrt(2 / pi);
    tanh(u) = 2 sigmoid(2u) - 1."""
    k = 0.7978845608028654
    t = 2.0 * tl.sigmoid(2.0 * k * (z + 0.044715 * z * z * z)) - 1.0
    return 0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)


@triton.jit
def bias_act_kernel(
    y_ptr,
    b_ptr,
    dout_ptr,
    out_ptr,
    N,
    F,
    stride_y,
    stride_out,
    ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BACKWARD: tl.constexpr,
    TANH: tl.constexpr,
):
    """Forward: out[N, F] = act(y + b).  Backward: out[N, F or 2F] = dz from dout[N, F] (same row stride as out's
    forward).  SwiGLU reads the gate at column c and the up projection at column F + c of y."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    ok = (rows < N)[:, None] & col_ok[None, :]
    at = rows[:, None] * stride_y + cols[None, :]
    z = tl.load(y_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        u = tl.load(y_ptr + at + F, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(b_ptr + F + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        sig = tl.sigmoid(z)
        silu = z * sig
    out_at = rows[:, None] * stride_out + cols[None, :]
    if BACKWARD:
        d = tl.load(dout_ptr + rows[:, None] * F + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if SWIGLU:
            dgate = d * u * (sig + silu * (1.0 - sig))
            tl.store(out_ptr + out_at, dgate.to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(out_ptr + out_at + F, (d * silu).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            if TANH:
                _, dgelu = gelu_tanh_terms(z)
            else:
                _, dgelu = gelu_terms(z)
            tl.store(out_ptr + out_at, (d * dgelu).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        if SWIGLU:
            act = silu * u
        elif TANH:
            act, _ = gelu_tanh_terms(z)
        else:
            act, _ = gelu_terms(z)
        tl.store(out_ptr + out_at, act.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(y2, bias, dout, out, f, *, swiglu: bool, backward: bool, tanh: bool = False) -> None:
    n = y2.shape[0]
    bf = block_size(f, lo=16, hi=1024)
    rows = rows_per_program(n, bf, budget=2048)
    grid = (triton.cdiv(n, rows), triton.cdiv(f, bf))
    bias_act_kernel[grid](
        y2, y2 if bias is None else bias, out if dout is None else dout, out, n, f, y2.stride(0), out.stride(0),
        ROWS=rows, BLOCK_F=bf, HAS_BIAS=bias is not None, SWIGLU=swiglu, BACKWARD=backward, TANH=tanh,
        num_warps=4,
    )  # fmt: skip


class _TritonBiasActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, swiglu, store, tanh=False):  # y: [..., f] (GeLU) or [..., 2f] (SwiGLU)
        width = y.shape[-1]
        f = width // 2 if swiglu else width
        y2 = y.reshape(-1, width).contiguous()  # [N, width]
        out = torch.empty(y2.shape[0], f, dtype=y.dtype, device=y.device)  # [N, f]
        _launch(y2, bias, None, out, f, swiglu=swiglu, backward=False, tanh=tanh)
        ctx.save_for_backward(y2)
        ctx.bias_ref, ctx.swiglu, ctx.store, ctx.tanh = bias, swiglu, store, tanh
        return out.view(*y.shape[:-1], f)

    @staticmethod
    def backward(ctx, dout):  # dout: [..., f]
        (y2,) = ctx.saved_tensors
        bias, store = ctx.bias_ref, ctx.store
        f = dout.shape[-1]
        dz = torch.empty_like(y2)  # [N, width]
        _launch(y2, bias, dout.reshape(-1, f).contiguous(), dz, f, swiglu=ctx.swiglu, backward=True, tanh=ctx.tanh)
        grad_y = dz.view(*dout.shape[:-1], y2.shape[1])
        if bias is None or not ctx.needs_input_grad[1]:
            return grad_y, None, None, None, None
        if store is None and getattr(bias, "main_grad", None) is None:
            return grad_y, dz.sum(0, dtype=torch.float32).to(bias.dtype), None, None, None

        def bias_grad_work() -> None:
            accumulate_grad(bias, dz.sum(0, dtype=torch.float32))

        if store is None:
            bias_grad_work()
        else:
            store.submit(bias_grad_work)
        return grad_y, None, None, None, None


def triton_bias_gelu(
    y: torch.Tensor, bias: torch.Tensor | None, *, store: WeightGradStore | None = None, approximate: str = "none"
):
    """``gelu(y + bias)`` for ``y [..., f]`` (``approximate`` as ``F.gelu``'s: "none" or "tanh"); the bias gradient
    is deferrable through ``store``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate={approximate!r} must be 'none' or 'tanh'")
    return _TritonBiasActivation.apply(y, bias, False, store, approximate == "tanh")


def triton_bias_gelu_tanh(y: torch.Tensor, bias: torch.Tensor | None, *, store: WeightGradStore | None = None):
    """``triton_bias_gelu`` with the tanh approximation (``--openai-gelu``)."""
    return triton_bias_gelu(y, bias, store=store, approximate="tanh")


def triton_bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None, *, store: WeightGradStore | None = None):
    """``silu(g) * u`` with ``[g ; u] = y + bias`` for ``y [..., 2f]``; returns ``[..., f]``."""
    return _TritonBiasActivation.apply(y, bias, True, store)
