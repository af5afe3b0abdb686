"""zb-auto's limits: the memory limit it plans under, and the makespan no plan can beat.

Memory limit
------------
``mem_limit`` is per rank in the units of the memory deltas.  ``None`` means 2p - 1 microbatches' worth:
``(2p - 1) * max(mem_f, mem_f + mem_b)`` of the rank's stage, ZB-H2's budget.  A limit below one microbatch
(``max(mem_f, mem_f + mem_b)`` on some rank) can serve no plan: ``ValueError`` names the smallest limit that works
(``smallest_feasible_mem_limit``).  With recomputation a B holds ``mem_b_transient`` above the sum before it while it
runs, so each rank's cap on what stays resident is the limit minus its stage's transient: the peak, transient
included (``memory.running_memory``), then stays within the limit.

Lower bound
-----------
``lower_bound`` is a makespan no plan can beat (own work plus unavoidable idle, a downstream bottleneck, memory
throughput); a plan that reaches it is optimal and ends the search at once (at F = B, c = 0 the anchors do).
"""

from __future__ import annotations

import math

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.zb_auto_passes import EPS, StageArrays


def smallest_feasible_mem_limit(costs: StageCosts) -> float:
    """The smallest per-rank limit any plan can use: one microbatch resident (``max(mem_f, mem_f + mem_b)``)."""
    t = costs.mem_b_transient
    return max(max(0.0, mf, mf + mb) + t[r] for r, (mf, mb) in enumerate(zip(costs.mem_f, costs.mem_b)))


def default_mem_limit(p: int, costs: StageCosts) -> tuple[float, ...]:
    """``mem_limit=None``: 2p - 1 microbatches' worth on every rank (ZB-H2's budget), as resident caps."""
    return tuple((2 * p - 1) * max(0.0, mf, mf + mb) for mf, mb in zip(costs.mem_f, costs.mem_b))


def resolve_mem_limit(p: int, costs: StageCosts, mem_limit: float | None) -> tuple[float, ...]:
    """Per-rank caps for ``mem_limit`` (``None``: 2p - 1 microbatches); ``ValueError`` if no plan fits."""
    need = smallest_feasible_mem_limit(costs)
    if mem_limit is None:
        return default_mem_limit(p, costs)
    if not math.isfinite(mem_limit) or mem_limit < need - EPS * max(1.0, need):
        raise ValueError(
            f"zb-auto: mem_limit={mem_limit} is below one microbatch on some rank; the smallest limit that works "
            f"is {need:g} (units of the memory deltas)"
        )
    return tuple(float(mem_limit) - t for t in costs.mem_b_transient)


def lower_bound(m: int, st: StageArrays) -> float:
    """A makespan no plan can beat under ``st`` (costs and caps): the search stops when it reaches it.

    Two bounds on the span of each rank r, valid for every order (``n_r`` below: how many microbatches the rank
    can hold; a W frees what its F and B took):

    - *own work and unavoidable idle*: its work ``m (F_r + B_r + W_r)``, plus the *head* -- its first B waits for
      the gradient of microbatch 0, ``window_r = sum_{q>=r} F_q + sum_{q>r} B_q + 2 (p-1-r) c`` after its first F,
      and until then it can only run forwards, at most ``n_r`` (with room for the B) -- plus the *tail*: between
      the start of its last F and the start of its last B the same window passes, and in it the rank can only run
      that F and the B and W of the other ``n_r - 1`` microbatches it holds (head and tail are disjoint when
      ``m > n_r``; else the larger counts);
    - *a bottleneck downstream*: for every rank q > r, microbatch 0 needs ``sum_{r<=s<q} (F_s + c)`` to reach q,
      q then runs all its F and B and all but at most ``n_q`` of its W before its last B ends, the gradient needs
      ``sum_{r<=s<q} B_s + (q - r) c`` back (B_r included), and rank r still runs ``W_r``.  With F = B and c = 0
      this is ZB-H1's makespan at a limit of p microbatches and ZB-H2's at 2p - 1: both are optimal there;
    - *memory throughput*: a microbatch is resident on rank r from the start of its F to the start of its W, at
      least ``R_r = sum_{q>=r} (F_q + B_q) + 2 (p-1-r) c``, and at most ``n_r`` are resident at once, so one of
      ``n_r`` chains of disjoint residences holds ``ceil(m / n_r)`` of them, and the last W still runs after.
    """
    p = len(st.f)
    c = st.comm
    hold = [_held(m, st, q, need_b_room=False) for q in range(p)]
    best = 0.0
    for r in range(p):
        f, b, w = st.f[r], st.b[r], st.w[r]
        window = sum(st.f[r:]) + sum(st.b[r + 1 :]) + 2 * (p - 1 - r) * c
        n = _held(m, st, r, need_b_room=True)
        head = max(0.0, window - n * f)
        tail = 0.0 if hold[r] >= m else max(0.0, window - f - (hold[r] - 1) * (b + w))
        idle = head + tail if m > n else max(head, tail)
        best = max(best, m * (f + b + w) + idle)
        if hold[r] < m:
            trip = sum(st.f[r:]) + sum(st.b[r:]) + 2 * (p - 1 - r) * c
            best = max(best, -(-m // hold[r]) * trip + w)
        down = up = 0.0  # sum_{r<=s<q} (F_s + c) and sum_{r<=s<q} (B_s + c)
        for q in range(r + 1, p):
            down += st.f[q - 1] + c
            up += st.b[q - 1] + c
            bq = m * (st.f[q] + st.b[q]) + (m - min(m, hold[q])) * st.w[q]
            best = max(best, down + bq + up + w)
    return best


def _held(m: int, st: StageArrays, r: int, *, need_b_room: bool) -> int:
    """How many microbatches rank ``r`` can hold: forwards before its first B with room for that B
    (``need_b_room``), else resident at once (only bounded when a W frees exactly what its F and B took)."""
    mf, mb, mw = st.mem_f[r], st.mem_b[r], st.mem_w[r]
    if need_b_room:
        return m if mf <= 0 else max(1, min(m, math.floor((st.cap[r] - max(0.0, mb)) / mf + 1e-9)))
    if mf + mb <= 0 or mb < 0 or abs(mw + mf + mb) > 1e-12 * max(1.0, mf + mb):
        return m
    return max(1, min(m, math.floor(st.cap[r] / (mf + mb) + 1e-9)))
