"""Lowering: the communication it adds pairs up exactly and never deadlocks under the strict (NCCL) model.

The lowered plans are checked twice: by ``validate_lowered`` and by the naive reference checkers of
``schedule_test_plans`` (pairing per rank pair, a fixed-point strict P2P run).
"""

from __future__ import annotations

import random

import pytest
from schedule_test_plans import (
    data_ready,
    expected_transfers,
    list_schedule,
    one_f_one_b,
    pair_lists,
    random_placement,
    run_p2p,
    v_gpipe,
)

from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement, v_placement
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule, lower
from zb_pipeline.schedule.validate import ScheduleError, check_and_lower, validate_lowered


def steps(text: str) -> tuple:
    """``"0F0 {0SEND_F0@1,0RECV_B0@1} 0BW0"`` -> lowered steps."""
    out = []
    for tok in text.split():
        if tok.startswith("{"):
            out.append(CommBatch(tuple(Action.parse(x) for x in tok[1:-1].split(","))))
        else:
            out.append(Action.parse(tok))
    return tuple(out)


def assert_sound(lowered: LoweredSchedule) -> None:
    """Reference checks: same compute, every cross-rank hand-off sent and received once, pairs in the same order,
    the strict model finishes; and validate_lowered agrees."""
    sched = lowered.schedule
    for r, row in enumerate(lowered.ranks):
        assert tuple(st for st in row if not isinstance(st, CommBatch)) == sched.ranks[r]
        assert all(len(st.actions) > 0 for st in row if isinstance(st, CommBatch))
    sends, recvs = pair_lists(lowered)
    assert sends.keys() == recvs.keys()
    for pair in sends:
        assert sends[pair] == recvs[pair], f"pair {pair}: sends and receives in different orders"
    flat = [t for lst in sends.values() for t in lst]
    assert len(flat) == len(set(flat)) and set(flat) == expected_transfers(sched)
    assert run_p2p(lowered, buffered=False) == []
    validate_lowered(lowered)


def test_exact_lowering_of_1f1b_p2_m2() -> None:
    """Receives are posted when the data comes into existence (unit-time run), sends right after their producer."""
    lowered = lower(one_f_one_b(2, 2))
    assert lowered.ranks[0] == steps("0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1} {0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1")
    assert lowered.ranks[1] == steps("{1RECV_F0@0} 1F0 {1RECV_F1@0} 1BW0 {1SEND_B0@0} 1F1 1BW1 {1SEND_B1@0}")
    assert_sound(lowered)


def test_simultaneous_transfers_share_a_batch() -> None:
    """In 1F1B's steady state a rank's send and the receive that ends at the same instant form one batch."""
    lowered = lower(one_f_one_b(3, 4))
    mixed = [
        st
        for row in lowered.ranks
        for st in row
        if isinstance(st, CommBatch) and {a.kind for a in st.actions} >= {Kind.SEND_F, Kind.RECV_B}
    ]
    assert mixed, "expected send_forward + recv_backward batches"
    assert_sound(lowered)


def test_receives_are_posted_before_unrelated_compute() -> None:
    """A receive is posted as soon as its data exists, even if other compute runs before its consumer: on 1F1B's
    last rank microbatch 1's activation arrives while 3BW0 runs, so its receive is posted before 3BW0."""
    row = lower(one_f_one_b(4, 8)).ranks[3]
    assert row[:4] == steps("{3RECV_F0@2} 3F0 {3RECV_F1@2} 3BW0")
    # In the steady state the next activation and the backward's send coincide: one batch, as Megatron pairs them.
    assert steps("{3SEND_B1@2,3RECV_F2@2}")[0] in row


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 3), (3, 7), (4, 8), (5, 2)])
@pytest.mark.parametrize("split", [False, True])
def test_1f1b_lowers_soundly(p: int, m: int, split: bool) -> None:
    assert_sound(lower(one_f_one_b(p, m, split=split)))


@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 5)])
def test_v_placement_hands_off_locally_at_the_turn(p: int, m: int) -> None:
    sched = v_gpipe(p, m)
    lowered = lower(sched)
    assert_sound(lowered)
    turn = [
        a
        for r in range(p)
        for a in lowered.comm_actions(r)
        if (a.kind in (Kind.SEND_F, Kind.RECV_B) and a.stage == p - 1)
        or (a.kind in (Kind.RECV_F, Kind.SEND_B) and a.stage == p)
    ]
    assert turn == []
    # 2 (p - 1) cross-rank hand-offs per microbatch and direction; each has a send and a receive.
    assert sum(len(lowered.comm_actions(r)) for r in range(p)) == 2 * 2 * 2 * (p - 1) * m


