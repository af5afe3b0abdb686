"""tip_hold: the tip of the V re-planned at its last forwards changes only the tip and its feeder, keeps the plan
valid, within its caps and each stage's W's in microbatch order, is kept only when the plan gets shorter, and gives
the same plan from the compiled timing and the Python reference."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.tip_hold import end_times, tip_hold
from zb_pipeline.schedule.generators.v_shape import peak_caps, plan_variants, rank_caps
from zb_pipeline.schedule.generators.v_shape_codes import actions_of, cpp, to_codes, to_schedule
from zb_pipeline.schedule.ir import Kind, v_placement
from zb_pipeline.schedule.memory import order_peak
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

needs_cpp = pytest.mark.skipif(not hasattr(cpp, "end_times"), reason="C++ extension not built (or built before it)")


def _costs(p: int) -> StageCosts:
    """F = B = 1, W = 0.7 per chunk, T_comm = 0.1; B frees 60% of F's activation, W the rest (as the paper table)."""
    return StageCosts.build(
        num_ranks=p, chunks=2, stage_to_rank=v_placement(p, 2), f=2.0, b=2.0, w=1.4, comm=0.1, mem_f=1, mem_b=-0.6,
        mem_w=-0.4,
    )  # fmt: skip


def _start(p: int, m: int, costs: StageCosts):
    """The other candidates' best (what v_shape hands the pass), the pass's own candidate, and the caps."""
    caps = peak_caps(p, costs, rank_caps("zb-v", p, costs, None))
    variants = plan_variants("zb-v", p, m, costs, rank_caps("zb-v", p, costs, None))
    best = variants[0]
    for cand in variants[1:-1]:
        if cand[0] < best[0] - 1e-9:
            best = cand
    return best, variants[-1], caps


def _last_f_end(sched, costs, rank: int) -> float:
    res = simulate(sched, costs)
    return max(x.end for x in res.timeline[rank] if x.action.kind is Kind.F)


@needs_cpp
def test_tip_hold_shortens_and_touches_only_the_tip_and_its_feeder() -> None:
    """zb-v at p = 4, m = 8: the other candidates' best ends at 46.1; with two more B's before the tip's last forward
    and three more W's after it, the plan ends at 46.0 (measured; 3 W - 2 B = 0.1 per chunk)."""
    p, m = 4, 8
    costs = _costs(p)
    (span, start), (new_span, out), caps = _start(p, m, costs)
    assert span == pytest.approx(46.1, abs=1e-9) and new_span == pytest.approx(46.0, abs=1e-9)
    got = tip_hold(p, m, costs, to_codes(start.ranks, m), span, caps, "cpp")
    assert got is not None and got[0] == new_span and to_schedule("zb-v", p, m, got[1]).ranks == out.ranks
    assert simulate(out, costs).makespan == new_span
    assert out.ranks[: p - 2] == start.ranks[: p - 2]  # only the feeder and the tip change ...
    for q in (p - 2, p - 1):  # ... each runs the same actions, within its cap
        assert Counter(out.ranks[q]) == Counter(start.ranks[q])
        assert order_peak(out.ranks[q], costs) <= caps[q] + 1e-9
    for s in (p - 1, p):  # the tip's W's of each stage keep microbatch order
        assert [a.microbatch for a in out.ranks[p - 1] if a.kind is Kind.W and a.stage == s] == list(range(m))
    assert _last_f_end(out, costs, p - 1) < _last_f_end(start, costs, p - 1) - 1e-9
    check_and_lower(out, costs=costs)


@needs_cpp
def test_tip_hold_reference_gives_the_same_plan() -> None:
    """The Python timing (``simulate``) and the compiled one give the same plan and numbers."""
    p, m = 5, 10
    costs = _costs(p)
    (span, start), _, caps = _start(p, m, costs)
    codes = to_codes(start.ranks, m)
    a = tip_hold(p, m, costs, codes, span, caps, "cpp")
    b = tip_hold(p, m, costs, codes, span, caps, "python")
    assert a is not None and a == b
    assert end_times(p, m, costs, codes, "cpp") == end_times(p, m, costs, codes, "python")


def _best_other(p: int, m: int, costs: StageCosts):
    """What ``v_shape`` hands the pass: the other candidates' best (span, codes), and the peak caps."""
    (span, start), _, caps = _start(p, m, costs)
    return span, to_codes(start.ranks, m), caps


@pytest.mark.parametrize(
    "case, shorter",
    [("paper", True), ("w_heavy", False)],  # paper: 46.1 -> 46.0; w_heavy (W = 1.3 F, T_comm = 0.25 F): 60.2 -> 60.5
)
def test_tip_hold_kept_only_when_shorter(case: str, shorter: bool) -> None:
    """``old`` only gates the result: the pass's own plan (asked with ``old`` = inf) comes back exactly when its
    makespan is strictly under ``old``, within every rank's cap.  Both directions on real plans: at the paper-like
    costs the pass shortens the other candidates' best, with heavier W's and T_comm it lengthens it."""
    p, m = 4, 8
    if case == "paper":
        costs = _costs(p)
    else:
        costs = StageCosts.build(
            num_ranks=p, chunks=2, stage_to_rank=v_placement(p, 2), f=2.0, b=2.0, w=2.6, comm=0.5, mem_f=1,
            mem_b=-0.6, mem_w=-0.4,
        )  # fmt: skip
    span, codes, caps = _best_other(p, m, costs)
    own = tip_hold(p, m, costs, codes, math.inf, caps, "python")
    assert own is not None
    assert (own[0] < span - 1e-6) is shorter  # each case on its side of the line, not at it
    assert tip_hold(p, m, costs, codes, span, caps, "python") == (own if shorter else None)
    assert tip_hold(p, m, costs, codes, own[0], caps, "python") is None  # as long: not kept
    assert tip_hold(p, m, costs, codes, own[0] + 1e-6, caps, "python") == own  # shorter by a hair: kept
    assert own[0] == simulate(to_schedule("zb-v", p, m, own[1]), costs).makespan
    for q in range(p):
        assert order_peak(actions_of(p, m, own[1][q]), costs) <= caps[q] + 1e-9
    # A tip cap below the plan's peak: that plan is never handed back; whatever is must keep the lower cap.
    tight = list(caps)
    tight[p - 1] = order_peak(actions_of(p, m, own[1][p - 1]), costs) - 0.1
    got = tip_hold(p, m, costs, codes, math.inf, tight, "python")
    assert got != own and (got is None or order_peak(actions_of(p, m, got[1][p - 1]), costs) <= tight[p - 1] + 1e-9)


def test_tip_hold_hands_nothing_back_at_uniform_costs() -> None:
    """At uniform costs zb-v is at its bound already: the search finds no earlier last forward, whatever ``old``."""
    p, m = 4, 8
    costs = StageCosts.uniform(2 * p)
    span, codes, caps = _best_other(p, m, costs)
    assert tip_hold(p, m, costs, codes, math.inf, caps, "python") is None
