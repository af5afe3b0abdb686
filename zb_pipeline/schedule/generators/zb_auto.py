"""``zb-auto``: search for the split-backward plan with the smallest makespan under a per-rank memory limit.

The search plans from the costs of every virtual stage as given (``T_F``, ``T_B``, ``T_W`` per stage and
``T_comm``): a first stage that embeds tokens or a last stage that carries the output head keeps its own cost.

How it searches
---------------
The building block is a *list scheduler*: an event-driven pass over time in which every rank, whenever it is free,
picks its next action by a policy, and the pass records what it picked (the plan) together with when everything
ran (the plan's simulated timing under the same model as ``simulate.py``).  A pass is O(actions log p).

The policy of rank ``r`` at time ``t``:

1. its next ``B`` if the input gradient has arrived (after a ``W`` first when the ``B`` would overrun the cap),
   unless an admissible ``F`` is ready and fewer than ``ahead[r]`` forwards await their ``B``;
2. else its oldest pending ``W`` if more than ``lag[r]`` are pending;
3. else its next ``F`` if the activation has arrived, the rank has room for it (memory after the ``F`` plus the
   ``B`` that will follow stays within the cap) and the rank's *warm-up budget* allows it (at most ``warm[r]``
   forwards before its first ``B``); with ``f_fits`` only if the ``F`` ends before the next ``B`` is due;
4. else its oldest pending ``W`` if it ends no later than ``theta_w * T_W`` after the next ``B`` is due (or when it
   is not known yet when that ``B`` will come);
5. else it waits for the next arrival.

A *static* variant instead follows a fixed order by counts: a W once more than ``lag[r]`` are pending (or to make
room for a wanted F), else an F while fewer than ``warm[r]`` forwards await their B, else a B; the rank waits for
what it chose.  ZB-H1 is the static variant warm = p - r, lag = r; ZB-H2 is the dynamic one with warm = 2(p-r) - 1,
B first, no lag and theta_w = 0.  These two *anchors* run first and uncut, so the search's own result is never worse
than ZB-H1 or ZB-H2 within its limit, for any costs, T_comm > 0 included.

Each policy variant is one pass; the search runs the anchors, then a family of variants -- warm-up budgets (none,
the number of forwards that fit before the first gradient returns computed from the real per-stage costs, rounded
both ways, 1F1B's ``p - r`` and ZB-H2's ``2(p - r) - 1``), ``ahead``, ``lag``, W thresholds ``theta_w`` in
{-inf, 0, 1/2, 1, inf}, ``f_fits`` and ``guard``, and the static orders -- and keeps the plan with the smallest
makespan (scored with the simulator's as-soon-as-possible timing of the plan; ties: the earlier variant).  Then a
local search moves one knob (warm, ahead, lag) of one rank by one while that shortens the makespan, and on small
shapes (``POLISH_MAX_ACTIONS``) ``polish`` swaps neighbouring actions of the plan itself.

Pruning: ``lower_bound`` is a makespan no plan can beat (own work plus unavoidable idle, a downstream bottleneck,
memory throughput); a plan that reaches it is optimal and ends the search at once (at F = B, c = 0 the anchors do).
A pass stops as soon as some rank's time used plus its remaining work exceeds the best makespan so far.  The effort
is bounded (``SEARCH_BUDGET`` simulated actions, cut passes counting what they ran): the anchors and the variants
that were most often best on a measured grid (``_FIRST``) always run, the rest while the budget lasts.

With stage costs that differ, the same search is also run on the median view of the costs (every stage at the
median) and its plan, scored with the true costs, is one more candidate: the passes decide locally, and on a few
shapes the smoother view decides better.  The result is therefore never worse than a plan searched from median
costs.

Memory limit
------------
``mem_limit`` is per rank in the units of the memory deltas.  ``None`` means 2p - 1 microbatches' worth:
``(2p - 1) * max(mem_f, mem_f + mem_b)`` of the rank's stage, ZB-H2's budget.  A limit below one microbatch
(``max(mem_f, mem_f + mem_b)`` on some rank) can serve no plan: ``ValueError`` names the smallest limit that works.

Speed
-----
The passes and the scoring run in C++ (``zb_pipeline.schedule._zb_auto_cpp.Searcher``, built from
``csrc/zb_auto_search.cpp``) when the extension is built, else in the Python reference below; both give identical
plans, spans, scores and work counts (tested).  The final ``Schedule`` reuses interned ``Action`` objects.
"""

from __future__ import annotations

import functools
import heapq
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement
from zb_pipeline.schedule.registry import register

