"""The optimizer (``--optimizer``: AdamW or SGD), its hyper-parameters, gradient clipping and the distributed
(ZeRO-1) optimizer switch."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer`` names an update rule of ``megatron.optimizer.registry`` ("adam": decoupled-weight-decay Adam,
    AdamW; "sgd": SGD with ``sgd_momentum`` and L2 weight decay, as Megatron), run in fp32; ``clip_grad=0`` disables
    global grad-norm clipping.

    Weight decay is not applied to biases and normalisation weights (any 1-D parameter), as in Megatron.
    ``use_distributed_optimizer`` shards the fp32 main parameters and optimizer states over the data-parallel ranks.
    """

    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    optimizer: str = "adam"
    sgd_momentum: float = 0.9

    def __post_init__(self) -> None:
        require(self.weight_decay >= 0, f"--weight-decay={self.weight_decay} must be >= 0")
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            require(0.0 <= beta < 1.0, f"{flag}={beta} must be in [0, 1)")
        require(self.adam_eps > 0, f"--adam-eps={self.adam_eps} must be > 0")
        require(self.clip_grad >= 0, f"--clip-grad={self.clip_grad} must be >= 0 (0 disables clipping)")
        require(0.0 <= self.sgd_momentum < 1.0, f"--sgd-momentum={self.sgd_momentum} must be in [0, 1)")
