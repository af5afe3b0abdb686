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


def _event(rank: int, cat: str, iteration: int, ts_ms: float) -> dict:
    args = {"iteration": iteration}
    return {"ph": "X", "pid": rank, "tid": 0, "cat": cat, "ts": ts_ms * 1e3, "dur": 1.0, "args": args}


def test_periods_are_rank0s_iteration_starts_after_the_replan() -> None:
    starts = [0, 100, 200, 300, 400, 500, 610, 730, 860]  # rank 0's first F of iterations 0..8
    events = [_event(0, "F", i, t) for i, t in enumerate(starts)]
    events += [_event(0, "W", i, t + 50) for i, t in enumerate(starts)]  # later actions of the same iteration
    events += [_event(1, "F", i, t - 5) for i, t in enumerate(starts)]  # another rank's, and a wait: not counted
    events += [_event(0, "wait", i, t - 7) for i, t in enumerate(starts)]
    first = bench.WINDOW[1] + bench.SETTLE
    want = [starts[i + 1] - starts[i] for i in range(first, len(starts) - 1)]
    assert bench.trace_periods({"traceEvents": events}) == pytest.approx(want)


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
