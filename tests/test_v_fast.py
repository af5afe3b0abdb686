"""The compiled V passes (``_v_shape_cpp``) give the plans and numbers of the Python reference, and are fast.

Targets of the issue: generating any V plan takes at most 1 s at p = 32, m = 256 and at most 5 s at p = 64,
m = 512 (measured in tools/bench_schedules.py, with the Python fallback beside).
"""

from __future__ import annotations

import time

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators import v_shape
from zb_pipeline.schedule.generators.v_shape_alternate import alternate_codes
from zb_pipeline.schedule.generators.v_shape_block import block_codes
from zb_pipeline.schedule.generators.v_shape_codes import cpp, makespan, to_codes, to_schedule
from zb_pipeline.schedule.ir import v_placement
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate

needs_cpp = pytest.mark.skipif(cpp is None, reason="C++ extension not built")


def _costs(kind: str, p: int) -> StageCosts:
    place = v_placement(p, 2)
    if kind == "uniform":
        return StageCosts.uniform(2 * p)
    if kind == "table":  # the first row, B freeing 60% of the activation
        return StageCosts.build(
            num_ranks=p, chunks=2, stage_to_rank=place, f=28814, b=28760, w=19352, comm=1610, mem_f=1, mem_b=-0.6,
            mem_w=-0.4,
        )  # fmt: skip
    f = [1.0 + 0.1 * (s % 3) for s in range(2 * p)]
    f[0] += 0.7
    f[-1] += 1.5
    return StageCosts.build(num_ranks=p, chunks=2, stage_to_rank=place, f=f, b=[2 * x for x in f], w=0.6, comm=0.3)


@needs_cpp
@pytest.mark.parametrize("kind", ["uniform", "table", "hetero"])
def test_compiled_passes_equal_the_reference(kind: str) -> None:
    checked = 0
    for p, m in ((1, 3), (2, 2), (3, 7), (5, 5), (6, 13)):
        costs = _costs(kind, p)
        for name in v_shape.V_NAMES:
            caps = v_shape.rank_caps(name, p, costs, None)
            plans = [alternate_codes(p, m, costs, caps, k, b) for k in v_shape._ALT_KNOBS for b in ("cpp", "python")]
            plans += [block_codes(p, m, costs, caps, b) for b in ("cpp", "python")]
            for a, b in zip(plans[::2], plans[1::2]):
                assert a == b, (name, p, m)
            for codes in plans[:-2:2] + plans[-2]:
                if codes is not None:
                    want = simulate(to_schedule(name, p, m, codes), costs).makespan
                    assert makespan(p, m, costs, codes, "cpp") == want
                    checked += 1
    assert checked > 40


@needs_cpp
def test_codes_round_trip() -> None:
    sched = generate("zb-v", 3, 5)
    assert to_schedule("zb-v", 3, 5, to_codes(sched.ranks, 5)).ranks == sched.ranks


@needs_cpp
def test_same_plan_from_either_backend() -> None:
    for name in v_shape.V_NAMES:
        for p, m in ((3, 7),):
            costs = _costs("table", p)
            a = v_shape.plan_v(name, p, m, chunks=2, costs=costs, mem_limit=None, backend="cpp")
            b = v_shape.plan_v(name, p, m, chunks=2, costs=costs, mem_limit=None, backend="python")
            assert a.ranks == b.ranks, (name, p, m)


@needs_cpp
@pytest.mark.slow
@pytest.mark.parametrize(("p", "m", "limit"), [(32, 256, 1.0), (64, 512, 5.0)])
def test_generation_time(p: int, m: int, limit: float) -> None:
    """CPU seconds of one generation (a loaded shared machine makes wall time noisy), each schedule and cost kind."""
    for kind in ("uniform", "table"):
        costs = _costs(kind, p)
        for name in v_shape.V_NAMES:
            t0 = time.process_time()
            v_shape.plan_v(name, p, m, chunks=2, costs=costs, mem_limit=None)
            took = time.process_time() - t0
            assert took <= limit, f"{name} p={p} m={m} {kind}: {took:.2f} s > {limit} s"
