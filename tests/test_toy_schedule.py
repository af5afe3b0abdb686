"""Adding a schedule takes one generator module and its registry entry (``tests/toy_schedule.py``): the CLI lists
and simulates it, the trainer's flag accepts it, and a pp = 2 training run with it gives the same losses, to the
bit, as pp = 1 (its W's accumulate in microbatch order, like every built-in schedule's)."""

from __future__ import annotations

import io

import toy_schedule
from test_pipeline_training import BASE, UNTIED, _reference

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.cli import main as zb_schedule
from zb_pipeline.testing.harness import run_multiprocess


def _train_with_toy(rank: int, world_size: int, argv: list[str]) -> dict:
    import torch
    import toy_schedule  # noqa: F401  (registers the schedule in this process)

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=io.StringIO())
    return {"losses": list(summary.losses), "valid": [v for _, v in summary.validation_losses]}


def test_toy_schedule_is_known_everywhere(capsys) -> None:
    spec = registry.get(toy_schedule.NAME)
    assert spec.stated_memory_bound(4, 6) == 6 and spec.placement == "loop"
    assert zb_schedule(["list"]) == 0
    assert toy_schedule.NAME in capsys.readouterr().out
    assert zb_schedule(["simulate", toy_schedule.NAME, "-p", "2", "-m", "3"]) == 0
    assert toy_schedule.NAME in capsys.readouterr().out


def test_training_with_the_toy_schedule_matches_pp1() -> None:
    argv = [*BASE, *UNTIED, "--global-batch-size", "6", "--clip-grad", "0"]
    ref = _reference(argv, 1)
    pp = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", toy_schedule.NAME]
    got = run_multiprocess(_train_with_toy, 2, args=([*argv, *pp],), timeout_s=240)
    assert got[0] == got[1]
    assert got[0]["losses"] == ref["losses"] and got[0]["valid"] == ref["valid"], (got[0], ref)
