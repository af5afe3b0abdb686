"""An exact pipeline-schedule solver: a mixed-integer program solved by HiGHS (``highspy``, optional).

It finds the plan with the smallest makespan under a per-rank activation-memory limit and reports the solver's
proven lower bound, so that the gap of any plan (``zb-auto``, the handcrafted ones, a user's plan file) to the
optimum can be measured.  ``zb-schedule certify`` (``certify.py``) runs it on a user's costs.

The model (all actions split into F, B and W; a fused BW is the special case of W right after B, so the optimum
here is also a bound for every full-backward schedule):

- a start time ``t[a] >= 0`` for every action ``a`` of every (virtual stage, microbatch);
- dependencies: ``F(s,j)`` after ``F(s-1,j)``; ``B(s,j)`` after ``B(s+1,j)`` (on the last stage after
  ``F(S-1,j)``) and after ``F(s,j)``; ``W(s,j)`` after ``B(s,j)``; a dependency between two ranks adds ``T_comm``;
- each stage runs its F's, its B's and its W's in microbatch order.  This loses nothing: microbatches are
  interchangeable, and relabelling the k-th F (B, W) a stage runs as microbatch k keeps every dependency (the k-th
  F of stage s starts after k F's of stage s-1 ended, so after the k-th did) and every memory sum;
- one action at a time per rank: for every pair of actions of different streams on one rank whose order is not
  already implied, a binary ``y`` chooses the order (big-M disjunction, with a big M per pair from the time windows
  below);
- memory: after every action with a positive memory delta, the sum of the deltas of everything the rank has run so
  far is at most ``mem_limit``;
- objective ``"span"``: the longest per-rank span ``C >= end(W(s, m-1)) - start(F(s_first, 0))`` (the simulator's
  ``makespan``); objective ``"end"``: the iteration time ``C >= end(a)`` for every action, all ranks starting at 0
  (the simulator's ``end_time``, what ``bounds.iteration_lower_bound`` bounds).

What the linear relaxation would not see by itself comes from ``milp_bounds``: the memory precedences are rows,
each start time lives in its window (``es[a] <= t[a]``; with objective ``"end"`` and an incumbent of iteration time
``U``, also ``t[a] <= U - tail[a]``), pairs whose windows force one order get no binary, each big M is the pair's
own, and ``C >= t[a] + tail[a]``.  With ``"end"`` the bound starts at ``max(iteration_lower_bound, es + tail)``; an
incumbent at that bound is optimal without running the solver.

The solution's per-rank order becomes a ``Schedule``; its makespan is taken from the simulator (the as-soon-as-possible
timing of that order), which is never more than the solver's objective.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement, v_placement
from zb_pipeline.schedule.milp_bounds import STREAMS, Act, ActionGraph


def highs_available() -> bool:
    """True when the optional ``highspy`` package can be imported."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class ExactResult:
    """What the solver found: the best plan, its makespan, and how far from optimal it may be."""

    schedule: Schedule | None  # None when no feasible plan was found within the time limit
    makespan: float  # simulated makespan of ``schedule`` in the objective's sense (inf without one)
    lower_bound: float  # proven lower bound on the optimal makespan
    optimal: bool  # the solver proved optimality (within its tolerance)
    status: str
    solve_seconds: float
    objective: str = "span"  # "span" (SimResult.makespan) or "end" (SimResult.end_time)
    searched: bool = True  # False: the warm start met the analytic bound, the solver did not run

    @property
    def gap(self) -> float:
        """Relative gap of the solver's own plan to its lower bound (0 when proven optimal)."""
        if self.schedule is None or self.lower_bound <= 0:
            return float("inf")
        return max(0.0, (self.makespan - self.lower_bound) / self.lower_bound)

    def gap_of(self, makespan: float) -> float:
        """Relative gap of another plan's makespan to the proven lower bound (an upper bound on its true gap)."""
        return max(0.0, (makespan - self.lower_bound) / self.lower_bound)


_EPS = 1e-9


