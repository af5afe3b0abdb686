"""Local search over per-rank action orders: move one action a few places, keep the move if the plan gets shorter.

Why: the V generators (``v_shape``) build whole plans from a list scheduler or a repeated building block.  Where
the memory cap is about the least any steady state needs (``v-min`` at p = 3, 6, 9, ...), both leave a few time
units on the table in the warm-up and cool-down that no priority rule recovers; the exact MILP
(``schedule/milp.py``) shows the gap, e.g. p = 3, m = 6, F = B = 2W: optimum 49 against 52 from the heuristics.
A hill climb on the orders closes most of it for small plans (50 there).

The move: take one action of one rank and put it back up to ``reach`` positions earlier or later on that rank.
A move is kept when the plan still completes (the simulator raises on a dependency cycle), every rank's peak stays
within its cap, and (makespan, sum of rank spans) strictly drops; the scan restarts at the next action of the same
rank.  The search is deterministic and bounded by ``budget`` simulated plans, so the same inputs always give the
same plan and the cost stays small (each evaluation is one O(actions) simulation).
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule
from zb_pipeline.schedule.memory import order_peak
from zb_pipeline.schedule.simulate import simulate

_EPS = 1e-9


def _spans(sched: Schedule, ranks: list[tuple[Action, ...]], costs: StageCosts) -> tuple[float, float] | None:
    """(makespan, sum of rank spans) of ``sched`` with its per-rank orders replaced by ``ranks``; ``None`` if
    that order can never finish (the simulator's own timing: as fast as a stripped copy of it, measured)."""
    trial = Schedule(sched.name, sched.num_ranks, sched.num_stages, sched.num_microbatches, sched.stage_to_rank, ranks)
    try:
        res = simulate(trial, costs)
    except ValueError:  # moves only reorder a rank's own actions: the only failure left is a deadlock
        return None
    return res.makespan, sum(res.rank_span)


def polish_orders(
    sched: Schedule, costs: StageCosts, caps: list[float], *, reach: int = 4, budget: int = 3000
) -> Schedule:
    """A plan at least as short as ``sched`` (same actions, reordered within each rank), within ``caps``.

    ``caps[r]`` bounds rank ``r``'s peak (the input must already respect it); at most ``budget`` candidate orders
    are timed.  Plans with a fused BW or communication actions are returned unchanged.
    """
    if any(a.kind not in (Kind.F, Kind.B, Kind.W) for acts in sched.ranks for a in acts):
        return sched
    ranks = [tuple(acts) for acts in sched.ranks]
    best = _spans(sched, ranks, costs)
    if best is None or any(order_peak(acts, costs) > cap + _EPS for acts, cap in zip(ranks, caps)):
        raise ValueError(f"polish_orders: the input plan {sched.name!r} does not finish within its caps")
    evals, improved = 0, False
    changed = True
    while changed and evals < budget:
        changed = False
        for r in range(len(ranks)):
            i = 0
            while i < len(ranks[r]) and evals < budget:
                order = list(ranks[r])
                for d in (*range(-reach, 0), *range(1, reach + 1)):
                    j = i + d
                    if not 0 <= j < len(order) or evals >= budget:
                        continue
                    cand = order[:]
                    cand.insert(j, cand.pop(i))
                    if order_peak(cand, costs) > caps[r] + _EPS:
                        continue
                    trial = ranks[:r] + [tuple(cand)] + ranks[r + 1 :]
                    evals += 1
                    sc = _spans(sched, trial, costs)
                    if sc is not None and (
                        sc[0] < best[0] - _EPS or (sc[0] < best[0] + _EPS and sc[1] < best[1] - _EPS)
                    ):
                        best, ranks, changed, improved = sc, trial, True, True
                        break
                i += 1
    if not improved:
        return sched
    return Schedule(sched.name, sched.num_ranks, sched.num_stages, sched.num_microbatches, sched.stage_to_rank, ranks)
