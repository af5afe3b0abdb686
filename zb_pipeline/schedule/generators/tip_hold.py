"""The tip of the V holds deferred W's instead of whole microbatches at its last forward (a post-pass of ``v_shape``).

Rank ``p-1`` (the tip: stages ``p-1`` and ``p``) under zb-v's cap runs at the cap at every forward: its warm-up fills
the cap, and from its first backward to its last forward it never idles.  Everything after its last forward is the
last microbatch's chain (down chunk 1, back up, down chunk 0, one W), which waits for nothing, so the plan ends as
early as the tip's last forward ends, and that is its first backward plus the work it runs before that forward.  At
the cap, that work is what frees the memory of the forwards in between.  The passes free it a microbatch at a time
(a B and its W, then the next), but per unit of memory a B can free more for its time than a W (at the zero-bubble
paper's p = 16 rows, -0.3 in 14380 us against -0.2 in 9676 us per chunk): running two B's earlier and three W's
later frees the same memory ``3 T_W - 2 T_B`` sooner (268 us there), once the gradients for those B's have arrived.
They arrive late because the feeder (rank ``p-2``, stage ``p+1``) runs its chunk-1 B in the slot after a chunk-1
forward.  The pass:

1. on the feeder, the last ``_FEEDER_B`` stage-``p+1`` B's that follow a W and a forward go before both, the W after
   the forward (the gradient reaches the tip a B earlier; the W it displaces has slack behind it);
2. the tip's last ``_WINDOW_F`` forwards and what runs between them are re-planned exactly: a depth-first search for
   the order that ends its last forward earliest, given the input arrival times of the plan after step 1 and the
   tip's memory cap (forwards in their order; the B's of each stage in their order; W's first-in, first-out);
3. the feedback of that order on the arrival times is repaired by moving single actions of the window (+-3
   places) while the plan gets strictly shorter, within ``_REPAIR_EVALS`` timed runs.

The result is kept only when the plan gets strictly shorter, every changed rank stays within its cap, and the plan
finishes (an order whose assumed arrivals depend on the tip's later outputs is discarded by the timing).  The
zero-bubble paper's p = 16 rows each gain one such swap (268, 278 and 305 us).
"""

from __future__ import annotations

import math

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape_codes import Codes, actions_of, cpp, makespan, to_schedule
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.memory import order_peak
from zb_pipeline.schedule.simulate import simulate

_EPS = 1e-9
_INF = math.inf
_FEEDER_B = 4  # feeder B's moved ahead of the forward before them (measured: 3 to 6 give the same plans)
_WINDOW_F = 6  # the tip's last forwards re-planned by the search (8 and more: orders that cannot finish)
_SEARCH_NODES = 100_000  # depth-first search nodes (the p = 16 rows need a few hundred)
_REPAIR_EVALS = 160  # timed runs of the repair (the p = 16 rows: one move found within the first scan)


def end_times(p: int, m: int, costs: StageCosts, codes: Codes, backend: str) -> tuple[float, list[float]]:
    """(makespan, end time of every action by code) of a plan given as codes."""
    if backend == "cpp" and hasattr(cpp, "end_times"):
        span, ends = cpp.end_times(p, m, costs.f, costs.b, costs.w, costs.comm, codes)
        return span, ends
    res = simulate(to_schedule("v", p, m, codes), costs)
    ends = [-1.0] * (2 * p * m * 3)
    kinds = {Kind.F: 0, Kind.B: 1, Kind.W: 2}
    for line in res.timeline:
        for x in line:
            a = x.action
            ends[(a.stage * m + a.microbatch) * 3 + kinds[a.kind]] = x.end
    return res.makespan, ends


def advance_feeder(p: int, m: int, plan: list[int], count: int) -> list[int]:
    """The feeder's plan with its last ``count`` stage-``p+1`` B's that follow [W, F] moved before them ([B, F, W])."""
    out = plan[:]
    moved = 0
    for i in range(len(out) - 1, 1, -1):
        c = out[i]
        if moved == count:
            break
        if c % 3 == 1 and c // 3 // m == p + 1 and out[i - 1] % 3 == 0 and out[i - 2] % 3 == 2:
            out[i - 2], out[i] = out[i], out[i - 2]
            moved += 1
    return out