def solve_exact(
    num_ranks: int,
    num_microbatches: int,
    *,
    chunks: int = 1,
    placement: str | Sequence[int] = "loop",
    costs: StageCosts | None = None,
    mem_limit: float | None = None,
    time_limit: float = 30.0,
    warm_start: Schedule | None = None,
    name: str = "exact",
    objective: str = "span",
) -> ExactResult:
    """Solve the schedule MILP for ``p`` ranks, ``m`` microbatches and ``chunks`` virtual stages per rank.

    ``placement`` is ``"loop"``, ``"v"`` or an explicit stage-to-rank tuple; ``mem_limit`` is per rank in the units
    of the memory deltas (None: no limit); ``objective`` is ``"span"`` or ``"end"`` (module docstring).
    ``warm_start`` (a plan of the same shape; fused ``BW`` actions are split into ``B`` then ``W``) gives the solver
    a first incumbent, and with ``"end"`` also the time windows.  ``time_limit`` (seconds) covers building the
    model and solving it (HiGHS checks its clock between steps, so a large model may run a little over).
    """
    try:
        import highspy
    except ImportError as exc:  # pragma: no cover - exercised only without the optional dependency
        raise ValueError(
            "the exact solver needs the optional package highspy: pip install 'zb-megatron[milp]'"
        ) from exc

    p, m = num_ranks, num_microbatches
    if p < 1 or m < 1 or chunks < 1:
        raise ValueError(f"need p >= 1, m >= 1 and chunks >= 1, got {p=} {m=} {chunks=}")
    if objective not in ("span", "end"):
        raise ValueError(f"objective must be 'span' or 'end', got {objective!r}")
    if not time_limit > 0:
        raise ValueError(f"time_limit={time_limit} must be > 0")
    stage_to_rank = _placement(placement, p, chunks)
    num_stages = p * chunks
    if costs is None:
        costs = StageCosts.uniform(num_stages)
    if costs.num_stages != num_stages:
        raise ValueError(f"costs are for {costs.num_stages} virtual stages, expected {num_stages}")

    from zb_pipeline.schedule.simulate import simulate

    t0 = time.perf_counter()
    warm = None
    if warm_start is not None:
        split = in_microbatch_order(split_fused(warm_start))
        if split.stage_to_rank != stage_to_rank or split.num_microbatches != m:
            raise ValueError(f"warm_start {warm_start.name!r} has another shape or placement than p={p} m={m}")
        warm = simulate(split, costs)
        if mem_limit is not None and max(warm.peak_memory) > mem_limit + _EPS:
            warm = None  # over the limit: not a feasible incumbent
    model = _Model(stage_to_rank, m, costs, objective)
    upper = None
    if warm is not None and objective == "end" and model.follows_model_order(warm):
        upper = warm.end_time
    if not model.build(mem_limit, upper):
        return _infeasible(name, "infeasible: memory limit below a forced peak", t0, objective)
    if upper is not None and upper <= model.analytic_bound * (1 + 1e-12):  # the incumbent meets the bound
        seconds = time.perf_counter() - t0
        return ExactResult(split, upper, upper, True, "Optimal", seconds, objective, searched=False)

    h = _quiet_highs(highspy)
    h.setOptionValue("time_limit", max(0.1, time_limit - (time.perf_counter() - t0)))  # building counts too
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.setOptionValue("threads", 1)
    model.pass_to(h)
    if warm is not None:
        model.set_warm_start(h, warm)

    h.run()
    seconds = time.perf_counter() - t0
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    lower = max(float(info.mip_dual_bound), model.analytic_bound)
    if info.primal_solution_status != 2:  # 2 = feasible
        return ExactResult(None, float("inf"), lower, False, status, seconds, objective)

    schedule = model.solution_schedule(h, name)
    sim = simulate(schedule, costs)
    simulated = sim.end_time if objective == "end" else sim.makespan
    optimal = status == "Optimal"
    return ExactResult(schedule, simulated, min(lower, simulated), optimal, status, seconds, objective)


def in_microbatch_order(schedule: Schedule) -> Schedule:
    """``schedule`` relabelled so that each stage runs its F's, B's and W's in microbatch order (the model's
    order): the k-th F (B, W) a stage runs becomes microbatch k.  The plan's timing and memory stay the same (module
    docstring), so a plan in any order is a warm start.  Returns ``schedule`` itself when it is in order already."""
    seen: dict[tuple[Kind, int], int] = {}
    ranks = []
    for acts in schedule.ranks:
        out = []
        for a in acts:
            k = (a.kind, a.stage)
            seen[k] = seen.get(k, -1) + 1
            out.append(a if a.microbatch == seen[k] else Action(a.stage, a.kind, seen[k]))
        ranks.append(tuple(out))
    if tuple(ranks) == schedule.ranks:
        return schedule
    s = schedule
    return Schedule(s.name, s.num_ranks, s.num_stages, s.num_microbatches, s.stage_to_rank, tuple(ranks))


