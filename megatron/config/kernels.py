"""Which implementation runs the fused operations: ``--kernels`` and Megatron's fusion flags.

``--kernels auto`` (default) takes the Triton kernels on a CUDA machine and plain torch elsewhere; ``torch`` and
``triton`` force one (``triton`` on a machine without CUDA runs Triton's interpreter: slow, for tests).  With Triton,
each fusion flag switches one kernel off (``--no-gradient-accumulation-fusion``, ``--no-bias-gelu-fusion``,
``--no-bias-swiglu-fusion``) or on (``--cross-entropy-loss-fusion``, off by default as in Megatron).  What a run
actually uses, and why, is decided once by ``megatron.kernels.select.resolve_kernels``.

``--transformer-impl {local,transformer_engine}`` (Megatron's flag): ``transformer_engine`` builds the decoder layers
from Transformer Engine >= 2.3 with its delayed weight gradient (``megatron.kernels.transformer_engine``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.config.errors import require

KERNEL_BACKENDS = ("auto", "torch", "triton")
TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass(frozen=True)
class KernelConfig:
    kernels: str = "auto"
    gradient_accumulation_fusion: bool = True  # the W kernel: fp32 accumulation straight into main_grad
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    cross_entropy_loss_fusion: bool = False
    transformer_impl: str = "local"

    def __post_init__(self) -> None:
        require(self.kernels in KERNEL_BACKENDS, f"--kernels={self.kernels!r} must be one of {KERNEL_BACKENDS}")
        require(
            self.transformer_impl in TRANSFORMER_IMPLS,
            f"--transformer-impl={self.transformer_impl!r} must be one of {TRANSFORMER_IMPLS}",
        )

    @classmethod
    def from_flags(cls, v: Mapping[str, Any]) -> KernelConfig:
        """From the parsed flag values (argparse dest names)."""
        return cls(
            kernels=v["kernels"],
            gradient_accumulation_fusion=v["gradient_accumulation_fusion"],
            bias_gelu_fusion=v["bias_gelu_fusion"],
            bias_swiglu_fusion=v["bias_swiglu_fusion"],
            cross_entropy_loss_fusion=v["cross_entropy_loss_fusion"],
            transformer_impl=v.get("transformer_impl", "local"),
        )
