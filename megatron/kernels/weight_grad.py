"""The W kernel: a linear's weight gradient accumulated in fp32 straight into ``main_grad``.

    main_grad[o, i] += sum_n grad_y[n, o] * x[n, i]          main_grad: [out, in] fp32; grad_y: [N, out]; x: [N, in]

The torch path of ``zb_pipeline.runtime.deferrable_linear`` does this with ``addmm_`` when the activations are fp32,
and otherwise with a half-precision GEMM whose ``[out, in]`` result is rounded to bf16/fp16 and then added: each
microbatch's contribution loses precision, and a weight-sized temporary is allocated.  The kernel reads the half
activations, multiplies on the tensor cores with an fp32 accumulator, and adds its tile into ``main_grad`` in place:
no half intermediate, no temporary.  Each ``[BLOCK_O, BLOCK_I]`` tile of ``main_grad`` is owned by one program,
which sums over the tokens in a fixed order, so the result is deterministic.

fp32 operands are multiplied in IEEE fp32 (``input_precision="ieee"``), as torch does unless TF32 is allowed.

``weight_grad_reference`` is the torch definition the tests hold the kernel to; ``accumulate_weight_grad`` is the
``wgrad_fn`` that ``megatron.kernels.select`` gives the deferrable linears.
"""

# ruff: noqa: N803  (Triton convention: compile-time tl.constexpr arguments and sizes in capitals)

import torch  # no ``from __future__ import annotations``: Triton 3.1's interpreter needs real tl.constexpr annotations

from megatron.kernels.triton_runtime import block_size, import_triton, interpreting, upcast_operands

triton, tl = import_triton()


def weight_grad_reference(main_grad: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += grad_y^T @ x`` computed in fp32 (the definition; it allocates fp32 copies)."""
    main_grad.add_(grad_y.t().float().mm(x.float()))


@triton.jit
def weight_grad_kernel(
    gy_ptr,
    x_ptr,
    g_ptr,
    N,
    O,
    I,
    stride_gy_n,
    stride_gy_o,
    stride_x_n,
    stride_x_i,
    stride_g_o,
    stride_g_i,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)  # rows of main_grad
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # columns of main_grad
    o_ok = offs_o < O
    i_ok = offs_i < I
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        gy_t = tl.load(  # grad_y^T tile [BLOCK_O, BLOCK_N]
            gy_ptr + offs_o[:, None] * stride_gy_o + offs_n[None, :] * stride_gy_n,
            mask=o_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        x = tl.load(  # [BLOCK_N, BLOCK_I]
            x_ptr + offs_n[:, None] * stride_x_n + offs_i[None, :] * stride_x_i,
            mask=n_ok[:, None] & i_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            gy_t = gy_t.to(tl.float32)
            x = x.to(tl.float32)
        if IEEE:
            acc = tl.dot(gy_t, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(gy_t, x, acc)
    g_ptrs = g_ptr + offs_o[:, None] * stride_g_o + offs_i[None, :] * stride_g_i
    g_ok = o_ok[:, None] & i_ok[None, :]
    g = tl.load(g_ptrs, mask=g_ok, other=0.0)
    tl.store(g_ptrs, (g + acc).to(g_ptr.dtype.element_ty), mask=g_ok)


def _blocks(n: int, o: int, i: int) -> tuple[int, int, int, int]:
    """(BLOCK_O, BLOCK_I, BLOCK_N, num_warps).  Under the interpreter: few, large programs (each costs ~1 ms)."""
    if interpreting():
        return block_size(o, lo=16, hi=64), block_size(i, lo=16, hi=64), block_size(n, lo=16, hi=64), 4
    return block_size(o, lo=16, hi=128), block_size(i, lo=16, hi=128), 32, 8 if min(o, i) >= 128 else 4


def accumulate_weight_grad(main_grad: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += grad_y^T @ x`` with the W kernel (in place, fp32 accumulation; see the module docstring).

    ``grad_y``: ``[N, out]``, ``x``: ``[N, in]`` (any strides, same dtype), ``main_grad``: ``[out, in]``.
    """
    n, o = grad_y.shape
    i = x.shape[1]
    if x.shape[0] != n or main_grad.shape != (o, i):
        raise ValueError(f"weight grad: grad_y {tuple(grad_y.shape)}, x {tuple(x.shape)}, main_grad {main_grad.shape}")
    if grad_y.dtype != x.dtype:
        raise ValueError(f"weight grad: grad_y is {grad_y.dtype} but x is {x.dtype}")
    if n == 0:
        return
    bo, bi, bn, warps = _blocks(n, o, i)
    grid = (triton.cdiv(o, bo), triton.cdiv(i, bi))
    weight_grad_kernel[grid](
        grad_y,
        x,
        main_grad,
        n,
        o,
        i,
        grad_y.stride(0),
        grad_y.stride(1),
        x.stride(0),
        x.stride(1),
        main_grad.stride(0),
        main_grad.stride(1),
        BLOCK_O=bo,
        BLOCK_I=bi,
        BLOCK_N=bn,
        UPCAST=upcast_operands(x.dtype),
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
    )
