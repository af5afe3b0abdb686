"""The feed-forward block: ``fc2(act(fc1(x)))`` with GeLU (exact; the tanh approximation with ``--openai-gelu``; or
``relu(x)^2``, ``--squared-relu``), or SwiGLU ``fc2(silu(gate(x)) * up(x))``.

For SwiGLU, ``linear_fc1`` is one fused projection whose full output is ``[gate (ffn) ; up (ffn)]``; it is split
with partition stride 2 so each tensor-parallel rank holds the matching rows of both halves.

``activation_kernel`` (``None``: torch) is a fused bias + activation (``megatron.kernels.activations``, set by
``megatron.kernels.select``): ``linear_fc1`` then leaves its bias out and the kernel adds it, with the bias gradient
deferred to W through ``linear_fc1``'s weight-gradient store.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.model.config import GPTConfig
from megatron.parallel.tensor_parallel import ColumnParallelLinear, HasTensorParallel, RowParallelLinear


class MLP(torch.nn.Module):
    def __init__(self, config: GPTConfig, *, tp: HasTensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.swiglu, self.squared_relu = config.swiglu, config.squared_relu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.is_gelu = config.gelu_mlp
        ffn, bias = config.ffn_hidden_size, config.add_bias_linear
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn if self.swiglu else ffn,
            tp=tp,
            bias=bias,
            sequence_parallel=sequence_parallel,
            partition_stride=2 if self.swiglu else 1,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, tp=tp, bias=bias, sequence_parallel=sequence_parallel
        )
        # activation_kernel(y, bias, store=...) -> act(y + bias); None: torch
        self.activation_kernel: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        if self.activation_kernel is not None:
            fc1 = self.linear_fc1
            y = fc1(x, add_bias=False)  # [s, b, ffn/tp] (x2 with SwiGLU), bias not yet added
            y = self.activation_kernel(y, fc1.bias, store=fc1.weight_grad_store)  # [s, b, ffn/tp]
            return self.linear_fc2(y)
        y = self.linear_fc1(x)  # [s, b, ffn/tp] (x2 with SwiGLU)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up  # [s, b, ffn/tp]
        elif self.squared_relu:
            y = torch.pow(F.relu(y), 2)
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.linear_fc2(y)  # [s, b, h] ([s/tp, b, h] with sequence parallelism)