try:  # the compiled passes; the Python reference below is the fallback
    from zb_pipeline.schedule import _zb_auto_cpp as _cpp
except ImportError:  # pragma: no cover - depends on the build
    _cpp = None

INF = math.inf
_EPS = 1e-9
# Search effort in simulated actions: about 0.2 s of C++ passes on the 2-core reference machine.
SEARCH_BUDGET = 1.2e6
# Action codes in the flat per-rank plans the passes produce: kind * m + microbatch.
_F, _B, _W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True)
class Policy:
    """One variant of the list scheduler (see the module docstring)."""

    warm: tuple[int, ...]  # per rank: most forwards before its first B
    ahead: tuple[int, ...]  # per rank: when both are ready, F goes first while fewer than ahead[r] await their B
    lag: tuple[int, ...]  # per rank: a W goes before any F once more than lag[r] W's are pending
    theta_w: float  # W may delay a due B by at most theta_w * T_W
    f_fits: bool  # F only if it ends before the next B is due
    guard: bool  # W's also keep clear of arrivals not decided yet (at the earliest they could come)
    label: str = ""
    static: bool = False  # a fixed order by counts (warm = forwards in flight, lag); the others are ignored


@dataclass(frozen=True)
class StageArrays:
    """Per-rank (= per-stage, one chunk) costs, memory deltas and caps as plain float lists for the passes."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    mem_f: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    cap: tuple[float, ...]

    @classmethod
    def of(cls, costs: StageCosts, cap: Sequence[float]) -> StageArrays:
        return cls(costs.f, costs.b, costs.w, costs.comm, costs.mem_f, costs.mem_b, costs.mem_w, tuple(cap))


@dataclass(frozen=True)
class SearchResult:
    """The plan the search chose, its makespan, the variant that made it, and how many passes ran.

    ``makespan`` is the plan's simulated makespan (as soon as possible, exactly what ``simulate`` reports).
    """

    schedule: Schedule
    makespan: float
    policy: Policy
    passes: int
    backend: str
    seconds: float = 0.0  # wall time of the search before the final Schedule objects are built
    cpu_seconds: float = 0.0  # the same in CPU time of this process (fair on a loaded machine)
    work: int = 0  # actions simulated over all passes
    lower_bound: float = 0.0  # a makespan no plan can beat (``lower_bound``); equal to ``makespan``: optimal


# ----------------------------------------------------------------------------------------------------------------
# The list scheduler (Python reference; csrc/zb_auto_search.cpp mirrors it operation for operation)
# ----------------------------------------------------------------------------------------------------------------


def list_schedule_py(
    m: int,
    st: StageArrays,
    warm: Sequence[int],
    ahead: Sequence[int],
    lag: Sequence[int],
    theta_w: float,
    f_fits: bool,
    guard: bool,
    static: bool = False,
    cut: float = INF,
) -> tuple[list[list[int]], float, int]:
    """One pass of the list scheduler: per-rank action codes (kind * m + mb), the pass's makespan, actions run.

    A pass stops early and reports ``inf`` once a lower bound on some rank's span (the time it has used plus the
    work it still has) exceeds ``cut``: the search passes its best makespan so far, so a variant that cannot win
    stops as soon as it has idled more than the best plan's slack.
    """
    p = len(st.f)
    f, b, w, c = st.f, st.b, st.w, st.comm
    mf, mb, mw, cap = st.mem_f, st.mem_b, st.mem_w, st.cap
    f_end = [[INF] * m for _ in range(p)]
    b_end = [[INF] * m for _ in range(p)]
    nf = [0] * p
    nb = [0] * p
    nw = [0] * p
    mem = [0.0] * p
    free = [0.0] * p
    first = [INF] * p
    wake = [INF] * p
    rem = [m * (f[r] + b[r] + w[r]) for r in range(p)]
    work = 0
    plans: list[list[int]] = [[] for _ in range(p)]
    heap: list[tuple[float, int]] = [(0.0, 0)]
    wake[0] = 0.0
    last = p - 1
    while heap:
        t, neg_r = heapq.heappop(heap)
        r = -neg_r
        if t != wake[r]:
            continue  # superseded by an earlier wake-up
        wake[r] = INF
        k = nb[r]
        tb = INF  # when the next B may start (INF: not known yet)
        if k < nf[r]:
            tb = f_end[r][k] if r == last else max(f_end[r][k], b_end[r + 1][k] + c)
        j = nf[r]
        tf = INF
        f_room = False
        if j < m:
            tf = 0.0 if r == 0 else f_end[r - 1][j] + c
            f_room = mem[r] + mf[r] + max(0.0, mb[r]) <= cap[r] + _EPS and (k > 0 or j < warm[r])
        has_w = nw[r] < k
        act = -1
        nxt = INF
        if static:
            # A fixed order: W once more than lag[r] are pending (or to make room for a wanted F), else F while
            # fewer than warm[r] await their B, else B; the rank waits for what it chose (ZB-H1: warm = p - r,
            # lag = r).
            want_f = j < m and j - k < warm[r]
            fits = mem[r] + mf[r] + max(0.0, mb[r]) <= cap[r] + _EPS
            if has_w and (k - nw[r] > lag[r] or (want_f and not fits)):
                act = _W
            elif want_f and fits:
                if tf <= t:
                    act = _F
                else:
                    nxt = tf
            elif k < j:
                if tb <= t:
                    act = _W if (has_w and mem[r] + mb[r] > cap[r] + _EPS) else _B
                else:
                    nxt = tb
            elif has_w:
                act = _W
        else:
            f_now = f_room and tf <= t
            if tb <= t and not (f_now and j - k < ahead[r]):
                act = _W if (has_w and mem[r] + mb[r] > cap[r] + _EPS) else _B
            elif has_w and k - nw[r] > lag[r]:
                act = _W
            elif f_now and (tb <= t or not f_fits or tb == INF or t + f[r] <= tb):
                act = _F
            elif has_w:
                # The next B or admissible F a W would delay; with ``guard`` an arrival not decided yet counts as
                # the earliest it could be (its producer starting it now or when it is free).
                due_b = tb
                if guard and due_b == INF and k < j:
                    due_b = max(t, free[r + 1]) + b[r + 1] + c
                due_f = INF
                if f_room:
                    due_f = tf
                    if guard and due_f == INF:
                        due_f = max(t, free[r - 1]) + f[r - 1] + c
                due = due_f if due_f < due_b else due_b
                if due == INF or t + w[r] <= due + theta_w * w[r]:
                    act = _W
            if act < 0:
                nxt = tb if tb > t else INF
                if f_room and t < tf < nxt:
                    nxt = tf
        if act < 0:  # wait for the next arrival we know of; others notify us when they are decided
            if nxt < INF:
                wake[r] = nxt
                heapq.heappush(heap, (nxt, -r))
            continue
        work += 1
        if act == _F:
            end = t + f[r]
            f_end[r][j] = end
            nf[r] = j + 1
            mem[r] += mf[r]
            rem[r] -= f[r]
            plans[r].append(j)
            if first[r] == INF:
                first[r] = t
            q = r + 1
            if q < p and nf[q] == j:  # the next rank may be waiting for this activation
                at = max(end + c, free[q])
                if at < wake[q]:
                    wake[q] = at
                    heapq.heappush(heap, (at, -q))
        elif act == _B:
            end = t + b[r]
            b_end[r][k] = end
            nb[r] = k + 1
            mem[r] += mb[r]
            rem[r] -= b[r]
            plans[r].append(m + k)
            q = r - 1
            if q >= 0 and nb[q] == k and nf[q] > k:  # the previous rank may be waiting for this gradient
                at = max(end + c, free[q])
                if at < wake[q]:
                    wake[q] = at
                    heapq.heappush(heap, (at, -q))
        else:
            end = t + w[r]
            i = nw[r]
            nw[r] = i + 1
            mem[r] += mw[r]
            rem[r] -= w[r]
            plans[r].append(2 * m + i)
        free[r] = end
        if end - first[r] + rem[r] > cut:
            return plans, INF, work
        if end < wake[r]:
            wake[r] = end
            heapq.heappush(heap, (end, -r))
    for r in range(p):
        if nw[r] != m:
            if static:  # a fixed order can deadlock when ranks differ in memory: the variant cannot serve
                return plans, INF, work
            # cannot happen with cap >= one microbatch; a loud guard against a broken policy
            raise RuntimeError(f"zb-auto list scheduler stalled on rank {r} ({nf[r]} F, {nb[r]} B, {nw[r]} W of {m})")
    makespan = max(free[r] - first[r] for r in range(p))
    return plans, makespan, work


def evaluate_py(m: int, st: StageArrays, plans: Sequence[Sequence[int]]) -> float:
    """Makespan of fixed per-rank plans (codes as above) under ``st``'s costs: the simulator's timing, fast."""
    return max(spans_py(m, st, plans))


def spans_py(m: int, st: StageArrays, plans: Sequence[Sequence[int]]) -> list[float]:
    """Per-rank spans of fixed plans (the makespan is their maximum) under the simulator's timing.

    Each rank's clock is the end of its last action; an action starts at the later of its rank's clock and its
    dependencies' ends (+ comm across ranks).  Ranks are swept until all finish (a stuck sweep raises).
    """
    p = len(st.f)
    f, b, w, c = st.f, st.b, st.w, st.comm
    f_end = [[INF] * m for _ in range(p)]
    b_end = [[INF] * m for _ in range(p)]
    pos = [0] * p
    clock = [0.0] * p
    first = [INF] * p
    remaining = p
    while remaining:
        progressed = False
        remaining = 0
        for r in range(p):
            plan = plans[r]
            i, t = pos[r], clock[r]
            while i < len(plan):
                kind, mb_ = divmod(plan[i], m)
                if kind == _F:
                    dep = 0.0 if r == 0 else f_end[r - 1][mb_] + c
                    if dep == INF:
                        break
                    s = max(t, dep)
                    t = s + f[r]
                    f_end[r][mb_] = t
                elif kind == _B:
                    dep = f_end[r][mb_] if r == p - 1 else max(f_end[r][mb_], b_end[r + 1][mb_] + c)
                    if dep == INF:
                        break
                    s = max(t, dep)
                    t = s + b[r]
                    b_end[r][mb_] = t
                else:
                    dep = b_end[r][mb_]
                    if dep == INF:
                        break
                    s = max(t, dep)
                    t = s + w[r]
                if first[r] == INF:
                    first[r] = s
                i += 1
            if i != pos[r]:
                progressed = True
            pos[r], clock[r] = i, t
            if i < len(plan):
                remaining += 1
        if remaining and not progressed:
            raise ValueError("plan can never finish: every unfinished rank waits on another")
    return [clock[r] - first[r] for r in range(p)]


# ----------------------------------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------------------------------


def min_mem_limit(costs: StageCosts) -> float:
    """The smallest per-rank limit any plan can use: one microbatch resident (``max(mem_f, mem_f + mem_b)``)."""
    return max(max(0.0, mf, mf + mb) for mf, mb in zip(costs.mem_f, costs.mem_b))


def default_mem_limit(p: int, costs: StageCosts) -> tuple[float, ...]:
    """``mem_limit=None``: 2p - 1 microbatches' worth on every rank (ZB-H2's budget)."""
    return tuple((2 * p - 1) * max(0.0, mf, mf + mb) for mf, mb in zip(costs.mem_f, costs.mem_b))


def fill_counts(m: int, costs: StageCosts, *, round_up: bool) -> tuple[int, ...]:
    """Per rank: how many forwards fit between its first F and the return of the first gradient.

    With every rank working as early as it can on microbatch 0, rank r starts at sum_{q<r}(T_F[q] + c) and the
    gradient of microbatch 0 reaches it at sum_q T_F[q] + (p-1) c + sum_{q>r}(T_B[q] + c).  ZB-H2's warm-up
    ``2(p - r) - 1`` is this count with F = B and c = 0.
    """
    p = costs.num_stages
    c = costs.comm
    total_f = sum(costs.f) + (p - 1) * c
    out = []
    start = 0.0
    for r in range(p):
        back = sum(costs.b[q] + c for q in range(r + 1, p))
        x = (total_f - start + back) / costs.f[r]
        n = math.ceil(x - 1e-9) if round_up else math.floor(x + 1e-9)
        out.append(max(1, min(m, n)))
        start += costs.f[r] + c
    return tuple(out)


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

    def held(r: int, need_b_room: bool) -> int:
        mf, mb, mw = st.mem_f[r], st.mem_b[r], st.mem_w[r]
        if need_b_room:  # forwards before the first B, with room for that B
            return m if mf <= 0 else max(1, min(m, math.floor((st.cap[r] - max(0.0, mb)) / mf + 1e-9)))
        # microbatches resident at once: only bounded when a W frees exactly what its F and B took
        if mf + mb <= 0 or mb < 0 or abs(mw + mf + mb) > 1e-12 * max(1.0, mf + mb):
            return m
        return max(1, min(m, math.floor(st.cap[r] / (mf + mb) + 1e-9)))

    hold = [held(q, False) for q in range(p)]
    best = 0.0
    for r in range(p):
        f, b, w = st.f[r], st.b[r], st.w[r]
        window = sum(st.f[r:]) + sum(st.b[r + 1 :]) + 2 * (p - 1 - r) * c
        n = held(r, True)
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


def _variant(
    warm: tuple[int, ...],
    ahead: tuple[int, ...],
    lag: tuple[int, ...],
    theta_w: float,
    f_fits: bool,
    guard: bool,
    label: str,
    static: bool = False,
) -> Policy:
    if static:  # the fields a static pass ignores, in one canonical form (so that duplicates are found)
        ahead, theta_w, f_fits, guard = (0,) * len(warm), 0.0, False, False
        # No rank may want more forwards in flight than the rank before it can send: else it waits for an F
        # that comes only after its own B (a deadlock).
        warm = tuple(min(warm[: r + 1]) for r in range(len(warm)))
    return Policy(warm, ahead, lag, theta_w, f_fits, guard, label, static)


def anchors(p: int, m: int) -> list[Policy]:
    """The handcrafted orders as members of the family: ZB-H1 (static, warm p - r, W lagging r behind B) and
    ZB-H2 (dynamic, warm 2(p - r) - 1, B first, F within the limit, W where it ends before the next arrival).

    They run first and uncut, so the search's own result is never worse than these orders within its limit."""
    h1 = _variant(
        tuple(max(1, min(m, p - r)) for r in range(p)), (0,) * p, tuple(range(p)), 0.0, False, False,
        "static warm=1f1b lag=rank", static=True,
    )  # fmt: skip
    h2 = _variant(
        tuple(max(1, min(m, 2 * (p - r) - 1)) for r in range(p)), (0,) * p, (m,) * p, 0.0, False, False,
        "warm=h2 ahead=0 lag=none theta_w=0.0 f_fits=False guard=False",
    )  # fmt: skip
    return [h1, h2]


