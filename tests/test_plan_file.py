"""Plan files: byte-identical round trips, action strings, and one-line errors naming rank and position."""

from __future__ import annotations

import json

import pytest

from zb_pipeline.schedule.ir import Action, Kind, parse_action
from zb_pipeline.schedule.plan_file import (
    PlanFileError,
    dumps_plan,
    load_plan,
    loads_plan,
    plan_from_dict,
    plan_to_dict,
    save_plan,
)
from zb_pipeline.schedule.registry import available, generate, get


def _shapes():
    for name in available():
        spec = get(name)
        chunks = spec.default_chunks
        for p, m in ((1, 1), (2, 3), (4, 8)):
            yield name, p, m, chunks


@pytest.mark.parametrize(("name", "p", "m", "chunks"), list(_shapes()))
def test_export_load_export_is_byte_identical(tmp_path, name: str, p: int, m: int, chunks: int):
    try:
        sched = generate(name, p, m, chunks=chunks)
    except ValueError:
        pytest.skip(f"{name} does not serve p={p} m={m}")
    path = tmp_path / "plan.json"
    save_plan(sched, path)
    first = path.read_bytes()
    loaded = load_plan(path)
    assert loaded == sched
    save_plan(loaded, path)
    assert path.read_bytes() == first
    assert json.loads(first) == plan_to_dict(sched)


def test_layout_is_stable_and_readable():
    text = dumps_plan(generate("1f1b", 2, 2))
    assert text == (
        "{\n"
        '  "schedule": "1f1b",\n'
        '  "num_ranks": 2,\n'
        '  "num_stages": 2,\n'
        '  "num_microbatches": 2,\n'
        '  "stage_to_rank": [0, 1],\n'
        '  "ranks": [\n'
        '    ["0F0", "0F1", "0BW0", "0BW1"],\n'
        '    ["1F0", "1BW0", "1F1", "1BW1"]\n'
        "  ]\n"
        "}\n"
    )


def test_hand_written_compact_json_loads():
    d = {
        "ranks": [["0F0", "0B0", "0W0"], ["1F0", "1B0", "1W0"]],
        "schedule": "mine",
        "num_ranks": 2,
        "num_stages": 2,
        "num_microbatches": 1,
        "stage_to_rank": [0, 1],
    }
    sched = loads_plan(json.dumps(d))
    assert sched.ranks[1] == (Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.W, 0))


@pytest.mark.parametrize("text", ["0F0", "3F0", "0B12", "5W7", "2BW4", "15BW63", "0SEND_F3@1", "7RECV_B0@6"])
def test_action_strings_round_trip(text: str):
    assert str(Action.parse(text)) == text


def test_every_action_of_every_registered_schedule_round_trips():
    for name in available():
        spec = get(name)
        try:
            sched = generate(name, 4, 8, chunks=spec.default_chunks)
        except ValueError:
            continue
        for acts in sched.ranks:
            for a in acts:
                assert parse_action(str(a)) == a  # a pair too (dualpipev)


def _base() -> dict:
    return plan_to_dict(generate("1f1b", 2, 2))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["ranks"][1].__setitem__(2, "1X1"), r"rank 1 position 2: bad action '1X1'"),
        (lambda d: d["ranks"][0].__setitem__(1, 7), r"rank 0 position 1: expected an action string"),
        (lambda d: d["ranks"][0].__setitem__(3, "1BW1"), r"rank 0 position 3: '1BW1' runs stage 1, which .* rank 1"),
        (lambda d: d["ranks"][1].__setitem__(0, "1F5"), r"rank 1 position 0: '1F5' names microbatch 5"),
        (lambda d: d["ranks"][1].__setitem__(0, "4F0"), r"rank 1 position 0: '4F0' names stage 4"),
        (lambda d: d["ranks"][1].__setitem__(0, "1SEND_F0@0"), r"rank 1 position 0: .* communication action"),
        (lambda d: d["ranks"][1].__setitem__(0, "01F0"), r"rank 1 position 0: write '01F0' as '1F0'"),
        (lambda d: d["ranks"].pop(), r'"ranks" must be a list of 2 action lists'),
        (lambda d: d["ranks"].__setitem__(0, "0F0"), r"rank 0: expected a list of action strings"),
        (lambda d: d.pop("num_stages"), r"missing key\(s\) 'num_stages'"),
        (lambda d: d.__setitem__("extra", 1), r"unknown key\(s\) 'extra'"),
        (lambda d: d.__setitem__("num_ranks", 0), r'"num_ranks" is 0, must be >= 1'),
        (lambda d: d.__setitem__("num_microbatches", "2"), r'"num_microbatches" must be an integer'),
        (lambda d: d.__setitem__("num_stages", 3), r'"num_stages" 3 must be a multiple of "num_ranks" 2'),
        (lambda d: d.__setitem__("stage_to_rank", [0]), r'"stage_to_rank" must be a list of 2 ranks'),
        (lambda d: d.__setitem__("stage_to_rank", [0, 2]), r'"stage_to_rank"\[1\] is 2'),
        (lambda d: d.__setitem__("stage_to_rank", [0, 0]), r"places 2 stages on rank 0"),
        (lambda d: d.__setitem__("schedule", ""), r'"schedule" must be a non-empty string'),
    ],
)
def test_malformed_plans_name_what_is_wrong(edit, message: str):
    d = _base()
    edit(d)
    with pytest.raises(PlanFileError, match=message) as e:
        plan_from_dict(d)
    assert "\n" not in str(e.value)


def test_broken_json_and_missing_file(tmp_path):
    with pytest.raises(PlanFileError, match="not valid JSON: .* line 2 column"):
        loads_plan('{\n  "schedule": }')
    with pytest.raises(PlanFileError, match="holds one JSON object"):
        loads_plan("[1, 2]")
    with pytest.raises(PlanFileError, match="cannot read plan file"):
        load_plan(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schedule": "x"}')
    with pytest.raises(PlanFileError, match=r"bad.json: missing key"):
        load_plan(bad)
