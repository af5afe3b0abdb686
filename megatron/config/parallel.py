"""How the run is laid out over ranks: tensor, pipeline and (derived) data parallelism, stage sizes, timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import ConfigError, require


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout requested by the user; the data-parallel size follows from the world size.

    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers`` give the first / last stage a
    different number of transformer layers (Megatron's uneven split); the remaining layers must divide evenly over
    the middle stages unless ``allow_padding_num_layers`` is set, in which case the last stages get fewer.
    """

    tp_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    allow_padding_num_layers: bool = False
    layer_split: str = "even"  # "even" (Megatron's) or "auto" (the stage planner: megatron.pipeline.layer_split)
    memory_limit_gb: float | None = None  # the stage planner's activation-memory limit per rank, GiB (None: none)
    distributed_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(self.tp_size >= 1, f"--tensor-model-parallel-size={self.tp_size} must be >= 1")
        require(self.pp_size >= 1, f"--pipeline-model-parallel-size={self.pp_size} must be >= 1")
        require(
            self.distributed_timeout_s > 0,
            f"distributed timeout {self.distributed_timeout_s}s must be > 0; "
            "set --distributed-timeout-minutes or --distributed-timeout-seconds to a positive value",
        )
        require(
            self.layer_split in ("even", "auto"), f"--pipeline-layer-split={self.layer_split!r} must be even or auto"
        )
        require(
            self.layer_split == "even" or self.pp_size > 1,
            f"--pipeline-layer-split auto needs --pipeline-model-parallel-size > 1 (got {self.pp_size})",
        )
        if self.memory_limit_gb is not None:
            require(self.memory_limit_gb > 0, f"--pipeline-memory-limit-gb={self.memory_limit_gb:g} must be > 0")
            require(
                self.layer_split == "auto",
                "--pipeline-memory-limit-gb is the stage planner's limit: it needs --pipeline-layer-split auto",
            )
        for flag, value in (
            ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers),
        ):
            if value is not None:
                require(value >= 1, f"{flag}={value} must be >= 1")
                require(self.pp_size > 1, f"{flag} needs --pipeline-model-parallel-size > 1 (got {self.pp_size})")

    @property
    def model_parallel_size(self) -> int:
        return self.tp_size * self.pp_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises if tp x pp does not divide it."""
        mp = self.model_parallel_size
        if world_size % mp != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor x pipeline parallel size "
                f"{self.tp_size} x {self.pp_size} = {mp}; launch a multiple of {mp} ranks "
                f"(torchrun --nproc-per-node) or change --tensor-model-parallel-size/--pipeline-model-parallel-size"
            )
        return world_size // mp


def split_layers(
    num_layers: int, stages: int, *, first: int | None = None, last: int | None = None, allow_padding: bool = False
) -> tuple[int, ...]:
    """Split ``num_layers`` over ``stages`` as Megatron does, with optional fixed first/last stage sizes.

    Without padding the layers left after the fixed stages must divide evenly over the other stages. With
    ``allow_padding`` each of those stages gets ``ceil(rest / n)`` layers and the last ones get fewer (at least 0).
    """
    require(num_layers >= 1, f"--num-layers={num_layers} must be >= 1")
    if stages == 1:
        return (num_layers,)
    fixed = [first, last]
    rest = num_layers - sum(v for v in fixed if v is not None)
    middle = stages - sum(v is not None for v in fixed)
    require(
        rest >= 0 and (middle > 0 or rest == 0),
        f"--decoder-first/last-pipeline-num-layers ({first}, {last}) do not fit --num-layers={num_layers} "
        f"over {stages} pipeline stages; lower them so the other stages get layers",
    )
    if middle == 0:
        sizes: list[int] = []
    elif rest % middle == 0:
        sizes = [rest // middle] * middle
    elif allow_padding:
        per = -(-rest // middle)
        sizes = []
        left = rest
        for _ in range(middle):
            sizes.append(min(per, left))
            left -= sizes[-1]
    else:
        raise ConfigError(
            f"--num-layers={num_layers} does not split evenly over {stages} pipeline stages "
            f"({rest} layers over {middle} stages); pick a multiple of {middle}, set "
            "--decoder-first/last-pipeline-num-layers, or pass --allow-padding-num-layers"
        )
    if first is not None:
        sizes.insert(0, first)
    if last is not None:
        sizes.append(last)
    if any(s == 0 for s in sizes) and not allow_padding:
        raise ConfigError(f"a pipeline stage would get no transformer layers ({sizes}); use fewer stages")
    return tuple(sizes)


__all__ = ["ConfigError", "ParallelConfig", "split_layers"]
