"""The cost simulator against hand-computed timelines and the closed forms of the classic schedules."""

from __future__ import annotations

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Schedule, loop_placement, v_placement
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate


def plan(name: str, p: int, m: int, placement: tuple[int, ...], ranks: list[str]) -> Schedule:
    return Schedule(
        name=name,
        num_ranks=p,
        num_stages=len(placement),
        num_microbatches=m,
        stage_to_rank=placement,
        ranks=[[Action.parse(t) for t in row.split()] for row in ranks],
    )


def times(result) -> dict[str, tuple[float, float]]:
    return {str(ta.action): (ta.start, ta.end) for tl in result.timeline for ta in tl}


def test_1f1b_p2_m2_with_comm_by_hand():
    # F = B = W = 1 (BW = 2), T_comm = 0.5.  Rank 0: 0F0 0F1 0BW0 0BW1; rank 1: 1F0 1BW0 1F1 1BW1.
    sched = generate("1f1b", 2, 2)
    assert [[str(a) for a in r] for r in sched.ranks] == [
        ["0F0", "0F1", "0BW0", "0BW1"],
        ["1F0", "1BW0", "1F1", "1BW1"],
    ]
    res = simulate(sched, StageCosts.uniform(2, comm=0.5))
    assert times(res) == {
        "0F0": (0.0, 1.0),
        "0F1": (1.0, 2.0),
        "1F0": (1.5, 2.5),  # 0F0 ends at 1, + 0.5 to cross ranks
        "1BW0": (2.5, 4.5),  # the last stage's backward follows its own F, no comm
        "1F1": (4.5, 5.5),  # 0F1 arrived at 2.5, but rank 1 is busy until 4.5
        "1BW1": (5.5, 7.5),
        "0BW0": (5.0, 7.0),  # 1BW0 ends at 4.5, + 0.5
        "0BW1": (8.0, 10.0),  # 1BW1 ends at 7.5, + 0.5
    }
    assert res.rank_span == (10.0, 6.0)
    assert res.makespan == 10.0
    assert res.rank_compute == (6.0, 6.0)
    assert res.bubble_rate == pytest.approx(1 - 6 / 10)
    assert res.peak_memory == (2.0, 1.0)
    assert res.start(Action.parse("0BW1")) == 8.0 and res.end(Action.parse("1F1")) == 5.5


def test_gpipe_p3_m2_heterogeneous_per_rank_costs_by_hand():
    # Per-rank costs: F = (1, 2, 1), B = (1, 1, 2), W = 1 everywhere; T_comm = 0.  BW = B + W.
    sched = generate("gpipe", 3, 2)
    costs = StageCosts.build(num_ranks=3, f=[1, 2, 1], b=[1, 1, 2], w=1)
    res = simulate(sched, costs)
    assert times(res) == {
        "0F0": (0.0, 1.0),
        "0F1": (1.0, 2.0),
        "1F0": (1.0, 3.0),
        "1F1": (3.0, 5.0),
        "2F0": (3.0, 4.0),
        "2F1": (5.0, 6.0),
        "2BW0": (6.0, 9.0),
        "2BW1": (9.0, 12.0),
        "1BW0": (9.0, 11.0),
        "1BW1": (12.0, 14.0),
        "0BW0": (11.0, 13.0),
        "0BW1": (14.0, 16.0),
    }
    assert res.rank_span == (16.0, 13.0, 9.0)
    assert res.makespan == 16.0
    assert res.rank_compute == (6.0, 8.0, 8.0)
    assert res.bubble_rate == pytest.approx(1 - 8 / 16)  # the busiest rank's compute over the makespan
    assert res.peak_memory == (2.0, 2.0, 2.0)


