"""Each Triton kernel against its torch reference, forward and backward, in fp32, fp16 and bf16.

Without CUDA the kernels run in Triton's interpreter (bf16 through the kernels' fp32 ``UPCAST`` switch); on a CUDA
machine the same tests run the compiled kernels on the GPU (native bf16).  Shapes are tiny: <= 64 tokens, hidden <= 64,
vocabulary <= 512.

Tolerances, fixed before measuring, as ``(rtol, atol)`` against the reference computed in fp32 from the same inputs:

- row-wise kernels (norms, activations, cross-entropy), whose outputs are rounded to the input dtype:
  fp32 (1e-5, 1e-5), fp16 (1e-2, 1e-2), bf16 (5e-2, 5e-2) -- a few units in the last place of each format;
- the W kernel, which accumulates in fp32 and never rounds to the input dtype: (1e-5, 1e-5) for every input dtype.
"""

from __future__ import annotations

import pytest
import torch

from megatron.kernels.triton_runtime import interpreter_problem, triton_importable

# Never import triton directly: Triton must see TRITON_INTERPRET (set by megatron.kernels) before its first import.
_PROBLEM = (
    ("triton is not installed" if not triton_importable() else None)
    if torch.cuda.is_available()
    else interpreter_problem()
)
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=f"cannot run the kernels: {_PROBLEM}")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROW_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}
W_TOL = (1e-5, 1e-5)


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    assert actual.dtype == expected.dtype or expected.dtype == torch.float32, what
    rtol, atol = tol
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_()


def _fp32_leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().requires_grad_()


# -- the W kernel -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, out, inp", [(64, 48, 40), (37, 64, 17), (5, 3, 7)])
def test_weight_grad_kernel_accumulates_in_fp32(dtype: torch.dtype, n: int, out: int, inp: int) -> None:
    from megatron.kernels.weight_grad import accumulate_weight_grad, weight_grad_reference

    grad_y, x = _randn(n, out, dtype=dtype, seed=1), _randn(n, inp, dtype=dtype, seed=2)
    start = _randn(out, inp, dtype=torch.float32, seed=3)
    got, want = start.clone(), start.clone()
    accumulate_weight_grad(got, grad_y, x)
    weight_grad_reference(want, grad_y, x)
    _close(got, want, W_TOL, f"main_grad {dtype}")
    if dtype != torch.float32:  # torch's half GEMM rounds each product sum to the half format before the add
        half_path = start + grad_y.t().mm(x).float()
        assert (half_path - want).abs().max() > 10 * (got - want).abs().max()


def test_weight_grad_kernel_takes_strided_operands() -> None:
    from megatron.kernels.weight_grad import accumulate_weight_grad, weight_grad_reference

    grad_y = _randn(24, 40, dtype=torch.bfloat16, seed=4).t()  # [40, 24], column-major
    x = _randn(40, 64, dtype=torch.bfloat16, seed=5)[:, ::2]  # [40, 32], stride 2
    got, want = torch.zeros(24, 32, device=DEVICE), torch.zeros(24, 32, device=DEVICE)
    accumulate_weight_grad(got, grad_y, x)
    weight_grad_reference(want, grad_y, x)
    _close(got, want, W_TOL, "strided")


