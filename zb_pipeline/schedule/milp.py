"""An exact pipeline-schedule solver: a mixed-integer program solved by HiGHS (``highspy``, optional).

It finds the plan with the smallest makespan under a per-rank activation-memory limit, for small shapes
(p <= 4, m <= 8 within a time limit), and reports the solver's lower bound so that the gap of any heuristic plan
(``zb-auto``, the handcrafted ones) to the optimum can be measured.

The model (all actions split into F, B and W; a fused BW is the special case of W right after B, so the optimum
here is also a bound for every full-backward schedule):

- a start time ``t[a] >= 0`` for every action ``a`` of every (virtual stage, microbatch);
- dependencies: ``F(s,j)`` after ``F(s-1,j)``; ``B(s,j)`` after ``B(s+1,j)`` (on the last stage after
  ``F(S-1,j)``) and after ``F(s,j)``; ``W(s,j)`` after ``B(s,j)``; a dependency between two ranks adds ``T_comm``;
- microbatches are interchangeable, so each stage runs its F's, its B's and its W's in microbatch order (the
  symmetry every generator here follows; "optimal" means optimal among such plans);
- one action at a time per rank: for every pair of actions of different streams on one rank whose order is not
  already implied, a binary ``y`` chooses the order (big-M disjunction);
- memory: after every action with a positive memory delta, the sum of the deltas of everything the rank has run so
  far is at most ``mem_limit``;
- objective: the makespan ``C >= end(W(s, m-1)) - start(F(s_first, 0))`` for every rank (its span: the first action
  of a rank is always the F of microbatch 0 on its lowest stage; the last is a W of microbatch m-1).

The solution's per-rank order becomes a ``Schedule``; its makespan is taken from the simulator (the as-soon-as-possible
timing of that order), which is never more than the solver's objective.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement, v_placement


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
    makespan: float  # simulated makespan of ``schedule`` (inf without one)
    lower_bound: float  # proven lower bound on the optimal makespan
    optimal: bool  # the solver proved optimality (within its tolerance)
    status: str
    solve_seconds: float

    @property
    def gap(self) -> float:
        """Relative gap of the solver's own plan to its lower bound (0 when proven optimal)."""
        if self.schedule is None or self.lower_bound <= 0:
            return float("inf")
        return max(0.0, (self.makespan - self.lower_bound) / self.lower_bound)

    def gap_of(self, makespan: float) -> float:
        """Relative gap of another plan's makespan to the proven lower bound (an upper bound on its true gap)."""
        return max(0.0, (makespan - self.lower_bound) / self.lower_bound)


_STREAMS = (Kind.F, Kind.B, Kind.W)
_Act = tuple[Kind, int, int]  # (kind, stage, microbatch)


