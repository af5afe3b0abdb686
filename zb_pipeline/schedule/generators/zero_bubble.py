"""The zero-bubble paper's handcrafted schedules with a split backward: ``zb-h1`` and ``zb-h2``.

Both split each backward into ``B`` (gradient of the stage input, on the critical path) and ``W`` (weight gradient,
needed by nobody downstream), and use ``W`` to fill what would otherwise be pipeline bubbles.

Why the bubbles are what they are (uniform costs F, B, W, communication c; memory: a microbatch is resident from
its F to its W)
--------------------------------------------------------------------------------------------------------------
Take the last microbatch.  Its gradient leaves the last rank when that rank runs ``B(m-1)`` and needs
``(p - 1)(B + c)`` to reach rank 0, which then still runs ``W(m-1)``.  If the last rank is never idle from its
first action (it starts at ``(p - 1)(F + c)``, when microbatch 0 arrives) and ends with ``D`` weight gradients
after ``B(m-1)``, then ``B(m-1)`` ends at ``(p-1)(F+c) + m(F+B+W) - D W`` and rank 0, which starts at time 0,
ends no earlier than

    (p-1)(F+c) + m(F+B+W) - D W + (p-1)(B+c) + W  =  m(F+B+W) + (p-1)(F+B+2c) - (D-1) W.

A rank that holds at most ``M`` microbatches can have at most ``M`` W's outstanding when it runs its last B, so
``D <= M``, and rank 0's span, the makespan, exceeds the ideal ``m(F+B+W)`` by at least
``(p-1)(F+B+2c) - (M-1) W``.  The two schedules reach this bound with equality when rank 0 has no other idle
time (``m >= 2p``, and c small enough that the last rank never waits: we test ``2c <= W``):

- ZB-H1, ``M = p`` (1F1B's memory): bubble ``(p-1)(F+B-W)`` at ``c = 0``.  Rank ``i`` runs 1F1B's order
  (``p - i`` warm-up forwards, then B / F pairs) with its W's held back ``i`` microbatches behind its B's, so
  the last rank ends with ``p`` W's and every rank holds at most ``p`` microbatches.  The order is fixed (it does
  not depend on the costs); with ``c > 0`` it is valid but does not reach ``(p-1)(F+B+2c-W)``.
- ZB-H2, ``M = 2p - 1``: bubble ``(p-1)(F+B+2c-2W)``.  Rank ``i`` first runs the ``2(p-i)-1`` forwards that
  fit before the gradient of microbatch 0 returns (with F = B, c = 0), then, whenever free, its next B if the
  gradient is there, else its next F while it holds fewer than ``2p - 1`` microbatches, else its oldest W if that
  W ends before the next B is due; the W's it never found room for trail its last B (the last rank: ``2p - 1``
  of them, the parallelogram of the paper), except that once a rank has no F left its pending W's go before a
  following stage-0 B (``tail_order``: never longer, and robust to a stage running slower than planned).
  Placing W's where they fit needs the stage costs: given, they are used (per stage, not a median).

Both work for every p and m (m < p included: the warm-up is cut to m); a ``mem_limit`` below the plan's peak
raises ``ValueError`` naming the peak it needs.
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.tail_order import first_stage_tail_w_first
from zb_pipeline.schedule.generators.zb_auto_bound import default_mem_limit
from zb_pipeline.schedule.generators.zb_auto_passes import (
    Policy,
    StageArrays,
    codes_to_schedule,
    resolve_backend,
    run_policy,
)
from zb_pipeline.schedule.ir import B, F, Schedule, W, loop_placement
from zb_pipeline.schedule.memory import schedule_mem_floor
from zb_pipeline.schedule.registry import register


def zb_h1_order(p: int, m: int) -> Schedule:
    """ZB-H1's fixed order (see the module docstring)."""
    ranks = []
    for i in range(p):
        acts = [F(i, k) for k in range(min(m, p - i))]
        next_f = len(acts)
        pending: list[int] = []  # microbatches whose B ran and whose W has not
        for k in range(m):
            acts.append(B(i, k))
            pending.append(k)
            if len(pending) > i:  # W trails B by i microbatches on rank i
                acts.append(W(i, pending.pop(0)))
            if next_f < m:
                acts.append(F(i, next_f))
                next_f += 1
        acts.extend(W(i, k) for k in pending)
        ranks.append(acts)
    return Schedule("zb-h1", p, p, m, loop_placement(p), ranks)


def zb_h2_order(p: int, m: int, costs: StageCosts) -> Schedule:
    """ZB-H2: 2(p-i)-1 warm-up forwards on rank i, then B first, F within 2p-1 microbatches, W where it fits; then
    the tail rule (``tail_order``)."""
    return first_stage_tail_w_first(zb_h2_greedy_order(p, m, costs), costs)


def zb_h2_greedy_order(p: int, m: int, costs: StageCosts) -> Schedule:
    """ZB-H2's greedy order before the tail rule (the paper's placement: a W only where it fits)."""
    st = StageArrays.of(costs, default_mem_limit(p, costs))
    warm = tuple(max(1, min(m, 2 * (p - i) - 1)) for i in range(p))
    plans, _ = run_policy(resolve_backend(None), m, st, Policy(warm, (0,) * p, (m,) * p, 0.0, False, False, "zb-h2"))
    return codes_to_schedule("zb-h2", p, m, plans)


def _check_limit(name: str, schedule: Schedule, costs: StageCosts, mem_limit: float | None) -> Schedule:
    if mem_limit is None:
        return schedule
    need = schedule_mem_floor(schedule, costs)
    if need > mem_limit + 1e-9 * max(1.0, abs(need)):
        raise ValueError(
            f"{name} needs mem_limit >= {need:g} for p={schedule.num_ranks}, m={schedule.num_microbatches} "
            f"(got {mem_limit:g}); use zb-auto to plan within a smaller limit"
        )
    return schedule


def _one_chunk(name: str, chunks: int, costs: StageCosts, p: int) -> None:
    if chunks != 1:
        raise ValueError(f"{name} runs one chunk per rank, got {chunks=}; use zb-v or interleaved-zb for more")
    if costs.num_stages != p:
        raise ValueError(f"{name}: costs have {costs.num_stages} stages, expected p={p}")


@register(
    "zb-h1",
    chunks=(1,),
    memory_bound=lambda p, m: min(p, m),
    description="zero-bubble H1: 1F1B memory, W fills the tail",
)
def zb_h1(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """ZB-H1: 1F1B's memory (p microbatches on rank 0), bubble (p-1)(F+B-W)."""
    _one_chunk("zb-h1", chunks, costs, p)
    return _check_limit("zb-h1", zb_h1_order(p, m), costs, mem_limit)


@register(
    "zb-h2",
    uses_costs=True,
    chunks=(1,),
    memory_bound=lambda p, m: min(2 * p - 1, m),
    description="zero-bubble H2: 2p-1 microbatches, bubble (p-1)(F+B+2c-2W)",
)
def zb_h2(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """ZB-H2: 2p-1 microbatches of activation memory, bubble (p-1)(F+B+2c-2W)."""
    _one_chunk("zb-h2", chunks, costs, p)
    return _check_limit("zb-h2", zb_h2_order(p, m, costs), costs, mem_limit)
