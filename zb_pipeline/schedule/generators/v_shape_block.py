"""The building block of the V schedules, derived from the costs, repeated and squeezed (a candidate of ``v_shape``).

"Pipeline Parallelism with Controllable Memory" (Qi et al., 2024) builds a schedule by repeating one microbatch's
*building block* -- the start offsets of its passes on every rank -- at a fixed interval, then squeezing the
warm-up and the cool-down.  A rank's activation memory is then the overlap of the block's lifespans (from a pass
F to its B and W), so the interval and the block's shape set the memory, and the interval sets the steady state's
throughput.  This module derives the block from the given per-stage costs and ``T_comm``:

1. **Offsets** (``block_offsets``): one microbatch's F on stages ``0 .. 2p-1`` (down the ranks, then back up), its
   loss, its B on ``2p-1 .. 0``, each as early as its dependency allows (plus ``T_comm`` across ranks, plus an
   optional ``pad`` on every hop and ``turn`` before the loss's backward) such that copies repeated every
   ``period`` never put two F/B passes on one rank at the same time (modulo scheduling).  The W passes are not part
   of the block: a repeated block has exactly ``period - (F + B)`` of idle time per rank and period, and the W's
   fill it in the squeeze.  ``collide=True`` takes the dependency chain as is (no slot search): the shortest
   lifespans, with collisions left to the squeeze (a candidate where memory is tight).
2. **Repetition** (``block_order``): copy ``k`` is shifted by ``k x period``; every rank runs its F/B passes in
   start-time order.  This order fixes the memory: with each W right after its B the rank's peak is
   ``order_floor``; the shortest period whose floor fits the cap is the one the schedule uses (``block_codes``
   searches it from the busiest rank's work per microbatch upwards).
3. **Squeeze** (``squeeze``): an event-driven pass runs each rank's F/B order as early as dependencies allow; a
   pending W runs when the next F/B is not ready yet (``fill``: always; ``fit``: only if it ends by then) and
   before any F/B that would overrun the cap.  The warm-up and cool-down of the repeated block shrink to what the
   dependencies need, and the plan is then timed by the simulator like every other candidate.
"""

from __future__ import annotations

import heapq
import math

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape_codes import Codes, cost_args, cpp, to_codes
from zb_pipeline.schedule.ir import Action, Kind, v_placement

_EPS = 1e-9
_INF = math.inf


def rank_work(costs: StageCosts, place: tuple[int, ...]) -> float:
    """The busiest rank's work per microbatch: the shortest interval a bubble-free steady state can repeat at."""
    p = max(place) + 1
    work = [0.0] * p
    for s, r in enumerate(place):
        work[r] += costs.f[s] + costs.b[s] + costs.w[s]
    return max(work)


def _slot(busy: list[tuple[float, float]], ready: float, dur: float, period: float) -> float | None:
    """Earliest ``t >= ready`` whose ``[t, t + dur)`` modulo ``period`` misses every busy interval (``None``: the
    free time is split into pieces too short)."""
    cands = sorted([ready] + [ready + (a + d - ready) % period for a, d in busy])
    for t in cands:
        if all((t - a) % period >= d - _EPS and (a - t) % period >= dur - _EPS for a, d in busy):
            return t
    return None


