"""A toy schedule added the way any schedule is: this generator module and its ``@register`` entry, nothing else.

``toy-gpipe-split``: GPipe with the backward split in two -- every rank runs all its forwards, then all its B's in
reverse pipeline order, then all its W's.  Peak memory m microbatches (nothing is freed before the W's).
``tests/test_toy_schedule.py`` imports it, lists and simulates it with ``zb-schedule`` and trains with it.
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import B, F, Schedule, W, loop_placement
from zb_pipeline.schedule.registry import register

NAME = "toy-gpipe-split"


@register(NAME, chunks=(1,), memory_bound=lambda p, m: m, description="toy: all F, then all B, then all W")
def toy_gpipe_split(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """All forwards, all input-gradient backwards, then all weight-gradient work (in microbatch order)."""
    ranks = [
        [F(r, mb) for mb in range(m)] + [B(r, mb) for mb in range(m)] + [W(r, mb) for mb in range(m)] for r in range(p)
    ]
    return Schedule(NAME, p, p, m, loop_placement(p), ranks)
