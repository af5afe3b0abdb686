"""Pure rank arithmetic for tensor, data and pipeline parallelism: which global ranks form which groups.

No ``torch.distributed`` here: everything is integers, so it is tested exhaustively in one process and the same
answers are used to build the real process groups (``megatron.parallel.context``).

Rank order (Megatron's default ``tp-dp-pp``): tensor-parallel rank varies fastest, then data-parallel, then
pipeline::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the ranks of one tensor-parallel group are consecutive (on one node, where the fast links are) and a pipeline
stage is a contiguous block of ``tp * dp`` ranks.  Example, world 8 = tp 2 x dp 2 x pp 2::

    pp_rank 0:  dp 0 -> ranks 0 1 (tp group)   dp 1 -> ranks 2 3
    pp_rank 1:  dp 0 -> ranks 4 5              dp 1 -> ranks 6 7
    tp groups [0 1] [2 3] [4 5] [6 7];  dp groups [0 2] [1 3] [4 6] [5 7];  pp groups [0 4] [1 5] [2 6] [3 7]
    model-parallel (tp x pp) groups [0 1 4 5] [2 3 6 7]

Virtual pipeline stages: with ``chunks`` model chunks per pipeline rank there are ``pp * chunks`` virtual stages,
placed by ``zb_pipeline.schedule.ir.loop_placement`` (stage s on pipeline rank s % pp) or ``v_placement`` (zig-zag,
so the first and the last stage share pipeline rank 0).  The embedding group (ranks holding the first or the last
virtual stage, which share the tied word embeddings) follows the placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from zb_pipeline.schedule.ir import loop_placement, v_placement

__all__ = ["PLACEMENTS", "RankCoords", "RankLayout", "stage_to_pipeline_rank"]

PLACEMENTS = ("loop", "v")


@lru_cache(maxsize=256)
def stage_to_pipeline_rank(pp: int, chunks: int = 1, placement: str = "loop") -> tuple[int, ...]:
    """Pipeline rank (0..pp-1) of each of the ``pp * chunks`` virtual stages under ``placement``."""
    if placement == "loop":
        return loop_placement(pp, chunks)
    if placement == "v":
        return v_placement(pp, chunks)
    raise ValueError(f"unknown stage placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where one global rank sits in the tp x dp x pp grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class RankLayout:
    """The tp x dp x pp grid of ``world_size`` ranks, and every group derived from it.

    Build it with ``RankLayout.build(world_size, tp=..., pp=...)`` (dp derived) or give all four sizes (checked).
    Group lists hold every group of a kind, each a sorted tuple of global ranks; the ``*_group_of(rank)`` methods
    return the one group that contains ``rank``.
    """

    world_size: int
    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(
                f"tp x pp x dp = {self.tp} x {self.pp} x {self.dp} = {self.tp * self.pp * self.dp} != world size "
                f"{self.world_size}; fix --tensor-model-parallel-size / --pipeline-model-parallel-size or the "
                f"number of processes"
            )

    @classmethod
    def build(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> RankLayout:
        """The layout with data-parallel size ``world_size / (tp * pp)``; ``ValueError`` if that is not whole."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if world_size % (tp * pp):
            raise ValueError(
                f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the world size {world_size} (tp x pp x dp must "
                f"equal it); fix --tensor-model-parallel-size / --pipeline-model-parallel-size or launch a multiple "
                f"of {tp * pp} processes"
            )
        return cls(world_size, tp, pp, world_size // (tp * pp))

    # ----------------------------------------------------------------------------------------------- coordinates
    def coords(self, rank: int) -> RankCoords:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        self._check_rank(rank)
        return self._all_coords[rank]

    @cached_property
    def _all_coords(self) -> tuple[RankCoords, ...]:
        out = []
        for rank in range(self.world_size):
            rest, tp_rank = divmod(rank, self.tp)
            pp_rank, dp_rank = divmod(rest, self.dp)
            out.append(RankCoords(tp_rank, dp_rank, pp_rank))
        return tuple(out)

    def rank_of(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The global rank at grid position (tp_rank, dp_rank, pp_rank)."""
        for name, value, size in (
            ("tp_rank", tp_rank, self.tp),
            ("dp_rank", dp_rank, self.dp),
            ("pp_rank", pp_rank, self.pp),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} outside 0..{size - 1}")
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1} (world size {self.world_size})")

    # ---------------------------------------------------------------------------------------------------- groups
    @cached_property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks that shard the same layers (consecutive ranks)."""
        return tuple(
            tuple(self.rank_of(tp_rank=t, dp_rank=d, pp_rank=p) for t in range(self.tp))
            for p in range(self.pp)
            for d in range(self.dp)
        )

    @cached_property
    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks holding the same parameter shard on different data; gradients are averaged over them."""
        return tuple(
            tuple(self.rank_of(tp_rank=t, dp_rank=d, pp_rank=p) for d in range(self.dp))
            for p in range(self.pp)
            for t in range(self.tp)
        )

    @cached_property
    def pp_groups(self) -> tuple[tuple[int, ...], ...]:
        """One pipeline each: its ranks in pipeline order (pp_rank 0 first)."""
        return tuple(
            tuple(self.rank_of(tp_rank=t, dp_rank=d, pp_rank=p) for p in range(self.pp))
            for d in range(self.dp)
            for t in range(self.tp)
        )

    @cached_property
    def stage_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks at one pipeline position (tp x dp): the distributed optimizer's gradient statistics reduce here."""
        return tuple(
            tuple(self.rank_of(tp_rank=t, dp_rank=d, pp_rank=p) for d in range(self.dp) for t in range(self.tp))
            for p in range(self.pp)
        )

    @cached_property
    def mp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Model-parallel groups (tp x pp): together they hold one full model replica (grad-norm, loss sums)."""
        return tuple(
            tuple(sorted(self.rank_of(tp_rank=t, dp_rank=d, pp_rank=p) for p in range(self.pp) for t in range(self.tp)))
            for d in range(self.dp)
        )

    def embedding_groups(self, *, chunks: int = 1, placement: str = "loop") -> tuple[tuple[int, ...], ...]:
        """Per pipeline, the ranks holding the first or the last virtual stage (they share tied embeddings).

        One rank when both stages live on the same rank (pp = 1, or V placement with an even number of chunks).
        """
        return _embedding_groups(self, chunks, placement)

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return self.tp_groups[c.pp_rank * self.dp + c.dp_rank]

    def dp_group_of(self, rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return self.dp_groups[c.pp_rank * self.tp + c.tp_rank]

    def pp_group_of(self, rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return self.pp_groups[c.dp_rank * self.tp + c.tp_rank]

    def mp_group_of(self, rank: int) -> tuple[int, ...]:
        return self.mp_groups[self.coords(rank).dp_rank]

    def embedding_group_of(self, rank: int, *, chunks: int = 1, placement: str = "loop") -> tuple[int, ...] | None:
        """The embedding group ``rank`` belongs to, or ``None`` if it holds neither the first nor the last stage."""
        c = self.coords(rank)
        group = self.embedding_groups(chunks=chunks, placement=placement)[c.dp_rank * self.tp + c.tp_rank]
        return group if rank in group else None

    # ---------------------------------------------------------------------------------------------- the pipeline
    def next_rank(self, rank: int) -> int:
        """The rank of the next pipeline position (wrapping from the last to the first, as virtual stages do)."""
        c = self.coords(rank)
        return self.rank_of(tp_rank=c.tp_rank, dp_rank=c.dp_rank, pp_rank=(c.pp_rank + 1) % self.pp)

    def prev_rank(self, rank: int) -> int:
        """The rank of the previous pipeline position (wrapping from the first to the last)."""
        c = self.coords(rank)
        return self.rank_of(tp_rank=c.tp_rank, dp_rank=c.dp_rank, pp_rank=(c.pp_rank - 1) % self.pp)

    def stage_to_rank(self, rank: int, *, chunks: int = 1, placement: str = "loop") -> tuple[int, ...]:
        """Global rank of each virtual stage in ``rank``'s pipeline (what the pipeline runtime sends to)."""
        pipe = self.pp_group_of(rank)
        return tuple(pipe[p] for p in stage_to_pipeline_rank(self.pp, chunks, placement))

    def stages_of(self, rank: int, *, chunks: int = 1, placement: str = "loop") -> tuple[int, ...]:
        """The virtual stages that ``rank`` holds, in increasing order."""
        pp_rank = self.coords(rank).pp_rank
        return tuple(s for s, p in enumerate(stage_to_pipeline_rank(self.pp, chunks, placement)) if p == pp_rank)

    # ------------------------------------------------------------------------------------------------- printing
    def describe(self) -> str:
        """One line for the start-up summary."""
        return (
            f"world size {self.world_size} = tp {self.tp} x dp {self.dp} x pp {self.pp} "
            f"(rank order tp-dp-pp: tp fastest)"
        )


@lru_cache(maxsize=64)
def _embedding_groups(layout: RankLayout, chunks: int, placement: str) -> tuple[tuple[int, ...], ...]:
    s2p = stage_to_pipeline_rank(layout.pp, chunks, placement)
    ends = sorted({s2p[0], s2p[-1]})
    return tuple(tuple(pipe[p] for p in ends) for pipe in layout.pp_groups)
