"""zb-auto: never worse than the handcrafted plans at their memory, within its limit, plans from real costs."""

from __future__ import annotations

import random
import statistics

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators import zb_auto as Z
from zb_pipeline.schedule.generators import zb_auto_bound, zb_auto_family, zb_auto_passes, zb_auto_polish
from zb_pipeline.schedule.generators.tail_order import first_stage_tail_w_first
from zb_pipeline.schedule.generators.zero_bubble import zb_h1_order, zb_h2_order
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

# (F, B, W): F = B = W, F = B = 2W, B = 2F, W = 2F; communication costs from none to one F.
RATIOS = ((1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 2.0))
COMMS = (0.0, 0.1, 0.3, 1.0)


def _shapes(ps, dense: bool):
    for p in ps:
        ms = range(1, 65) if dense else sorted({1, 2, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 2})
        for m in ms:
            yield p, m


def _check_dominance(p: int, m: int, f: float, b: float, w: float, c: float) -> None:
    costs = StageCosts.uniform(p, f=f, b=b, w=w, comm=c)
    h1 = simulate(zb_h1_order(p, m), costs).makespan
    h2 = simulate(zb_h2_order(p, m, costs), costs).makespan
    for limit, handcrafted in ((p, h1), (2 * p - 1, h2)):
        res = Z.search(p, m, costs, limit)
        sim = simulate(res.schedule, costs)
        # The search scores plans with the simulator's timing and reports its own result (not a handcrafted plan).
        assert sim.makespan == pytest.approx(res.makespan, rel=1e-12, abs=1e-12)
        assert max(sim.peak_memory) <= limit + 1e-9
        assert res.lower_bound <= res.makespan + 1e-9
        assert res.makespan <= handcrafted + 1e-9, (p, m, (f, b, w, c), limit, res.policy.label)


@pytest.mark.parametrize("f,b,w", RATIOS)
def test_never_worse_than_zb_h1_and_zb_h2_subset(f: float, b: float, w: float) -> None:
    for p, m in _shapes((1, 2, 3, 4, 6), dense=False):
        for c in COMMS:
            _check_dominance(p, m, f, b, w, c)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 17))
def test_never_worse_than_zb_h1_and_zb_h2_full(p: int) -> None:
    for _, m in _shapes((p,), dense=True):
        for f, b, w in RATIOS:
            for c in COMMS:
                _check_dominance(p, m, f, b, w, c)


def test_handcrafted_orders_are_members_of_the_family() -> None:
    # The anchors reproduce ZB-H1 and ZB-H2 action for action (so the search can express them, with c > 0 too).
    for p, m in ((1, 3), (3, 2), (4, 9), (5, 13)):
        costs = StageCosts.uniform(p, f=1.0, b=2.0, w=1.0, comm=0.3)
        h1_pol, h2_pol = zb_auto_family.anchors(p, m)
        for pol, limit, ref in ((h1_pol, p, zb_h1_order(p, m)), (h2_pol, 2 * p - 1, zb_h2_order(p, m, costs))):
            st = zb_auto_passes.StageArrays.of(costs, zb_auto_bound.resolve_mem_limit(p, costs, limit))
            plans, _, score, _ = zb_auto_passes.Engine(zb_auto_passes.resolve_backend(None), m, st).run(
                pol, want_plan=True
            )
            raw = zb_auto_passes.codes_to_schedule(ref.name, p, m, plans)
            # zb-h2 adds the tail rule on top (tail_order); ZB-H1's order has nothing for it to move.
            assert first_stage_tail_w_first(raw, costs).ranks == ref.ranks, (p, m, pol.label)
            assert score == pytest.approx(simulate(raw, costs).makespan, rel=1e-12)
            assert simulate(ref, costs).makespan <= score + 1e-12


@pytest.mark.parametrize("f,b,w", RATIOS[:2])
def test_lower_bound_is_reached_where_theory_says(f: float, b: float, w: float) -> None:
    # c = 0, F = B: ZB-H1's makespan at limit p and ZB-H2's at 2p - 1 equal the analytic lower bound, so the
    # search proves them optimal and stops.
    for p in (2, 4, 7):
        for m in (2 * p, 3 * p + 1):
            costs = StageCosts.uniform(p, f=f, b=b, w=w)
            for limit, bubble in ((p, (p - 1) * (f + b - w)), (2 * p - 1, max(0.0, (p - 1) * (f + b - 2 * w)))):
                res = Z.search(p, m, costs, limit)
                assert res.lower_bound == pytest.approx(m * (f + b + w) + bubble)
                assert res.makespan == pytest.approx(res.lower_bound)


def _random_costs(rng: random.Random, p: int) -> StageCosts:
    def vals(base: float) -> list[float]:
        out = [base * rng.uniform(0.8, 1.25) for _ in range(p)]
        out[0] *= rng.uniform(1.0, 1.6)  # embedding
        out[-1] *= rng.uniform(1.2, 2.2)  # output head and loss
        return out

    return StageCosts.build(num_ranks=p, f=vals(1.0), b=vals(1.1), w=vals(0.9), comm=rng.choice([0.0, 0.1, 0.3]))


