"""LayerNorm and RMSNorm over the last (hidden) dimension.

Norm weights stay on autograd's immediate path (their backward produces the input gradient and the weight gradient in
one kernel, so deferring them would cost a second pass); they are a tiny share of backward time.  Under sequence
parallelism each rank normalises its own sequence slice, so the weights are tagged ``sequence_parallel`` and their
gradients are summed over the tensor-parallel group before the optimizer step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, *, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))  # [h]
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))  # [h]
        self.weight.sequence_parallel = self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, hidden_size: int, *, eps: float, sequence_parallel: bool) -> torch.nn.Module:
    if kind == "LayerNorm":
        return LayerNorm(hidden_size, eps=eps, sequence_parallel=sequence_parallel)
    if kind == "RMSNorm":
        return RMSNorm(hidden_size, eps=eps, sequence_parallel=sequence_parallel)
    raise ValueError(f"normalization={kind!r} must be 'LayerNorm' or 'RMSNorm'")
