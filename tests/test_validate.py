"""The validator: hand-made broken plans are rejected with the right one-line message and a marked grid; valid
plans (hand-made, random, and every registered generator over a grid) pass."""

from __future__ import annotations

import pytest
from schedule_test_plans import list_schedule, one_f_one_b, pair_lists, run_p2p, v_gpipe

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Schedule, loop_placement, v_placement
from zb_pipeline.schedule.lowering import LoweredSchedule
from zb_pipeline.schedule.memory import peak_memory, schedule_mem_floor
from zb_pipeline.schedule.validate import ScheduleError, check_and_lower, render_grid, validate_schedule


def plan(p: int, m: int, rows: list[str], *, chunks: int = 1, v: bool = False) -> Schedule:
    place = v_placement(p, chunks) if v else loop_placement(p, chunks)
    return Schedule("hand", p, p * chunks, m, place, [[Action.parse(x) for x in row.split()] for row in rows])


def rejected(sched: Schedule, **kw) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        check_and_lower(sched, **kw)
    err = info.value
    assert "\n" not in str(err), "the message must be one line"
    assert str(err).startswith(f"{sched.name}: ")
    return err


# ------------------------------------------------------------------------------------------------ valid plans


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("split", [False, True])
def test_hand_made_1f1b_passes(p: int, split: bool) -> None:
    lowered = check_and_lower(one_f_one_b(p, 5, split=split))
    assert isinstance(lowered, LoweredSchedule)
    sends, recvs = pair_lists(lowered)
    assert sends == recvs  # the k-th send of every pair is the k-th receive
    assert run_p2p(lowered, buffered=False) == []


def test_literal_1f1b_p3_with_split_backward_passes() -> None:
    sched = plan(
        3,
        3,
        [
            "0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2",
            "1F0 1F1 1B0 1W0 1F2 1B1 1W1 1B2 1W2",
            "2F0 2B0 2W0 2F1 2B1 2W1 2F2 2B2 2W2",
        ],
    )
    check_and_lower(sched)


def test_v_placed_plan_passes() -> None:
    check_and_lower(v_gpipe(3, 4))
    # Literal V plan, p = 2: stages 0..3 on ranks 0, 1, 1, 0; rank 1 hands 1F -> 2F and 2B -> 1B locally.
    sched = plan(
        2,
        2,
        [
            "0F0 0F1 3F0 3B0 3F1 3W0 3B1 3W1 0B0 0B1 0W0 0W1",
            "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 2W1 1W0 1W1",
        ],
        chunks=2,
        v=True,
    )
    check_and_lower(sched)


def test_random_plans_pass() -> None:
    for seed in range(10):
        check_and_lower(list_schedule(3, 4, v_placement(3, 2), seed=seed))


# ------------------------------------------------------------------------------------------------ broken plans


def test_missing_w() -> None:
    sched = plan(2, 2, ["0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W1"])
    err = rejected(sched)
    assert "rank 1 position 1 (1B0): missing 1W0" in str(err)
    assert (err.rank, err.index) == (1, 1)
    assert "[1B0]" in err.grid and err.grid.count("[") == 1


def test_missing_backward_and_missing_forward() -> None:
    err = rejected(plan(2, 2, ["0F0 0F1 0BW0 0BW1", "1F0 1BW0 1F1"]))
    assert "missing the backward of 1F1" in str(err)
    err = rejected(plan(2, 2, ["0F0 0F1 0BW0 0BW1", "1F0 1BW0 1BW1"]))
    assert "rank 1: missing 1F1" in str(err)
    assert "*rank 1:" in err.grid  # no position to mark: the rank is


def test_duplicated_action() -> None:
    err = rejected(plan(2, 2, ["0F0 0F1 0BW0 0BW1 0F1", "1F0 1BW0 1F1 1BW1"]))
    assert "rank 0 position 4 (0F1): duplicate; 0F1 already ran at position 1" in str(err)
    assert (err.rank, err.index) == (0, 4)


def test_bw_and_split_backward_for_the_same_microbatch() -> None:
    err = rejected(plan(2, 1, ["0F0 0BW0", "1F0 1BW0 1B0"]))
    assert "(1B0): 1BW0 at position 1 already does this work" in str(err)


def test_b_before_its_f() -> None:
    err = rejected(plan(2, 2, ["0F0 0F1 0BW0 0BW1", "1F0 1B1 1F1 1B0 1W0 1W1"]))
    assert "rank 1 position 1 (1B1): comes before 1F1 (position 2) that it depends on" in str(err)
    assert "[1B1]" in err.grid


def test_w_before_its_b() -> None:
    err = rejected(plan(2, 1, ["0F0 0W0 0B0", "1F0 1BW0"]))
    assert "rank 0 position 1 (0W0): comes before 0B0 (position 2)" in str(err)


def test_local_dependency_order_with_v_placement() -> None:
    # 2F0 needs 1F0, both on rank 1.
    err = rejected(plan(2, 1, ["0F0 3F0 3BW0 0BW0", "2F0 1F0 2BW0 1BW0"], chunks=2, v=True))
    assert "rank 1 position 0 (2F0): comes before 1F0 (position 1)" in str(err)


def test_action_on_the_wrong_rank() -> None:
    err = rejected(plan(2, 1, ["0F0 1F0 0BW0", "1BW0"]))
    assert "rank 0 position 1 (1F0): stage 1 lives on rank 1 (stage_to_rank), not 0" in str(err)
    assert (err.rank, err.index) == (0, 1)


