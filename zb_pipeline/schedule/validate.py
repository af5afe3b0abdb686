"""The validator: is a plan complete, dependency-valid, deadlock-free under strict P2P, and within memory?

``check_and_lower(schedule)`` runs, in order, and stops at the first problem:

1. *Structure*: compute actions only, stages and microbatches in range, every action on the rank that owns its
   stage, nothing twice; then *counts*: every (stage, microbatch) has exactly one F and either one B and one W or
   one BW.  An overlapped pair (``ir.PairAction``) counts as its F and its BW, both at its position, and must hold
   two different microbatches (a backward cannot overlap the forward it needs).
2. *Dependencies within a rank*, by position: F of ``s`` after F of ``s - 1``; B after its own F and after the B
   (or BW) of ``s + 1`` (after its own F on the last stage); W after its B.
3. *Dependencies across ranks*: the plan is run once (``lowering.event_order``); if some ranks wait on each other
   forever, the cycle is reported.
4. *Lowering* (``lowering.lower``) and the checks of the lowered plan's communication (``lowered_checks``): every
   hand-off that crosses ranks has exactly one send and one receive with the right peers, a send after its
   producer and a receive before its consumer; between every pair of ranks the k-th send and the k-th receive are
   the same transfer; and the strict model (no buffering, batches posted as a unit, see ``lowering``) finishes
   without deadlock.
5. *Memory*: each rank's peak of the running sum of memory deltas (``memory.peak_memory``) against ``mem_limit``.

and returns the lowered plan.  ``validate_schedule`` runs steps 1-3 and 5 only (no lowering); ``validate_lowered``
checks a lowered plan someone else made (steps 1-4 on it).

A failure raises ``ScheduleError``: ``str(err)`` is one line (rank, position, action, reason), ``err.grid`` is
the rank x step grid with the failing step in ``[brackets]``.  Everything is O(number of actions).
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, PairAction, Schedule
from zb_pipeline.schedule.lowered_checks import check_lowered_comms
from zb_pipeline.schedule.lowering import (
    SLOT_F,
    SLOT_G,
    EventOrder,
    LoweredSchedule,
    event_order,
    kind_code,
    lower,
    no_gc,
    step_deps,
)
from zb_pipeline.schedule.memory import first_over, peak_memory
from zb_pipeline.schedule.schedule_error import MAX_STUCK_LISTED, ScheduleError, plan_error, render_grid

# ScheduleError and render_grid are part of the validator's interface (their home is schedule_error).
__all__ = ["ScheduleError", "check_and_lower", "render_grid", "validate_lowered", "validate_schedule"]


def check_and_lower(
    schedule: Schedule, *, costs: StageCosts | None = None, mem_limit: float | None = None
) -> LoweredSchedule:
    """Check ``schedule`` completely (module docstring), lower it, check the lowered plan, and return it; raises
    ``ScheduleError``.

    Without ``costs`` the memory model is the default one: ``mem_f = 1`` for a rank's whole share of layers
    (``1 / chunks`` per virtual stage), ``mem_b = 0``, ``mem_w = -mem_f``.
    """
    with no_gc():
        lowered = lower(schedule, order=_check_compute(schedule))  # the event order is not kept past lowering
        check_lowered_comms(lowered)
    if mem_limit is not None:
        _check_memory(schedule, _costs_or_default(schedule, costs), mem_limit)
    return lowered


def validate_schedule(schedule: Schedule, *, costs: StageCosts | None = None, mem_limit: float | None = None) -> None:
    """Check ``schedule``'s structure, dependencies and (with ``mem_limit``) memory without lowering it; raises
    ``ScheduleError``.  ``check_and_lower`` also checks the strict P2P order of its communication."""
    with no_gc():
        _check_compute(schedule)
    if mem_limit is not None:
        _check_memory(schedule, _costs_or_default(schedule, costs), mem_limit)


def validate_lowered(lowered: LoweredSchedule) -> None:
    """Check a lowered plan (for instance a hand-made one): its compute plan, then its communication."""
    with no_gc():
        _check_compute(lowered.schedule)
        check_lowered_comms(lowered)


def _check_compute(schedule: Schedule) -> EventOrder:
    """Steps 1-3: structure, counts, dependencies; returns the event order lowering reuses."""
    return _check_dependencies(schedule, _check_structure(schedule))


# --------------------------------------------------------------------------------------------- compute plan
# Where each compute action sits: where[(stage * m + mb) * 4 + code] = its position on its stage's rank (-1: none),
# with code 0..3 for F, B, W, BW (lowering.kind_code).  The rank is the stage's owner (checked first).
_KIND_OF_CODE = (Kind.F, Kind.B, Kind.W, Kind.BW)


def _check_structure(schedule: Schedule) -> list[int]:
    """Steps 1 and 2 of the module docstring; returns ``where`` (see above)."""
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    where = [-1] * (S * m * 4)

    def at(r: int, i: int) -> str:
        return f"rank {r} position {i} ({schedule.ranks[r][i]})"

    for r, acts in enumerate(schedule.ranks):
        for i, step in enumerate(acts):
            if type(step) is PairAction:
                if step.forward.microbatch == step.backward.microbatch:
                    msg = (
                        f"{at(r, i)}: a pair overlaps the F and the BW of one microbatch ({step.forward.microbatch}); "
                        "the backward needs the forward's result"
                    )
                    raise plan_error(schedule, msg, r, i)
                todo: tuple = (step.forward, step.backward)
            else:
                todo = (step,)
            for a in todo:
                if not isinstance(a, Action):
                    raise plan_error(schedule, f"rank {r} position {i}: {a!r} is not an Action", r, i)
                code = kind_code(a.kind)
                s, mb = a.stage, a.microbatch
                if code < 0:
                    raise plan_error(
                        schedule, f"{at(r, i)}: plans hold compute actions only (lowering adds communication)", r, i
                    )
                if s >= S:
                    raise plan_error(schedule, f"{at(r, i)}: stage {s} is out of range 0..{S - 1}", r, i)
                if mb >= m:
                    raise plan_error(schedule, f"{at(r, i)}: microbatch {mb} is out of range 0..{m - 1}", r, i)
                if owner[s] != r:
                    raise plan_error(
                        schedule, f"{at(r, i)}: stage {s} lives on rank {owner[s]} (stage_to_rank), not {r}", r, i
                    )
                key = (s * m + mb) * 4 + code
                if where[key] >= 0:
                    msg = f"{at(r, i)}: duplicate; {a} already ran at position {where[key]}"
                    raise plan_error(schedule, msg, r, i)
                where[key] = i

    for s in range(S):
        o = owner[s]
        for mb in range(m):
            key = (s * m + mb) * 4
            f, b, w, bw = where[key], where[key + 1], where[key + 2], where[key + 3]
            if f < 0:
                raise plan_error(schedule, f"rank {o}: missing {s}F{mb} (stage {s} lives on rank {o})", o)
            if bw >= 0 and (b >= 0 or w >= 0):
                i = b if b >= 0 else w
                raise plan_error(schedule, f"{at(o, i)}: {s}BW{mb} at position {bw} already does this work", o, i)
            if bw < 0:
                if b < 0 and w < 0:
                    msg = f"rank {o}: missing the backward of {s}F{mb} (neither {s}BW{mb} nor {s}B{mb} + {s}W{mb})"
                    raise plan_error(schedule, msg, o)
                if w < 0:
                    raise plan_error(schedule, f"{at(o, b)}: missing {s}W{mb} (every B needs its W)", o, b)
                if b < 0:
                    raise plan_error(schedule, f"{at(o, w)}: missing {s}B{mb} (every W needs its B)", o, w)

    return where


def _check_dependencies(schedule: Schedule, where: list[int]) -> EventOrder:
    """Steps 2 and 3: run the plan once; if it gets stuck, say why (a misordered rank, else a cross-rank cycle)."""
    order = event_order(schedule)
    if not order.stuck:
        return order
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    # An action placed before something it needs on its own rank is the most specific diagnosis.
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            for ev in step_deps(a, S, m):
                key = _event_action(ev, where)
                if owner[key // 4 // m] == r and where[key] > i:
                    msg = (
                        f"rank {r} position {i} ({a}): comes before {_spell(key, m)} (position {where[key]}) "
                        "that it depends on"
                    )
                    raise plan_error(schedule, msg, r, i)
    parts = []
    for r, i, event in order.stuck[:MAX_STUCK_LISTED]:
        key = _event_action(event, where)
        parts.append(
            f"rank {r} position {i} ({schedule.ranks[r][i]}) waits for {_spell(key, m)} "
            f"(rank {owner[key // 4 // m]} position {where[key]})"
        )
    more = len(order.stuck) - MAX_STUCK_LISTED
    tail = f"; ... and {more} more ranks" if more > 0 else ""
    r0, i0, _ = order.stuck[0]
    raise plan_error(schedule, "dependency cycle across ranks (deadlock): " + "; ".join(parts) + tail, r0, i0)


def _event_action(event: int, where: list[int]) -> int:
    """The ``where`` key of the action whose end is lowering's event key ``event``."""
    sm, slot = divmod(event, 3)
    if slot == SLOT_F:
        return sm * 4
    if slot == SLOT_G:
        return sm * 4 + 1 if where[sm * 4 + 1] >= 0 else sm * 4 + 3
    return sm * 4 + 2


def _spell(key: int, m: int) -> str:
    sm, code = divmod(key, 4)
    s, mb = divmod(sm, m)
    return f"{s}{_KIND_OF_CODE[code].value}{mb}"


# --------------------------------------------------------------------------------------------------- memory


def _costs_or_default(schedule: Schedule, costs: StageCosts | None) -> StageCosts:
    if costs is not None:
        return costs
    return StageCosts.build(num_ranks=schedule.num_ranks, chunks=schedule.chunks, stage_to_rank=schedule.stage_to_rank)


def _check_memory(schedule: Schedule, costs: StageCosts, mem_limit: float) -> None:
    peaks = peak_memory(schedule, costs)
    tol = 1e-9 * max(1.0, abs(mem_limit))
    for r, peak in enumerate(peaks):
        if peak > mem_limit + tol:
            first, cur = first_over(schedule.ranks[r], costs, mem_limit + tol)
            a = schedule.ranks[r][first]
            raise plan_error(
                schedule,
                f"rank {r} position {first} ({a}): memory reaches {cur:g} here and peaks at {peak:g} on this rank, "
                f"over mem_limit={mem_limit:g} (this plan needs at least {max(peaks):g})",
                r,
                first,
            )
