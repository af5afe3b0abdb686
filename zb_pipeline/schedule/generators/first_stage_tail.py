"""The tail of the rank that holds stage 0, re-ordered by when its inputs arrive (a post-pass of ``v_shape``).

Once the rank holding stage 0 has run its last F and its last B of any other stage, nothing it still runs feeds
another action: what is left are B's of stage 0 (whose output is a weight gradient nobody waits for) and W's.  The
rest of the plan cannot see this suffix, so its order moves only this rank's end.  The inputs of the suffix are
fixed: each B of stage 0 is released when the gradient from stage 1 arrives (simulated on the unchanged plan), a W
when its own B ends.

The generators' passes fill a wait for a B with a W only when the W fits into it (or the wait is long): right for a
B that others wait for, wrong here.  In a cool-down whose B's arrive slightly more than ``B + W`` apart, each wait is
a little shorter than a W, so the W's slip one B behind and the rank ends with two W's after its last B instead of
one (the zero-bubble paper's ZB-V rows at p = 16: one W of the 2-3% of idle time).  The pass re-orders the suffix
greedily: a released B first (in the plan's order), else the next W whose B has run (W's keep their order, so the
weight gradients accumulate in the same order), else wait for the next release.  The result is kept only if the
plan gets strictly shorter and the rank's peak memory stays within its cap.

``tail_candidate`` runs it on a V plan with the compiled pass (``_v_shape_cpp.tail_fill``: one timed run of the
plan and the same greedy, same floating-point expressions) or with this reference.
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape_codes import cpp, to_codes, to_schedule
from zb_pipeline.schedule.ir import Action, Kind, Schedule
from zb_pipeline.schedule.memory import order_peak
from zb_pipeline.schedule.simulate import SimResult, simulate

_EPS = 1e-9


def _suffix_start(acts: tuple) -> int:
    """Position after the rank's last action that another action depends on (an F, or a B of a stage > 0)."""
    for i in range(len(acts) - 1, -1, -1):
        a = acts[i]
        if a.kind is Kind.F or (a.kind is Kind.B and a.stage > 0):
            return i + 1
    return 0


def fill_first_stage_tail(sched: Schedule, costs: StageCosts, res: SimResult, cap: float) -> tuple[float, Schedule]:
    """(makespan, plan) with the suffix of stage 0's rank re-ordered (see the module docstring); ``sched`` and its
    makespan unchanged when that is not strictly shorter or would exceed ``cap`` (the rank's peak memory bound).
    ``res`` is ``sched``'s simulation under ``costs``."""
    unchanged = (res.makespan, sched)
    if any(a.kind not in (Kind.F, Kind.B, Kind.W) for acts in sched.ranks for a in acts):
        return unchanged
    place = sched.stage_to_rank
    r0 = place[0]
    acts = sched.ranks[r0]
    cut = _suffix_start(acts)
    if cut == 0 or cut >= len(acts) - 1:
        return unchanged
    # When each B of stage 1 ends (its rank's times; the suffix cannot change them), and this rank's B's before the cut.
    b_end: dict[tuple[int, int], float] = {}
    for q in {place[1] if len(place) > 1 else r0, r0}:
        idx, _, ends = res.rank_times(q)
        plan = sched.ranks[q]
        for i, e in zip(idx, ends):
            a = plan[i]
            if a.kind is Kind.B and (a.stage == 1 or (q == r0 and i < cut)):
                b_end[(a.stage, a.microbatch)] = e
    idx, starts, ends = res.rank_times(r0)
    pos = {i: j for j, i in enumerate(idx)}
    t = ends[pos[cut - 1]]
    hop = costs.comm if len(place) > 1 and place[1] != r0 else 0.0
    bs = [a for a in acts[cut:] if a.kind is Kind.B]
    ws = [a for a in acts[cut:] if a.kind is Kind.W]
    out: list[Action] = []
    ib = iw = 0
    while ib < len(bs) or iw < len(ws):
        rel_b = b_end[(1, bs[ib].microbatch)] + hop if ib < len(bs) else float("inf")
        w_key = (ws[iw].stage, ws[iw].microbatch) if iw < len(ws) else None
        rel_w = b_end.get(w_key, float("inf")) if w_key is not None else float("inf")
        if ib < len(bs) and rel_b <= t + _EPS:
            a, dur = bs[ib], costs.b[0]
            ib += 1
            b_end[(0, a.microbatch)] = t + dur
        elif rel_w <= t + _EPS:
            a, dur = ws[iw], costs.w[ws[iw].stage]
            iw += 1
        else:
            t = min(rel_b, rel_w)
            continue
        out.append(a)
        t += dur
    span = t - starts[0]
    others = max((s for q, s in enumerate(res.rank_span) if q != r0), default=0.0)
    new = max(others, span)
    if new >= res.makespan - _EPS:
        return unchanged
    ranks = list(sched.ranks)
    ranks[r0] = tuple(acts[:cut]) + tuple(out)
    if order_peak(ranks[r0], costs) > cap + _EPS:
        return unchanged
    return new, Schedule(sched.name, sched.num_ranks, sched.num_stages, sched.num_microbatches, place, ranks)


def tail_candidate(
    name: str, p: int, m: int, costs: StageCosts, sched: Schedule, cap: float, backend: str
) -> tuple[float, Schedule] | None:
    """``fill_first_stage_tail`` on V plan ``sched`` (stage 0 on rank 0), compiled when ``backend == "cpp"``: the
    (makespan, plan) it gives, or ``None`` where it hands ``sched`` back."""
    if backend != "cpp" or not hasattr(cpp, "tail_fill"):  # the reference (also under a build older than the pass)
        span, out = fill_first_stage_tail(sched, costs, simulate(sched, costs), cap)
        return None if out is sched else (span, out)
    codes = to_codes(sched.ranks, m)
    got = cpp.tail_fill(p, m, costs.f, costs.b, costs.w, costs.comm, codes)
    if got is None:
        return None
    span, codes[0] = got
    out = to_schedule(name, p, m, codes)
    return None if order_peak(out.ranks[0], costs) > cap + _EPS else (span, out)