def test_one_rank_needs_no_communication() -> None:
    sched = list_schedule(1, 4, loop_placement(1, 3), seed=0)
    lowered = lower(sched)
    assert lowered.num_batches == 0 and lowered.ranks == sched.ranks


def _random_cases() -> list[tuple[str, int, int, int, int]]:
    cases = []
    for seed in range(24):
        rng = random.Random(seed)
        placement = ("loop", "v", "random")[seed % 3]
        cases.append((placement, rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 7), seed))
    return cases


@pytest.mark.parametrize("placement,p,chunks,m,seed", _random_cases())
def test_random_valid_plans_lower_soundly(placement: str, p: int, chunks: int, m: int, seed: int) -> None:
    """Any dependency-valid plan (random order, any placement, mixed BW and split B/W) lowers to a sound plan."""
    rng = random.Random(1000 + seed)
    place = {
        "loop": loop_placement(p, chunks),
        "v": v_placement(p, chunks),
        "random": random_placement(p, chunks, rng),
    }[placement]
    sched = list_schedule(p, m, place, seed=seed)
    lowered = check_and_lower(sched)
    assert lowered == lower(sched)
    assert_sound(lowered)


# ------------------------------------------------------------------------------------- hand-made lowered plans


def _lowered(sched: Schedule, *rows: str) -> LoweredSchedule:
    return LoweredSchedule(sched, tuple(steps(r) for r in rows))


def test_both_ranks_sending_first_deadlocks_only_without_buffering() -> None:
    """Receives placed just before their consumer: rank 0 sends 0F1 while rank 1 sends 1B0; each waits for a
    receive that the other posts only after its own send.  gloo's buffering would hide it; NCCL hangs."""
    plan = _lowered(
        one_f_one_b(2, 2),
        "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1} {0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
        "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0} {1RECV_F1@0} 1F1 1BW1 {1SEND_B1@0}",
    )
    assert run_p2p(plan, buffered=True) == []
    assert run_p2p(plan, buffered=False) == [0, 1]
    with pytest.raises(ScheduleError) as info:
        validate_lowered(plan)
    err = info.value
    msg = str(err)
    assert "\n" not in msg and "deadlock" in msg
    assert "rank 0 step 3 (0SEND_F1@1) waits for rank 1 to post 1RECV_F1@0" in msg
    assert "rank 1 step 3 (1SEND_B0@0) waits for rank 0 to post 0RECV_B0@1" in msg
    assert (err.rank, err.index) == (0, 3)
    assert "[{0SEND_F1@1}]" in err.grid


def test_pairing_send_with_next_receive_fixes_it() -> None:
    plan = _lowered(
        one_f_one_b(2, 2),
        "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
        "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0,1RECV_F1@0} 1F1 1BW1 {1SEND_B1@0}",
    )
    assert_sound(plan)


def test_receives_in_another_order_than_sends_are_rejected() -> None:
    sched = Schedule(
        "gp",
        2,
        2,
        2,
        (0, 1),
        [
            [Action.parse(x) for x in "0F0 0F1 0BW0 0BW1".split()],
            [Action.parse(x) for x in "1F0 1F1 1BW0 1BW1".split()],
        ],
    )
    plan = _lowered(
        sched,
        "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1} {0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
        "{1RECV_F1@0,1RECV_F0@0} 1F0 1F1 1BW0 {1SEND_B0@0} 1BW1 {1SEND_B1@0}",
    )
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 step 0 \(1RECV_F1@0\): receive #0 from rank 0 is matched .* "
        r"which is 0SEND_F0@1 .* different orders",
    ):
        validate_lowered(plan)


