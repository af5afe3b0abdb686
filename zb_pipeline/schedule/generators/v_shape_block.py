"""The building block of the V schedules, derived from the costs, repeated and squeezed (a candidate of ``v_shape``).

"Pipeline Parallelism with Controllable Memory" (Qi et al., 2024) builds a schedule by repeating one microbatch's
*building block* -- the start offsets of its passes on every rank -- at a fixed interval, then squeezing the
warm-up and the cool-down.  A rank's activation memory is then the overlap of the block's lifespans (from a pass
F to its B and W), so the interval and the block's shape set the memory, and the interval sets the steady state's
throughput.  This module derives the block from the given per-stage costs and ``T_comm``:

1. **Offsets** (``block_offsets``): one microbatch's F on stages ``0 .. 2p-1`` (down the ranks, then back up), its
   loss, its B on ``2p-1 .. 0``, each as early as its dependency allows (plus ``T_comm`` across ranks, plus a
   ``pad`` on every hop and a ``turn`` before the loss's backward) such that copies repeated every ``period`` never
   put two F/B passes on one rank at the same time (modulo scheduling).  The W passes are not part of the block: a
   repeated block leaves ``period - (F + B)`` idle per rank and period, and the W's fill it in the squeeze.
2. **Repetition** (``block_order``): copy ``k`` is shifted by ``k x period``; every rank runs its F/B passes in
   start-time order.  This order fixes the memory: with each W right after its B the rank's peak is
   ``order_floor``, and only periods whose floor fits every rank's cap are used.
3. **Squeeze** (``squeeze``): an event-driven pass runs each rank's F/B order as early as dependencies allow; a
   pending W runs when the next F/B is not ready yet (``fill``: always; ``fit``: only if it ends by then) and
   before any F/B that would overrun the cap.  The warm-up and cool-down of the repeated block shrink to what the
   dependencies need.
4. **Search** (``block_codes``): turn, pad, period and fill are searched on a short probe plan (the squeezed
   makespan decides; warm-up and cool-down are already in a plan of ``2p`` microbatches), and the best few are
   squeezed at full length.  The shortest period that fits is not always best: a longer one also changes the
   interleaving (on the issue's table V-Half is shortest 0-30% above it, V-Min near it).
"""

from __future__ import annotations

import heapq
import math

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape_codes import Codes, cost_args, cpp, makespan, to_codes
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
    place: tuple[int, ...], costs: StageCosts, period: float, *, turn: float = 0.0, pad: float = 0.0
) -> tuple[list[float], list[float]] | None:
    """Start offsets of one microbatch's F and B on every virtual stage (see the module docstring); ``None`` if a
    pass finds no free slot in the period."""
    S = len(place)
    p = max(place) + 1
    busy: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    o_f, o_b = [0.0] * S, [0.0] * S

    def put(s: int, ready: float, dur: float) -> float | None:
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


# The block's shape is searched: ``turn`` and ``pad`` (fractions of the busiest rank's work per microbatch) and the
# period, from that work upwards (``_STRETCH``, a multiple of it).  A longer period spaces the copies out: fewer in
# flight, so less memory, and a different interleaving that the squeeze may run faster (measured on the issue's
# table: V-Half is shortest 0-30% above the first period that fits, V-Min near the first).
BLOCK_TURNS = (0.0, 0.1)
BLOCK_PADS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.08)
BLOCK_FILLS = ("fill", "fit")
_STEP = 0.04  # the period grid, as a multiple of the busiest rank's work per microbatch: 1, 1.04, ... (coarse) ...
_COARSE = tuple(1.0 + _STEP * i for i in range(16))
_PER_SHAPE = 8  # fitting periods tried per (turn, pad) on the coarse grid; then the best few +- _STEP / 2
_REFINE = 3  # probe candidates whose neighbouring periods are tried too
_KEEP = 3  # best probe candidates squeezed at full length


def _probe_m(p: int, m: int) -> int:
    """Microbatches of the probe plans the search compares (warm-up and cool-down are in; the steady state repeats)."""
    return min(m, 2 * p)


