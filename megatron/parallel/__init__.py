"""Parallelism for the trainer: pure rank math, the frozen ParallelContext, tensor-parallel layers, DP grad reduction.

``rank_math`` is pure integers (imported here); ``context`` and ``data_parallel`` need torch and are imported from
their modules directly (``from megatron.parallel.context import ParallelContext``).
"""

from megatron.parallel.rank_math import PLACEMENTS, RankCoords, RankLayout, stage_to_pipeline_rank

__all__ = ["PLACEMENTS", "RankCoords", "RankLayout", "stage_to_pipeline_rank"]