@pytest.mark.parametrize(
    "row0,row1,message",
    [
        (  # the activation of microbatch 1 is never received
            "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
            "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0} 1F1 1BW1 {1SEND_B1@0}",
            r"rank 1 step 4 \(1F1\): no 1RECV_F1@0 receives its input",
        ),
        (  # sent before it was computed
            "{0SEND_F0@1} 0F0 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
            "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0,1RECV_F1@0} 1F1 1BW1 {1SEND_B1@0}",
            r"rank 0 step 0 \(0SEND_F0@1\): sent before the action that produces it \(step 1\)",
        ),
        (  # received after it was needed
            "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
            "1F0 {1RECV_F0@0} 1BW0 {1SEND_B0@0,1RECV_F1@0} 1F1 1BW1 {1SEND_B1@0}",
            r"rank 1 step 1 \(1RECV_F0@0\): received after the action that needs it \(step 0\)",
        ),
        (  # wrong peer
            "0F0 {0SEND_F0@0} 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
            "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0,1RECV_F1@0} 1F1 1BW1 {1SEND_B1@0}",
            r"rank 0 step 1 \(0SEND_F0@0\): ",
        ),
        (  # the same receive twice
            "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1} 0BW1",
            "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0,1RECV_F0@0} 1F1 1BW1 {1SEND_B1@0}",
            r"rank 1 step 3 \(1RECV_F0@0\): duplicate",
        ),
        (  # a compute action missing from the lowered plan
            "0F0 {0SEND_F0@1} 0F1 {0SEND_F1@1,0RECV_B0@1} 0BW0 {0RECV_B1@1}",
            "{1RECV_F0@0} 1F0 1BW0 {1SEND_B0@0,1RECV_F1@0} 1F1 1BW1 {1SEND_B1@0}",
            r"rank 0: the lowered plan's compute actions differ",
        ),
    ],
)
def test_broken_lowered_plans_are_rejected(row0: str, row1: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        validate_lowered(_lowered(one_f_one_b(2, 2), row0, row1))
    assert "\n" not in str(info.value)


def test_local_hand_off_must_not_be_communicated() -> None:
    sched = v_gpipe(2, 1)  # stages 0,1,2,3 on ranks 0,1,1,0: 1 -> 2 is local on rank 1
    good = lower(sched)
    row1 = list(good.ranks[1])
    i = row1.index(Action.parse("1F0"))
    row1.insert(i + 1, CommBatch((Action.parse("1SEND_F0@1"),)))
    with pytest.raises(ScheduleError, match="same rank, so this hand-off is local"):
        validate_lowered(LoweredSchedule(sched, (good.ranks[0], tuple(row1))))


def test_lowering_an_invalid_plan_raises() -> None:
    sched = one_f_one_b(2, 2)
    bad = Schedule("bad", 2, 2, 2, (0, 1), [sched.ranks[0], tuple(reversed(sched.ranks[1]))])
    with pytest.raises(ValueError, match="never finishes"):
        lower(bad)


def _mutate(lowered: LoweredSchedule, rng: random.Random) -> LoweredSchedule:
    """Move one comm op of a random rank to another place (a new batch or another batch), keeping compute order."""
    rows = [list(r) for r in lowered.ranks]
    r = rng.choice([r for r in range(len(rows)) if any(isinstance(st, CommBatch) for st in rows[r])])
    row = rows[r]
    j = rng.choice([j for j, st in enumerate(row) if isinstance(st, CommBatch)])
    ops = list(row[j].actions)
    op = ops.pop(rng.randrange(len(ops)))
    if ops:
        row[j] = CommBatch(tuple(ops))
    else:
        del row[j]
    batches = [k for k, st in enumerate(row) if isinstance(st, CommBatch)]
    if batches and rng.random() < 0.5:  # join another batch, at a random slot
        k = rng.choice(batches)
        joined = list(row[k].actions)
        joined.insert(rng.randrange(len(joined) + 1), op)
        row[k] = CommBatch(tuple(joined))
    else:  # a batch of its own anywhere
        row.insert(rng.randrange(len(row) + 1), CommBatch((op,)))
    return LoweredSchedule(lowered.schedule, tuple(tuple(x) for x in rows))


@pytest.mark.parametrize("seed", range(12))
def test_validate_lowered_agrees_with_the_reference_on_mutated_plans(seed: int) -> None:
    """Differential test: after random moves of comm ops, validate_lowered accepts exactly the plans that the
    naive reference accepts (data ready in time, pairs in the same order, strict run finishes)."""
    rng = random.Random(seed)
    p, chunks, m = rng.randint(2, 4), rng.randint(1, 2), rng.randint(2, 5)
    place = (loop_placement, v_placement)[seed % 2](p, chunks)
    lowered = lower(list_schedule(p, m, place, seed=seed))
    verdicts = {True: 0, False: 0}
    for _ in range(60):
        plan = lowered
        for _ in range(rng.randint(1, 3)):
            plan = _mutate(plan, rng)
        sends, recvs = pair_lists(plan)
        expected_ok = data_ready(plan) and sends == recvs and run_p2p(plan, buffered=False) == []
        try:
            validate_lowered(plan)
            ok = True
        except ScheduleError as err:
            ok = False
            assert "\n" not in str(err)
        assert ok == expected_ok, str(plan)
        verdicts[ok] += 1
    assert verdicts[False] > 0  # the mutations do break plans (and, usually, some survive)
