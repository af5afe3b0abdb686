"""How fast *any* plan of a layout can be: a lower bound on the iteration time under given per-stage costs.

A speed-up over 1F1B has a ceiling that no scheduler can break, and a benchmark should say where it lies before it
judges a measured ratio.  Under the simulator's model (``zb_pipeline.schedule.simulate``: every rank runs one action
at a time, an action starts once its inputs exist, ``costs.comm`` per cross-rank hop), with every rank starting at 0
and ``m`` microbatches, each rank ``r`` gives two bounds on the time its last action ends:

- **first input**: no action of virtual stage ``s`` can start before ``F(s, 0)``'s input exists, i.e. before the
  forward chain ``F(0) .. F(s - 1)`` and its hops have run (``forward_arrival(s)``).  After the earliest such moment
  over the rank's stages it still has all its own work to do: ``m * sum(f + b + w)`` over its stages;
- **first gradient**: no ``B`` (or ``W``) of stage ``s`` can start before the gradient chain from the loss reaches
  it (``backward_arrival(s)``: the whole forward chain, the last stage's ``F``, then ``B(S - 1) .. B(s + 1)`` and
  their hops); after the earliest such moment the rank still has all its ``B`` and ``W`` to do: ``m * sum(b + w)``.

The iteration cannot end before the largest of these over all ranks.  The bound holds for every plan -- fused
backwards (a ``BW`` costs ``b + w`` and releases the gradient later than a ``B``), any memory limit, any order -- and
it is *attained* in cases that matter: at p = 2 with the last stage the heavier one, zb-auto without a memory limit
ends exactly at it and ZB-H2 (at most 2p - 1 microbatches in flight) within 1% (``tests/test_iteration_bound.py``).
Then 1F1B's simulated iteration over the bound is the largest speed-up any schedule of that layout can show.  At
F = B = 2W, p = 2 that ceiling is (m + 1) * 2.5 / (1 + 2.5 m): 1.136x at m = 4, only 1.071x at m = 8
(``theory_ceiling``).

The bound is on the end of the iteration (``SimResult.end_time``: what a user's iteration costs between two
barriers), not on ``SimResult.makespan``, the longest *per-rank* span, which leaves out the time a rank waits for its
first input and can be shorter.  It ignores memory, so plans under a tight limit may stay above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts


@dataclass(frozen=True)
class IterationBound:
    """The lower bound and where it comes from."""

    time: float  # no plan of this layout ends an iteration earlier (all ranks starting at 0)
    rank: int  # the rank whose bound is the largest
    reason: str  # "first input" or "first gradient": which of the two bounds of ``rank`` it is
    per_rank: tuple[float, ...]  # each rank's larger bound


def forward_arrival(costs: StageCosts, stage_to_rank: Sequence[int], stage: int) -> float:
    """The earliest time ``F(stage, mb)`` can start: ``F(0) .. F(stage - 1)`` and the hops between ranks."""
    t = 0.0
    for k in range(stage):
        t += costs.f[k] + (costs.comm if stage_to_rank[k] != stage_to_rank[k + 1] else 0.0)
    return t


def backward_arrival(costs: StageCosts, stage_to_rank: Sequence[int], stage: int) -> float:
    """The earliest time ``B(stage, mb)`` can start: the forward chain to the loss, then ``B(S - 1) .. B(stage + 1)``
    and the hops between ranks."""
    last = costs.num_stages - 1
    t = forward_arrival(costs, stage_to_rank, last) + costs.f[last]
    for k in range(last, stage, -1):
        t += costs.b[k] + (costs.comm if stage_to_rank[k] != stage_to_rank[k - 1] else 0.0)
    return t


def _arrivals(costs: StageCosts, stage_to_rank: Sequence[int]) -> tuple[list[float], list[float]]:
    """``forward_arrival`` and ``backward_arrival`` of every stage in one pass each (the same sums, in the same
    order, so the same floats)."""
    n = costs.num_stages
    fwd = [0.0] * n
    for k in range(n - 1):
        fwd[k + 1] = fwd[k] + (costs.f[k] + (costs.comm if stage_to_rank[k] != stage_to_rank[k + 1] else 0.0))
    bwd = [0.0] * n
    bwd[n - 1] = fwd[n - 1] + costs.f[n - 1]
    for k in range(n - 1, 0, -1):
        bwd[k - 1] = bwd[k] + (costs.b[k] + (costs.comm if stage_to_rank[k] != stage_to_rank[k - 1] else 0.0))
    return fwd, bwd


def iteration_lower_bound(costs: StageCosts, stage_to_rank: Sequence[int], num_microbatches: int) -> IterationBound:
    """No plan with this placement and ``num_microbatches`` ends an iteration before ``.time`` under ``costs``."""
    m = num_microbatches
    if m < 1:
        raise ValueError(f"num_microbatches={m} must be >= 1")
    if len(stage_to_rank) != costs.num_stages:
        raise ValueError(
            f"stage_to_rank has {len(stage_to_rank)} entries but the costs cover {costs.num_stages} stages; "
            "pass the schedule's stage_to_rank with costs built for it"
        )
    num_ranks = max(stage_to_rank) + 1
    fwd, bwd = _arrivals(costs, stage_to_rank)
    by_rank: list[list[int]] = [[] for _ in range(num_ranks)]  # one pass: O(stages), not O(ranks x stages)
    for s, owner in enumerate(stage_to_rank):
        by_rank[owner].append(s)
    per_rank, reasons = [], []
    for r, stages in enumerate(by_rank):
        if not stages:
            raise ValueError(f"rank {r} holds no stage in stage_to_rank={tuple(stage_to_rank)}")
        backward_work = m * sum(costs.b[s] + costs.w[s] for s in stages)
        by_input = min(fwd[s] for s in stages) + backward_work
        by_input += m * sum(costs.f[s] for s in stages)
        by_gradient = min(bwd[s] for s in stages) + backward_work
        per_rank.append(max(by_input, by_gradient))
        reasons.append("first input" if by_input >= by_gradient else "first gradient")
    rank = max(range(num_ranks), key=lambda r: per_rank[r])
    return IterationBound(time=per_rank[rank], rank=rank, reason=reasons[rank], per_rank=tuple(per_rank))


def theory_ceiling(num_ranks: int, num_microbatches: int, f: float = 1.0, b: float = 1.0, w: float = 0.5) -> float:
    """The largest speed-up over 1F1B any schedule can reach for uniform stages (one per rank, no communication
    cost): 1F1B's iteration, ``(m + p - 1)(f + b + w)``, over ``iteration_lower_bound`` -- for ``m >= p`` that is
    ``(p - 1) f + m (f + b + w)``, the last rank waiting for its first input and then busy to the end."""
    p, m = num_ranks, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need num_ranks >= 1 and num_microbatches >= 1, got {p=}, {m=}")
    costs = StageCosts.build(num_ranks=p, f=f, b=b, w=w)
    bound = iteration_lower_bound(costs, tuple(range(p)), m)
    return (m + p - 1) * (f + b + w) / bound.time