def policies(p: int, m: int, costs: StageCosts) -> list[Policy]:
    """The family of variants the search runs, in order: the anchors, then the rest (no two alike)."""
    warms: list[tuple[str, tuple[int, ...]]] = [("free", (m,) * p)]
    for label, wm in (
        ("fill-", fill_counts(m, costs, round_up=False)),
        ("fill+", fill_counts(m, costs, round_up=True)),
        ("1f1b", tuple(max(1, min(m, p - r)) for r in range(p))),
        ("h2", tuple(max(1, min(m, 2 * (p - r) - 1)) for r in range(p))),
    ):
        if all(wm != w_ for _, w_ in warms):
            warms.append((label, wm))
    lags = (("none", (m,) * p), ("rank", tuple(range(p))))
    out = []
    for label, wm in warms:
        for ahead_label, ahead in (("0", (0,) * p), ("warm", wm)):
            for lag_label, lag in lags:
                for theta_w in (-INF, 0.0, 0.5, 1.0, INF):
                    for f_fits in (False, True):
                        for guard in (False, True) if math.isfinite(theta_w) else (theta_w < 0,):
                            name = (
                                f"warm={label} ahead={ahead_label} lag={lag_label} theta_w={theta_w} "
                                f"f_fits={f_fits} guard={guard}"
                            )
                            out.append(_variant(wm, ahead, lag, theta_w, f_fits, guard, name))
        if label != "free":  # a static order needs a finite number of forwards in flight
            for lag_label, lag in (*lags, ("0", (0,) * p), ("rank/2", tuple(r // 2 for r in range(p)))):
                out.append(_variant(wm, (0,) * p, lag, 0.0, False, False, f"static warm={label} lag={lag_label}", True))
    # Most useful first (measured: how often a variant alone is best over a grid of shapes and cost ratios), so
    # that the cut of later passes bites early.
    rank = {label: i for i, label in enumerate(_FIRST)}
    out.sort(key=lambda pol: rank.get(pol.label, len(rank)))
    family, seen = [], set()
    for pol in anchors(p, m) + out:
        key = (pol.warm, pol.ahead, pol.lag, pol.theta_w, pol.f_fits, pol.guard, pol.static)
        if key not in seen:
            seen.add(key)
            family.append(pol)
    return family


_FIRST = (
    "warm=fill- ahead=warm lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=1f1b ahead=warm lag=rank theta_w=0.0 f_fits=False guard=False",
    "warm=fill- ahead=warm lag=rank theta_w=0.0 f_fits=False guard=False",
    "warm=free ahead=0 lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=1f1b ahead=warm lag=none theta_w=0.5 f_fits=False guard=False",
    "warm=fill- ahead=warm lag=none theta_w=0.5 f_fits=False guard=False",
    "warm=fill+ ahead=warm lag=none theta_w=0.5 f_fits=False guard=False",
    "warm=1f1b ahead=warm lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=free ahead=0 lag=none theta_w=0.0 f_fits=False guard=True",
    "warm=fill- ahead=0 lag=rank theta_w=0.5 f_fits=True guard=False",
    "warm=1f1b ahead=warm lag=rank theta_w=0.5 f_fits=True guard=False",
    "warm=fill- ahead=0 lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=fill+ ahead=warm lag=rank theta_w=0.0 f_fits=False guard=False",
    "warm=fill+ ahead=0 lag=rank theta_w=0.0 f_fits=False guard=False",
)


def _backend(name: str | None) -> str:
    if name is None:
        return "cpp" if _cpp is not None else "python"
    if name == "cpp" and _cpp is None:
        raise ValueError("backend='cpp' asked for, but zb_pipeline.schedule._zb_auto_cpp is not built")
    if name not in ("cpp", "python"):
        raise ValueError(f"backend={name!r}: expected 'cpp', 'python' or None")
    return name


class Engine:
    """Passes and scoring over one cost view, in C++ (``_zb_auto_cpp.Searcher``) or in the Python reference."""

    def __init__(self, backend: str, m: int, st: StageArrays) -> None:
        self.backend, self.m, self.st = backend, m, st
        self._cpp = None
        if backend == "cpp":
            self._cpp = _cpp.Searcher(m, st.f, st.b, st.w, st.comm, st.mem_f, st.mem_b, st.mem_w, st.cap)

    def run(
        self, pol: Policy, want_plan: bool = False, cut: float = INF
    ) -> tuple[list[list[int]] | None, float, float, int]:
        """One pass: (plans or None, the pass's span, the plan's simulated makespan, actions run); inf when cut."""
        if self._cpp is not None:
            return self._cpp.run(
                pol.warm, pol.ahead, pol.lag, pol.theta_w, pol.f_fits, pol.guard, pol.static, want_plan, cut
            )
        plans, span, work = list_schedule_py(
            self.m, self.st, pol.warm, pol.ahead, pol.lag, pol.theta_w, pol.f_fits, pol.guard, pol.static, cut
        )
        if span == INF:
            return None, INF, INF, work
        return (plans if want_plan else None), span, evaluate_py(self.m, self.st, plans), work

    def evaluate(self, plans: Sequence[Sequence[int]]) -> float:
        """Simulated makespan of fixed plans under this view's costs."""
        if self._cpp is not None:
            return self._cpp.evaluate(plans)
        return evaluate_py(self.m, self.st, plans)

    def spans(self, plans: Sequence[Sequence[int]]) -> list[float]:
        """Simulated span of every rank (``ValueError`` if the plans deadlock)."""
        if self._cpp is not None:
            return self._cpp.spans(plans)
        return spans_py(self.m, self.st, plans)


def _run(
    backend: str, m: int, st: StageArrays, pol: Policy, want_plan: bool = True, bound: float = INF
) -> tuple[list[list[int]] | None, float]:
    """One pass (plans, the pass's span); kept for the handcrafted generators that run a fixed policy."""
    plans, span, _, _ = Engine(backend, m, st).run(pol, want_plan, bound)
    return plans, span


def resolve_mem_limit(p: int, costs: StageCosts, mem_limit: float | None) -> tuple[float, ...]:
    """Per-rank caps for ``mem_limit`` (``None``: 2p - 1 microbatches); ``ValueError`` if no plan fits."""
    need = min_mem_limit(costs)
    if mem_limit is None:
        return default_mem_limit(p, costs)
    if not math.isfinite(mem_limit) or mem_limit < need - _EPS * max(1.0, need):
        raise ValueError(
            f"zb-auto: mem_limit={mem_limit} is below one microbatch on some rank; the smallest limit that works "
            f"is {need:g} (units of the memory deltas)"
        )
    return (float(mem_limit),) * p


def _tol(x: float) -> float:
    return _EPS * max(1.0, abs(x))


def search(
    p: int,
    m: int,
    costs: StageCosts,
    mem_limit: float | None = None,
    *,
    backend: str | None = None,
    improve: bool = True,
    budget: float = SEARCH_BUDGET,
    median_view: bool = True,
) -> SearchResult:
    """Run the variant family (and the local improvement), return the best plan found.

    ``budget`` bounds the effort in simulated actions (summed over passes; a cut pass counts what it ran): the
    anchors and the first ``len(_FIRST)`` variants always run, the rest while the budget lasts.
    """
    if costs.num_stages != p:
        raise ValueError(f"zb-auto plans one chunk per rank: costs have {costs.num_stages} stages, expected p={p}")
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    be = _backend(backend)
    st = StageArrays.of(costs, resolve_mem_limit(p, costs, mem_limit))
    eng = Engine(be, m, st)
    floor = lower_bound(m, st)
    span, pol, plans, passes, work = _search_view(p, m, costs, eng, improve, budget, floor)
    if median_view and not _stage_uniform(costs) and span > floor + _tol(floor):
        # One more candidate: the plan the same search makes when every stage costs the median, scored with the
        # true costs.  Passes make local decisions from the costs they see, and on some shapes the smoother view
        # happens to decide better; keeping it as a candidate means real costs never lose to a median plan.
        med = _median(costs)
        eng_med = Engine(be, m, StageArrays.of(med, st.cap))
        _, v_pol, v_plans, v_passes, v_work = _search_view(
            p, m, med, eng_med, improve, budget, lower_bound(m, eng_med.st)
        )
        v_span = eng.evaluate(v_plans)
        passes += v_passes
        work += v_work
        if v_span < span - _tol(span):
            span, pol, plans = v_span, replace(v_pol, label=v_pol.label + " (median view)"), v_plans
    seconds, cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
    return SearchResult(_to_schedule("zb-auto", p, m, plans), span, pol, passes, be, seconds, cpu, work, floor)


def _search_view(
    p: int, m: int, costs: StageCosts, eng: Engine, improve: bool, budget: float, floor: float
) -> tuple[float, Policy, list[list[int]], int, int]:
    """The variant family (cut by the best so far), the local search on knobs, then the polish of the plan:
    (makespan, policy, plans, passes, work)."""
    family = policies(p, m, costs)
    n_anchor = len(anchors(p, m))
    min_passes = n_anchor + len(_FIRST)
    best: tuple[float, Policy] | None = None
    passes = work = 0
    done = False
    for i, pol in enumerate(family):
        if i >= min_passes and work >= budget:
            break
        cut = INF if best is None or i < n_anchor else best[0] - _tol(best[0])
        _, _, score, w = eng.run(pol, cut=cut)
        passes += 1
        work += w
        if best is None or score < best[0] - _tol(best[0]):
            best = (score, pol)
        if best[0] <= floor + _tol(floor):  # no plan can do better
            done = True
            break
    assert best is not None
    if not done and improve and p > 1 and work < budget:
        best, extra, extra_work = _improve(eng, best, budget - work)
        passes += extra
        work += extra_work
    span, pol = best
    plans, _, again, _ = eng.run(pol, want_plan=True)
    assert plans is not None and again == span
    if improve and span > floor + _tol(floor) and 3 * p * m <= POLISH_MAX_ACTIONS:
        plans, polished, extra_work = polish(eng, plans, span, max(0.0, budget - work))
        work += extra_work
        if polished < span - _tol(span):
            span, pol = polished, replace(pol, label=pol.label + " +polish")
    return span, pol, plans, passes, work


def _stage_uniform(costs: StageCosts) -> bool:
    return all(len(set(v)) <= 1 for v in (costs.f, costs.b, costs.w))


def _median(costs: StageCosts) -> StageCosts:
    """Every stage at the median cost (memory deltas kept per stage)."""
    p = costs.num_stages

    def med(v: tuple[float, ...]) -> tuple[float, ...]:
        return (statistics.median(v),) * p

    return replace(costs, f=med(costs.f), b=med(costs.b), w=med(costs.w))


def _improve(eng: Engine, best: tuple[float, Policy], budget: float) -> tuple[tuple[float, Policy], int, int]:
    """Local search on the best variant's per-rank knobs: warm-up budget, ``ahead`` and ``lag``, one step at a time.

    A move changes one knob of one rank by one; a move that shortens the makespan is kept at once (and the next
    move tried from there).  Sweeps over ranks from the last to the first repeat while they find something, at most
    ``_SWEEPS`` times, within ``budget`` simulated actions (trial passes are cut by the best makespan, so moves that
    cannot win stop early).  The warm-up budget starts at what the plan actually used before its first B (a budget
    above it changes nothing).
    """
    span, pol = best
    plans, _, _, _ = eng.run(pol, want_plan=True)
    assert plans is not None
    m = eng.m
    p = len(plans)
    used = []
    for r in range(p):
        n = 0
        for code in plans[r]:
            if code >= m:
                break
            n += 1
        used.append(max(1, n))
    knobs = {"warm": list(used), "ahead": [min(a, m) for a in pol.ahead], "lag": [min(x, m) for x in pol.lag]}
    fields = ("warm", "lag") if pol.static else ("warm", "ahead", "lag")
    passes = work = 0
    for _ in range(_SWEEPS):
        found = False
        for r in range(p - 1, -1, -1):
            for name in fields:
                for delta in (-1, 1):
                    v = knobs[name]
                    new = v[r] + delta
                    if new < (1 if name == "warm" else 0) or new > m or work >= budget:
                        continue
                    v[r] = new
                    trial = replace(pol, **{k: tuple(x) for k, x in knobs.items()}, label=pol.label + " +improve")
                    if pol.static:
                        trial = _variant(trial.warm, trial.ahead, trial.lag, 0.0, False, False, trial.label, True)
                    _, _, t_span, w = eng.run(trial, cut=span - _tol(span))
                    passes += 1
                    work += w
                    if t_span < span - _tol(span):
                        span, pol, found = t_span, trial, True
                    else:
                        v[r] -= delta
        if not found:
            break
    return (span, pol), passes, work


def polish(eng: Engine, plans: list[list[int]], span: float, budget: float) -> tuple[list[list[int]], float, int]:
    """Local search on the plan itself: swap two neighbouring actions of a rank while that helps.

    A swap must keep each stream in microbatch order, every B after its F and every W after its B, the memory
    within the cap, and the plan free of deadlock.  It is kept when it lowers (makespan, sum of rank spans)
    lexicographically: the second key walks the plateaus where many orders share a makespan.  Each trial is one
    simulation of the plan (3pm actions), within ``budget``.  Returns (plans, makespan, actions simulated).
    """
    m, st = eng.m, eng.st
    deltas = (st.mem_f, st.mem_b, st.mem_w)
    cur = eng.spans(plans)
    key = (max(cur), sum(cur))
    size = sum(len(x) for x in plans)
    work = 0
    improved = True
    while improved and work + size <= budget:
        improved = False
        for r in range(len(plans) - 1, -1, -1):
            plan, cap = plans[r], st.cap[r]
            mem = 0.0
            for i in range(len(plan) - 1):
                a, b = plan[i], plan[i + 1]
                ka, ja = divmod(a, m)
                kb, jb = divmod(b, m)
                if ka == kb or ja == jb or mem + deltas[kb][r] > cap + _EPS or work + size > budget:
                    mem += deltas[ka][r]
                    continue
                plan[i], plan[i + 1] = b, a
                work += size
                try:
                    trial = eng.spans(plans)
                except ValueError:  # the swap deadlocks
                    trial = None
                if trial is not None and (
                    max(trial) < key[0] - _tol(key[0])
                    or (max(trial) <= key[0] + _tol(key[0]) and sum(trial) < key[1] - _tol(key[1]))
                ):
                    key, improved = (min(max(trial), key[0]), sum(trial)), True
                    mem += deltas[kb][r]
                else:
                    plan[i], plan[i + 1] = a, b
                    mem += deltas[ka][r]
    return plans, key[0], work


# Polish only plans of at most this many actions (3pm): each trial is a full simulation.
POLISH_MAX_ACTIONS = 1536


# Sweeps of the local search (each sweep tries up to 6p moves).
_SWEEPS = 3


@functools.lru_cache(maxsize=4096)
def _actions_of(rank: int, kind: int) -> list[Action]:
    """Interned actions of one rank and kind, by microbatch (grown on demand; plans share the objects)."""
    return []


def _action_table(rank: int, m: int) -> list[Action]:
    """Code -> Action for one rank (codes kind * m + microbatch)."""
    table: list[Action] = []
    for kind in range(3):
        acts = _actions_of(rank, kind)
        for j in range(len(acts), m):
            acts.append(Action(rank, _KINDS[kind], j))
        table += acts[:m]
    return table


def _to_schedule(name: str, p: int, m: int, plans: Sequence[Sequence[int]]) -> Schedule:
    ranks = []
    for r, codes in enumerate(plans):
        ranks.append(tuple(map(_action_table(r, m).__getitem__, codes)))
    return Schedule(name, p, p, m, loop_placement(p), ranks)


@register(
    "zb-auto",
    uses_costs=True,
    chunks=(1,),
    description="searched zero-bubble plan under a memory limit (default 2p-1 mb)",
)
def zb_auto(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """Searched zero-bubble plan: smallest makespan found under ``mem_limit`` (default: 2p - 1 microbatches)."""
    if chunks != 1:
        raise ValueError(f"zb-auto plans one chunk per rank, got {chunks=}; use zb-v for two chunks")
    return search(p, m, costs, mem_limit).schedule
