"""The W kernel from apex: ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``.

apex's extension (``csrc/megatron/fused_weight_gradient_dense.cpp``, built with ``--cuda_ext``) documents

    wgrad_gemm_accum_fp32(input: Tensor, d_output: Tensor, d_weight: Tensor) -> None
        d_weight += d_output^T @ input     input [N, in], d_output [N, out] (fp32/fp16/bf16, same dtype),
                                           d_weight [out, in] fp32, all contiguous; one cuBLAS GEMM, fp32 accumulate

which is exactly our ``wgrad_fn(main_grad, grad_y, x)`` contract (Megatron-LM calls it as
``wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)``).  The extension reads raw row-major
pointers, so the operands are made contiguous first (``deferrable_linear`` passes reshaped views, usually
contiguous already).  Chosen by ``megatron.kernels.select`` on CUDA when apex is installed; it has not run against
the real apex in this project (``docs/gpu.md``).
"""

from __future__ import annotations

import importlib

import torch

from megatron.kernels.vendor import APEX_WGRAD_MODULE


def apex_accumulate_weight_grad(main_grad: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += grad_y^T @ x`` by apex (fp32 ``main_grad``, in place)."""
    if main_grad.dtype != torch.float32:
        raise ValueError(f"apex weight grad: main_grad is {main_grad.dtype}, wgrad_gemm_accum_fp32 needs float32")
    if grad_y.dtype != x.dtype:
        raise ValueError(f"apex weight grad: grad_y is {grad_y.dtype} but x is {x.dtype}")
    if grad_y.shape[0] == 0:
        return
    ext = importlib.import_module(APEX_WGRAD_MODULE)
    ext.wgrad_gemm_accum_fp32(x.contiguous(), grad_y.contiguous(), main_grad)