def test_v_placement_split_backward_by_hand():
    # p = 2, chunks = 2, V placement: stages 0, 1, 2, 3 on ranks 0, 1, 1, 0.  F = B = W = 1, T_comm = 1.
    placement = v_placement(2, 2)
    assert placement == (0, 1, 1, 0)
    sched = plan(
        "hand-v",
        2,
        2,
        placement,
        [
            "0F0 0F1 3F0 3B0 3W0 3F1 3B1 0B0 3W1 0B1 0W0 0W1",
            "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 2W1 1W1",
        ],
    )
    res = simulate(sched, StageCosts.uniform(4, comm=1.0))
    assert times(res) == {
        "0F0": (0.0, 1.0),
        "0F1": (1.0, 2.0),
        "1F0": (2.0, 3.0),  # 0F0 + comm
        "2F0": (3.0, 4.0),  # stages 1 and 2 share rank 1: no comm
        "1F1": (4.0, 5.0),
        "2F1": (5.0, 6.0),
        "3F0": (5.0, 6.0),  # 2F0 ends at 4, + comm
        "3B0": (6.0, 7.0),  # last stage: after its own F
        "3W0": (7.0, 8.0),
        "3F1": (8.0, 9.0),
        "3B1": (9.0, 10.0),
        "2B0": (8.0, 9.0),  # 3B0 ends at 7, + comm
        "1B0": (9.0, 10.0),
        "2B1": (11.0, 12.0),  # 3B1 ends at 10, + comm
        "1B1": (12.0, 13.0),
        "2W0": (13.0, 14.0),
        "1W0": (14.0, 15.0),
        "2W1": (15.0, 16.0),
        "1W1": (16.0, 17.0),
        "0B0": (11.0, 12.0),  # 1B0 ends at 10, + comm
        "3W1": (12.0, 13.0),
        "0B1": (14.0, 15.0),  # 1B1 ends at 13, + comm
        "0W0": (15.0, 16.0),
        "0W1": (16.0, 17.0),
    }
    assert res.rank_span == (17.0, 15.0)
    assert res.makespan == 17.0
    assert res.bubble_rate == pytest.approx(1 - 12 / 17)
    # Memory: one unit per stage and microbatch from F to W (uniform default).
    assert res.peak_memory == (3.0, 4.0)


def test_heterogeneous_per_virtual_stage_costs_by_hand():
    # p = 2, chunks = 2, loop placement (stages 0,1,2,3 on ranks 0,1,0,1), one cost per virtual stage.
    # F = (1, 2, 3, 1), B = (1, 1, 1, 2), W = 1; T_comm = 0.25.  Full backwards.
    sched = plan(
        "hand-loop",
        2,
        2,
        loop_placement(2, 2),
        ["0F0 0F1 2F0 2F1 2BW0 2BW1 0BW0 0BW1", "1F0 1F1 3F0 3BW0 3F1 3BW1 1BW0 1BW1"],
    )
    costs = StageCosts.build(num_ranks=2, chunks=2, f=[1, 2, 3, 1], b=[1, 1, 1, 2], w=[1, 1, 1, 1], comm=0.25)
    assert costs.f == (1.0, 2.0, 3.0, 1.0)  # a list per virtual stage is taken as given (a scalar would be halved)
    res = simulate(sched, costs)
    assert times(res) == {
        "0F0": (0.0, 1.0),
        "0F1": (1.0, 2.0),
        "1F0": (1.25, 3.25),
        "1F1": (3.25, 5.25),
        "2F0": (3.5, 6.5),  # 1F0 ends at 3.25, + 0.25
        "2F1": (6.5, 9.5),
        "3F0": (6.75, 7.75),  # 2F0 ends at 6.5, + 0.25
        "3BW0": (7.75, 10.75),
        "3F1": (10.75, 11.75),  # 2F1 arrived at 9.75
        "3BW1": (11.75, 14.75),
        "2BW0": (11.0, 13.0),  # 3BW0 ends at 10.75, + 0.25
        "2BW1": (15.0, 17.0),  # 3BW1 ends at 14.75, + 0.25
        "1BW0": (14.75, 16.75),  # 2BW0 arrived at 13.25; rank 1 busy until 14.75
        "1BW1": (17.25, 19.25),  # 2BW1 ends at 17, + 0.25
        "0BW0": (17.0, 19.0),  # 1BW0 ends at 16.75, + 0.25
        "0BW1": (19.5, 21.5),
    }
    assert res.makespan == 21.5
    assert res.rank_span == (21.5, 18.0)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 5), (2, 2), (3, 4), (4, 4), (4, 9), (5, 16), (8, 8), (7, 20)])
