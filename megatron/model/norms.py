"""LayerNorm and RMSNorm over the last (hidden) dimension.

The torch path (``kernel`` is ``None``) keeps the norm weights on autograd's immediate path: torch's backward produces
the input gradient and the weight gradient together, and they are a tiny share of backward time.  A fused kernel
(``megatron.kernels.norms``, set by ``megatron.kernels.select``, the only place that chooses) splits the backward:
the input gradient in B and, when ``defer_weight_grad`` is set, the weight/bias gradients as W work in the
``WeightGradStore`` bound like a deferrable linear's (``weight_grad_store``; the torch path never reads it).  Under
sequence parallelism each rank normalises its own sequence slice, so the weights are tagged ``sequence_parallel``
and their gradients are summed over the tensor-parallel group before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zb_pipeline.runtime.weight_grad_store import WeightGradStore


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, *, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))  # [h]
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))  # [h]
        self.weight.sequence_parallel = self.bias.sequence_parallel = sequence_parallel
        # kernel(x, weight, bias, eps, store=..., defer=...) -> y; None: torch
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.weight_grad_store: WeightGradStore | None = None
        self.defer_weight_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        if self.kernel is not None:
            store, defer = self.weight_grad_store, self.defer_weight_grad
            return self.kernel(x, self.weight, self.bias, self.eps, store=store, defer=defer)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (no mean subtraction, no bias)."""

    def __init__(self, hidden_size: int, *, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))  # [h]
        self.weight.sequence_parallel = sequence_parallel
        # kernel(x, weight, eps, store=..., defer=...) -> y; None: torch
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.weight_grad_store: WeightGradStore | None = None
        self.defer_weight_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        if self.kernel is not None:
            store, defer = self.weight_grad_store, self.defer_weight_grad
            return self.kernel(x, self.weight, self.eps, store=store, defer=defer)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, hidden_size: int, *, eps: float, sequence_parallel: bool) -> torch.nn.Module:
    if kind == "LayerNorm":
        return LayerNorm(hidden_size, eps=eps, sequence_parallel=sequence_parallel)
    if kind == "RMSNorm":
        return RMSNorm(hidden_size, eps=eps, sequence_parallel=sequence_parallel)
    raise ValueError(f"normalization={kind!r} must be 'LayerNorm' or 'RMSNorm'")
