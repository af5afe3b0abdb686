"""The V schedules plan with recomputation's B transient like zb-auto: under ``mem_limit`` each rank's resident cap
is the limit minus its largest transient, so the predicted peak (``memory.peak_memory``, transient included) is
within the limit; a limit below one microbatch plus the transient names the smallest that works."""

from __future__ import annotations

import dataclasses
import re

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape import V_NAMES, peak_caps, rank_caps
from zb_pipeline.schedule.ir import v_placement
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.registry import generate


def recompute_costs(p: int) -> StageCosts:
    """Recompute, per virtual stage: F keeps 2 (unit inputs and what is not recomputed), B holds a transient of 2
    while it rebuilds a unit and leaves 1 more for W; the head's stage (the last) keeps 3 and hardly recomputes."""
    S = 2 * p
    return StageCosts.build(
        num_ranks=p, chunks=2, stage_to_rank=v_placement(p, 2), f=[1.0] * S, b=[2.0] * S, w=[0.8] * S,
        mem_f=[2.0] * (S - 1) + [3.0], mem_b=[1.0] * (S - 1) + [0.5], mem_b_transient=[2.0] * (S - 1) + [0.5],
    )  # fmt: skip


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize("p", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_predicted_peak_with_the_transient_stays_within_the_limit(name, p) -> None:
    m = 2 * p
    costs = recompute_costs(p)
    with pytest.raises(ValueError, match="the smallest limit that works is") as err:
        generate(name, p, m, costs=costs, mem_limit=1.0)
    smallest = float(re.search(r"smallest limit that works is ([0-9.e+-]+)", str(err.value)).group(1))
    for limit in (smallest, smallest + 1, smallest + 2, smallest + 3):
        plan = generate(name, p, m, costs=costs, mem_limit=limit)
        assert max(peak_memory(plan, costs)) <= limit * (1 + 1e-9), (name, limit, peak_memory(plan, costs))
    # The limit binds: planned blind to the transient, the plan's peak is over it.
    blind = dataclasses.replace(costs, mem_b_transient=(0.0,) * 2 * p, mem_bw_transient=(0.0,) * 2 * p)
    assert max(peak_memory(generate(name, p, m, costs=blind, mem_limit=smallest), costs)) > smallest
    with pytest.raises(ValueError, match="transient"):
        generate(name, p, m, costs=costs, mem_limit=smallest * 0.99)


def test_caps_are_the_limit_minus_the_transient() -> None:
    p, limit = 2, 9.0
    costs = recompute_costs(p)
    # rank 0 holds stages 0 and 3 (transients 2 and 0.5), rank 1 stages 1 and 2 (2 and 2)
    caps = rank_caps("zb-v", p, costs, limit)
    assert caps == [min(c, limit - 2.0) for c in rank_caps("zb-v", p, costs, None)]
    assert peak_caps(p, costs, caps) == [c + 2.0 for c in caps]
