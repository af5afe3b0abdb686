"""V-shaped zero-bubble schedules: ``zb-v``, ``v-half`` and ``v-min`` (two chunks per rank, V placement).

Placement: with ``p`` ranks there are ``S = 2p`` virtual stages; chunk 0 (stages ``0..p-1``) goes down the ranks and
chunk 1 (stages ``p..2p-1``) comes back up, so rank ``r`` holds stages ``r`` and ``2p-1-r``.  The hand-off between
the two chunks on rank ``p-1`` (forward) and the loss on rank 0 (stage ``2p-1``, whose backward starts where its
forward ended) are local: no communication.

How a plan is built.  A list scheduler simulates time with the *real* per-virtual-stage costs (``StageCosts``:
T_F, T_B, T_W per stage and T_comm on every hand-off between ranks).  Whenever a rank is free it runs one action
that is ready there, by priority (backward first, then forward, then the deferred weight-gradient work W, which
fills what would otherwise be bubbles), subject to a per-rank memory cap.  Two rules keep the greedy sound:

- *Channel order.*  Messages between two ranks are consumed in the order they were produced, so lowering can post
  every receive in the sender's order (the strict one-order-per-pair model) without buffering.
- *Oldest microbatch first on memory.*  An action that grows a rank's memory for microbatch ``k`` may only run if
  what remains of the oldest unfinished microbatch's growth on that rank still fits under the cap; the oldest one
  can therefore always move.  If this optimistic rule ever leaves the plan stuck, the planner falls back to full
  reservation (a microbatch enters the pipeline only when its whole footprint fits on every rank), which can never
  get stuck as long as one microbatch fits.

A few priority variants are planned and the one with the smallest simulated makespan is kept; memory never exceeds
the cap by construction.

Memory caps, per rank ``r`` and in units of that rank's whole-share ``M_r = mem_f[r] + mem_f[2p-1-r]`` (the memory
of one microbatch's forward through both of its chunks; with the default model each chunk's F adds ``M_r / 2``):

- ``zb-v``:   ``p`` x M_r, the activation memory of 1F1B (ZB-V of the zero-bubble paper).
- ``v-half``: ``ceil(p / 2) + 1`` half-units, i.e. ``(ceil(p / 2) + 1) / 2`` x M_r ... see ``cap_units``.
- ``v-min``:  see ``cap_units``.

The exact cap of each schedule for each ``p`` is ``cap_units(name, p)`` (a multiple of ``M_r / 2``); the plans never
exceed it on any rank, and reach it exactly once ``m`` is large enough (tested).  A ``mem_limit`` smaller than the
cap lowers it further; one below a single microbatch's footprint is rejected with the smallest limit that works.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule, v_placement
from zb_pipeline.schedule.registry import register

_EPS = 1e-9


def cap_units(name: str, p: int) -> int:
    """Memory cap of V schedule ``name`` for ``p`` ranks, in half-units (``M_r / 2``: one chunk's forward).

    ``zb-v``: ``2p`` (= p x M_r, 1F1B's activation memory).  ``v-half``: ``p + 1`` (about half of 1F1B).
    ``v-min``: ``ceil(2p / 3) + 1`` (about a third).  Never below 2 (one microbatch through both chunks).
    """
    if name == "zb-v":
        units = 2 * p
    elif name == "v-half":
        units = p + 1
    elif name == "v-min":
        units = -(-2 * p // 3) + 1
    else:
        raise ValueError(f"unknown V schedule {name!r}; known: zb-v, v-half, v-min")
    return max(2, min(units, 2 * p))


@dataclass(frozen=True)
class _Policy:
    """One priority variant of the list scheduler."""

    admission: str  # "oldest" (optimistic, see module doc) or "reserve" (whole footprint reserved on entry)
    order: str  # "bfw": B > F > W;  "fbw": F > B > W;  "f1bf0w": chunk-1 F > B > chunk-0 F > W
    pace: float = 0.0  # new microbatch k enters no earlier than (k - burst) x pace x period (0: no pacing)
    burst: int = 0


_POLICIES = (
    _Policy("oldest", "bfw"),
    _Policy("oldest", "f1bf0w"),
    _Policy("oldest", "fbw"),
)
_SAFE = _Policy("reserve", "bfw")


@dataclass
class _Plan:
    ranks: list[list[Action]]
    makespan: float
    peak: list[float]


def plan_list_schedule(
    stage_to_rank: tuple[int, ...],
    m: int,
    costs: StageCosts,
    caps: list[float],
    policy: _Policy,
) -> _Plan | None:
    """Run the memory-capped list scheduler once; ``None`` if the optimistic rule got stuck."""
    S = len(stage_to_rank)
    p = max(stage_to_rank) + 1
    stages_on = [[s for s in range(S) if stage_to_rank[s] == r] for r in range(p)]
    delta = {Kind.F: costs.mem_f, Kind.B: costs.mem_b, Kind.W: costs.mem_w}
    dur = {Kind.F: costs.f, Kind.B: costs.b, Kind.W: costs.w}
    footprint = [sum(max(0.0, delta[k][s]) for s in stages_on[r] for k in delta) for r in range(p)]

    orders: list[list[Action]] = [[] for _ in range(p)]
    first_start: list[float | None] = [None] * p
    free_at = [0.0] * p
    mem = [0.0] * p
    peak = [0.0] * p
    reserved = [0.0] * p  # "reserve" mode: growth still owed to admitted microbatches
    growth_left = [[footprint[r]] * m for r in range(p)]  # per rank, per microbatch: growth not yet applied
    oldest = [0] * p
    inbox: dict[int, list[tuple[int, int]]] = {r: [] for r in range(p)}  # rank -> channel keys (src, dst) into it
    channels: dict[tuple[int, int], deque[tuple[Action, float]]] = {}
    for a in range(p):
        for b in range(p):
            if a != b:
                channels[(a, b)] = deque()
                inbox[b].append((a, b))
    local: list[list[Action]] = [[] for _ in range(p)]  # ready, dependency on the same rank
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    entry_rank = stage_to_rank[0]
    # The bottleneck rank's work per microbatch: the steady-state period of a full pipeline.
    period = max(sum(costs.f[s] + costs.b[s] + costs.w[s] for s in stages_on[r]) for r in range(p))
    next_new = 0
    total = 3 * S * m
    n_done = 0
    events: list[float] = [0.0]
    t = 0.0

    def grows(r: int, a: Action) -> float:
        return delta[a.kind][a.stage]

    def allowed(r: int, a: Action) -> bool:
        d = grows(r, a)
        if d <= 0:
            return True
        if policy.admission == "reserve":
            return True  # covered by the reservation made on entry
        if mem[r] + d > caps[r] + _EPS:
            return False
        o = oldest[r]
        if a.microbatch != o and o < m and mem[r] + d + growth_left[r][o] > caps[r] + _EPS:
            return False
        return True

    def admit_new() -> bool:
        if policy.pace and t + _EPS < (next_new - policy.burst) * policy.pace * period:
            return False
        if policy.admission == "reserve":
            return all(mem[r] + reserved[r] + footprint[r] <= caps[r] + _EPS for r in range(p))
        return allowed(entry_rank, Action(0, Kind.F, next_new))

    def rank_key(a: Action) -> tuple:
        k = a.kind
        if policy.order == "bfw":
            cls = 0 if k is Kind.B else 1
        elif policy.order == "fbw":
            cls = 0 if k is Kind.F else 1
        else:  # f1bf0w
            cls = 0 if (k is Kind.F and a.stage >= S // 2) else (1 if k is Kind.B else 2)
        return (cls, a.microbatch, -a.stage if k is Kind.F else a.stage)

    def finish(r: int, a: Action, start: float) -> None:
        nonlocal n_done
        end = start + dur[a.kind][a.stage]
        orders[r].append(a)
        if first_start[r] is None:
            first_start[r] = start
        free_at[r] = end
        heapq.heappush(events, end)
        n_done += 1
        d = grows(r, a)
        mem[r] += d
        peak[r] = max(peak[r], mem[r])
        if d > 0:
            growth_left[r][a.microbatch] -= d
            if policy.admission == "reserve":
                reserved[r] -= d
            while oldest[r] < m and growth_left[r][oldest[r]] <= _EPS:
                oldest[r] += 1
        succ: list[Action] = []
        if a.kind is Kind.F:
            succ.append(Action(a.stage + 1, Kind.F, a.microbatch) if a.stage + 1 < S else Action(a.stage, Kind.B, a.microbatch))
        elif a.kind is Kind.B:
            pending_w[r].append(Action(a.stage, Kind.W, a.microbatch))
            if a.stage > 0:
                succ.append(Action(a.stage - 1, Kind.B, a.microbatch))
        for nxt in succ:
            dst = stage_to_rank[nxt.stage]
            if dst == r:
                local[r].append(nxt)
            else:
                arrival = end + costs.comm
                channels[(r, dst)].append((nxt, arrival))
                heapq.heappush(events, arrival)

    while n_done < total:
        for r in range(p):
            if free_at[r] > t + _EPS:
                continue
            cands: list[tuple[tuple, Action, str, object]] = []
            for key in inbox[r]:
                q = channels[key]
                if q and q[0][1] <= t + _EPS and allowed(r, q[0][0]):
                    cands.append((rank_key(q[0][0]), q[0][0], "chan", key))
            for i, a in enumerate(local[r]):
                if allowed(r, a):
                    cands.append((rank_key(a), a, "local", i))
            if r == entry_rank and next_new < m and admit_new():
                a = Action(0, Kind.F, next_new)
                cands.append((rank_key(a), a, "new", None))
            if cands:
                _, act, src, ref = min(cands, key=lambda c: c[0])
                if src == "chan":
                    channels[ref].popleft()  # type: ignore[index]
                elif src == "local":
                    local[r].pop(ref)  # type: ignore[arg-type]
                else:
                    if policy.admission == "reserve":
                        for q in range(p):
                            reserved[q] += footprint[q]
                    next_new += 1
                finish(r, act, t)
            elif pending_w[r]:
                finish(r, pending_w[r].pop(0), t)
        # Advance to the next moment anything can change.
        while events and events[0] <= t + _EPS:
            heapq.heappop(events)
        if n_done >= total:
            break
        if policy.pace and next_new < m:
            heapq.heappush(events, max(t, (next_new - policy.burst) * policy.pace * period))
        if not events:
            return None  # stuck: nothing runs and nothing is in flight
        t = heapq.heappop(events)
    makespan = max(free_at[r] - (first_start[r] or 0.0) for r in range(p))
    return _Plan(orders, makespan, peak)


def _plan_best(stage_to_rank: tuple[int, ...], m: int, costs: StageCosts, caps: list[float]) -> _Plan:
    best: _Plan | None = None
    for policy in _POLICIES:
        plan = plan_list_schedule(stage_to_rank, m, costs, caps, policy)
        if plan is not None and (best is None or plan.makespan < best.makespan - _EPS):
            best = plan
    if best is None:
        best = plan_list_schedule(stage_to_rank, m, costs, caps, _SAFE)
        if best is None:  # cannot happen when one microbatch fits on every rank
            raise RuntimeError("V planner: the full-reservation fallback got stuck; this is a bug")
    return best


def rank_caps(name: str, p: int, costs: StageCosts, mem_limit: float | None) -> list[float]:
    """Per-rank memory cap of V schedule ``name`` (in the units of the mem deltas), ``mem_limit`` applied."""
    S = 2 * p
    place = v_placement(p, 2)
    units = cap_units(name, p)
    caps = []
    for r in range(p):
        stages = [s for s in range(S) if place[s] == r]
        whole = sum(costs.mem_f[s] for s in stages)
        need = sum(max(0.0, d[s]) for s in stages for d in (costs.mem_f, costs.mem_b, costs.mem_w))
        cap = max(units * whole / 2.0, need)
        if mem_limit is not None:
            if mem_limit + _EPS < need:
                smallest = max(
                    sum(max(0.0, d[s]) for s in range(S) if place[s] == q for d in (costs.mem_f, costs.mem_b, costs.mem_w))
                    for q in range(p)
                )
                raise ValueError(
                    f"mem_limit={mem_limit:g} is below what {name} needs on rank {r} (one microbatch through both "
                    f"chunks: {need:g}); the smallest limit that works is {smallest:g}"
                )
            cap = min(cap, mem_limit)
        caps.append(cap)
    return caps


def plan_v(name: str, p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None) -> Schedule:
    """Shared entry point of the three V schedules."""
    if chunks != 2:
        raise ValueError(f"{name} uses V placement with exactly 2 chunks per rank, got chunks={chunks}")
    if costs.num_stages != 2 * p:
        raise ValueError(f"{name}: costs are given for {costs.num_stages} virtual stages, expected 2p={2 * p}")
    for s in range(2 * p):
        if costs.mem_f[s] < 0:
            raise ValueError(f"{name}: mem_f of stage {s} is {costs.mem_f[s]}; forward memory must be >= 0")
    caps = rank_caps(name, p, costs, mem_limit)
    place = v_placement(p, 2)
    plan = _plan_best(place, m, costs, caps)
    return Schedule(name=name, num_ranks=p, num_stages=2 * p, num_microbatches=m, stage_to_rank=place, ranks=plan.ranks)


@register("zb-v", chunks=(2,), placement="v", description="ZB-V: V placement, split B/W, 1F1B memory (p x M)")
def zb_v(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """ZB-V: peak memory at most p x the rank's whole-share mem_f; near-zero bubble once m >= 2p."""
    return plan_v("zb-v", p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)


@register("v-half", chunks=(2,), placement="v", description="V-Half: V placement, about half of 1F1B's memory")
def v_half(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """V-Half: peak memory at most (p + 1) / 2 x the rank's whole-share mem_f."""
    return plan_v("v-half", p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)


@register("v-min", chunks=(2,), placement="v", description="V-Min: V placement, about a third of 1F1B's memory")
def v_min(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """V-Min: peak memory at most (ceil(2p / 3) + 1) / 2 x the rank's whole-share mem_f."""
    return plan_v("v-min", p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)


__all__ = ["cap_units", "plan_list_schedule", "plan_v", "rank_caps", "zb_v", "v_half", "v_min", "math"]
