"""``uses_costs`` in the registry says the truth: the trainer re-plans exactly the schedules whose plan depends on the
stage costs (``megatron.pipeline.trainer_hooks.attach_replanner``), so a fixed-order schedule must give the same plan
under any costs and a cost-dependent one must change for some realistic costs."""

from __future__ import annotations

import pytest

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts

P, M = 4, 12
# F = B = W (the default), and costs as measured on CPU (W below F, the last stage heavier), with T_comm.
VARIANTS = (dict(f=1.0, b=1.0, w=1.0), dict(f=[1.0, 1.0, 1.0, 1.3], b=[1.0, 1.1, 1.0, 1.2], w=0.6, comm=0.1))


def _plans(name: str) -> list:
    c = registry.get(name).default_chunks
    place = registry.placement_of(name, P, c)
    out = []
    for kw in VARIANTS:
        per_rank = {k: v for k, v in kw.items() if k != "comm"}
        costs = StageCosts.build(num_ranks=P, chunks=c, stage_to_rank=place, comm=kw.get("comm", 0.0), **per_rank)
        out.append(registry.generate(name, P, M, chunks=c, costs=costs).ranks)
    return out


@pytest.mark.parametrize("name", registry.available())
def test_uses_costs_matches_what_the_generator_does(name: str) -> None:
    a, b = _plans(name)
    if registry.get(name).uses_costs:
        assert a != b, f"{name} is marked uses_costs but plans the same under other costs"
    else:
        assert a == b, f"{name} plans differently under other costs: mark it uses_costs (the trainer re-plans those)"
