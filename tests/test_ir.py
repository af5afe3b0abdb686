"""The action IR: string round trips, parsing errors, placements, schedule invariants."""

import itertools

import pytest

from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement, v_placement


@pytest.mark.parametrize("kind", [k for k in Kind if k is not Kind.PAIR])  # pairs: test_dualpipe_v.py
def test_every_kind_round_trips(kind: Kind) -> None:
    for stage, mb in itertools.product((0, 3, 17), (0, 12, 511)):
        a = Action(stage, kind, mb, None if kind.is_compute else 5)
        assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["3F0", "0B12", "5W7", "2BW4", "0SEND_F3@1", "7RECV_B0@6"])
def test_examples_parse_back(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_bw_is_not_read_as_b() -> None:
    a = Action.parse("2BW4")
    assert a.kind is Kind.BW and a.stage == 2 and a.microbatch == 4


@pytest.mark.parametrize("bad", ["", "F0", "3X0", "3F", "-1F0", "3F0@1", "0SEND_F3", "3 F 0", "3f0"])
def test_bad_actions_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(bad)


def test_placements() -> None:
    assert loop_placement(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert v_placement(4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v_placement(3, 3) == (0, 1, 2, 2, 1, 0, 0, 1, 2)
    for p, c in itertools.product(range(1, 9), range(1, 4)):
        for placement in (loop_placement(p, c), v_placement(p, c)):
            assert sorted(placement) == sorted(list(range(p)) * c)


def test_schedule_checks_shape_and_reports_placement() -> None:
    s = Schedule("t", 2, 4, 1, v_placement(2, 2), ((Action.parse("0F0"), Action.parse("3F0")), ()))
    assert s.placement == "v" and s.chunks == 2 and s.stages_of(0) == (0, 3)
    with pytest.raises(ValueError, match="num_stages"):
        Schedule("t", 2, 3, 1, (0, 1, 0), ((), ()))
    with pytest.raises(ValueError, match="rank action lists"):
        Schedule("t", 2, 2, 1, (0, 1), ((),))
    with pytest.raises(ValueError, match="num_microbatches"):
        Schedule("t", 2, 2, 0, (0, 1), ((), ()))
