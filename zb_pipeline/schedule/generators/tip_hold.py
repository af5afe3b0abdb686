"""The tip of the V holds deferred W's instead of whole microbatches at its last forward (a post-pass of ``v_shape``).

Rank ``p-1`` (the tip: stages ``p-1`` and ``p``) under zb-v's cap runs at the cap at every forward: its warm-up fills
the cap, and from its first backward to its last forward it never idles.  Everything after its last forward is the
last microbatch's chain (down chunk 1, back up, down chunk 0, one W), which waits for nothing, so the plan ends as
early as the tip's last forward ends: its first backward plus the work it runs before that forward.  At the cap,
that work is what frees the memory of the forwards in between.  The alternating pass frees it a microbatch at a
time (a B and its W, then the next), but a B can free more memory for its time than a W (at the zero-bubble paper's
p = 16 rows, -0.3 in 14380 us against -0.2 in 9676 us per chunk): two B's run earlier and three W's later free the
same memory ``3 T_W - 2 T_B`` sooner (268 us there), once the gradients for those B's are back.  They come back late
because the feeder (rank ``p-2``, stage ``p+1``) runs its chunk-1 B after a W and a chunk-1 forward.  The pass:

1. on the feeder, the last ``_FEEDER_B`` stage-``p+1`` B's that follow a W and a forward go before both, the W after
   the forward (the gradient reaches the tip a B earlier; the W it displaces has slack behind it);
2. the tip's last ``_WINDOW_F`` forwards and what runs between them are re-planned by a depth-first search for the
   order that ends its last forward earliest, within the tip's cap (forwards in their order; the B's of each stage
   in their order; W's first-in, first-out, so each stage's W's keep microbatch order).  The feeder keeps its order
   and is re-timed against the tip's new outputs (a chunk-1 forward feeds its stage ``p+1``, a chunk-0 B its stage
   ``p-2``); its inputs from other ranks arrive as in the plan after step 1.  A state is pruned only when another
   order reached the same actions no later, with no output the feeder consumes later.

The result is timed and kept only when the plan gets strictly shorter, both ranks stay within their caps, and the
plan finishes.  The zero-bubble paper's rows each gain one such exchange (p = 16: 268, 278 and 305 us).
"""

from __future__ import annotations

import math

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape_codes import Codes, actions_of, cpp, makespan, to_schedule
from zb_pipeline.schedule.ir import v_placement
from zb_pipeline.schedule.memory import order_peak
from zb_pipeline.schedule.simulate import simulate

_EPS = 1e-9
_INF = math.inf
_FEEDER_B = 4  # feeder B's moved ahead of the forward before them (measured: 3 to 6 give the same plans)
_WINDOW_F = 4  # the tip's last forwards re-planned by the search (the p = 16..32 rows: 4 and 6 give the same plans)
_SEARCH_NODES = 20_000  # depth-first search nodes (the table rows: 2100-2700)


