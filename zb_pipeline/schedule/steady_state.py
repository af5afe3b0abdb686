"""Iteration time in steady state, optimizer step included: synchronised versus post-validated.

``simulate`` gives one iteration's makespan with every rank starting at 0.  Training repeats the plan, and what a
user sees is the *period*: the time from one iteration's start to the next's, optimizer step included.

- **Synchronised optimizer**: every rank waits for the global gradient statistics (one reduction, ``reduce_s``
  after the last rank's last action), then steps (``opt``) and starts the next iteration.  All ranks start
  together, so the period is ``makespan + reduce_s + opt``.
- **Post-validated** (``zb_pipeline.optim.post_validation``): a rank steps (``opt``) as soon as its own last
  action ends and starts the next iteration straight away.  Rank ``r`` starts iteration ``k + 1`` at
  ``end_r(k) + opt``; the next iteration is simulated from those start times (``simulate(rank_start=...)``) until
  the period settles.  The validation chain is not on the critical path: rank ``r`` needs it at its validation
  point, before its first backward, which itself waits for rank ``r + 1``'s first backward, which comes after
  ``r + 1``'s own validation point -- so the state, one hop behind, is there in time.  (Its per-hop latency is
  the same ``costs.comm`` as the activations'.)
"""

from __future__ import annotations

from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.simulate import simulate


@dataclass(frozen=True)
class SteadyState:
    synchronised: float  # period with the synchronised optimizer
    post_validated: float  # period with post-validation
    makespan: float  # one iteration alone, every rank starting at 0

    @property
    def speedup(self) -> float:
        """Synchronised period / post-validated period (above 1: post-validation is faster)."""
        return self.synchronised / self.post_validated


def steady_state(
    schedule: Schedule, costs: StageCosts, *, opt: float, reduce_s: float | None = None, iterations: int = 12
) -> SteadyState:
    """Both periods for ``schedule`` (``reduce_s`` defaults to ``costs.comm``: one reduction hop)."""
    if opt < 0 or iterations < 2:
        raise ValueError(f"need opt >= 0 and iterations >= 2, got {opt=}, {iterations=}")
    reduce_s = costs.comm if reduce_s is None else reduce_s
    first = simulate(schedule, costs)
    synchronised = first.end_time + reduce_s + opt
    start = [0.0] * schedule.num_ranks
    starts = [start[0]]
    for _ in range(iterations):
        sim = simulate(schedule, costs, rank_start=start)
        start = [(tl[-1].end if tl else s) + opt for tl, s in zip(sim.timeline, start)]
        starts.append(min(start))
    half = len(starts) // 2  # the first iterations settle the ranks' offsets; average the rest
    post_validated = (starts[-1] - starts[half]) / (len(starts) - 1 - half)
    return SteadyState(synchronised=synchronised, post_validated=post_validated, makespan=first.end_time)
