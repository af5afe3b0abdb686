"""ZB-H1 and ZB-H2: exact bubble theory, memory bounds, validity for every shape."""

from __future__ import annotations

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

RATIOS = ((1.0, 1.0, 1.0), (2.0, 2.0, 1.0))  # (F, B, W): F = B = W and F = B = 2W


def _bubble(name: str, p: int, m: int, f: float, b: float, w: float, c: float) -> float:
    costs = StageCosts.uniform(p, f=f, b=b, w=w, comm=c)
    res = simulate(generate(name, p, m, costs=costs), costs)
    return res.makespan - m * (f + b + w)


@pytest.mark.parametrize("f,b,w", RATIOS)
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_zb_h1_bubble_is_exact(p: int, f: float, b: float, w: float) -> None:
    for m in (2 * p, 2 * p + 3, 4 * p):
        assert _bubble("zb-h1", p, m, f, b, w, 0.0) == pytest.approx((p - 1) * (f + b - w), abs=1e-9)


@pytest.mark.parametrize("f,b,w", RATIOS)
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_zb_h2_bubble_is_exact_with_and_without_comm(p: int, f: float, b: float, w: float) -> None:
    # The derivation (zero_bubble.py) needs the last rank never to wait: we test 2c <= W.
    for c in (0.0, w / 4, w / 2):
        for m in (2 * p, 2 * p + 3, 4 * p):
            got = _bubble("zb-h2", p, m, f, b, w, c)
            assert got == pytest.approx((p - 1) * (f + b + 2 * c - 2 * w), abs=1e-9), (p, m, c)


@pytest.mark.parametrize("p", [1, 2, 4, 7])
def test_peak_memory_bounds(p: int) -> None:
    for m in (1, p, 2 * p, 3 * p + 1):
        for f, b, w in RATIOS:
            costs = StageCosts.uniform(p, f=f, b=b, w=w, comm=0.1)
            h1 = simulate(generate("zb-h1", p, m, costs=costs), costs)
            h2 = simulate(generate("zb-h2", p, m, costs=costs), costs)
            assert max(h1.peak_memory) <= p
            assert max(h2.peak_memory) <= 2 * p - 1
            if m >= 2 * p:  # the bounds are reached
                assert h1.peak_memory[0] == p
                assert h2.peak_memory[0] == 2 * p - 1


def _check_shape(name: str, p: int, m: int, costs: StageCosts) -> None:
    sched = generate(name, p, m, costs=costs)
    check_and_lower(sched, costs=costs)
    counts = {k: 0 for k in (Kind.F, Kind.B, Kind.W)}
    for acts in sched.ranks:
        for a in acts:
            counts[a.kind] += 1
    assert counts == {Kind.F: p * m, Kind.B: p * m, Kind.W: p * m}


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_every_shape_validates_subset(name: str) -> None:
    for p in (1, 2, 3, 5, 8):
        for m in (1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p + 1, 3 * p + 2):
            if m >= 1:
                _check_shape(name, p, m, StageCosts.uniform(p, f=1.0, b=1.5, w=0.7, comm=0.2))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("p", range(1, 17))
def test_every_shape_validates_full(name: str, p: int) -> None:
    for m in range(1, 65):
        for f, b, w in ((1, 1, 1), (2, 2, 1), (1, 2, 1), (1, 1, 2)):
            _check_shape(name, p, m, StageCosts.uniform(p, f=f, b=b, w=w, comm=0.3))


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 17))
def test_theory_full(p: int) -> None:
    for f, b, w in RATIOS:
        for m in range(2 * p, 64 + 1, 5):
            assert _bubble("zb-h1", p, m, f, b, w, 0.0) == pytest.approx((p - 1) * (f + b - w), abs=1e-9)
            for c in (0.0, w / 2):
                assert _bubble("zb-h2", p, m, f, b, w, c) == pytest.approx((p - 1) * (f + b + 2 * c - 2 * w), abs=1e-9)


def test_heterogeneous_stage_costs_are_used() -> None:
    p, m = 4, 12
    costs = StageCosts.build(num_ranks=p, f=[1.5, 1, 1, 2.0], b=[1.2, 1, 1, 2.2], w=[1, 1, 1, 1.6], comm=0.1)
    for name in ("zb-h1", "zb-h2"):
        sched = generate(name, p, m, costs=costs)
        check_and_lower(sched, costs=costs, mem_limit=2 * p - 1)


def test_mem_limit_below_peak_says_what_is_needed() -> None:
    with pytest.raises(ValueError, match=r"zb-h2 needs mem_limit >= 7"):
        generate("zb-h2", 4, 16, mem_limit=4)
    with pytest.raises(ValueError, match=r"zb-h1 needs mem_limit >= 4"):
        generate("zb-h1", 4, 16, mem_limit=3)
    generate("zb-h1", 4, 16, mem_limit=4)


def test_chunks_other_than_one_are_refused() -> None:
    with pytest.raises(ValueError, match="chunks"):
        generate("zb-h1", 4, 8, chunks=2)


def test_first_stage_tail_runs_w_first_and_never_costs_time_or_memory() -> None:
    """ZB-H2 places a W before a stage-0 B in a rank's tail (after its last F) whenever one is pending: that B
    feeds nobody, so the swap can only fill a wait. Under any costs -- also costs other than the ones planned for
    (a profile taken earlier) -- the plan with the swaps is never longer and never holds more memory."""
    import random
    from dataclasses import replace

    from zb_pipeline.schedule.generators.tail_order import first_stage_tail_w_first
    from zb_pipeline.schedule.generators.zero_bubble import zb_h2_greedy_order
    from zb_pipeline.schedule.memory import peak_memory

    rng = random.Random(3)
    moved_somewhere = False
    for _ in range(40):
        p, m = rng.randint(2, 5), rng.randint(2, 12)
        planned = StageCosts.uniform(p, f=rng.uniform(5, 20), b=rng.uniform(5, 20), w=rng.uniform(2, 12), comm=0.2)
        before = zb_h2_greedy_order(p, m, planned)
        after = generate("zb-h2", p, m, costs=planned)
        assert after.ranks == first_stage_tail_w_first(before, planned).ranks
        check_and_lower(after)
        for r in range(p):  # same actions, W's and B's each in the same order
            for kind in (Kind.F, Kind.B, Kind.W):
                assert [a for a in after.ranks[r] if a.kind is kind] == [a for a in before.ranks[r] if a.kind is kind]
        tail = after.ranks[0][max(i for i, a in enumerate(after.ranks[0]) if a.kind is Kind.F) + 1 :]
        for i, a in enumerate(tail):  # no W left behind a B it could have run before
            if a.kind is Kind.W:
                assert all(x.kind is not Kind.B or x.microbatch == a.microbatch for x in tail[i - 1 : i])
        moved_somewhere |= after.ranks != before.ranks
        for _ in range(5):  # the costs the plan really meets: each stage off by up to +-30%
            real = replace(
                planned,
                f=tuple(x * rng.uniform(0.7, 1.3) for x in planned.f),
                b=tuple(x * rng.uniform(0.7, 1.3) for x in planned.b),
                w=tuple(x * rng.uniform(0.7, 1.3) for x in planned.w),
            )
            assert simulate(after, real).makespan <= simulate(before, real).makespan + 1e-9
        assert max(peak_memory(after, planned)) <= max(peak_memory(before, planned)) + 1e-9
    assert moved_somewhere