def block_offsets(
    place: tuple[int, ...], costs: StageCosts, period: float, *, turn: float = 0.0, pad: float = 0.0, collide=False
) -> tuple[list[float], list[float]] | None:
    """Start offsets of one microbatch's F and B on every virtual stage (see the module docstring); ``None`` if a
    pass finds no free slot in the period."""
    S = len(place)
    p = max(place) + 1
    busy: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    o_f, o_b = [0.0] * S, [0.0] * S

    def put(s: int, ready: float, dur: float) -> float | None:
        if collide:
            return ready
        t = _slot(busy[place[s]], ready, dur, period)
        if t is not None:
            busy[place[s]].append((t % period, dur))
        return t

    def hop(a: int, b: int) -> float:
        return costs.comm + pad if place[a] != place[b] else 0.0

    for s in range(S):
        t = put(s, o_f[s - 1] + costs.f[s - 1] + hop(s - 1, s) if s else 0.0, costs.f[s])
        if t is None:
            return None
        o_f[s] = t
    for s in range(S - 1, -1, -1):
        ready = o_f[s] + costs.f[s] + (turn if s == S - 1 else 0.0)
        if s < S - 1:
            ready = max(ready, o_b[s + 1] + costs.b[s + 1] + hop(s + 1, s))
        t = put(s, ready, costs.b[s])
        if t is None:
            return None
        o_b[s] = t
    return o_f, o_b


def block_order(
    place: tuple[int, ...], m: int, o_f: list[float], o_b: list[float], period: float
) -> list[list[tuple[int, int, int]]]:
    """Each rank's F/B passes of ``m`` copies of the block in start-time order, as ``(stage, 0 for F / 1 for B, mb)``
    (ties: the earlier copy, then F before B, then the smaller stage)."""
    p = max(place) + 1
    timed: list[list[tuple[float, int, int, int, int]]] = [[] for _ in range(p)]
    for s, r in enumerate(place):
        lst = timed[r]
        for k in range(m):
            lst.append((o_f[s] + k * period, k, 0, s, k))
            lst.append((o_b[s] + k * period, k, 1, s, k))
    out = []
    for lst in timed:
        lst.sort()
        out.append([(s, kind, k) for _, _, kind, s, k in lst])
    return out


def order_floor(order: list[tuple[int, int, int]], costs: StageCosts) -> float:
    """The least peak memory of a rank running ``order``: each W right after its B."""
    mf, mb, mw = costs.mem_f, costs.mem_b, costs.mem_w
    cur = peak = 0.0
    for s, kind, _ in order:
        if kind == 0:
            cur += mf[s]
            peak = max(peak, cur)
        else:
            peak = max(peak, cur + mb[s])
            cur += mb[s] + mw[s]
    return peak


def squeeze(
    place: tuple[int, ...],
    m: int,
    costs: StageCosts,
    orders: list[list[tuple[int, int, int]]],
    caps: list[float],
    fill: str = "fill",
) -> list[list[Action]] | None:
    """Each rank's plan: its F/B ``orders`` run as early as possible, W's in the waits and wherever memory needs
    them (see the module docstring); ``None`` if a rank cannot go on within its cap."""
    p, S = len(orders), len(place)
    c = costs.comm
    f_end = [[_INF] * m for _ in range(S)]
    b_end = [[_INF] * m for _ in range(S)]
    ptr, free, mem = [0] * p, [0.0] * p, [0.0] * p
    wq: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    wh = [0] * p
    plans: list[list[Action]] = [[] for _ in range(p)]
    heap = [(0.0, r) for r in range(p)]
    F, B, W = Kind.F, Kind.B, Kind.W

    def emit_w(r: int, t: float) -> None:
        s, k = wq[r][wh[r]]
        wh[r] += 1
        mem[r] += costs.mem_w[s]
        plans[r].append(Action(s, W, k))
        free[r] = t + costs.w[s]
        heapq.heappush(heap, (free[r], r))

    while heap:
        t, r = heapq.heappop(heap)
        if free[r] > t + _EPS:
            continue
        pend = len(wq[r]) - wh[r]
        order = orders[r]
        if ptr[r] == len(order):
            if pend:
                emit_w(r, t)
            continue
        s, kind, k = order[ptr[r]]
        if kind == 0:
            ready = 0.0 if s == 0 else f_end[s - 1][k] + (c if place[s - 1] != r else 0.0)
            dm = costs.mem_f[s]
        else:
            ready = f_end[s][k]
            if s < S - 1:
                ready = max(ready, b_end[s + 1][k] + (c if place[s + 1] != r else 0.0))
            dm = costs.mem_b[s]
        if mem[r] + dm > caps[r] + _EPS:
            if pend:
                emit_w(r, t)
                continue
            return None  # pragma: no cover - the period search keeps every order's floor within the cap
        if ready <= t + _EPS:
            ptr[r] += 1
            mem[r] += dm
            end = t + (costs.f[s] if kind == 0 else costs.b[s])
            free[r] = end
            heapq.heappush(heap, (end, r))
            if kind == 0:
                f_end[s][k] = end
                plans[r].append(Action(s, F, k))
                nxt = s + 1 if s < S - 1 else s  # the next stage's F, or the loss's own B
                q = place[nxt]
            else:
                b_end[s][k] = end
                plans[r].append(Action(s, B, k))
                wq[r].append((s, k))
                if s == 0:
                    continue
                q = place[s - 1]
            heapq.heappush(heap, (end + (c if q != r else 0.0), q))
            continue
        if pend and (fill == "fill" or ready == _INF or t + costs.w[wq[r][wh[r]][0]] <= ready + _EPS):
            emit_w(r, t)
    if any(len(pl) != 6 * m for pl in plans):
        return None  # pragma: no cover - every dependency of an order from a block is eventually met
    return plans