def test_1f1b_closed_form(p: int, m: int):
    f, b, w = 1.0, 2.0, 1.5
    costs = StageCosts.build(num_ranks=p, f=f, b=b, w=w, mem_f=2.5)
    res = simulate(generate("1f1b", p, m, costs=costs), costs)
    assert res.makespan == (m + p - 1) * (f + b + w)
    assert res.bubble_rate == pytest.approx(1 - m * (f + b + w) / res.makespan)
    assert res.peak_memory[0] == min(p, m) * 2.5
    assert res.peak_memory == tuple(min(p - r, m) * 2.5 for r in range(p))


@pytest.mark.parametrize(("p", "m"), [(1, 3), (3, 2), (4, 8), (6, 5)])
def test_gpipe_peak_memory_and_makespan(p: int, m: int):
    costs = StageCosts.build(num_ranks=p, f=1, b=1, w=1, mem_f=3)
    res = simulate(generate("gpipe", p, m), costs)
    assert res.peak_memory == (m * 3.0,) * p
    # Forwards pipeline through in m + p - 1 forward slots, backwards likewise.
    assert res.makespan == (m + p - 1) * 1 + (m + p - 1) * 2


def test_comm_actions_are_skipped_and_rank_peak_memory_matches():
    sched = generate("1f1b", 3, 5)
    costs = StageCosts.uniform(3, comm=0.5)
    res = simulate(sched, costs)
    assert peak_memory(sched, costs) == res.peak_memory
    assert res.end_time == max(ta.end for tl in res.timeline for ta in tl)


def test_deadlock_is_reported_with_the_stuck_ranks():
    # Rank 0 waits for 1B0 before sending 0F1; rank 1 waits for 0F1 before its 1BW0.
    sched = plan("stuck", 2, 2, (0, 1), ["0F0 0BW0 0F1 0BW1", "1F0 1F1 1BW0 1BW1"])
    with pytest.raises(ValueError, match=r"can never finish: rank 0 waits at position 1 \(0BW0\) for 1B0") as e:
        simulate(sched, StageCosts.uniform(2))
    assert "rank 1 waits at position 1 (1F1) for 0F1" in str(e.value)


def test_missing_action_is_reported():
    sched = plan("missing", 2, 1, (0, 1), ["0BW0", "1F0 1BW0"])  # no 0F0
    with pytest.raises(ValueError, match=r"rank 0 waits at position 0 \(0BW0\) for 0F0"):
        simulate(sched, StageCosts.uniform(2))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["0F0 0F0 0BW0", "1F0 1BW0"], "repeats the F work"),
        (["0F0 0B0 0BW0", "1F0 1BW0"], "repeats the B work"),
        (["0F0 1BW0", "1F0 0BW0"], "belongs to stage 1 on rank 1"),
        (["0F0 0F3", "1F0 1BW0"], "outside the plan"),
    ],
)
def test_malformed_plans_raise(rows: list[str], message: str):
    sched = plan("bad", 2, 1, (0, 1), rows)
    with pytest.raises(ValueError, match=message):
        simulate(sched, StageCosts.uniform(2))


def test_costs_must_match_the_stage_count():
    with pytest.raises(ValueError, match="4 virtual stages"):
        simulate(generate("1f1b", 2, 2), StageCosts.uniform(4))


def test_large_plan_runs():
    # p = 32, m = 256: 16k actions; the simulator is one pass over them.
    sched = generate("1f1b", 32, 256)
    res = simulate(sched, StageCosts.uniform(32))
    assert res.makespan == (256 + 31) * 3