# -- LayerNorm / RMSNorm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [(16, 4, 48), (37, 64)])
def test_norm_forward_and_backward(dtype: torch.dtype, kind: str, shape: tuple[int, ...]) -> None:
    from megatron.kernels.norms import layer_norm_reference, rms_norm_reference, triton_layer_norm, triton_rms_norm

    h = shape[-1]
    x = _randn(*shape, dtype=dtype, scale=2.0)
    w = (1 + _randn(h, dtype=torch.float32, scale=0.3, seed=1)).to(dtype)
    b = _randn(h, dtype=dtype, scale=0.3, seed=2) if kind == "LayerNorm" else None
    dy = _randn(*shape, dtype=dtype, seed=3)
    args = [t for t in (x, w, b) if t is not None]

    def run(impl, tensors):
        leaves = [_leaf(t) if impl is not None else _fp32_leaf(t) for t in tensors]
        if kind == "LayerNorm":
            y = (impl or layer_norm_reference)(*leaves, 1e-5)
        else:
            y = (impl or rms_norm_reference)(*leaves, 1e-5)
        grads = torch.autograd.grad(y, leaves, dy if impl is not None else dy.float())
        return y, grads

    y, grads = run(triton_layer_norm if kind == "LayerNorm" else triton_rms_norm, args)
    y_ref, grads_ref = run(None, args)
    tol = ROW_TOL[dtype]
    _close(y, y_ref, tol, "y")
    for name, g, r in zip(("dx", "dw", "db"), grads, grads_ref):
        assert g.dtype == dtype
        _close(g, r, tol, name)


# -- bias + GeLU, bias + SwiGLU ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_activation_forward_and_backward(dtype: torch.dtype, act: str, bias: bool) -> None:
    from megatron.kernels.activations import (
        bias_gelu_reference,
        bias_swiglu_reference,
        triton_bias_gelu,
        triton_bias_gelu_tanh,
        triton_bias_swiglu,
    )

    width = 2 * 40 if act == "swiglu" else 40  # f = 40: not a power of two, masked columns
    y = _randn(8, 4, width, dtype=dtype, scale=2.0)
    b = _randn(width, dtype=dtype, seed=1) if bias else None
    kernel, reference = {
        "gelu": (triton_bias_gelu, bias_gelu_reference),
        "gelu_tanh": (triton_bias_gelu_tanh, lambda y, b: bias_gelu_reference(y, b, approximate="tanh")),
        "swiglu": (triton_bias_swiglu, bias_swiglu_reference),
    }[act]
    leaves = [_leaf(t) for t in (y, b) if t is not None]
    out = kernel(leaves[0], leaves[1] if bias else None)
    assert out.shape == (8, 4, 40) and out.dtype == dtype
    dout = _randn(*out.shape, dtype=dtype, seed=2)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [_fp32_leaf(t) for t in (y, b) if t is not None]
    ref = reference(ref_leaves[0], ref_leaves[1] if bias else None)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    tol = ROW_TOL[dtype]
    _close(out, ref, tol, "out")
    for name, g, r in zip(("dy", "dbias"), grads, ref_grads):
        assert g.dtype == dtype
        _close(g, r, tol, name)


# -- cross-entropy ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, true_vocab", [(512, 500), (200, None)])
def test_cross_entropy_forward_and_backward(dtype: torch.dtype, vocab: int, true_vocab: int | None) -> None:
    from megatron.kernels.cross_entropy import fused_vocab_parallel_cross_entropy, reference_cross_entropy
    from megatron.parallel.tensor_parallel import TPContext

    s, b = 16, 4
    logits = _randn(s, b, vocab, dtype=dtype, scale=3.0)
    target = torch.randint(0, true_vocab or vocab, (s, b), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    leaf = _leaf(logits)
    loss = fused_vocab_parallel_cross_entropy(leaf, target, TPContext(), true_vocab)
    assert loss.shape == (s, b) and loss.dtype == torch.float32
    dloss = _randn(s, b, dtype=torch.float32, seed=2)
    (grad,) = torch.autograd.grad(loss, leaf, dloss)
    assert grad.dtype == dtype

    ref_leaf = _fp32_leaf(logits)
    used = ref_leaf[..., : true_vocab or vocab]  # padded columns take no part
    ref = reference_cross_entropy(used.reshape(-1, used.shape[-1]), target.reshape(-1)).view(s, b)
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf, dloss)
    tol = ROW_TOL[dtype]
    _close(loss, ref, ROW_TOL[torch.float32], "loss")  # computed in fp32 from the same logits
    _close(grad, ref_grad, tol, "dlogits")
    if true_vocab is not None:
        assert torch.all(grad[..., true_vocab:] == 0)