def _median_costs(costs: StageCosts) -> StageCosts:
    p = costs.num_stages
    return StageCosts.uniform(
        p, f=statistics.median(costs.f), b=statistics.median(costs.b), w=statistics.median(costs.w), comm=costs.comm
    )


@pytest.mark.parametrize("seed", range(6))
def test_real_stage_costs_beat_a_median_plan(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(4):
        p = rng.randint(2, 8)
        m = rng.choice([p, 2 * p, 3 * p + 1, 4 * p])
        costs = _random_costs(rng, p)
        for limit in (p, 2 * p - 1):
            true_plan = Z.search(p, m, costs, limit)
            median_plan = Z.search(p, m, _median_costs(costs), limit).schedule
            ours = simulate(true_plan.schedule, costs).makespan
            theirs = simulate(median_plan, costs).makespan
            assert ours <= theirs + 1e-9, (seed, p, m, limit, ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 60))
def test_real_stage_costs_beat_a_median_plan_many(seed: int) -> None:
    test_real_stage_costs_beat_a_median_plan(seed)


def test_limit_below_one_microbatch_names_the_smallest_that_works() -> None:
    costs = StageCosts.build(num_ranks=4, mem_f=[1.0, 1.0, 1.0, 2.5])
    with pytest.raises(ValueError, match=r"smallest limit that works is 2\.5"):
        generate("zb-auto", 4, 8, costs=costs, mem_limit=2.0)
    sched = generate("zb-auto", 4, 8, costs=costs, mem_limit=2.5)
    check_and_lower(sched, costs=costs, mem_limit=2.5)


@pytest.mark.parametrize("limit", [1, 2, 3, 5, None])
def test_any_limit_is_respected_and_validates(limit: float | None) -> None:
    for p, m in ((1, 3), (3, 2), (4, 9), (5, 13)):
        costs = StageCosts.uniform(p, f=1.0, b=1.3, w=0.8, comm=0.2)
        sched = generate("zb-auto", p, m, costs=costs, mem_limit=limit)
        cap = (2 * p - 1) if limit is None else limit
        check_and_lower(sched, costs=costs, mem_limit=cap)


def test_default_limit_is_2p_minus_1_microbatches() -> None:
    costs = StageCosts.build(num_ranks=3, mem_f=[1.0, 2.0, 0.5])
    assert zb_auto_bound.resolve_mem_limit(3, costs, None) == (5.0, 10.0, 2.5)


def test_zero_bubble_is_reached_when_memory_allows() -> None:
    p, m = 6, 24
    costs = StageCosts.uniform(p)
    res = Z.search(p, m, costs, None)
    assert res.makespan == pytest.approx(3 * m)  # no idle time at all on the busiest rank


def test_evaluator_matches_simulator() -> None:
    rng = random.Random(3)
    for _ in range(5):
        p, m = rng.randint(1, 6), rng.randint(1, 14)
        costs = _random_costs(rng, p)
        st = zb_auto_passes.StageArrays.of(costs, zb_auto_bound.resolve_mem_limit(p, costs, None))
        for sched in (zb_h1_order(p, m), zb_h2_order(p, m, costs)):
            codes = [[zb_auto_passes._KINDS.index(a.kind) * m + a.microbatch for a in acts] for acts in sched.ranks]
            assert zb_auto_passes.evaluate_py(m, st, codes) == pytest.approx(simulate(sched, costs).makespan, rel=1e-12)


@pytest.mark.skipif(zb_auto_passes._cpp is None, reason="C++ extension not built")
def test_cpp_and_python_give_identical_passes_and_searches() -> None:
    rng = random.Random(7)
    for _ in range(12):
        p, m = rng.randint(1, 7), rng.randint(1, 20)
        costs = _random_costs(rng, p) if rng.random() < 0.5 else StageCosts.uniform(p, f=2, b=2, w=1, comm=0.2)
        st = zb_auto_passes.StageArrays.of(
            costs, zb_auto_bound.resolve_mem_limit(p, costs, rng.choice([p, 2 * p - 1, None]))
        )
        cpp, py = zb_auto_passes.Engine("cpp", m, st), zb_auto_passes.Engine("python", m, st)
        family = zb_auto_family.policies(p, m, costs)
        full = None
        for pol in family[:: max(1, rng.randint(3, 9))] + [pol for pol in family if pol.static]:
            got = cpp.run(pol, want_plan=True)
            assert got == py.run(pol, want_plan=True), pol.label
            full = got[2] if full is None else full
            cut = full * rng.uniform(0.9, 1.05)  # cut passes stop at the same action in both
            assert cpp.run(pol, cut=cut) == py.run(pol, cut=cut), pol.label
            assert cpp.evaluate(got[0]) == py.evaluate(got[0]) == got[2]
        limit = rng.choice([p, 2 * p - 1])
        a = Z.search(p, m, costs, limit, backend="cpp")
        b = Z.search(p, m, costs, limit, backend="python")
        assert a.schedule == b.schedule and a.makespan == b.makespan and a.work == b.work