# Variants of the block: (turn, pad) as fractions of the busiest rank's work per microbatch, and collide.
BLOCK_VARIANTS: tuple[tuple[float, float, bool], ...] = ((0.0, 0.0, False), (0.0, 0.0, True))
# Periods tried, as multiples of the busiest rank's work per microbatch (the first that fits is taken).
_STRETCH = tuple(1.0 + 0.01 * i for i in range(21)) + tuple(1.2 + 0.05 * i for i in range(1, 37))


def fitting_period(
    p: int, m: int, costs: StageCosts, caps: list[float], turn: float, pad: float, collide: bool, backend: str
) -> tuple[float, list[float], list[float]] | None:
    """The shortest period (of ``_STRETCH``) whose repeated block fits every rank's cap, with the block's offsets."""
    place = v_placement(p, 2)
    base = rank_work(costs, place)
    for stretch in _STRETCH:
        period = base * stretch
        offsets = block_offsets(place, costs, period, turn=turn * base, pad=pad * base, collide=collide)
        if offsets is None:
            continue
        o_f, o_b = offsets
        life = max(o_b[s] + costs.b[s] - o_f[s] for s in range(2 * p))
        probe = min(m, int(life / period) + 3)  # enough copies for the steady state's peak
        if backend == "cpp":
            floors = cpp.order_floors(p, probe, *cost_args(costs), o_f, o_b, period)
        else:
            floors = [order_floor(o, costs) for o in block_order(place, probe, o_f, o_b, period)]
        if all(fl <= cap + _EPS for fl, cap in zip(floors, caps)):
            return period, o_f, o_b
    return None


BLOCK_FILLS = ("fill", "fit")


def block_codes(p: int, m: int, costs: StageCosts, caps: list[float], backend: str) -> list[Codes | None]:
    """The squeezed plan of every block variant at its fitting period, as codes, in the order ``BLOCK_VARIANTS`` x
    ``BLOCK_FILLS`` (``None`` where a variant has no period that fits)."""
    place = v_placement(p, 2)
    out: list[Codes | None] = []
    for turn, pad, collide in BLOCK_VARIANTS:
        found = fitting_period(p, m, costs, caps, turn, pad, collide, backend)
        for fill in BLOCK_FILLS:
            if found is None:
                out.append(None)
            elif backend == "cpp":
                period, o_f, o_b = found
                out.append(cpp.squeeze(p, m, *cost_args(costs), caps, o_f, o_b, period, fill == "fill"))
            else:
                period, o_f, o_b = found
                plan = squeeze(place, m, costs, block_order(place, m, o_f, o_b, period), caps, fill)
                out.append(None if plan is None else to_codes(plan, m))
    return out