def split_fused(schedule: Schedule) -> Schedule:
    """``schedule`` with every fused ``BW`` replaced by its ``B`` and then its ``W``, and every overlapped pair (an
    action with ``forward`` and ``backward`` halves) by its halves in that order: no action starts later (a ``B``'s
    gradient leaves when it ends instead of after the ``W``), so the split plan is never slower at an overlap of 1.
    Returns ``schedule`` itself when there is nothing to split."""

    def halves(a) -> list[Action]:
        if hasattr(a, "forward") and hasattr(a, "backward"):
            return halves(a.forward) + halves(a.backward)
        if a.kind is Kind.BW:
            return [Action(a.stage, Kind.B, a.microbatch), Action(a.stage, Kind.W, a.microbatch)]
        return [a]

    ranks = tuple(tuple(x for a in acts for x in halves(a)) for acts in schedule.ranks)
    if ranks == schedule.ranks:
        return schedule
    s = schedule
    return Schedule(s.name, s.num_ranks, s.num_stages, s.num_microbatches, s.stage_to_rank, ranks)


def _placement(placement: str | Sequence[int], p: int, chunks: int) -> tuple[int, ...]:
    if isinstance(placement, str):
        if placement not in ("loop", "v"):
            raise ValueError(f"placement must be 'loop', 'v' or a stage-to-rank tuple, got {placement!r}")
        return loop_placement(p, chunks) if placement == "loop" else v_placement(p, chunks)
    s2r = tuple(int(r) for r in placement)
    if len(s2r) != p * chunks or sorted(s2r) != sorted(list(range(p)) * chunks):
        raise ValueError(f"placement {s2r} must put {chunks} of the {p * chunks} stages on each of {p} ranks")
    return s2r


