"""LayerNorm and RMSNorm over the last (hidden) dimension.

The torch path (``kernel`` is ``None``) keeps the norm weights on autograd's immediate path: torch's backward produces
the input gradient and the weight gradient together, and they are a tiny share of backward time.  A fused kernel
(``megatron.kernels.norms``, set by ``megatron.kernels.select``, the only place that chooses) splits the backward:
the input gradient in B and, when ``defer_weight_grad`` is set, the weight/bias gradients as W work in the
``WeightGradStore`` bound like a deferrable linear's (``weight_grad_store``; the torch path never reads it).  Under
sequence parallelism each rank normalises its own sequence slice, so the weights are tagged ``sequence_parallel``
and their gradients are summed over the tensor-parallel group before the optimizer step.

``zero_centered`` (``--apply-layernorm-1p``): the stored weight is ``gamma - 1`` (initialised to 0) and the norm
multiplies by ``1 + weight``.  An input of another dtype than the weights (the fp32 residual stream of
``--fp32-residual-connection`` under bf16/fp16 parameters) is normalised in fp32 and returned in the weights' dtype,
as Megatron's mixed-dtype fused norms do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zb_pipeline.runtime.weight_grad_store import WeightGradStore


def _gamma(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    return weight + 1 if zero_centered else weight


def _mixed_dtype_norm(norm: Callable[..., torch.Tensor], x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
    """``norm(x, *params)`` computed in fp32 and cast to the parameters' dtype (x of another dtype)."""
    out = norm(x.float(), *(None if p is None else p.float() for p in params))
    return out.to(params[0].dtype)


class LayerNorm(torch.nn.Module):
    def __init__(
        self, hidden_size: int, *, eps: float = 1e-5, sequence_parallel: bool = False, zero_centered: bool = False
    ) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))  # [h]
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))  # [h]
        self.weight.sequence_parallel = self.bias.sequence_parallel = sequence_parallel
        # kernel(x, weight, bias, eps, store=..., defer=...) -> y; None: torch
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.weight_grad_store: WeightGradStore | None = None
        self.defer_weight_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        weight = _gamma(self.weight, self.zero_centered)
        if self.kernel is not None:
            store, defer = self.weight_grad_store, self.defer_weight_grad
            return self.kernel(x, weight, self.bias, self.eps, store=store, defer=defer)
        if x.dtype != weight.dtype:
            return _mixed_dtype_norm(self._norm, x, weight, self.bias)
        return self._norm(x, weight, self.bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, weight.shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", zero_centered" if self.zero_centered else "")


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (no mean subtraction, no bias)."""

    def __init__(
        self, hidden_size: int, *, eps: float = 1e-5, sequence_parallel: bool = False, zero_centered: bool = False
    ) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))  # [h]
        self.weight.sequence_parallel = sequence_parallel
        # kernel(x, weight, eps, store=..., defer=...) -> y; None: torch
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.weight_grad_store: WeightGradStore | None = None
        self.defer_weight_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        weight = _gamma(self.weight, self.zero_centered)
        if self.kernel is not None:
            store, defer = self.weight_grad_store, self.defer_weight_grad
            return self.kernel(x, weight, self.eps, store=store, defer=defer)
        if x.dtype != weight.dtype:
            return _mixed_dtype_norm(self._norm, x, weight)
        return self._norm(x, weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", zero_centered" if self.zero_centered else "")


def build_norm(
    kind: str, hidden_size: int, *, eps: float, sequence_parallel: bool, zero_centered: bool = False
) -> torch.nn.Module:
    if kind == "LayerNorm":
        return LayerNorm(hidden_size, eps=eps, sequence_parallel=sequence_parallel, zero_centered=zero_centered)
    if kind == "RMSNorm":
        return RMSNorm(hidden_size, eps=eps, sequence_parallel=sequence_parallel, zero_centered=zero_centered)
    raise ValueError(f"normalization={kind!r} must be 'LayerNorm' or 'RMSNorm'")
