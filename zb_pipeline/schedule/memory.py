"""Activation memory of a plan: each rank's running sum of memory deltas over its compute actions, and its peak.

Deltas come from ``StageCosts``: ``mem_f``, ``mem_b``, ``mem_w`` per virtual stage, and ``mem_b + mem_w`` for a
fused ``BW``.  An overlapped pair (``ir.PairAction``) adds its F's and its BW's; its entry in the running sum is the
sum inside it, after the F and before the BW frees (the runtime runs them back to back; two streams would hold both
at once), which is its peak.  A ``B`` (``BW``) also holds ``mem_b_transient`` (``mem_bw_transient``) of its stage
above the sum before it while it runs (recomputation); its entry is the larger of that and the sum after it.  A rank
starts at 0; communication actions add nothing.  ``running_memory`` is the one implementation of the sum (one rank's
actions in order), ``order_peak`` its peak, ``peak_memory`` the peak of every rank of a plan; the simulator, the
validator and the generators all ask these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind, PlanAction, Schedule

# Enum members as plain constants: the loop compares kinds by identity (hashing a str Enum is slow).
_F, _B, _W, _BW, _PAIR = Kind.F, Kind.B, Kind.W, Kind.BW, Kind.PAIR


def running_memory(actions: Iterable[PlanAction], costs: StageCosts) -> list[float]:
    """One rank's running sum of memory deltas after each of ``actions`` (a communication action repeats the sum
    before it; a pair gives the sum inside it, after its F): the one place the deltas are summed."""
    mf, mb, mw = costs.mem_f, costs.mem_b, costs.mem_w
    if any(costs.mem_b_transient) or any(costs.mem_bw_transient):
        return _running_memory_transient(actions, costs)
    sums: list[float] = []
    append = sums.append
    cur = 0.0
    for a in actions:
        k = a.kind
        if k is not _PAIR:
            s = a.stage
        if k is _F:
            cur += mf[s]
        elif k is _B:
            cur += mb[s]
        elif k is _W:
            cur += mw[s]
        elif k is _BW:
            cur += mb[s] + mw[s]
        elif k is _PAIR:
            f, b = a.forward.stage, a.backward.stage
            inside = cur + mf[f]
            cur = inside + mb[b] + mw[b]
            append(max(inside, cur))
            continue
        append(cur)
    return sums


def _running_memory_transient(actions: Iterable[PlanAction], costs: StageCosts) -> list[float]:
    """``running_memory`` when some B holds a transient above the sum before it (recomputation)."""
    mf, mb, mw, mt, mtw = costs.mem_f, costs.mem_b, costs.mem_w, costs.mem_b_transient, costs.mem_bw_transient
    sums: list[float] = []
    cur = 0.0
    for a in actions:
        k = a.kind
        if k is _PAIR:
            f, b = a.forward.stage, a.backward.stage
            inside = cur + mf[f]
            cur = inside + mb[b] + mw[b]
            sums.append(max(inside + mtw[b], cur))
            continue
        s = a.stage
        if k is _F:
            cur += mf[s]
        elif k is _B or k is _BW:
            before = cur
            cur += mb[s] + (mw[s] if k is _BW else 0.0)
            sums.append(max(before + (mtw[s] if k is _BW else mt[s]), cur))
            continue
        elif k is _W:
            cur += mw[s]
        sums.append(cur)
    return sums


def order_peak(actions: Iterable[PlanAction], costs: StageCosts) -> float:
    """One rank's peak of the running sum of memory deltas over ``actions`` in order (0 if it never rises)."""
    return max(0.0, max(running_memory(actions, costs), default=0.0))


def first_over(actions: Iterable[PlanAction], costs: StageCosts, limit: float) -> tuple[int, float] | None:
    """The first position in ``actions`` where the running sum exceeds ``limit``, with the sum there (or ``None``)."""
    return next(((i, cur) for i, cur in enumerate(running_memory(actions, costs)) if cur > limit), None)


def check_costs_match(schedule: Schedule, costs: StageCosts) -> None:
    """``ValueError`` unless ``costs`` has one entry per virtual stage of ``schedule``."""
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"costs are given for {costs.num_stages} virtual stages, but schedule {schedule.name!r} has "
            f"{schedule.num_stages}"
        )


def peak_memory(schedule: Schedule, costs: StageCosts) -> tuple[float, ...]:
    """Each rank's peak of the running sum of memory deltas over its compute actions, in order (0 at the start)."""
    check_costs_match(schedule, costs)
    return tuple(order_peak(acts, costs) for acts in schedule.ranks)


def schedule_mem_floor(schedule: Schedule, costs: StageCosts) -> float:
    """The smallest ``mem_limit`` that ``schedule`` fits in: its largest per-rank peak."""
    return max(peak_memory(schedule, costs), default=0.0)


def microbatch_bytes(mem_f: Sequence[float], mem_b: Sequence[float], stage_to_rank: Sequence[int]) -> float:
    """The most any rank holds for one microbatch (the sum over its stages of ``max(mem_f, mem_f + mem_b)``: what F
    keeps, or after B what waits for W, with the recompute in force)."""
    per_rank = [0.0] * (max(stage_to_rank) + 1)
    for s, r in enumerate(stage_to_rank):
        per_rank[r] += max(0.0, mem_f[s], mem_f[s] + mem_b[s])
    return max(per_rank)


def schedule_mem_limit(
    costs: StageCosts,
    stage_to_rank: Sequence[int],
    *,
    limit_bytes: float | None = None,
    microbatches: float | None = None,
) -> float | None:
    """A memory-capped generator's limit in the units of ``costs``' memory (bytes per rank): ``limit_bytes`` (a
    byte limit such as ``--pipeline-memory-limit-gb``) and ``microbatches`` (``--zero-bubble-max-pending-backward
    N``: N microbatches of the heaviest rank, ``microbatch_bytes``, plus the largest transient a B holds while it
    recomputes, so N keeps counting pending microbatches under the recompute in force), the smaller of those
    given; ``None`` without either."""
    limits = [] if limit_bytes is None else [float(limit_bytes)]
    if microbatches is not None:
        limits.append(
            pending_bytes(microbatches, costs.mem_f, costs.mem_b, costs.mem_b_transient, stage_to_rank=stage_to_rank)
        )
    return min(limits) if limits else None


def pending_bytes(
    n: float,
    mem_f: Sequence[float],
    mem_b: Sequence[float],
    mem_b_transient: Sequence[float],
    *,
    stage_to_rank: Sequence[int],
) -> float:
    """``--zero-bubble-max-pending-backward n`` in bytes: n microbatches of the heaviest rank
    (``microbatch_bytes``) plus the largest transient a B holds while it recomputes."""
    if not n > 0:
        raise ValueError(f"memory limit of {n} microbatches must be > 0")
    return float(n) * microbatch_bytes(mem_f, mem_b, stage_to_rank) + max(mem_b_transient, default=0.0)
