"""The repeated building block behind the V schedules (candidate 2 in ``v_shape``'s docstring).

The pattern of the papers: one microbatch's F/B/W offsets, placed as early as dependencies allow such that copies
repeated every ``period`` never overlap on a rank (modulo scheduling); each rank runs the copies' actions in
start-time order and the simulator squeezes the warm-up and cool-down.  Memory is then exactly the overlap of the
block's lifespans, so the shortest period whose overlap fits the cap is taken.  This is what makes ``v-min`` (a cap
close to the least any steady state needs) work at large p.
"""

from __future__ import annotations

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, v_placement
from zb_pipeline.schedule.memory import order_peak

_EPS = 1e-9
# Periods tried for the modulo template, as multiples of the busiest rank's work per microbatch (up to 1.6: at
# p = 3 under the v-min cap no single-microbatch block fits below 1.5, F = B = 2W, shown by an exact block search).
_TEMPLATE_STRETCH = tuple(1.0 + 0.025 * i for i in range(25))


def _circular_slot(busy: list[tuple[float, float]], ready: float, dur: float, period: float) -> float | None:
    """Earliest start >= ``ready`` whose interval ``[t, t + dur)`` modulo ``period`` misses every busy one."""
    cands = [ready] + [ready + (a + d - ready) % period for a, d in busy]
    for t in sorted(cands):
        if all((t - a) % period >= d - _EPS and (a - t) % period >= dur - _EPS for a, d in busy):
            return t
    return None


def modulo_template(
    stage_to_rank: tuple[int, ...], costs: StageCosts, period: float, w_eager: bool
) -> dict[tuple[int, Kind], float] | None:
    """One microbatch's start offsets such that repeating them every ``period`` never overlaps on a rank.

    Modulo scheduling of the building block: F of stages 0..S-1, then B of S-1..0, each as early as its dependency
    (plus T_comm across ranks) and the rank's free time modulo ``period`` allow; then each W as early as possible
    at least ``w_delay`` after its B.  ``None`` if some action finds no free slot.
    """
    S = len(stage_to_rank)
    p = max(stage_to_rank) + 1
    busy: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    off: dict[tuple[int, Kind], float] = {}
    end: dict[tuple[int, Kind], float] = {}
    dur = {Kind.F: costs.f, Kind.B: costs.b, Kind.W: costs.w}

    def place(s: int, k: Kind, ready: float) -> bool:
        r = stage_to_rank[s]
        d = dur[k][s]
        t = _circular_slot(busy[r], ready, d, period)
        if t is None:
            return False
        busy[r].append((t % period, d))
        off[(s, k)], end[(s, k)] = t, t + d
        return True

    def hop(src: int, dst: int) -> float:
        return costs.comm if stage_to_rank[src] != stage_to_rank[dst] else 0.0

    for s in range(S):
        if not place(s, Kind.F, end[(s - 1, Kind.F)] + hop(s - 1, s) if s else 0.0):
            return None
    for s in range(S - 1, -1, -1):
        ready = end[(s, Kind.F)] if s == S - 1 else max(end[(s, Kind.F)], end[(s + 1, Kind.B)] + hop(s + 1, s))
        if not place(s, Kind.B, ready):
            return None
        if w_eager and not place(s, Kind.W, end[(s, Kind.B)]):
            return None
    if not w_eager:
        for s in sorted(range(S), key=lambda x: end[(x, Kind.B)]):
            if not place(s, Kind.W, end[(s, Kind.B)]):
                return None
    return off


def _unrolled(stage_to_rank: tuple[int, ...], m: int, offsets: dict[tuple[int, Kind], float], period: float):
    """Each rank's actions of ``m`` copies of the template (copy k shifted by k x period), sorted by start time."""
    p = max(stage_to_rank) + 1
    timed: list[list[tuple[float, int, int, Action]]] = [[] for _ in range(p)]
    for (s, k), o in offsets.items():
        dst = timed[stage_to_rank[s]]
        for mb in range(m):
            dst.append((o + mb * period, 0 if k is Kind.W else 1, s, Action(s, k, mb)))  # W first on ties
    return [[a for *_, a in sorted(lst, key=lambda x: x[:3])] for lst in timed]


def _template_peaks(
    stage_to_rank: tuple[int, ...], m: int, offsets: dict[tuple[int, Kind], float], period: float, costs: StageCosts
) -> list[float]:
    """Each rank's peak memory of ``_unrolled`` without unrolling all ``m`` copies: enough copies to reach the
    steady state (ties in start time, W first and stage are broken by the memory delta, smaller first)."""
    p = max(stage_to_rank) + 1
    delta = {Kind.F: costs.mem_f, Kind.B: costs.mem_b, Kind.W: costs.mem_w}
    life = max(offsets[(s, Kind.W)] - offsets[(s, Kind.F)] for s in range(len(stage_to_rank)))
    copies = min(m, int(life / period) + 3)  # the running sum repeats once every live copy overlaps
    events: list[list[tuple[float, int, int, float, Action]]] = [[] for _ in range(p)]
    for (s, k), o in offsets.items():
        for mb in range(copies):
            events[stage_to_rank[s]].append(
                (o + mb * period, 0 if k is Kind.W else 1, s, delta[k][s], Action(s, k, mb))
            )
    return [order_peak([e[-1] for e in sorted(lst, key=lambda e: e[:4])], costs) for lst in events]


def template_plans(p: int, m: int, costs: StageCosts, caps: list[float], keep: int = 1) -> list[list[list[Action]]]:
    """Orders from the repeated modulo template (the papers' building block), shortest periods that fit the caps.

    The template for one microbatch (``modulo_template``) is repeated every ``period``; each rank runs its actions
    in start-time order, so its memory is exactly the template's overlap of lifespans, and the simulator then
    squeezes the timing.  Periods from the busiest rank's work per microbatch upwards (``_TEMPLATE_STRETCH``);
    the first ``keep`` (period, W mode) settings whose every rank peak is within its cap are returned.
    """
    place = v_placement(p, 2)
    base = max(sum(costs.f[s] + costs.b[s] + costs.w[s] for s in range(2 * p) if place[s] == r) for r in range(p))
    out = []
    for stretch in _TEMPLATE_STRETCH:
        for eager in (False, True):
            period = base * stretch
            offsets = modulo_template(place, costs, period, eager)
            if offsets is None:
                continue
            if all(pk <= cap + _EPS for pk, cap in zip(_template_peaks(place, m, offsets, period, costs), caps)):
                out.append(_unrolled(place, m, offsets, period))
                if len(out) >= keep:
                    return out
    return out