class _Model(ActionGraph):
    """The MILP of the module docstring as arrays (columns, rows), handed to ``highspy.Highs`` in one call."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int, costs: StageCosts, objective: str) -> None:
        super().__init__(stage_to_rank, m, costs)
        self.objective = objective
        # Any as-soon-as-possible order finishes by the total work plus every possible communication delay.
        self.horizon = sum(self.dur(k, s) for k, s, _ in self.actions) + costs.comm * 2 * self.S * m + 1.0
        self.col_lb: list[float] = []
        self.col_ub: list[float] = []
        self.integer: list[int] = []
        self.rows_lo: list[float] = []
        self.rows_hi: list[float] = []
        self.rows: list[tuple[list[int], list[float]]] = []
        self.before: dict[tuple[Act, Act], float | int] = {}  # 1.0/0.0, or the column of y = "a runs before b"
        self.binaries: list[tuple[Act, Act, int]] = []
        self.analytic_bound = 0.0

    def follows_model_order(self, sim) -> bool:
        """The plan runs each stage's streams in microbatch order (so its timing is a point of this model)."""
        start = {}
        for timed in sim.timeline:
            for ta in timed:
                start[(ta.action.kind, ta.action.stage, ta.action.microbatch)] = ta.start
        return all(start[(k, s, j)] > start[(k, s, j - 1)] for k, s, j in self.actions if j > 0)

    # ------------------------------------------------------------------------------------------ building
    def _col(self, lb: float, ub: float, integer: bool = False) -> int:
        self.col_lb.append(lb)
        self.col_ub.append(ub)
        if integer:
            self.integer.append(len(self.col_lb) - 1)
        return len(self.col_lb) - 1

    def _row(self, lo: float, hi: float, cols: list[int], vals: list[float]) -> None:
        self.rows_lo.append(lo)
        self.rows_hi.append(hi)
        self.rows.append((cols, vals))

    def build(self, mem_limit: float | None, upper: float | None) -> bool:
        """All columns and rows; False if the memory limit alone makes the model infeasible."""
        from zb_pipeline.schedule.bounds import iteration_lower_bound

        if mem_limit is not None and not self.memory_precedences(mem_limit):
            return False
        inf = float("inf")
        self.windows()
        if self.objective == "end":
            self.analytic_bound = max(
                iteration_lower_bound(self.costs, self.stage_to_rank, self.m).time,
                max(self.es[a] + self.tail[a] for a in self.actions),
            )
        top = self.horizon if upper is None else upper
        ub = {a: top - (self.tail[a] if self.objective == "end" else self.dur(a[0], a[1])) for a in self.actions}
        if any(ub[a] < self.es[a] - 1e-7 for a in self.actions):
            ub = {a: max(ub[a], self.es[a]) for a in self.actions}  # an incumbent at the bound: keep it feasible
        self.ub = ub
        self.t = {a: self._col(self.es[a], ub[a]) for a in self.actions}
        self.makespan = self._col(self.analytic_bound, top if self.objective == "end" else inf)
        self._dependencies()
        self._rank_order()
        if mem_limit is not None and not self._memory_limit(mem_limit):
            return False
        self._objective()
        return True

    def _dependencies(self) -> None:
        """Each action after what it needs (+ T_comm across ranks), each stream in microbatch order, memory
        precedences."""
        t = self.t
        for a in self.actions:
            for x, gap in self.deps(a):
                self._row(gap, float("inf"), [t[a], t[x]], [1.0, -1.0])

    def _rank_order(self) -> None:
        """Pairwise order on each rank: implied orders are constants, the rest binaries (big-M disjunction)."""
        t, es, ub = self.t, self.es, self.ub
        for acts in self.by_rank:
            for i, a in enumerate(acts):
                da = self.dur(a[0], a[1])
                for b in acts[i + 1 :]:
                    db = self.dur(b[0], b[1])
                    implied = _implied_order(a, b)  # by the dependency rows already
                    by_windows = None
                    if implied is None:
                        if ub[b] < es[a] + da - 1e-9:  # a cannot end before b's latest start: b first
                            by_windows = False
                        elif ub[a] < es[b] + db - 1e-9:
                            by_windows = True
                    if implied is None and by_windows is None:
                        y = self._col(0.0, 1.0, integer=True)
                        self.binaries.append((a, b, y))
                        # y = 1: a before b: t[a] + da <= t[b] + M_ab (1 - y)
                        m_ab = ub[a] + da - es[b]
                        self._row(-float("inf"), m_ab - da, [t[a], t[b], y], [1.0, -1.0, m_ab])
                        # y = 0: b before a: t[b] + db <= t[a] + M_ba y
                        m_ba = ub[b] + db - es[a]
                        self._row(-float("inf"), -db, [t[b], t[a], y], [1.0, -1.0, -m_ba])
                        self.before[(a, b)] = y
                    elif implied is not None:
                        self.before[(a, b)] = 1.0 if implied else 0.0
                    else:
                        self.before[(a, b)] = 1.0 if by_windows else 0.0
                        first, second, d = (a, b, da) if by_windows else (b, a, db)
                        if ub[first] + d > es[second]:  # the windows alone do not keep them apart
                            self._row(d, float("inf"), [t[second], t[first]], [1.0, -1.0])

    def _is_before(self, x: Act, a: Act) -> tuple[float, int | None]:
        """(constant, column): ``x`` runs before ``a`` iff constant + sign * y, as (value, None) or (sign, y)."""
        if (x, a) in self.before:
            v = self.before[(x, a)]
            return (v, None) if isinstance(v, float) else (1.0, v)
        v = self.before[(a, x)]
        return (1.0 - v, None) if isinstance(v, float) else (-1.0, v)

    def _memory_limit(self, mem_limit: float) -> bool:
        """Memory after each action that adds memory; False if the order alone already forces it over the limit."""
        for acts in self.by_rank:
            for a in acts:
                if self.delta(a[0], a[1]) <= 0:
                    continue
                const = self.delta(a[0], a[1])
                cols, vals = [], []
                for x in acts:
                    d = self.delta(x[0], x[1])
                    if x == a or d == 0:
                        continue
                    c, y = self._is_before(x, a)
                    if y is None:
                        const += d * c
                    else:
                        if c < 0:  # 1 - y
                            const += d
                        cols.append(y)
                        vals.append(d * c)
                if cols:
                    self._row(-float("inf"), mem_limit - const, cols, vals)
                elif const > mem_limit + _EPS:
                    return False
        return True

    def _objective(self) -> None:
        """The makespan: at least every rank's span (or every action's end), and each action's start + tail."""
        t, c, m = self.t, self.makespan, self.m
        for stages in self.rank_stages:
            first = t[(Kind.F, stages[0], 0)]
            work = sum(self.dur(k, s) * m for s in stages for k in STREAMS)
            if self.objective == "span":
                for s in stages:
                    self._row(self.dur(Kind.W, s), float("inf"), [c, t[(Kind.W, s, m - 1)], first], [1.0, -1.0, 1.0])
                self._row(work, float("inf"), [c], [1.0])
            else:
                self._row(work, float("inf"), [c, first], [1.0, -1.0])
        if self.objective == "end":
            for a in self.actions:
                self._row(self.tail[a], float("inf"), [c, t[a]], [1.0, -1.0])

    def pass_to(self, h) -> None:
        import highspy
        import numpy as np

        n = len(self.col_lb)
        cost = np.zeros(n)
        cost[self.makespan] = 1.0
        h.addCols(n, cost, np.array(self.col_lb), np.array(self.col_ub), 0, np.array([], dtype=np.int32),
                  np.array([], dtype=np.int32), np.array([], dtype=np.float64))  # fmt: skip
        starts, index, value = [], [], []
        for cols, vals in self.rows:
            starts.append(len(index))
            index += cols
            value += vals
        h.addRows(len(self.rows), np.array(self.rows_lo), np.array(self.rows_hi), len(index),
                  np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value))  # fmt: skip
        if self.integer:
            idx = np.array(self.integer, dtype=np.int32)
            h.changeColsIntegrality(len(idx), idx, np.full(len(idx), 1, dtype=np.uint8))
        h.changeObjectiveSense(highspy.ObjSense.kMinimize)

    def set_warm_start(self, h, sim) -> None:
        """Hand the solver a first incumbent: the simulated times and orders of an existing plan."""
        start = {}
        for timed in sim.timeline:
            for ta in timed:
                start[(ta.action.kind, ta.action.stage, ta.action.microbatch)] = ta.start
        if set(start) != set(self.t) or not self.follows_model_order(sim):
            return
        values = [0.0] * len(self.col_lb)
        for a, col in self.t.items():
            values[col] = start[a]
        values[self.makespan] = sim.end_time if self.objective == "end" else sim.makespan
        for a, b, y in self.binaries:
            values[y] = 1.0 if start[a] < start[b] else 0.0
        sol = h.getSolution()
        sol.col_value = values
        sol.value_valid = True
        h.setSolution(sol)

    def solution_schedule(self, h, name: str) -> Schedule:
        """The solved start times as per-rank orders."""
        values = h.getSolution().col_value
        starts = {a: values[self.t[a]] for a in self.actions}
        ranks = []
        for acts in self.by_rank:
            order = sorted(acts, key=lambda a: (starts[a], STREAMS.index(a[0]), a[1], a[2]))
            ranks.append(tuple(Action(s, k, j) for k, s, j in order))
        return Schedule(name, self.p, self.S, self.m, self.stage_to_rank, tuple(ranks))


def _implied_order(a: tuple[Kind, int, int], b: tuple[Kind, int, int]) -> bool | None:
    """True if ``a`` must run before ``b``, False if after, None if either order is possible.

    Only orders within one stage are implied here (stream order plus F -> B -> W of the same microbatch).
    """
    ka, sa, ja = a
    kb, sb, jb = b
    if sa != sb:
        return None
    rank = {Kind.F: 0, Kind.B: 1, Kind.W: 2}
    if ka == kb:
        return ja < jb
    # a is of an earlier kind than b: a(j) precedes b(j') when j <= j' (chains F(j)->...->F(j')->B(j') etc.).
    if rank[ka] < rank[kb]:
        return True if ja <= jb else None
    return False if jb <= ja else None


def _quiet_highs(highspy):
    """A silent ``Highs``: its constructor prints a banner on the C stdout, which would spoil ``--json`` output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        h = highspy.Highs()
        h.silent()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h


def _infeasible(name: str, status: str, t0: float, objective: str) -> ExactResult:
    return ExactResult(None, float("inf"), float("inf"), False, status, time.perf_counter() - t0, objective)