def replan_tip_window(
    p: int, m: int, costs: StageCosts, plan: list[int], ends: list[float], cap: float
) -> tuple[list[int], int, int] | None:
    """The tip's plan with its last ``_WINDOW_F`` forwards and what runs between them re-ordered to end its last
    forward earliest (see the module docstring), with (window start, window length); ``None`` without a result."""
    fpos = [i for i, c in enumerate(plan) if c % 3 == 0]
    if len(fpos) < _WINDOW_F:
        return None
    cut = fpos[-_WINDOW_F]
    if cut == 0:
        return None
    mems = (costs.mem_f, costs.mem_b, costs.mem_w)
    trans = costs.mem_b_transient
    durs = (costs.f, costs.b, costs.w)
    comm = costs.comm
    mem0 = sum(mems[c % 3][c // 3 // m] for c in plan[:cut])
    t0 = ends[plan[cut - 1]]
    rest = plan[cut:]
    before = set(plan[:cut])
    fs = [c for c in rest if c % 3 == 0]
    b1 = [c for c in rest if c % 3 == 1 and c // 3 // m == p]  # chunk 1: input from the feeder
    b0 = [c for c in rest if c % 3 == 1 and c // 3 // m == p - 1]  # chunk 0: input from the tip's own chunk 1
    w0 = tuple(c for c in rest if c % 3 == 2 and c - 1 in before)  # W's whose B ran before the window

    def arrival(c: int) -> float:
        """When the input of tip action ``c`` from the feeder arrives (``-inf`` for a local input)."""
        s, k, kind = c // 3 // m, (c // 3) % m, c % 3
        if kind == 0 and s == p - 1:
            return ends[((s - 1) * m + k) * 3] + comm
        if kind == 1 and s == p and s + 1 < 2 * p:
            return ends[((s + 1) * m + k) * 3 + 1] + comm
        return -_INF

    best: list = [_INF, None]
    seen: dict[tuple[int, int, int, int], float] = {}
    nodes = [0]

    def search(t: float, mem: float, fi: int, i1: int, i0: int, wq: tuple, nw: int, done: frozenset, seq: tuple):
        nodes[0] += 1
        if nodes[0] > _SEARCH_NODES or t >= best[0] - _EPS:
            return
        if fi == len(fs):
            best[0], best[1] = t, seq
            return
        key = (fi, i1, i0, nw)
        if seen.get(key, _INF) <= t + _EPS:
            return
        seen[key] = t

        def ran(c: int) -> bool:
            return c in before or c in done

        f = fs[fi]
        s = f // 3 // m
        if mem + mems[0][s] <= cap + _EPS and (s != p or ran(f - 3 * m)):  # F(p, k) after F(p-1, k)
            search(max(t, arrival(f)) + durs[0][s], mem + mems[0][s], fi + 1, i1, i0, wq, nw, done | {f}, seq + (f,))
        for stream, i in ((b1, i1), (b0, i0)):
            if i < len(stream):
                b = stream[i]
                s, k = b // 3 // m, (b // 3) % m
                up = ((s + 1) * m + k) * 3 + 1
                if not ran(b - 1) or (s == p - 1 and not ran(up)):
                    continue
                if max(mem + mems[1][s], mem + trans[s]) > cap + _EPS:
                    continue
                nxt = (i1 + 1, i0) if stream is b1 else (i1, i0 + 1)
                start = max(t, arrival(b))
                search(start + durs[1][s], mem + mems[1][s], fi, *nxt, wq + (b + 1,), nw, done | {b}, seq + (b,))
        if wq:
            w = wq[0]
            s = w // 3 // m
            if mem + mems[2][s] <= cap + _EPS:
                search(t + durs[2][s], mem + mems[2][s], fi, i1, i0, wq[1:], nw + 1, done | {w}, seq + (w,))

    search(t0, mem0, 0, 0, 0, w0, 0, frozenset(), ())
    if best[1] is None:
        return None
    used = set(best[1])
    return plan[:cut] + list(best[1]) + [c for c in rest if c not in used], cut, len(best[1])


def tip_hold(
    p: int, m: int, costs: StageCosts, codes: Codes, caps: list[float], backend: str
) -> tuple[float, Codes] | None:
    """(makespan, plan) of ``codes`` with the tip's hold re-planned (see the module docstring), or ``None`` where
    that is not strictly shorter; ``caps``: each rank's peak cap (``v_shape.peak_caps``)."""
    if p < 2:
        return None
    tip, feeder = p - 1, p - 2
    try:
        old = makespan(p, m, costs, codes, backend)
        out = [list(c) for c in codes]
        out[feeder] = advance_feeder(p, m, out[feeder], _FEEDER_B)
        if order_peak(actions_of(p, m, out[feeder]), costs) > caps[feeder] + _EPS:
            out[feeder] = list(codes[feeder])
        _, ends = end_times(p, m, costs, out, backend)
        got = replan_tip_window(p, m, costs, out[tip], ends, caps[tip])
        if got is None:
            return None
        out[tip], cut, length = got
        span = makespan(p, m, costs, out, backend)
    except ValueError:  # an order that cannot finish
        return None
    window = range(max(1, cut - 4), min(len(out[tip]), cut + length + 4))
    span, out = _repair(p, m, costs, out, span, window, caps, backend)
    if span >= old - _EPS or order_peak(actions_of(p, m, out[tip]), costs) > caps[tip] + _EPS:
        return None
    return span, out


def _repair(
    p: int, m: int, costs: StageCosts, codes: Codes, span: float, window: range, caps: list[float], backend: str
) -> tuple[float, Codes]:
    """First-improvement moves of single tip actions in ``window`` by +-1..3 places, while strictly shorter."""
    tip = p - 1
    evals = 0
    improved = True
    while improved and evals < _REPAIR_EVALS:
        improved = False
        for i in window:
            for d in (-3, -2, -1, 1, 2, 3):
                j = i + d
                if not 0 <= j < len(codes[tip]) or evals >= _REPAIR_EVALS:
                    continue
                cand = codes[tip][:]
                cand.insert(j, cand.pop(i))
                trial = codes[:tip] + [cand]
                evals += 1
                try:
                    got = makespan(p, m, costs, trial, backend)
                except ValueError:
                    continue
                if got < span - _EPS and order_peak(actions_of(p, m, cand), costs) <= caps[tip] + _EPS:
                    span, codes, improved = got, trial, True
                    break
            if improved:
                break
    return span, codes