def _span(p: int, m: int, costs: StageCosts, caps: list[float], o_f, o_b, period: float, fill: str, backend: str):
    """The simulated makespan of the squeezed block (inf if the squeeze cannot finish)."""
    if backend == "cpp":
        return cpp.squeeze_span(p, m, *cost_args(costs), caps, o_f, o_b, period, fill == "fill")
    place = v_placement(p, 2)
    plan = squeeze(place, m, costs, block_order(place, m, o_f, o_b, period), caps, fill)
    return _INF if plan is None else makespan(p, m, costs, to_codes(plan, m), "python")


def _floors(p: int, m: int, costs: StageCosts, o_f, o_b, period: float, backend: str) -> list[float]:
    if backend == "cpp":
        return cpp.order_floors(p, m, *cost_args(costs), o_f, o_b, period)
    return [order_floor(o, costs) for o in block_order(v_placement(p, 2), m, o_f, o_b, period)]


# With the Python reference only, plans beyond this many compute actions search a smaller grid (``_SMALL_GRID``).
_PYTHON_FULL_GRID_ACTIONS = 12_000
_SMALL_GRID = ((0.0,), (0.0, 0.02, 0.05), 4)  # turns, pads, fitting periods per (turn, pad)


def block_codes(p: int, m: int, costs: StageCosts, caps: list[float], backend: str) -> list[Codes]:
    """The best squeezed blocks (at most ``_KEEP``), as codes: every (turn, pad) x period x fill whose floor fits the
    caps is squeezed on a probe of ``_probe_m`` microbatches (periods on a coarse grid, then the neighbours of the
    best few), and the shortest few are squeezed at full length."""
    turns, pads, per_shape = BLOCK_TURNS, BLOCK_PADS, _PER_SHAPE
    if backend != "cpp" and 6 * p * m > _PYTHON_FULL_GRID_ACTIONS:
        turns, pads, per_shape = _SMALL_GRID
    place = v_placement(p, 2)
    base = rank_work(costs, place)
    pm = _probe_m(p, m)
    scored: list[tuple[float, int, list[float], list[float], float, str, tuple[float, float, float]]] = []

    def offsets_that_fit(turn: float, pad: float, stretch: float):
        period = base * stretch
        offsets = block_offsets(place, costs, period, turn=turn * base, pad=pad * base)
        if offsets is None:
            return None
        o_f, o_b = offsets
        life = max(o_b[s] + costs.b[s] - o_f[s] for s in range(2 * p))
        probe = min(m, int(life / period) + 3)  # enough copies for the steady state's peak
        if any(fl > cap + _EPS for fl, cap in zip(_floors(p, probe, costs, o_f, o_b, period, backend), caps)):
            return None
        return o_f, o_b, period

    def probe(turn: float, pad: float, stretch: float) -> bool:
        found = offsets_that_fit(turn, pad, stretch)
        if found is None:
            return False
        o_f, o_b, period = found
        for fill in BLOCK_FILLS:
            span = _span(p, pm, costs, caps, o_f, o_b, period, fill, backend)
            scored.append((span, len(scored), o_f, o_b, period, fill, (turn, pad, stretch)))
        return True

    for turn in turns:
        for pad in pads:
            tried = 0
            for stretch in _COARSE:
                tried += probe(turn, pad, stretch)
                if tried >= per_shape:
                    break
    seen = {c[6] for c in scored}
    for *_, (turn, pad, stretch) in sorted(scored, key=lambda c: (c[0], c[1]))[:_REFINE]:
        for near in (stretch - _STEP / 2, stretch + _STEP / 2):
            if near >= 1.0 - _EPS and (turn, pad, near) not in seen:
                seen.add((turn, pad, near))
                probe(turn, pad, near)
    scored.sort(key=lambda x: (x[0], x[1]))
    out = []
    for span, _, o_f, o_b, period, fill, _ in scored[:_KEEP]:
        if span == _INF:
            continue
        if backend == "cpp":
            codes = cpp.squeeze(p, m, *cost_args(costs), caps, o_f, o_b, period, fill == "fill")
        else:
            plan = squeeze(place, m, costs, block_order(place, m, o_f, o_b, period), caps, fill)
            codes = None if plan is None else to_codes(plan, m)
        if codes is not None:
            out.append(codes)
    return out
