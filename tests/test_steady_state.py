"""Steady-state iteration period with the optimizer step: synchronised versus post-validated (simulator side)."""

from __future__ import annotations

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.steady_state import steady_state


def test_hand_computed_two_ranks() -> None:
    """zb-h1, p = 2, m = 1; rank 1's W costs 5, everything else 1, optimizer 1, no communication time.

    One iteration: rank 0 F [0,1]; rank 1 F [1,2] B [2,3] W [3,8]; rank 0 B [3,4] W [4,5]: makespan 8, so the
    synchronised period is 8 + 1.  Post-validated, rank 1 is busy 7 of every period and never waits (rank 0's F of
    the next iteration is ready long before): period 7 + 1.
    """
    costs = StageCosts.build(num_ranks=2, f=1, b=1, w=[1, 5])
    sched = generate("zb-h1", 2, 1)
    ss = steady_state(sched, costs, opt=1.0, reduce_s=0.0)
    assert ss.makespan == 8.0 and ss.synchronised == 9.0 and ss.post_validated == pytest.approx(8.0)
    assert ss.speedup == pytest.approx(9.0 / 8.0)


def test_rank_start_delays_only_that_rank() -> None:
    costs = StageCosts.build(num_ranks=2, f=1, b=1, w=1)
    sched = generate("1f1b", 2, 2)
    base = simulate(sched, costs)
    late = simulate(sched, costs, rank_start=[0.0, 3.0])
    assert late.timeline[1][0].start == 3.0 and late.timeline[0][0].start == 0.0
    assert late.end_time >= base.end_time
    with pytest.raises(ValueError, match="rank_start has 1 entries"):
        simulate(sched, costs, rank_start=[0.0])


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-auto"])
@pytest.mark.parametrize("heavy", [1.0, 1.5])
def test_post_validation_never_slower(name: str, heavy: float) -> None:
    p = 4
    costs = StageCosts.build(num_ranks=p, f=[2] * (p - 1) + [2 * heavy], b=[2] * (p - 1) + [2 * heavy], w=1, comm=0.1)
    ss = steady_state(generate(name, p, 8, costs=costs), costs, opt=1.0, reduce_s=0.2)
    assert ss.synchronised == pytest.approx(ss.makespan + 1.2)
    assert ss.post_validated <= ss.synchronised + 1e-9


def test_heavy_last_stage_gains_with_zb_h2() -> None:
    """A heavier last stage ends zb-h2's iteration last on rank p-1: the other ranks start the next one earlier."""
    p = 8
    costs = StageCosts.build(num_ranks=p, f=[20] * 7 + [30], b=[20] * 7 + [30], w=[10] * 7 + [15], comm=0.3)
    ss = steady_state(generate("zb-h2", p, 24, costs=costs), costs, opt=20.0, reduce_s=1.0)
    assert ss.speedup > 1.02


@pytest.mark.slow
def test_bench_post_validation_quick_writes_its_report(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "tools" / "bench_post_validation.py"), "--quick", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    report = json.loads((tmp_path / "post_validation.json").read_text())
    assert {r["setting"] for r in report["rows"]} == {"uniform", "heavy last stage"}
    for row in report["rows"]:
        assert row["measured_sync_ms"] > 0 and row["simulated_pv_ms"] > 0
    assert "| heavy last stage |" in (tmp_path / "post_validation.md").read_text()
