"""``tools/bench_post_validation_trainer.py``: its trainer command parses, its log reading leaves the profiling
window out, and its prediction is the steady state of the plan the trainer re-planned."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import bench_post_validation_trainer as bench  # noqa: E402

from megatron.arguments import parse_run_config  # noqa: E402
from zb_pipeline.schedule import registry  # noqa: E402
from zb_pipeline.schedule.plan_file import plan_to_dict  # noqa: E402
from zb_pipeline.schedule.steady_state import steady_state  # noqa: E402

LOG = """\
 iteration        2/      14 | consumed samples: 16 | elapsed time per iteration (ms): 671.5 | lm loss: 0 |
replanned zb-auto (p=4, m=8) from profiled costs: predicted iteration 607.04 ms, bubble rate 1.7%
 iteration        4/      14 | consumed samples: 32 | elapsed time per iteration (ms): 696.6 | lm loss: 0 |
 iteration        6/      14 | consumed samples: 48 | elapsed time per iteration (ms): 656.6 | lm loss: 0 |
 iteration        8/      14 | consumed samples: 64 | elapsed time per iteration (ms): 660.9 | lm loss: 0 |
"""


def test_log_windows_after_the_replan_only() -> None:
    windows, after = bench.parse_log(LOG)
    assert windows == [(2, 671.5), (4, 696.6), (6, 656.6), (8, 660.9)] and after == 4
    assert bench.measured_windows(windows, after) == [656.6, 660.9]
    assert bench.measured_windows(*bench.parse_log(LOG.replace("replanned", "planned"))) == []


@pytest.mark.parametrize("tied,pv", [(False, True), (True, False)])
def test_trainer_command_is_the_intended_run(tied: bool, pv: bool) -> None:
    cmd = bench.trainer_command("zb-h2", 4, "last-1.5", tied=tied, pv=pv, train_iters=14, save="/tmp/x")
    argv = cmd[cmd.index(os.path.join(bench.REPO, "pretrain_gpt.py")) + 1 :]
    run = parse_run_config(argv, world_size=4)
    assert run.pipeline.schedule == "zb-h2" and run.pipeline.emulate_stage_scale == "1,1,1,1.5"
    assert (run.pipeline.timers_start_iter, run.pipeline.timers_end_iter) == bench.WINDOW
    assert run.model.untie_embeddings_and_output_weights is not tied
    assert run.pipeline.optimizer_post_validation is pv


def test_prediction_is_the_steady_state_of_the_plan_run() -> None:
    costs = bench.nominal_costs(4, "last-1.5", 0.3)
    plan = registry.generate("zb-auto", 4, 8, costs=costs)
    record = {"p": 4, "m": 8, "scale": "last-1.5", "plan": plan_to_dict(plan)}
    want = steady_state(plan, costs, opt=bench.OPT_MS, reduce_s=1.0)
    assert bench.simulated(record, 0.3, 1.0) == pytest.approx((want.synchronised, want.post_validated), abs=1e-9)
    assert bench.simulated({k: v for k, v in record.items() if k != "plan"}, 0.3, 1.0) is None  # a failed launch