def solve_exact(
    num_ranks: int,
    num_microbatches: int,
    *,
    chunks: int = 1,
    placement: str = "loop",
    costs: StageCosts | None = None,
    mem_limit: float | None = None,
    time_limit: float = 30.0,
    warm_start: Schedule | None = None,
    name: str = "exact",
) -> ExactResult:
    """Solve the schedule MILP for ``p`` ranks, ``m`` microbatches and ``chunks`` virtual stages per rank.

    ``placement`` is ``"loop"`` or ``"v"``; ``mem_limit`` is per rank in the units of the memory deltas (None: no
    limit).  ``warm_start`` (a split-B/W plan of the same shape) gives the solver a first incumbent.
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
    if placement not in ("loop", "v"):
        raise ValueError(f"placement must be 'loop' or 'v', got {placement!r}")
    stage_to_rank = loop_placement(p, chunks) if placement == "loop" else v_placement(p, chunks)
    num_stages = p * chunks
    if costs is None:
        costs = StageCosts.uniform(num_stages)
    if costs.num_stages != num_stages:
        raise ValueError(f"costs are for {costs.num_stages} virtual stages, expected {num_stages}")

    h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.setOptionValue("threads", 1)
    model = _Model(h, stage_to_rank, m, costs)
    model.add_dependencies()
    model.add_rank_order()
    if mem_limit is not None and not model.add_memory_limit(mem_limit):
        return _infeasible(name, "infeasible: memory limit below a forced peak", time.perf_counter())
    model.add_objective()
    if warm_start is not None:
        _set_warm_start(h, warm_start, costs, model.t, model.makespan, model.binaries)

    t0 = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - t0
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    lower = float(info.mip_dual_bound)
    if info.primal_solution_status != 2:  # 2 = feasible
        return ExactResult(None, float("inf"), lower, False, status, seconds)

    schedule = model.solution_schedule(name)
    from zb_pipeline.schedule.simulate import simulate

    simulated = simulate(schedule, costs).makespan
    optimal = status == "Optimal"
    return ExactResult(schedule, simulated, min(lower, simulated), optimal, status, seconds)


class _Model:
    """The MILP of the module docstring, built constraint group by constraint group on a ``highspy.Highs``."""

    def __init__(self, h, stage_to_rank: tuple[int, ...], m: int, costs: StageCosts) -> None:
        self.h, self.stage_to_rank, self.m, self.costs = h, stage_to_rank, m, costs
        self.num_stages = len(stage_to_rank)
        self.p = max(stage_to_rank) + 1
        self.actions: list[_Act] = [(k, s, j) for s in range(self.num_stages) for k in _STREAMS for j in range(m)]
        self.by_rank: list[list[_Act]] = [[] for _ in range(self.p)]
        for a in self.actions:
            self.by_rank[stage_to_rank[a[1]]].append(a)
        # Horizon for the big-M constraints: any as-soon-as-possible order finishes by the total work plus every
        # possible communication delay.
        self.horizon = sum(self.dur(k, s) for k, s, _ in self.actions) + costs.comm * 2 * self.num_stages * m + 1.0
        self.t = {a: h.addVariable(lb=0.0, ub=self.horizon) for a in self.actions}
        self.makespan = h.addVariable(lb=0.0, ub=self.horizon)
        self.before: dict[tuple, object] = {}  # (a, b) -> 1.0 / 0.0 or a binary variable meaning "a runs before b"
        self.binaries: list[tuple[_Act, _Act, object]] = []

    def dur(self, kind: Kind, s: int) -> float:
        return {Kind.F: self.costs.f, Kind.B: self.costs.b, Kind.W: self.costs.w}[kind][s]

    def delta(self, kind: Kind, s: int) -> float:
        return {Kind.F: self.costs.mem_f, Kind.B: self.costs.mem_b, Kind.W: self.costs.mem_w}[kind][s]

    def comm(self, s_from: int, s_to: int) -> float:
        return self.costs.comm if self.stage_to_rank[s_from] != self.stage_to_rank[s_to] else 0.0

    def add_dependencies(self) -> None:
        """Each action after what it needs (+ T_comm across ranks); each stream in microbatch order."""
        h, t, dur, comm = self.h, self.t, self.dur, self.comm
        for s, j in itertools.product(range(self.num_stages), range(self.m)):
            f, b, w = (Kind.F, s, j), (Kind.B, s, j), (Kind.W, s, j)
            if s > 0:
                h.addConstr(t[f] >= t[(Kind.F, s - 1, j)] + dur(Kind.F, s - 1) + comm(s - 1, s))
            if s < self.num_stages - 1:
                h.addConstr(t[b] >= t[(Kind.B, s + 1, j)] + dur(Kind.B, s + 1) + comm(s + 1, s))
            h.addConstr(t[b] >= t[f] + dur(Kind.F, s))
            h.addConstr(t[w] >= t[b] + dur(Kind.B, s))
            # Streams in microbatch order.
            if j > 0:
                for k in _STREAMS:
                    h.addConstr(t[(k, s, j)] >= t[(k, s, j - 1)] + dur(k, s))

    def add_rank_order(self) -> None:
        """Pairwise order on each rank: implied orders are constants, the rest binaries (big-M disjunction)."""
        h, t, before, horizon = self.h, self.t, self.before, self.horizon
        for acts in self.by_rank:
            for a, b in itertools.combinations(acts, 2):
                implied = _implied_order(a, b)
                if implied is None:
                    y = h.addBinary()
                    self.binaries.append((a, b, y))
                    h.addConstr(t[a] + self.dur(a[0], a[1]) <= t[b] + horizon * (1 - y))
                    h.addConstr(t[b] + self.dur(b[0], b[1]) <= t[a] + horizon * y)
                    before[(a, b)] = y
                    before[(b, a)] = 1 - y
                else:
                    before[(a, b)] = 1.0 if implied else 0.0
                    before[(b, a)] = 0.0 if implied else 1.0

    def add_memory_limit(self, mem_limit: float) -> bool:
        """Memory after each action that adds memory; False if the order alone already forces it over the limit."""
        for acts in self.by_rank:
            for a in acts:
                if self.delta(a[0], a[1]) <= 0:
                    continue
                expr = self.delta(a[0], a[1])
                const = 0.0
                terms = []
                for b in acts:
                    if b == a:
                        continue
                    v = self.before[(b, a)]
                    d = self.delta(b[0], b[1])
                    if d == 0:
                        continue
                    if isinstance(v, float):
                        const += d * v
                    else:
                        terms.append(d * v)
                if terms:
                    self.h.addConstr(sum(terms[1:], terms[0]) <= mem_limit - expr - const)
                elif expr + const > mem_limit + 1e-9:
                    return False
        return True

    def add_objective(self) -> None:
        """Minimise the makespan: at least every rank's span, and (a cut) at least every rank's own work."""
        h, t, makespan, m = self.h, self.t, self.makespan, self.m
        for r in range(self.p):
            s_first = min(s for s in range(self.num_stages) if self.stage_to_rank[s] == r)
            first = t[(Kind.F, s_first, 0)]
            for s in range(self.num_stages):
                if self.stage_to_rank[s] == r:
                    h.addConstr(makespan >= t[(Kind.W, s, m - 1)] + self.dur(Kind.W, s) - first)
            # A valid cut the LP relaxation does not see by itself: a span holds at least the rank's own work.
            h.addConstr(makespan >= sum(self.dur(k, s) for k, s, _ in self.by_rank[r]))
        h.minimize(makespan)

    def solution_schedule(self, name: str) -> Schedule:
        """The solved start times as per-rank orders."""
        values = self.h.getSolution().col_value
        starts = {a: values[self.t[a].index] for a in self.actions}
        ranks = []
        for acts in self.by_rank:
            order = sorted(acts, key=lambda a: (starts[a], _STREAMS.index(a[0]), a[1], a[2]))
            ranks.append(tuple(Action(s, k, j) for k, s, j in order))
        return Schedule(name, self.p, self.num_stages, self.m, self.stage_to_rank, tuple(ranks))


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


def _set_warm_start(h, schedule: Schedule, costs: StageCosts, t, makespan, binaries) -> None:
    """Hand the solver a first incumbent: the simulated times and orders of an existing split-B/W plan."""
    from zb_pipeline.schedule.simulate import simulate

    if any(a.kind is Kind.BW for acts in schedule.ranks for a in acts):
        return  # only split plans map onto the model's variables
    result = simulate(schedule, costs)
    start = {}
    for timed in result.timeline:
        for ta in timed:
            start[(ta.action.kind, ta.action.stage, ta.action.microbatch)] = ta.start
    if set(start) != set(t):
        return
    n = h.getNumCol()
    values = [0.0] * n
    for a, var in t.items():
        values[var.index] = start[a]
    values[makespan.index] = result.makespan
    for a, b, y in binaries:
        values[y.index] = 1.0 if start[a] < start[b] else 0.0
    sol = h.getSolution()
    sol.col_value = values
    sol.value_valid = True
    h.setSolution(sol)


def _infeasible(name: str, status: str, t0: float) -> ExactResult:
    return ExactResult(None, float("inf"), float("inf"), False, status, time.perf_counter() - t0)
