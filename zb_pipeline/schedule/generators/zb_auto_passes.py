"""zb-auto's building block: one pass of the list scheduler, and the timing of a fixed plan.

A *pass* is an event-driven walk over time in which every rank, whenever it is free, picks its next action by a
policy, and the pass records what it picked (the plan) together with when everything ran (the plan's simulated
timing under the same model as ``simulate.py``).  A pass is O(actions log p).

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
what it chose.

Plans are flat per-rank lists of action codes ``kind * m + microbatch`` (kind 0, 1, 2 for F, B, W).

Speed: the passes and the scoring run in C++ (``zb_pipeline.schedule._zb_auto_cpp.Searcher``, built from
``csrc/zb_auto_search.cpp``) when the extension is built, else in the Python reference below; both give identical
plans, spans, scores and work counts (tested).  ``codes_to_schedule`` reuses interned ``Action`` objects.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement

try:  # the compiled passes; the Python reference below is the fallback
    from zb_pipeline.schedule import _zb_auto_cpp as _cpp
except ImportError:  # pragma: no cover - depends on the build
    _cpp = None

INF = math.inf
EPS = 1e-9
# Action codes in the flat per-rank plans the passes produce: kind * m + microbatch.
_F, _B, _W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)


def tol(x: float) -> float:
    """The tolerance the search compares makespans with: relative ``EPS``, absolute below 1."""
    return EPS * max(1.0, abs(x))


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


# ----------------------------------------------------------------------------------------------------------------
# The list scheduler (Python reference; csrc/zb_auto_search.cpp mirrors it operation for operation)
# ----------------------------------------------------------------------------------------------------------------


class _Pass:
    """The state of one pass: per rank the F, B and W run so far, memory, clocks, and the wake-up queue."""

    def __init__(self, m: int, st: StageArrays, warm: Sequence[int], ahead: Sequence[int], lag: Sequence[int]):
        p = len(st.f)
        self.m, self.p, self.st = m, p, st
        self.warm, self.ahead, self.lag = warm, ahead, lag
        self.f_end = [[INF] * m for _ in range(p)]
        self.b_end = [[INF] * m for _ in range(p)]
        self.nf = [0] * p
        self.nb = [0] * p
        self.nw = [0] * p
        self.mem = [0.0] * p
        self.free = [0.0] * p  # when the rank's last action ends
        self.first = [INF] * p  # when the rank's first action started
        self.wake = [INF] * p  # the rank's pending wake-up (INF: none)
        self.rem = [m * (st.f[r] + st.b[r] + st.w[r]) for r in range(p)]  # work the rank still has
        self.work = 0
        self.plans: list[list[int]] = [[] for _ in range(p)]
        self.heap: list[tuple[float, int]] = [(0.0, 0)]
        self.wake[0] = 0.0

    def notify(self, q: int, at: float) -> None:
        """Wake rank ``q`` at ``at`` unless it already wakes earlier."""
        if at < self.wake[q]:
            self.wake[q] = at
            heapq.heappush(self.heap, (at, -q))

    def fits_f(self, r: int) -> bool:
        """Room on rank ``r`` for its next F and the B that will follow it."""
        st = self.st
        return self.mem[r] + st.mem_f[r] + max(0.0, st.mem_b[r]) <= st.cap[r] + EPS

    def b_or_w(self, r: int, has_w: bool) -> int:
        """The next B, or a W first when that B would overrun the cap."""
        st = self.st
        return _W if (has_w and self.mem[r] + st.mem_b[r] > st.cap[r] + EPS) else _B

    def choose_static(self, r: int, t: float, k: int, j: int, tb: float, tf: float) -> tuple[int, float]:
        """A fixed order: W once more than lag[r] are pending (or to make room for a wanted F), else F while fewer
        than warm[r] await their B, else B; the rank waits for what it chose (ZB-H1: warm = p - r, lag = r).
        Returns (action code or -1, the time to wake up at when waiting)."""
        has_w = self.nw[r] < k
        want_f = j < self.m and j - k < self.warm[r]
        fits = self.fits_f(r)
        if has_w and (k - self.nw[r] > self.lag[r] or (want_f and not fits)):
            return _W, INF
        if want_f and fits:
            return (_F, INF) if tf <= t else (-1, tf)
        if k < j:
            return (self.b_or_w(r, has_w), INF) if tb <= t else (-1, tb)
        if has_w:
            return _W, INF
        return -1, INF

    def choose_dynamic(
        self, r: int, t: float, k: int, j: int, tb: float, tf: float, f_room: bool, pol: tuple[float, bool, bool]
    ) -> tuple[int, float]:
        """Steps 1-5 of the module docstring; ``pol`` is (theta_w, f_fits, guard).  Returns (action code or -1,
        the time to wake up at when waiting)."""
        theta_w, f_fits, guard = pol
        st = self.st
        has_w = self.nw[r] < k
        f_now = f_room and tf <= t
        if tb <= t and not (f_now and j - k < self.ahead[r]):
            return self.b_or_w(r, has_w), INF
        if has_w and k - self.nw[r] > self.lag[r]:
            return _W, INF
        if f_now and (tb <= t or not f_fits or tb == INF or t + st.f[r] <= tb):
            return _F, INF
        if has_w:
            # The next B or admissible F a W would delay; with ``guard`` an arrival not decided yet counts as
            # the earliest it could be (its producer starting it now or when it is free).
            due_b = tb
            if guard and due_b == INF and k < j:
                due_b = max(t, self.free[r + 1]) + st.b[r + 1] + st.comm
            due_f = INF
            if f_room:
                due_f = tf
                if guard and due_f == INF:
                    due_f = max(t, self.free[r - 1]) + st.f[r - 1] + st.comm
            due = due_f if due_f < due_b else due_b
            if due == INF or t + st.w[r] <= due + theta_w * st.w[r]:
                return _W, INF
        nxt = tb if tb > t else INF
        if f_room and t < tf < nxt:
            nxt = tf
        return -1, nxt

    def execute(self, r: int, t: float, act: int, k: int, j: int) -> float:
        """Run action ``act`` on rank ``r`` at ``t``, wake the neighbour that may wait for it; returns its end."""
        st, m, c = self.st, self.m, self.st.comm
        self.work += 1
        if act == _F:
            end = t + st.f[r]
            self.f_end[r][j] = end
            self.nf[r] = j + 1
            self.mem[r] += st.mem_f[r]
            self.rem[r] -= st.f[r]
            self.plans[r].append(j)
            if self.first[r] == INF:
                self.first[r] = t
            q = r + 1
            if q < self.p and self.nf[q] == j:  # the next rank may be waiting for this activation
                self.notify(q, max(end + c, self.free[q]))
        elif act == _B:
            end = t + st.b[r]
            self.b_end[r][k] = end
            self.nb[r] = k + 1
            self.mem[r] += st.mem_b[r]
            self.rem[r] -= st.b[r]
            self.plans[r].append(m + k)
            q = r - 1
            if q >= 0 and self.nb[q] == k and self.nf[q] > k:  # the previous rank may be waiting for this gradient
                self.notify(q, max(end + c, self.free[q]))
        else:
            end = t + st.w[r]
            i = self.nw[r]
            self.nw[r] = i + 1
            self.mem[r] += st.mem_w[r]
            self.rem[r] -= st.w[r]
            self.plans[r].append(2 * m + i)
        self.free[r] = end
        return end


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
    ps = _Pass(m, st, warm, ahead, lag)
    p, c, last = ps.p, st.comm, ps.p - 1
    f_end, b_end, nf, nb, wake, heap = ps.f_end, ps.b_end, ps.nf, ps.nb, ps.wake, ps.heap
    knobs = (theta_w, f_fits, guard)
    while heap:
        t, neg_r = heapq.heappop(heap)
        r = -neg_r
        if t != wake[r]:
            continue  # superseded by an earlier wake-up
        wake[r] = INF
        k, j = nb[r], nf[r]
        tb = INF  # when the next B may start (INF: not known yet)
        if k < j:
            tb = f_end[r][k] if r == last else max(f_end[r][k], b_end[r + 1][k] + c)
        tf = INF
        f_room = False
        if j < m:
            tf = 0.0 if r == 0 else f_end[r - 1][j] + c
            f_room = ps.fits_f(r) and (k > 0 or j < warm[r])
        if static:
            act, nxt = ps.choose_static(r, t, k, j, tb, tf)
        else:
            act, nxt = ps.choose_dynamic(r, t, k, j, tb, tf, f_room, knobs)
        if act < 0:  # wait for the next arrival we know of; others notify us when they are decided
            if nxt < INF:
                wake[r] = nxt
                heapq.heappush(heap, (nxt, -r))
            continue
        end = ps.execute(r, t, act, k, j)
        if end - ps.first[r] + ps.rem[r] > cut:
            return ps.plans, INF, ps.work
        if end < wake[r]:
            wake[r] = end
            heapq.heappush(heap, (end, -r))
    for r in range(p):
        if ps.nw[r] != m:
            if static:  # a fixed order can deadlock when ranks differ in memory: the variant cannot serve
                return ps.plans, INF, ps.work
            # cannot happen with cap >= one microbatch; a loud guard against a broken policy
            raise RuntimeError(
                f"zb-auto list scheduler stalled on rank {r} ({nf[r]} F, {nb[r]} B, {ps.nw[r]} W of {m})"
            )
    makespan = max(ps.free[r] - ps.first[r] for r in range(p))
    return ps.plans, makespan, ps.work


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
# The engine: passes and scoring in C++ or in the Python reference
# ----------------------------------------------------------------------------------------------------------------


def extension_backend(name: str | None, extension: object | None, extension_name: str) -> str:
    """``"cpp"`` when compiled ``extension`` (module ``zb_pipeline.schedule.<extension_name>``, ``None`` if not
    built) is there or asked for, else ``"python"``; a clear ``ValueError`` for any other ``name``."""
    if name is None:
        return "cpp" if extension is not None else "python"
    if name == "cpp" and extension is None:
        raise ValueError(f"backend='cpp' asked for, but zb_pipeline.schedule.{extension_name} is not built")
    if name not in ("cpp", "python"):
        raise ValueError(f"backend={name!r}: expected 'cpp', 'python' or None")
    return name


def resolve_backend(name: str | None) -> str:
    return extension_backend(name, _cpp, "_zb_auto_cpp")


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


def run_policy(
    backend: str, m: int, st: StageArrays, pol: Policy, want_plan: bool = True, bound: float = INF
) -> tuple[list[list[int]] | None, float]:
    """One pass (plans, the pass's span); kept for the handcrafted generators that run a fixed policy."""
    plans, span, _, _ = Engine(backend, m, st).run(pol, want_plan, bound)
    return plans, span


# ----------------------------------------------------------------------------------------------------------------
# Plans as Schedules
# ----------------------------------------------------------------------------------------------------------------


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


def codes_to_schedule(name: str, p: int, m: int, plans: Sequence[Sequence[int]]) -> Schedule:
    ranks = []
    for r, codes in enumerate(plans):
        ranks.append(tuple(map(_action_table(r, m).__getitem__, codes)))
    return Schedule(name, p, p, m, loop_placement(p), ranks)