def _random_valid_plan(rng: random.Random, p: int, m: int, st: zb_auto_passes.StageArrays) -> list[list[int]]:
    """A random order that every rank can run: grown one action at a time among those whose inputs already ran."""
    nf, nb, nw, mem = [0] * p, [0] * p, [0] * p, [0.0] * p
    plans: list[list[int]] = [[] for _ in range(p)]
    while any(n < m for n in nw):
        moves = []
        for r in range(p):
            j, k = nf[r], nb[r]
            if j < m and (r == 0 or nf[r - 1] > j) and mem[r] + st.mem_f[r] + max(0.0, st.mem_b[r]) <= st.cap[r]:
                moves.append((r, 0))
            if k < j and (r == p - 1 or nb[r + 1] > k) and mem[r] + st.mem_b[r] <= st.cap[r]:
                moves.append((r, 1))
            if nw[r] < k:
                moves.append((r, 2))
        r, kind = rng.choice(moves)
        counts = (nf, nb, nw)
        plans[r].append(kind * m + counts[kind][r])
        counts[kind][r] += 1
        mem[r] += (st.mem_f, st.mem_b, st.mem_w)[kind][r]
    return plans


@pytest.mark.parametrize("seed", range(4))
def test_lower_bound_holds_for_random_valid_plans(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        p, m = rng.randint(1, 5), rng.randint(1, 12)
        costs = _random_costs(rng, p) if rng.random() < 0.5 else StageCosts.uniform(p, f=1, b=2, w=1, comm=0.5)
        st = zb_auto_passes.StageArrays.of(
            costs, zb_auto_bound.resolve_mem_limit(p, costs, rng.choice([1, 2, p, p + 1, 2 * p - 1]))
        )
        bound = zb_auto_bound.lower_bound(m, st)
        for _ in range(10):
            plans = _random_valid_plan(rng, p, m, st)
            assert zb_auto_passes.evaluate_py(m, st, plans) >= bound - 1e-9


def test_polish_keeps_plans_valid_and_never_worse() -> None:
    rng = random.Random(5)
    for _ in range(8):
        p, m = rng.randint(2, 4), rng.randint(2, 8)
        costs = StageCosts.uniform(p, f=1.0, b=rng.choice([1.0, 2.0]), w=rng.choice([1.0, 2.0]), comm=0.3)
        limit = rng.choice([p, p + 1])
        st = zb_auto_passes.StageArrays.of(costs, zb_auto_bound.resolve_mem_limit(p, costs, limit))
        eng = zb_auto_passes.Engine(zb_auto_passes.resolve_backend(None), m, st)
        plans = _random_valid_plan(rng, p, m, st)
        before = eng.evaluate(plans)
        plans, after, _ = zb_auto_polish.polish(eng, plans, before, 1e6)
        assert after <= before + 1e-9 and eng.evaluate(plans) == pytest.approx(after)
        check_and_lower(zb_auto_passes.codes_to_schedule("polished", p, m, plans), costs=costs, mem_limit=limit)


# Measured on the grid of test_within_stated_gap_of_the_exact_optimum_full (p <= 3, m <= 5, limits p and p + 1,
# c in {0.3, 1}, F:B:W in {1:1:1, 1:1:2, 2:2:1}): zb-auto is optimal in 47 of 48 settings; the worst is p=2, m=5,
# limit 3, c=1, F=B=W (18 vs the optimum 17: 5.9 %).  The bound is fixed from that measurement.
EXACT_GAP = 0.06


def _check_exact_gap(p: int, m: int, limit: int, c: float, fbw: tuple[float, float, float]) -> None:
    milp = pytest.importorskip("zb_pipeline.schedule.milp")
    if not milp.highs_available():
        pytest.skip("highspy is not installed")
    costs = StageCosts.uniform(p, f=fbw[0], b=fbw[1], w=fbw[2], comm=c)
    res = Z.search(p, m, costs, limit)
    exact = milp.solve_exact(p, m, costs=costs, mem_limit=limit, time_limit=30, warm_start=res.schedule)
    assert res.lower_bound <= exact.makespan + 1e-6  # the analytic bound never exceeds a feasible plan
    if exact.optimal:
        assert res.makespan <= exact.makespan * (1 + EXACT_GAP) + 1e-9, (p, m, limit, c, fbw)
        assert res.lower_bound <= exact.lower_bound + 1e-6 * max(1.0, exact.lower_bound)


@pytest.mark.parametrize("p,m,limit", [(2, 3, 2), (3, 3, 3), (2, 5, 3)])
def test_within_stated_gap_of_the_exact_optimum(p: int, m: int, limit: int) -> None:
    _check_exact_gap(p, m, limit, 1.0, (1.0, 1.0, 1.0))


@pytest.mark.slow
@pytest.mark.parametrize("p,m", [(2, 3), (2, 5), (3, 3), (3, 4)])
def test_within_stated_gap_of_the_exact_optimum_full(p: int, m: int) -> None:
    for limit in (p, p + 1):
        for c in (0.3, 1.0):
            for fbw in ((1.0, 1.0, 1.0), (1.0, 1.0, 2.0), (2.0, 2.0, 1.0)):
                _check_exact_gap(p, m, limit, c, fbw)
