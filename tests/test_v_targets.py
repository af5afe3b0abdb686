"""The V schedules against the papers: the zero-bubble paper's ZB-V table, and the uniform-cost lower bound.

The table is the zero-bubble paper's (its Table 8: per-chunk costs in microseconds, T_comm = c), run as

    zb-schedule simulate NAME -p P -m M --chunks 2 --cost-f 2F --cost-b 2B --cost-w 2W --cost-comm c \\
        --mem-f 1 --mem-b -0.6 --mem-w -0.4 --json

(whole-share costs are twice the chunk's; W keeps 40% of F's activation until it runs; 1F1B and ZB-H1 reproduce
the paper's columns exactly under it).  Targets, each at the schedule's cap (``v_shape.cap_units``):

- zb-v: bubble at most the paper's ZB-V column, peak activation memory at most 1F1B's;
- v-half: at most halfway between the paper's ZB-H1 and 1F1B;
- v-min: at most 1F1B's + 12 points.

Rows a schedule does not reach yet are listed in ``MISSES`` with the bubble measured now (six decimals): those rows
assert the measured value (so they cannot get worse) and are reported as expected failures of the target.  None is
listed now: zb-v's three p = 16 rows, the closest, are below the paper's printed values (0.069661, 0.053293 and
0.027399 against 0.0697, 0.0533 and 0.0274; ``generators/tip_hold.py``).

One row per schedule runs in ``make test``; the table and the uniform grid up to p = 32 in ``make test-slow``.
"""

from __future__ import annotations

import pytest

from zb_pipeline.schedule.bounds import iteration_lower_bound
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import v_placement
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.paper_tables import ZB_V_TABLE
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

TABLE = ZB_V_TABLE  # model, p, m, F, B, W, c (per chunk, us), the paper's 1F1B, ZB-H1, ZB-V bubble rates

# (schedule, row index) -> the bubble measured now, where the target is not reached yet.
MISSES: dict[tuple[str, int], float] = {}
FAST_ROWS = {"zb-v": 3, "v-half": 0, "v-min": 0}  # the rows in make test


def table_costs(p: int, f: float, b: float, w: float, c: float, chunks: int = 2) -> StageCosts:
    place = v_placement(p, 2) if chunks == 2 else None
    return StageCosts.build(
        num_ranks=p, chunks=chunks, stage_to_rank=place, f=2 * f, b=2 * b, w=2 * w, comm=c, mem_f=1, mem_b=-0.6,
        mem_w=-0.4,
    )  # fmt: skip


def target(name: str, row: tuple) -> float:
    _, _, _, _, _, _, _, one_f_one_b, zb_h1, zb_v = row
    return {"zb-v": zb_v, "v-half": (one_f_one_b + zb_h1) / 2, "v-min": one_f_one_b + 0.12}[name]


def _check_row(name: str, i: int) -> None:
    row = TABLE[i]
    _, p, m, f, b, w, c = row[:7]
    costs = table_costs(p, f, b, w, c)
    sched = generate(name, p, m, chunks=2, costs=costs)
    res = simulate(sched, costs)
    if name == "zb-v":  # at most 1F1B's activation memory
        flat = table_costs(p, f, b, w, c, chunks=1)
        ref = max(peak_memory(generate("1f1b", p, m, costs=flat), flat))
        assert max(res.peak_memory) <= ref + 1e-9, (max(res.peak_memory), ref)
    if (name, i) in MISSES:
        assert res.bubble_rate <= MISSES[(name, i)], f"{name} row {i}: {res.bubble_rate:.6f} got worse"
        pytest.xfail(f"{name} row {i}: {res.bubble_rate:.6f} against the target {target(name, row):.4f}")
    assert res.bubble_rate <= target(name, row) + 1e-12, (name, i, res.bubble_rate, target(name, row))


def _rows() -> list:
    out = []
    for name in ("zb-v", "v-half", "v-min"):
        for i in range(len(TABLE)):
            marks = [] if FAST_ROWS[name] == i else [pytest.mark.slow]
            out.append(pytest.param(name, i, marks=marks, id=f"{name}-p{TABLE[i][1]}-m{TABLE[i][2]}"))
    return out


@pytest.mark.parametrize(("name", "i"), _rows())
def test_paper_table(name: str, i: int) -> None:
    _check_row(name, i)


def test_fast_rows_pass_the_validator() -> None:
    """The make-test rows' plans are valid under the strict communication model."""
    for name, i in FAST_ROWS.items():
        _, p, m, f, b, w, c = TABLE[i][:7]
        costs = table_costs(p, f, b, w, c)
        check_and_lower(generate(name, p, m, chunks=2, costs=costs), costs=costs)


# ------------------------------------------------------------------------------------------------ uniform costs


def _uniform(p: int, m: int) -> None:
    """F = B = W = 1 per chunk, T_comm = 0: zb-v ends exactly at ``iteration_lower_bound`` (6m + p - 1) and no rank
    idles inside its span (makespan 6m); the issue asks for the bound up to p = 8 and at most bound + 2 beyond."""
    costs = StageCosts.uniform(2 * p)
    res = simulate(generate("zb-v", p, m, chunks=2, costs=costs), costs)
    bound = iteration_lower_bound(costs, v_placement(p, 2), m).time
    assert bound == 6 * m + p - 1
    assert (res.end_time, res.makespan) == (bound, 6 * m), (p, m)


def test_uniform_bound_one_point() -> None:
    _uniform(8, 16)


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32])
def test_uniform_bound_grid(p: int) -> None:
    for m in (2 * p, 3 * p, 4 * p, 8 * p):
        _uniform(p, m)
