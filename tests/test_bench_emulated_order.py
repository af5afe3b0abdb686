"""The emulated benchmark's order of work at p = 2: every case is planned before any rank runs one, the cases run in
turns (one iteration of each per round), and no rank starts a turn before every rank ended the previous one -- a
rank planning or running ahead would take a core from a measured iteration elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

from zb_pipeline.runtime.emulate import EmulatedCosts
from zb_pipeline.schedule.plan_file import plan_from_dict
from zb_pipeline.testing import run_multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_pipeline_emulated import _emulated_rank, emulated_plan  # noqa: E402

EMU = EmulatedCosts(2.0, 2.0, 1.0, 0.5)
CASES = [("1f1b", 4), ("zb-h2", 4), ("zb-v", 4)]  # zb-h2 and zb-v are planned for the costs
ITERATIONS = 2


def test_plans_precede_runs_and_cases_run_in_turns() -> None:
    res = run_multiprocess(_emulated_rank, 2, args=(CASES, ITERATIONS, EMU, 0.0), timeout_s=120)
    turns = [(f"{name}/{m}", it) for it in range(ITERATIONS) for name, m in CASES]
    runs = [[e for e in r["timeline"] if e[0] == "run"] for r in res]
    for rank, got in enumerate(runs):
        assert [(key, it) for _, key, it, _, _ in got] == turns, f"rank {rank}"
    planned = max(e[4] for r in res for e in r["timeline"] if e[0] == "plan")
    for i in range(len(turns)):
        before = planned if i == 0 else max(got[i - 1][4] for got in runs)
        assert min(got[i][3] for got in runs) >= before, f"turn {turns[i]} began before the previous work ended"
    # the plans were made by one rank each and gathered: each is the one a rank makes alone
    for r in res:
        assert r["latency_ms"] == res[0]["latency_ms"]
    for name, m in CASES:
        alone = emulated_plan(name, 2, m, res[0]["latency_ms"], EMU)
        assert plan_from_dict(res[0]["cases"][f"{name}/{m}"]["plan"]) == alone, name
