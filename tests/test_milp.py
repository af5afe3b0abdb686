"""The exact MILP solver on shapes small enough to solve to optimality in a second or two."""

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.milp import highs_available, solve_exact
from zb_pipeline.schedule.simulate import simulate

pytestmark = pytest.mark.skipif(not highs_available(), reason="optional dependency highspy not installed")


@pytest.mark.parametrize(
    "p, m, mem_limit, expected",
    [
        # m >= 2p, F = B = W = 1: without a memory limit zero bubble is reachable (ZB-H2's bound, (p-1)(F+B-2W) = 0).
        (2, 4, None, 12.0),
        # With p microbatches of memory, ZB-H1's (p-1)(F+B-W) = 1 extra is optimal.
        (2, 4, 2.0, 13.0),
        # One microbatch of memory per rank: rank 0 runs F0 [0,1] B0 [3,4] W0 [4,5] F1 [5,6] B1 [8,9] W1 [9,10]
        # (rank 1: F0 [1,2] B0 [2,3] W0 [3,4] F1 [6,7] B1 [7,8] W1 [8,9]); no order does better.
        (2, 2, 1.0, 10.0),
    ],
)
def test_known_optima(p: int, m: int, mem_limit: float | None, expected: float) -> None:
    r = solve_exact(p, m, mem_limit=mem_limit, time_limit=60)
    assert r.optimal, r.status
    assert r.makespan == pytest.approx(expected)
    assert r.lower_bound == pytest.approx(expected, abs=1e-4)


def test_solution_is_split_complete_and_within_memory() -> None:
    costs = StageCosts.build(num_ranks=3, f=[1.0, 1.5, 1.0], b=[1.0, 2.0, 1.5], w=[0.5, 1.0, 0.5], comm=0.25)
    r = solve_exact(3, 4, costs=costs, mem_limit=2.0, time_limit=60)
    assert r.schedule is not None and r.optimal
    sim = simulate(r.schedule, costs)
    assert max(sim.peak_memory) <= 2.0 + 1e-9
    assert sim.makespan == pytest.approx(r.makespan)
    seen = {(a.kind, a.stage, a.microbatch) for acts in r.schedule.ranks for a in acts}
    assert seen == {(k, s, j) for k in (Kind.F, Kind.B, Kind.W) for s in range(3) for j in range(4)}
    # The optimum is never worse than what any rank's own work forces.
    assert r.makespan >= max(4 * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(3)) - 1e-9


def test_v_placement_two_chunks() -> None:
    r = solve_exact(2, 2, chunks=2, placement="v", time_limit=60)
    assert r.optimal
    assert r.schedule.placement == "v"
    # Each rank holds 2 chunks x 2 microbatches x 3 actions of 1/2 cost each: 6 units of work.
    assert r.makespan >= 6.0 - 1e-9


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="placement"):
        solve_exact(2, 2, placement="zigzag")
    with pytest.raises(ValueError, match="m=0"):
        solve_exact(2, 0)