def test_out_of_range_and_communication_in_a_plan() -> None:
    assert "microbatch 2 is out of range 0..1" in str(rejected(plan(2, 2, ["0F0 0F2", "1F0"])))
    assert "stage 5 is out of range 0..1" in str(rejected(plan(2, 2, ["0F0 5F0", "1F0"])))
    err = rejected(plan(2, 1, ["0F0 0SEND_F0@1 0BW0", "1F0 1BW0"]))
    assert "compute actions only" in str(err)


def test_cross_rank_cycle_deadlocks() -> None:
    # 1F1 comes first on rank 1 but needs 0F1, which rank 0 runs after 0BW0, which needs 1BW0, after 1F1.
    err = rejected(plan(2, 2, ["0F0 0BW0 0F1 0BW1", "1F1 1F0 1BW0 1BW1"]))
    msg = str(err)
    assert "dependency cycle across ranks (deadlock)" in msg
    assert "rank 0 position 1 (0BW0) waits for 1B0 (rank 1 position 2)" in msg or "waits for 1BW0" in msg
    assert "rank 1 position 0 (1F1) waits for 0F1 (rank 0 position 2)" in msg
    assert (err.rank, err.index) == (0, 1)
    assert "[0BW0]" in err.grid


def test_memory_overrun() -> None:
    sched = one_f_one_b(3, 6)
    costs = StageCosts.build(num_ranks=3)
    assert peak_memory(sched, costs) == (3.0, 2.0, 1.0)
    check_and_lower(sched, costs=costs, mem_limit=3)
    err = rejected(sched, costs=costs, mem_limit=2.5)
    assert "rank 0 position 2 (0F2): memory reaches 3 here and peaks at 3 on this rank, over mem_limit=2.5" in str(err)
    assert "needs at least 3" in str(err)
    assert (err.rank, err.index) == (0, 2)
    # Default memory model (mem_f = 1 per rank's share): the same.
    rejected(sched, mem_limit=2)


def test_validate_schedule_checks_without_lowering() -> None:
    # The compute-plan and memory checks alone: same verdict and message as check_and_lower, nothing returned.
    sched = one_f_one_b(3, 6)
    costs = StageCosts.build(num_ranks=3)
    assert validate_schedule(sched, costs=costs, mem_limit=3) is None
    with pytest.raises(ScheduleError) as info:
        validate_schedule(sched, costs=costs, mem_limit=2.5)
    assert str(info.value) == str(rejected(sched, costs=costs, mem_limit=2.5))
    cycle = plan(2, 2, ["0F0 0BW0 0F1 0BW1", "1F1 1F0 1BW0 1BW1"])
    with pytest.raises(ScheduleError) as info:
        validate_schedule(cycle)
    assert str(info.value) == str(rejected(cycle))


def test_memory_with_split_backward_and_chunks() -> None:
    # W frees the activation: with B and W split, memory only drops at W.
    sched = plan(2, 2, ["0F0 0F1 0B0 0B1 0W0 0W1", "1F0 1B0 1W0 1F1 1B1 1W1"])
    costs = StageCosts.build(num_ranks=2, mem_f=[4, 2])
    assert peak_memory(sched, costs) == (8.0, 2.0)
    assert schedule_mem_floor(sched, costs) == 8.0
    # Per-rank share split over chunks: two chunks per rank, each 1/2 of mem_f.
    sched2 = v_gpipe(2, 3)
    costs2 = StageCosts.build(num_ranks=2, chunks=2, stage_to_rank=v_placement(2, 2), mem_f=1)
    assert peak_memory(sched2, costs2) == (3.0, 3.0)


def test_grid_rendering() -> None:
    sched = one_f_one_b(2, 2)
    grid = render_grid(sched, mark=(1, 2))
    lines = grid.splitlines()
    assert lines[1].split() == ["rank", "0:", "0F0", "0F1", "0BW0", "0BW1"]
    assert lines[2].split() == ["rank", "1:", "1F0", "1BW0", "[1F1]", "1BW1"]
    # Columns line up.
    assert lines[1].index("0BW0") == lines[2].index("[1F1]")
    colored = render_grid(sched, mark=(1, 2), color=True)
    assert "\x1b[1;41m[1F1]\x1b[0m" in colored


# --------------------------------------------------------------------------------------- registered generators


def _generator_cases(ps, ms, chunk_set) -> list[tuple[str, int, int, int]]:
    cases = []
    for name in registry.available():
        supported = registry.get(name).chunks
        for c in chunk_set:
            if supported is not None and c not in supported:
                continue
            cases += [(name, p, m, c) for p in ps for m in ms]
    return cases


def _check_generator(name: str, p: int, m: int, chunks: int) -> None:
    try:
        sched = registry.generate(name, p, m, chunks=chunks)
    except ValueError as exc:  # a constraint of the schedule: must be named in one line
        assert str(exc) and "\n" not in str(exc)
        return
    lowered = check_and_lower(sched)
    sends, recvs = pair_lists(lowered)
    assert sends == recvs


def _subset_ids() -> list:
    return _generator_cases((1, 2, 3, 4), (1, 3, 8), (1, 2, 3))  # m < p, odd m, m not a multiple of p


@pytest.mark.parametrize("name", registry.available())
def test_registered_generators_small_grid(name: str) -> None:
    for n, p, m, c in _subset_ids():
        if n == name:
            _check_generator(n, p, m, c)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # interleaved-zb's grid alone ran past the default 600 s on 2 cores
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("name", registry.available())
def test_registered_generators_full_grid(name: str, chunks: int) -> None:
    cases = [case for case in _generator_cases(range(1, 17), range(1, 65), (chunks,)) if case[0] == name]
    if not cases:
        pytest.skip(f"{name} has no {chunks}-chunk variant")
    for n, p, m, c in cases:
        _check_generator(n, p, m, c)