def end_times(p: int, m: int, costs: StageCosts, codes: Codes, backend: str) -> tuple[float, list[float]]:
    """(makespan, end time of every action by code) of a plan given as codes."""
    if backend == "cpp" and hasattr(cpp, "end_times"):
        span, ends = cpp.end_times(p, m, costs.f, costs.b, costs.w, costs.comm, codes)
        return span, ends
    res = simulate(to_schedule("v", p, m, codes), costs)
    ends = [-1.0] * (2 * p * m * 3)
    for plan, line in zip(codes, res.timeline, strict=True):
        for x in line:
            ends[plan[x.index]] = x.end
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
    p: int, m: int, costs: StageCosts, plan: list[int], feeder: list[int], ends: list[float], cap: float
) -> list[int] | None:
    """The tip's plan with its last ``_WINDOW_F`` forwards and what runs between them re-ordered to end its last
    forward earliest (see the module docstring); ``None`` where no order ends it earlier than ``plan`` does."""
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

    # The feeder's order is kept and re-timed against the window's outputs (its inputs from other ranks arrive as in
    # ``ends``): from its first action that consumes a tip output of the window or later, up to the one asked for.
    S = 2 * p
    place = v_placement(p, 2)
    tip, fed = p - 1, p - 2
    where = {c: q for q, c in enumerate(feeder)}

    def inputs(c: int) -> tuple[int, ...]:
        s, k, kind = c // 3 // m, (c // 3) % m, c % 3
        if kind == 0:
            return (((s - 1) * m + k) * 3,) if s > 0 else ()
        if kind == 1:
            return ((s * m + k) * 3,) + ((((s + 1) * m + k) * 3 + 1,) if s + 1 < S else ())
        return (c - 1,)

    first = next(
        (q for q, c in enumerate(feeder) if any(place[d // 3 // m] == tip and d not in before for d in inputs(c))),
        len(feeder),
    )

    def feeder_end(q: int, done: dict) -> float:
        """When the feeder's action at position ``q`` ends (``inf`` if it first needs a tip output not run yet)."""
        if q < first:
            return ends[feeder[q]]
        t = ends[feeder[first - 1]] if first > 0 else 0.0
        local: dict[int, float] = {}
        for j in range(first, q + 1):
            c = feeder[j]
            start = t
            for d in inputs(c):
                r = place[d // 3 // m]
                if r == fed:
                    e = local.get(d, ends[d])
                elif r == tip and d not in before:
                    if d not in done:
                        return _INF
                    e = done[d] + comm
                else:
                    e = ends[d] + comm
                start = max(start, e)
            t = start + durs[c % 3][c // 3 // m]
            local[c] = t
        return t

    def arrival(c: int, done: dict) -> float:
        """When the input of tip action ``c`` from the feeder arrives (``-inf`` for a local input, ``inf`` when the
        feeder first needs a tip output not run yet)."""
        s, k, kind = c // 3 // m, (c // 3) % m, c % 3
        if kind == 0 and s == p - 1:
            src = ((s - 1) * m + k) * 3
        elif kind == 1 and s == p and s + 1 < S:
            src = ((s + 1) * m + k) * 3 + 1
        else:
            return -_INF
        return feeder_end(where[src], done) + comm

    best: list = [_INF, None]
    seen: dict[tuple[int, int, int, int], list[tuple[float, tuple[float, ...]]]] = {}
    fed_inputs = sorted({d for c in feeder for d in inputs(c) if place[d // 3 // m] == tip and d not in before})
    nodes = [0]

    def search(t: float, mem: float, fi: int, i1: int, i0: int, wq: tuple, nw: int, done: dict, seq: tuple):
        nodes[0] += 1
        if nodes[0] > _SEARCH_NODES or t >= best[0] - _EPS:
            return
        if fi == len(fs):
            best[0], best[1] = t, seq
            return
        # Dominance: the same actions run, no later, and no output the feeder consumes later.
        key = (fi, i1, i0, nw)
        outs = tuple(done[c] for c in fed_inputs if c in done)  # a key fixes the F's and B's done
        for t2, outs2 in seen.get(key, ()):
            if t2 <= t + _EPS and all(a <= b + _EPS for a, b in zip(outs2, outs)):
                return
        seen.setdefault(key, []).append((t, outs))

        def ran(c: int) -> bool:
            return c in before or c in done

        f = fs[fi]
        s = f // 3 // m
        if mem + mems[0][s] <= cap + _EPS and (s != p or ran(f - 3 * m)):  # F(p, k) after F(p-1, k)
            e = max(t, arrival(f, done)) + durs[0][s]
            search(e, mem + mems[0][s], fi + 1, i1, i0, wq, nw, {**done, f: e}, seq + (f,))
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
                e = max(t, arrival(b, done)) + durs[1][s]
                search(e, mem + mems[1][s], fi, *nxt, wq + (b + 1,), nw, {**done, b: e}, seq + (b,))
        if wq:
            w = wq[0]
            s = w // 3 // m
            if mem + mems[2][s] <= cap + _EPS:
                e = t + durs[2][s]
                search(e, mem + mems[2][s], fi, i1, i0, wq[1:], nw + 1, {**done, w: e}, seq + (w,))

    now = ends[fs[-1]]  # when the tip's last forward ends in the plan as it is
    best[0] = now  # only an order that ends it strictly earlier
    search(t0, mem0, 0, 0, 0, w0, 0, {}, ())
    if best[1] is None:
        return None
    used = set(best[1])
    return plan[:cut] + list(best[1]) + [c for c in rest if c not in used]


def tip_hold(
    p: int, m: int, costs: StageCosts, codes: Codes, old: float, caps: list[float], backend: str
) -> tuple[float, Codes] | None:
    """(makespan, plan) of ``codes`` (whose makespan is ``old``) with the tip's hold re-planned (see the module
    docstring), or ``None`` where that is not strictly shorter; ``caps``: each rank's peak cap
    (``v_shape.peak_caps``)."""
    if p < 2:
        return None
    tip, feeder = p - 1, p - 2
    try:
        out = [list(c) for c in codes]
        out[feeder] = advance_feeder(p, m, out[feeder], _FEEDER_B)
        if order_peak(actions_of(p, m, out[feeder]), costs) > caps[feeder] + _EPS:
            out[feeder] = list(codes[feeder])
        _, ends = end_times(p, m, costs, out, backend)
        got = replan_tip_window(p, m, costs, out[tip], out[feeder], ends, caps[tip])
        if got is None:
            return None
        out[tip] = got
        span = makespan(p, m, costs, out, backend)
    except ValueError:  # an order that cannot finish
        return None
    if span >= old - _EPS or order_peak(actions_of(p, m, out[tip]), costs) > caps[tip] + _EPS:
        return None
    return span, out
