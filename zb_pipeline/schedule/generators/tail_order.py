"""Orders that lose nothing when the costs a plan was made from turn out wrong (a profile is taken earlier)."""

from __future__ import annotations

from dataclasses import replace

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind, Schedule


def first_stage_tail_w_first(schedule: Schedule, costs: StageCosts) -> Schedule:
    """After a rank's last F, run its pending W's before any B of stage 0 that follows them.

    A B of stage 0 feeds nobody (there is no stage before it) and, once the rank has no F left, frees memory nobody
    waits for; a W placed right before it fills the wait for its input gradient if that gradient comes late, and
    costs nothing if it does not (the rank does the same work either way, and the B can only start once the
    gradient is there).  So the swap never lengthens the plan under *any* costs, and it shortens the run whenever
    the gradient arrives later than planned -- the costs a plan was made from are a profile taken earlier.  Each
    W stays after its own B and the W's keep their order (gradients accumulate in the same order).  A swap that
    would raise the rank's peak memory (a W that frees less than the B) is not made.
    """
    ranks = []
    for acts in schedule.ranks:
        acts = list(acts)
        last_f = max((i for i, a in enumerate(acts) if a.kind is Kind.F), default=-1)
        moved = True
        while moved:
            moved = False
            for i in range(last_f + 1, len(acts) - 1):
                b, w = acts[i], acts[i + 1]
                if (
                    b.kind is Kind.B
                    and b.stage == 0
                    and w.kind is Kind.W
                    and (w.stage, w.microbatch) != (b.stage, b.microbatch)
                    and costs.mem_w[w.stage] <= costs.mem_b[b.stage]
                ):
                    acts[i], acts[i + 1] = w, b
                    moved = True
        ranks.append(acts)
    return replace(schedule, ranks=tuple(tuple(acts) for acts in ranks))
