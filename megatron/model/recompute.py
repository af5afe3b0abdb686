"""Activation recomputation applied to built GPT stages from outside (``--recompute-*``; ``docs/recompute.md``).

``apply_recompute(model, config, tp)`` sets, on every ``GPTStage`` in ``model``, the runs of layers recomputed at
backward (``RecomputeConfig.segments``: full granularity) and, on every ``SelfAttention`` of a stage, whether its core
attention is (selective granularity); with ``--recompute-granularity auto`` each stage takes the planner's choice
(``RecomputeConfig.for_stage``).  The model code then wraps those units in ``zb_pipeline.runtime.recompute.recompute``,
which replays the RNG state, recomputes once in B and leaves the weight-gradient GEMMs deferred to W.

``--distribute-saved-activations``: a recomputed run keeps only this tensor-parallel rank's slice of its (flattened)
input and all-gathers it when B recomputes (``TPSlice``).
"""

from __future__ import annotations

import torch

from megatron.config.recompute import RecomputeConfig
from megatron.model.attention import SelfAttention
from megatron.model.gpt import GPTStage
from megatron.parallel.tensor_parallel.mappings import HasTensorParallel, all_gather_along


class TPSlice:
    """``pack``/``unpack`` of a recomputed run's input: keep ``1/tp`` of it (padded to split evenly), gather at B."""

    def __init__(self, tp: HasTensorParallel) -> None:
        self.tp = tp

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        part = -(-flat.numel() // self.tp.tp_size)
        start = self.tp.tp_rank * part
        mine = flat[start : start + part]
        out = torch.zeros(part, dtype=x.dtype, device=x.device)
        out[: mine.numel()] = mine  # a copy: the full input's storage can go
        return out

    def unpack(self, kept: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        full = all_gather_along(kept, 0, self.tp)
        return full[: shape.numel()].view(shape)


def apply_recompute(model: torch.nn.Module, config: RecomputeConfig, tp: HasTensorParallel | None = None) -> int:
    """Mark the recomputed units of every stage in ``model``; returns how many units were marked."""
    marked = 0
    options: dict = {}
    if config.distribute_saved_activations and tp is not None and tp.tp_size > 1:
        codec = TPSlice(tp)
        options = {"pack": codec.pack, "unpack": codec.unpack}
    for stage in (m for m in model.modules() if isinstance(m, GPTStage)):
        mine = config.for_stage(stage.layer_range)  # --recompute-granularity auto: the planner's choice here
        stage.recompute_segments = mine.segments(len(stage.layers))
        stage.recompute_options = options
        marked += len(stage.recompute_segments)
        for module in stage.modules():
            if isinstance(module, SelfAttention):
                module.recompute_core = mine.selective
                marked += int(mine.selective)
    return marked
