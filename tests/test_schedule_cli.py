"""``zb-schedule``: every subcommand end to end, and bad input as one line on stderr with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zb_pipeline.schedule.cli import main
from zb_pipeline.schedule.plan_file import dumps_plan, load_plan, plan_to_dict
from zb_pipeline.schedule.registry import available, generate


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zb_pipeline.schedule", *args], capture_output=True, text=True, timeout=120
    )


def test_simulate_json_1f1b(capsys):
    assert (
        main(["simulate", "1f1b", "-p", "4", "-m", "8", "--cost-f", "1", "--cost-b", "2", "--cost-w", "1", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "1f1b"
    assert out["makespan"] == (8 + 4 - 1) * 4
    assert out["bubble_rate"] == pytest.approx(1 - 8 * 4 / out["makespan"])
    assert out["peak_memory"] == [4, 3, 2, 1]
    assert out["p2p_messages"] == 2 * 8 * 3  # one activation and one gradient per microbatch per boundary


def test_simulate_reports_the_lower_bound(capsys):
    # p = 2, m = 8, F = B = 2W: no plan ends before F + 8 (F + B + W) = 21; ZB-H2 does, 1F1B ends at 9 x 2.5.
    ends = {}
    for name in ("zb-h2", "1f1b"):
        assert main(["simulate", name, "-p", "2", "-m", "8", "--cost-w", "0.5", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["lower_bound"] == pytest.approx(21.0)
        ends[name] = out["end_time"]
    assert ends == pytest.approx({"zb-h2": 21.0, "1f1b": 22.5})
    assert main(["simulate", "1f1b", "-p", "2", "-m", "8", "--cost-w", "0.5"]) == 0
    assert "no plan of this layout can end before 21 (rank 1, first input): +7.14% over that bound" in (
        capsys.readouterr().out
    )


def test_simulate_long_flags_text_and_export(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    rc = main(
        ["simulate", "interleaved-1f1b", "--ranks", "4", "--microbatches", "6", "--chunks", "2"]
        + ["--cost-f", "1,1,1,2", "--cost-comm", "0.1", "--mem-f", "2", "--export", str(plan)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "interleaved-1f1b: p=4 m=6 chunks=2 (loop)" in text and "peak mem" in text
    sched = load_plan(plan)
    assert sched == generate("interleaved-1f1b", 4, 6, chunks=2)
    assert plan.read_text() == dumps_plan(sched)


def test_per_virtual_stage_costs_and_v_placement(capsys):
    # zb-v is V-placed: a per-rank list applies to both of a rank's chunks (stages r and 2p-1-r).
    rc = main(["simulate", "zb-v", "-p", "2", "-m", "4", "--cost-f", "1,3", "--json"])
    assert rc == 0
    per_rank = json.loads(capsys.readouterr().out)
    rc = main(["simulate", "zb-v", "-p", "2", "-m", "4", "--cost-f", "0.5,1.5,1.5,0.5", "--json"])
    assert rc == 0
    per_stage = json.loads(capsys.readouterr().out)
    assert per_rank["makespan"] == per_stage["makespan"]
    assert per_rank["placement"] == "v"


def test_show_terminal_and_pictures(tmp_path, capsys):
    assert main(["show", "1f1b", "-p", "3", "-m", "4", "--color", "never"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("1f1b: p=3 m=4")
    assert lines[1].startswith("rank 0 | F0 F1 F2") and "X0" in lines[1]
    assert "\x1b[" not in out
    assert main(["show", "zb-v", "-p", "2", "-m", "3", "--color", "always"]) == 0
    assert "\x1b[" in capsys.readouterr().out
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    assert main(["show", "interleaved-1f1b", "-p", "4", "-m", "8", "--png", str(png), "--svg", str(svg)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()[:2000]
    assert main(["show", "1f1b", "-p", "2", "-m", "2", "--grid"]) == 0
    assert "rank 1: 1F0 1BW0 1F1  1BW1" in capsys.readouterr().out  # aligned columns


def test_compare_lists_every_schedule(tmp_path, capsys):
    chart = tmp_path / "cmp.png"
    assert main(["compare", "-p", "4", "-m", "8", "--json", "--png", str(chart)]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [r["schedule"] for r in out["schedules"]] + [s["schedule"] for s in out["skipped"]]
    assert sorted(names) == sorted(available())
    by_name = {r["schedule"]: r for r in out["schedules"]}
    assert by_name["1f1b"]["makespan"] == 33 and by_name["gpipe"]["peak_memory"] == [8, 8, 8, 8]
    assert by_name["interleaved-1f1b"]["bubble_rate"] < by_name["1f1b"]["bubble_rate"]
    assert chart.read_bytes()[:4] == b"\x89PNG"


def test_compare_names_schedules_that_cannot_serve_the_shape(capsys):
    # m = 1 < p: schedules that need m >= p (or more) are listed with their reason, not dropped.
    assert main(["compare", "-p", "4", "-m", "1", "--mem-limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "gpipe" in out and "1f1b" in out
    for name in available():
        assert name in out


def test_validate_good_and_broken_plans(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(dumps_plan(generate("1f1b", 3, 4)))
    assert main(["validate", str(good)]) == 0
    assert "valid plan '1f1b'" in capsys.readouterr().out
    d = plan_to_dict(generate("1f1b", 3, 4))
    d["ranks"][0].remove("0BW0")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    assert main(["validate", str(bad)]) == 2
    cap = capsys.readouterr()
    assert "rank 0" in cap.out  # the grid
    assert cap.err.count("\n") == 1 and "0BW0" in cap.err


def test_validate_with_the_post_validation_chain(tmp_path, capsys):
    plan = tmp_path / "zbh2.json"
    plan.write_text(dumps_plan(generate("zb-h2", 4, 8)))
    assert main(["validate", str(plan), "--post-validation"]) == 0
    out = capsys.readouterr().out
    assert "post-validation chain: valid" in out
    assert "rank 0: validates after 5 forward(s): 0F0 0F1 0F2 0F3 0F4" in out  # the cut, from the lowered plan
    assert "rank 3: validates in its prologue" in out


BAD_INPUT = [
    (["simulate", "1f1b", "-p", "4", "-m", "8", "--cost-f", "0"], "--cost-f"),
    (["simulate", "1f1b", "-p", "4", "-m", "8", "--cost-w", "-1"], "must be > 0"),
    (["simulate", "1f1b", "-p", "4", "-m", "0"], "-m/--microbatches 0 must be >= 1"),
    (["simulate", "1f1b", "-p", "0", "-m", "4"], "-p/--ranks 0 must be >= 1"),
    (["simulate", "1f1b", "-p", "4", "-m", "8", "--cost-b", "1,2,3"], "has 3 values"),
    (["simulate", "1f1b", "-p", "4", "-m", "8", "--mem-limit", "3"], "at least 4"),
    (["simulate", "no-such", "-p", "4", "-m", "8"], "known schedules: gpipe, 1f1b"),
    (["show", "1f1b", "-p", "four", "-m", "8"], "invalid int value"),
    (["simulate", "1f1b", "-p", "4", "-m", "8", "--cost-comm", "x"], "not a number"),
    (["compare", "-p", "4", "-m", "-2"], "must be >= 1"),
    (["validate", "/no/such/plan.json"], "cannot read plan file"),
    (["bogus"], "invalid choice"),
]


@pytest.mark.parametrize(("args", "needle"), BAD_INPUT)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("zb-schedule: error: ") and needle in proc.stderr


def test_malformed_plan_file_names_rank_and_position(tmp_path):
    d = plan_to_dict(generate("1f1b", 2, 2))
    d["ranks"][1][2] = "1Q1"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "rank 1 position 2: bad action '1Q1'" in proc.stderr
    path.write_text("{ not json")
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr and proc.stderr.count("\n") == 1


def test_console_script_entry_point():
    proc = run_cli("list")
    assert proc.returncode == 0
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert name in proc.stdout
