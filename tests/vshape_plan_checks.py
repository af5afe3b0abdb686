"""Independent checks of generated plans for the V and interleaved zero-bubble tests.

Written separately from the generators (no shared code) so that a bug in a planner cannot hide itself:
- every (stage, F/B/W, microbatch) exactly once, each on the rank its stage lives on;
- the compute-only timing model of the simulator contract (an action starts at max(previous end on its rank, end of
  each dependency + T_comm when the dependency ran on another rank)); raises if the plan can never finish;
- per-rank peak memory under the mem deltas;
- channel order: for each ordered pair of ranks, the hand-offs are consumed in the order they were produced (what
  the strict one-order-per-pair communication model needs without buffering).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule


@dataclass
class CheckResult:
    makespan: float
    bubble_rate: float
    peak: list[float]
    start: dict[Action, float]
    end: dict[Action, float]


def _deps(a: Action, num_stages: int) -> list[Action]:
    s, mb = a.stage, a.microbatch
    if a.kind is Kind.F:
        return [Action(s - 1, Kind.F, mb)] if s > 0 else []
    if a.kind is Kind.B:
        nxt = Action(s + 1, Kind.B, mb) if s + 1 < num_stages else Action(s, Kind.F, mb)
        return [nxt, Action(s, Kind.F, mb)]
    if a.kind is Kind.W:
        return [Action(s, Kind.B, mb)]
    raise AssertionError(f"unexpected kind in plan: {a}")


def check_plan(sched: Schedule, costs: StageCosts, *, check_channels: bool = True) -> CheckResult:
    S, m, p = sched.num_stages, sched.num_microbatches, sched.num_ranks
    seen: set[Action] = set()
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            assert a.kind in (Kind.F, Kind.B, Kind.W), f"rank {r}: unexpected action {a}"
            assert 0 <= a.stage < S and 0 <= a.microbatch < m, f"rank {r}: out of range {a}"
            assert sched.stage_to_rank[a.stage] == r, f"{a} placed on rank {r}, its stage lives elsewhere"
            assert a not in seen, f"{a} appears twice"
            seen.add(a)
    assert len(seen) == 3 * S * m, f"{3 * S * m - len(seen)} actions missing"

    dur = {Kind.F: costs.f, Kind.B: costs.b, Kind.W: costs.w}
    memd = {Kind.F: costs.mem_f, Kind.B: costs.mem_b, Kind.W: costs.mem_w}
    rank_of = sched.stage_to_rank
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    pos = [0] * p
    free = [0.0] * p
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(sched.ranks[r]):
                a = sched.ranks[r][pos[r]]
                deps = _deps(a, S)
                if any(d not in end for d in deps):
                    break
                t = free[r]
                for d in deps:
                    t = max(t, end[d] + (costs.comm if rank_of[d.stage] != r else 0.0))
                start[a] = t
                end[a] = t + dur[a.kind][a.stage]
                free[r] = end[a]
                pos[r] += 1
                progressed = True
    stuck = [f"rank {r} at {sched.ranks[r][pos[r]]}" for r in range(p) if pos[r] < len(sched.ranks[r])]
    assert not stuck, "plan can never finish: " + ", ".join(stuck)

    peak = []
    for acts in sched.ranks:
        cur = best = 0.0
        for a in acts:
            cur += memd[a.kind][a.stage]
            best = max(best, cur)
        peak.append(best)

    if check_channels:
        # Each cross-rank dependency is one message; the consumer must take them in the producer's order.
        order_on = {a: i for acts in sched.ranks for i, a in enumerate(acts)}
        consumed: dict[tuple[int, int], list[Action]] = defaultdict(list)
        for r, acts in enumerate(sched.ranks):
            for a in acts:
                for d in _deps(a, S):
                    if rank_of[d.stage] != r:
                        consumed[(rank_of[d.stage], r)].append(d)
        for (src, dst), lst in consumed.items():
            produced = sorted(lst, key=lambda d: order_on[d])
            bad = next((i for i, (x, y) in enumerate(zip(lst, produced)) if x != y), None)
            assert bad is None, (
                f"channel {src}->{dst}: message {bad} consumed is {lst[bad]}, but {produced[bad]} was sent first"
            )

    spans = [end[acts[-1]] - start[acts[0]] for acts in sched.ranks if acts]
    makespan = max(spans)
    work = max(sum(dur[a.kind][a.stage] for a in acts) for acts in sched.ranks)
    return CheckResult(makespan, 1.0 - work / makespan, peak, start, end)
