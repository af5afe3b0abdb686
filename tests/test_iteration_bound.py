"""``iteration_lower_bound``: no registered schedule ends an iteration before it, under any costs; ZB-H2 reaches it
where the docstring says so; the uniform ceiling is 1F1B's simulated iteration over it."""

from __future__ import annotations

import random

import pytest

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.bounds import backward_arrival, forward_arrival, iteration_lower_bound, theory_ceiling
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.simulate import simulate

EPS = 1e-9


def _random_costs(rng: random.Random, p: int, chunks: int, place: tuple[int, ...]) -> StageCosts:
    n = p * chunks
    return StageCosts.build(
        num_ranks=p,
        chunks=chunks,
        stage_to_rank=place,
        f=[rng.uniform(0.5, 2.0) for _ in range(n)],
        b=[rng.uniform(0.5, 2.0) for _ in range(n)],
        w=[rng.uniform(0.2, 1.5) for _ in range(n)],
        comm=rng.choice([0.0, 0.05, 0.4]),
    )


@pytest.mark.parametrize("name", registry.available())
def test_no_registered_schedule_ends_before_the_bound(name: str) -> None:
    rng = random.Random(sum(map(ord, name)))
    chunks = registry.get(name).default_chunks
    checked = 0
    for p in (2, 3, 4):
        place = tuple(registry.placement_of(name, p, chunks))
        for m in (p, 2 * p + 1):
            for _ in range(2):
                costs = _random_costs(rng, p, chunks, place)
                try:
                    sched = registry.generate(name, p, m, chunks=chunks, costs=costs)
                except ValueError:  # shape the schedule does not support (e.g. m < 2p)
                    continue
                bound = iteration_lower_bound(costs, sched.stage_to_rank, m)
                end = simulate(sched, costs).end_time
                assert end >= bound.time - EPS, f"{name} p={p} m={m}: ends at {end} before the bound {bound}"
                checked += 1
    assert checked >= 4, f"{name}: only {checked} shapes could be generated"


@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("comm", [0.0, 0.15])
def test_the_bound_is_reached_at_p2_with_the_last_stage_heavier(m: int, comm: float) -> None:
    """The bound is tight: zb-auto without a memory limit ends exactly at it; ZB-H2 (limit 2p - 1) within 1%."""
    rng = random.Random(m * 100 + int(comm * 100))
    for _ in range(4):
        f0, b0 = rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.2)
        w0 = rng.uniform(0.5, 0.8) * max(f0, b0)  # W about F / 2 or more, as measured on CPU
        grow = rng.uniform(1.03, 1.3)  # the last stage (with the output head) costs more
        costs = StageCosts.build(num_ranks=2, f=[f0, f0 * grow], b=[b0, b0 * grow], w=[w0, w0 * grow], comm=comm)
        bound = iteration_lower_bound(costs, (0, 1), m)
        assert (bound.rank, bound.reason) == (1, "first input")
        assert bound.time == pytest.approx(f0 + comm + m * (f0 + b0 + w0) * grow, rel=1e-12)
        unlimited = registry.generate("zb-auto", 2, m, costs=costs, mem_limit=m)
        assert simulate(unlimited, costs).end_time == pytest.approx(bound.time, rel=1e-12)
        zb_h2 = simulate(registry.generate("zb-h2", 2, m, costs=costs), costs).end_time
        assert bound.time - EPS <= zb_h2 <= 1.01 * bound.time
        one_f_one_b = simulate(registry.generate("1f1b", 2, m), costs).end_time
        assert one_f_one_b > bound.time + 0.5 * f0  # 1F1B leaves a bubble the bound does not


def test_arrivals_follow_the_chains() -> None:
    costs = StageCosts.build(num_ranks=2, chunks=2, stage_to_rank=(0, 1, 1, 0), f=[1, 2, 3, 4], b=[5, 6, 7, 8],
                             w=1, comm=0.5)  # fmt: skip
    place = (0, 1, 1, 0)
    assert [forward_arrival(costs, place, s) for s in range(4)] == [0.0, 1.5, 3.5, 7.0]
    # The loss after F(3) at 7 + 4 = 11; B(3) 8 and a hop -> 19.5; B(2) 7 on the same rank -> 26.5; B(1) 6 and a hop.
    assert [backward_arrival(costs, place, s) for s in range(4)] == [33.0, 26.5, 19.5, 11.0]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_uniform_ceiling_is_1f1b_over_the_bound(p: int, m: int) -> None:
    costs = StageCosts.build(num_ranks=p, f=1.0, b=1.0, w=0.5)
    one_f_one_b = simulate(registry.generate("1f1b", p, m), costs).end_time
    bound = iteration_lower_bound(costs, tuple(range(p)), m)
    assert theory_ceiling(p, m) == pytest.approx(one_f_one_b / bound.time, rel=1e-12)
    assert theory_ceiling(p, m) <= (m + p - 1) / m + EPS  # never above the loose bound the issue quotes


def test_the_ceiling_at_p2_m4_and_m8() -> None:
    assert theory_ceiling(2, 4) == pytest.approx(25 / 22)  # 1.136: ZB-H2's 1.14x is the ceiling
    assert theory_ceiling(2, 8) == pytest.approx(15 / 14)  # 1.071: no schedule reaches 1.08x at m = 8


def test_bad_input_is_named() -> None:
    costs = StageCosts.build(num_ranks=2, f=1.0)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        iteration_lower_bound(costs, (0, 1), 0)
    with pytest.raises(ValueError, match="stage_to_rank has 3 entries"):
        iteration_lower_bound(costs, (0, 1, 1), 4)
