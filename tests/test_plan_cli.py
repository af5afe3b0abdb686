"""``zb-schedule plan`` and the profile's per-part costs: the planner's answer printed, bad input one line, exit 2."""

from __future__ import annotations

import json

import pytest

from zb_pipeline.schedule.cli import main
from zb_pipeline.schedule.profile import Profile
from zb_pipeline.schedule.stage_planner import ModelCosts, PartCosts, RecomputeOption, plan_stages

PARTS = ["--layer", "1,1,0.8,4", "--embedding", "0.05,0.01,0.05,0.5", "--head", "2.1,2,1.9,6"]
MODEL = ModelCosts(
    num_layers=6,
    layer=PartCosts(1.0, 1.0, 0.8, 4.0),
    embedding=PartCosts(0.05, 0.01, 0.05, 0.5),
    head=PartCosts(2.1, 2.0, 1.9, 6.0),
    recompute=(RecomputeOption("full", 1.0, 1.0, 2.0),),
)


def profile_of(model: ModelCosts, layers: tuple[int, ...], **extra) -> Profile:
    """A profile whose stage medians are exactly ``model``'s costs under ``layers`` (one stage per rank)."""
    c = model.stage_costs(layers, [0] * len(layers))
    S = len(layers)
    return Profile(
        num_ranks=S, stage_to_rank=tuple(range(S)), f=c.f, b=c.b, w=c.w, bw=(None,) * S, comm=c.comm,
        mem_f=c.mem_f, mem_b=c.mem_b, mem_w=c.mem_w, schedule="zb-h1", num_microbatches=8, **extra,
    )  # fmt: skip


def test_plan_from_flags_json(capsys) -> None:
    args = ["plan", "zb-h2", "-m", "6", "-p", "2", "--num-layers", "6", *PARTS, "--recompute", "full=1,1,2"]
    assert main([*args, "--mem-limit", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = plan_stages(MODEL, schedule="zb-h2", num_ranks=2, num_microbatches=6, mem_limit=40)
    assert out["layers"] == list(want.layers) and out["recompute"] == list(want.recompute)
    assert out["iteration"] == pytest.approx(want.iteration) and max(out["peak_memory"]) <= 40
    assert out["even"]["layers"] == [3, 3] and max(out["even"]["peak_memory"]) > 40
    assert out["exact"]


def test_plan_text_names_split_and_prediction(capsys) -> None:
    assert main(["plan", "zb-h1", "-m", "4", "-p", "2", "--num-layers", "4", *PARTS]) == 0
    out = capsys.readouterr().out
    assert "layers per stage: [3, 1]" in out and "predicted iteration" in out and "even split [2, 2]" in out


def test_profile_parts_round_trip_and_derivation(tmp_path, capsys) -> None:
    # A 'parts' entry is read as given.
    prof = profile_of(MODEL, (2, 2, 2), parts=MODEL.to_dict())
    path = tmp_path / "prof.json"
    prof.save(path)
    assert Profile.load(path).model_costs() == MODEL
    # Without it, the parts are derived from the stage medians and the layers each stage held.
    derived = profile_of(MODEL, (1, 3, 2), stage_layers=(1, 3, 2)).model_costs()
    for name in ("layer", "embedding", "head"):
        got, want = getattr(derived, name), getattr(MODEL, name)
        for field in ("f", "b", "w", "mem_f", "mem_b"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), abs=1e-9), (name, field)
    assert main(["plan", "zb-h1", "-m", "8", "--profile", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_ranks"] == 3 and sum(out["layers"]) == 6


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "zb-h1", "-m", "4", "-p", "2", "--num-layers", "4", "--layer", "1,x"], "--layer '1,x'"),
        (["plan", "zb-h1", "-m", "4"], "plan needs --profile"),
        (["plan", "zb-h1", "-m", "4", "-p", "2", "--num-layers", "4", *PARTS, "--recompute", "full"], "NAME=B_EXTRA"),
        (["plan", "zb-h2", "-m", "6", "-p", "2", "--num-layers", "6", *PARTS, "--mem-limit", "3"], "smallest limit"),
        (["plan", "zb-h1", "-m", "4", "-p", "4", "--num-layers", "3", *PARTS], "at least 1 layer"),
        (["plan", "zb-h1", "-m", "4", "--profile", "/nonexistent/prof.json"], "cannot access"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, capsys) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_profile_without_parts_says_how_to_fix(tmp_path, capsys) -> None:
    path = tmp_path / "prof.json"
    profile_of(MODEL, (3, 3)).save(path)
    assert main(["plan", "zb-h1", "-m", "4", "--profile", str(path)]) == 2
    assert "no per-part costs" in capsys.readouterr().err
