"""The classic schedules, with full backward passes (BW): GPipe, 1F1B and interleaved 1F1B.

- ``gpipe``: every rank runs all forwards, then all backwards.  Peak activation memory: m microbatches.
- ``1f1b``: rank r runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards.  Peak memory on rank 0: ``min(p, m)`` microbatches.
- ``interleaved-1f1b``: each rank holds ``chunks`` virtual stages (loop placement: stage ``s`` on rank ``s % p``).
  Microbatches are taken in groups of ``p`` (the last group may be smaller); within a group, all of chunk 0 runs,
  then all of chunk 1, and so on (Megatron's microbatch-group order).  Backwards follow the same order with the
  chunks reversed.  Any ``m >= 1`` is accepted.

All three take ``mem_limit`` only to refuse it: they cannot trade bubble for memory, so a limit below their peak
raises ``ValueError`` naming the smallest limit that works.
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import BW, Action, F, Schedule, loop_placement
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.registry import register


def check_mem_limit(schedule: Schedule, costs: StageCosts, mem_limit: float | None) -> None:
    """Raise ``ValueError`` if a fixed-shape schedule's peak memory exceeds ``mem_limit`` (say what would fit)."""
    if mem_limit is None:
        return
    peaks = peak_memory(schedule, costs)
    need = max(peaks)
    if need > mem_limit + 1e-9 * max(1.0, abs(mem_limit)):
        r = peaks.index(need)
        raise ValueError(
            f"{schedule.name} with p={schedule.num_ranks} m={schedule.num_microbatches} needs a memory limit of at "
            f"least {need:g} (peak on rank {r}), got mem_limit={mem_limit:g}"
        )


def _schedule(name: str, p: int, m: int, chunks: int, ranks: list[list[Action]]) -> Schedule:
    return Schedule(
        name=name,
        num_ranks=p,
        num_stages=p * chunks,
        num_microbatches=m,
        stage_to_rank=loop_placement(p, chunks),
        ranks=tuple(tuple(r) for r in ranks),
    )


@register(
    "gpipe",
    chunks=(1,),
    memory_bound=lambda p, m: m,
    description="GPipe: all forwards, then all backwards (full BW); peak memory m",
)
def gpipe(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """All forwards, then all full backwards in the same microbatch order."""
    ranks = [[F(r, mb) for mb in range(m)] + [BW(r, mb) for mb in range(m)] for r in range(p)]
    sched = _schedule("gpipe", p, m, 1, ranks)
    check_mem_limit(sched, costs, mem_limit)
    return sched


@register(
    "1f1b",
    chunks=(1,),
    memory_bound=lambda p, m: min(p, m),
    description="1F1B: warm-up forwards, then one forward one backward (full BW)",
)
def one_f_one_b(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """PipeDream-flush / Megatron 1F1B with fused backward."""
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [F(r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            acts += [F(r, warmup + i), BW(r, i)]
        acts += [BW(r, mb) for mb in range(m - warmup, m)]
        ranks.append(acts)
    sched = _schedule("1f1b", p, m, 1, ranks)
    check_mem_limit(sched, costs, mem_limit)
    return sched


def interleaved_order(p: int, m: int, chunks: int) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order of forwards on every rank: groups of p microbatches, chunk by chunk."""
    starts = list(range(0, m, p))
    order = []
    for g, first in enumerate(starts):
        group = range(first, starts[g + 1] if g + 1 < len(starts) else m)
        for c in range(chunks):
            order += [(mb, c) for mb in group]
    return order


@register(
    "interleaved-1f1b",
    chunks=None,
    default_chunks=2,
    description="Interleaved 1F1B: several chunks per rank (loop placement), Megatron's microbatch-group order",
)
def interleaved_1f1b(p: int, m: int, *, chunks: int = 2, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """Megatron's interleaved schedule with full backwards, for any m >= 1.

    Rank r warms up with as many forwards as it takes for the first backward's forward (microbatch 0 on the last
    chunk) to be done, plus ``2 (p - r - 1)`` to cover the trip down the pipeline and back; then it alternates
    one forward and one backward, then drains.  With ``m`` a multiple of ``p`` this is exactly Megatron's warm-up
    count ``2 (p - r - 1) + (chunks - 1) p``.  When the last group has ``g < p`` microbatches, the second half of
    the trip is capped at ``g - 1``: with Megatron's full count, rank 0 would wait for the last rank's forward of
    the small group while the last rank waits for rank 0's backward (checked over p <= 16, m <= 64, chunks <= 3
    by the validator under the strict P2P model).  With one chunk the schedule is exactly ``1f1b``.
    """
    fwd = interleaved_order(p, m, chunks)
    bwd = [(mb, chunks - 1 - c) for mb, c in fwd]
    total = len(fwd)
    first_last_chunk = fwd.index((0, chunks - 1))  # forwards before the one the first backward needs
    smallest_group = min(p, m - (m - 1) // p * p)  # the last group's size
    ranks = []
    for r in range(p):
        # Megatron's 2 (p - r - 1) trip, capped so that a small group's chunk hand-off from the last rank back to
        # rank 0 cannot wait on a backward that itself waits for that forward (no deadlock for any m).
        trip = (p - r - 1) + (min(p - r - 1, smallest_group - 1) if chunks > 1 else 0)
        warmup = min(total, first_last_chunk + trip)
        acts = [F(c * p + r, mb) for mb, c in fwd[:warmup]]
        for i in range(total - warmup):
            mb, c = fwd[warmup + i]
            acts.append(F(c * p + r, mb))
            mb, c = bwd[i]
            acts.append(BW(c * p + r, mb))
        acts += [BW(c * p + r, mb) for mb, c in bwd[total - warmup :]]
        ranks.append(acts)
    sched = _schedule("interleaved-1f1b", p, m, chunks, ranks)
    check_mem_limit(sched, costs, mem_limit)
    return sched
