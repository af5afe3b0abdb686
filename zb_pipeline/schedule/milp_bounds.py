"""What every plan of the exact model (``milp.py``) must satisfy, computed without a solver: the action graph of one
iteration, the precedences a memory limit forces, and each action's time window.

These are the valid inequalities that make the solver's bound climb fast (each holds for every plan, so the
optimum is unchanged):

- *memory precedences*: under the limit, ``F(s,j)`` can only run once ``W(s,i)`` (or ``B(s,i)``) has run for the
  largest ``i`` whose absence alone would already break the limit (each other stage on the rank holds >= 0 memory
  at all times, so one stage's own sum is a lower bound on the rank's);
- *time windows*: ``es[a]``, a time no plan starts ``a`` before (every rank starting at 0), and ``tail[a]``, a time
  no plan's iteration ends sooner than after ``a`` starts.  Each is the longest dependency chain (with the memory
  precedences), or a set of the rank's own actions that must all run in between (head-body-tail reasoning on one
  machine): before ``a``, every predecessor ``x`` on the rank with ``es[x] >= R`` runs after ``R`` and before ``a``,
  for every threshold ``R``; after ``a``, likewise the successors, ordered by ``tail[x] - dur(x)``.

So ``max(es[a] + tail[a])`` is itself a lower bound on the iteration time; on the zero-bubble paper's p = 8 settings
it often equals the best plan's time, which is then optimal without any search.
"""

from __future__ import annotations

from collections.abc import Sequence

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind

STREAMS = (Kind.F, Kind.B, Kind.W)
Act = tuple[Kind, int, int]  # (kind, stage, microbatch)
_EPS = 1e-9


def action_windows(
    stage_to_rank: Sequence[int], num_microbatches: int, costs: StageCosts, mem_limit: float | None = None
) -> tuple[dict[Act, float], dict[Act, float]]:
    """The time windows of the module docstring, for every plan under ``mem_limit``: ``(es, tail)`` keyed by
    ``(kind, stage, microbatch)``: no plan starts the action before ``es`` (every rank starting at 0) or ends its
    iteration sooner than ``tail`` after the action starts.  ``ValueError`` if the limit admits no plan."""
    model = ActionGraph(tuple(stage_to_rank), num_microbatches, costs)
    if mem_limit is not None and not model.memory_precedences(mem_limit):
        raise ValueError(f"no plan stays under mem_limit={mem_limit:g}")
    model.windows()
    return model.es, model.tail


class ActionGraph:
    """One iteration's split actions (F, B, W of every stage and microbatch) on ``stage_to_rank``: what each waits
    for, and (after ``memory_precedences`` and ``windows``) what a memory limit forces and each action's window."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int, costs: StageCosts) -> None:
        self.stage_to_rank, self.m, self.costs = stage_to_rank, m, costs
        self.S = len(stage_to_rank)
        self.p = max(stage_to_rank) + 1
        self.rank_stages = [tuple(s for s in range(self.S) if stage_to_rank[s] == r) for r in range(self.p)]
        self.actions: list[Act] = [(k, s, j) for s in range(self.S) for k in STREAMS for j in range(m)]
        self.by_rank: list[list[Act]] = [[] for _ in range(self.p)]
        for a in self.actions:
            self.by_rank[stage_to_rank[a[1]]].append(a)
        self.mem_pred: dict[Act, list[Act]] = {}  # F(s,j) -> the B/W of stage s it must follow (memory)
        self.es: dict[Act, float] = {}
        self.tail: dict[Act, float] = {}

    def dur(self, kind: Kind, s: int) -> float:
        return {Kind.F: self.costs.f, Kind.B: self.costs.b, Kind.W: self.costs.w}[kind][s]

    def delta(self, kind: Kind, s: int) -> float:
        return {Kind.F: self.costs.mem_f, Kind.B: self.costs.mem_b, Kind.W: self.costs.mem_w}[kind][s]

    def comm(self, s_from: int, s_to: int) -> float:
        return self.costs.comm if self.stage_to_rank[s_from] != self.stage_to_rank[s_to] else 0.0

    def deps(self, a: Act) -> list[tuple[Act, float]]:
        """What ``a`` waits for, with the gap from that action's start: (action, its duration + hop)."""
        k, s, j = a
        out: list[tuple[Act, float]] = []
        if k is Kind.F and s > 0:
            out.append(((Kind.F, s - 1, j), self.dur(Kind.F, s - 1) + self.comm(s - 1, s)))
        if k is Kind.B:
            if s < self.S - 1:
                out.append(((Kind.B, s + 1, j), self.dur(Kind.B, s + 1) + self.comm(s + 1, s)))
            out.append(((Kind.F, s, j), self.dur(Kind.F, s)))
        if k is Kind.W:
            out.append(((Kind.B, s, j), self.dur(Kind.B, s)))
        if j > 0:
            out.append(((k, s, j - 1), self.dur(k, s)))
        out += [(x, self.dur(x[0], x[1])) for x in self.mem_pred.get(a, ())]
        return out

    def memory_precedences(self, limit: float) -> bool:
        """For each F(s,j), and each stream X of its rank that frees memory, the last X(i) that must have run before
        it for the rank to stay under ``limit`` right after it; False if no order can keep F(s,j) under the limit.

        Right after F(s,j) the rank's memory is ``sum_T n_T * delta_T`` over its streams T (an F, B or W of one of
        its stages), ``n_T`` the number of T's actions that have run.  The counts obey what one microbatch's graph
        forces (``n_Y <= n_X`` when X(i) precedes Y(i)), ``n = j + 1`` for F(s), ``n >= j + 1`` for the streams
        F(s,j) waits for, ``n <= j`` for those that wait for it, and ``n_X <= i`` when X(i) has not run.  The least
        memory under these is exact: split the counts into levels ``t = 1..m`` (the streams with ``n_T >= t``); each
        level is a set closed under the graph, the levels can be chosen independently (a distributive lattice with a
        modular cost), and each is found by enumerating the closed sets of the rank's few streams.
        """
        m, reach = self.m, self._microbatch_order()
        for stages in self.rank_stages:
            types = [(k, s) for s in stages for k in STREAMS]
            if len(types) > 12:  # too many streams to enumerate: no memory precedences (fewer cuts, still valid)
                continue
            index = {t: n for n, t in enumerate(types)}
            pairs = [(index[x], index[y]) for x in types for y in types if x != y and y in reach[x]]
            delta = [self.delta(k, s) for k, s in types]
            closed = []
            for mask in range(1 << len(types)):
                if all(not (mask >> y) & 1 or (mask >> x) & 1 for x, y in pairs):
                    closed.append((mask, sum(delta[n] for n in range(len(types)) if (mask >> n) & 1)))

            def least(lo: list[int], hi: list[int], closed: list = closed, n: int = len(types)) -> float:
                total, edges = 0.0, sorted({0, m, *lo, *hi})
                for t0, t1 in zip(edges, edges[1:]):  # levels t0 + 1 .. t1 force the same streams in and out
                    if t1 <= t0:
                        continue
                    need = sum(1 << k for k in range(n) if lo[k] >= t1)
                    ban = sum(1 << k for k in range(n) if hi[k] < t1)
                    best = min((c for mask, c in closed if mask & need == need and not mask & ban), default=None)
                    if best is None:
                        return float("inf")
                    total += best * (t1 - t0)
                return total

            for s in stages:
                if self.delta(Kind.F, s) <= 0:
                    continue
                a = index[(Kind.F, s)]
                for j in range(m):
                    lo = [j + 1 if t == (Kind.F, s) or (Kind.F, s) in reach[t] else 0 for t in types]
                    hi = [j if t in reach[(Kind.F, s)] else (j + 1 if n == a else m) for n, t in enumerate(types)]
                    if least(lo, hi) > limit + _EPS:
                        return False
                    preds = []
                    for x, (k, s2) in enumerate(types):
                        if delta[x] >= 0 or lo[x] >= hi[x]:
                            continue
                        # the largest i in [lo, hi) whose absence breaks the limit (least() grows as i shrinks)
                        first, last = lo[x], hi[x] - 1
                        if least(lo, hi[:x] + [first] + hi[x + 1 :]) <= limit + _EPS:
                            continue
                        while first < last:
                            mid = (first + last + 1) // 2
                            if least(lo, hi[:x] + [mid] + hi[x + 1 :]) > limit + _EPS:
                                first = mid
                            else:
                                last = mid - 1
                        preds.append((k, s2, first))
                    if preds:
                        self.mem_pred[(Kind.F, s, j)] = preds
        return True

    def _microbatch_order(self) -> dict[tuple[Kind, int], set[tuple[Kind, int]]]:
        """For each (kind, stage): the (kind, stage) pairs that wait for it within one microbatch (transitively)."""
        nxt: dict[tuple[Kind, int], list[tuple[Kind, int]]] = {(k, s): [] for s in range(self.S) for k in STREAMS}
        for s in range(self.S):
            nxt[(Kind.F, s)].append((Kind.F, s + 1) if s + 1 < self.S else (Kind.B, s))
            nxt[(Kind.F, s)].append((Kind.B, s))
            if s > 0:
                nxt[(Kind.B, s)].append((Kind.B, s - 1))
            nxt[(Kind.B, s)].append((Kind.W, s))
        reach: dict[tuple[Kind, int], set[tuple[Kind, int]]] = {}
        for s in range(self.S):  # in reverse topological order: W's, then B's upwards, then F's downwards
            reach[(Kind.W, s)] = set()
        for s in range(self.S):
            reach[(Kind.B, s)] = {y for x in nxt[(Kind.B, s)] for y in (x, *reach[x])}
        for s in reversed(range(self.S)):
            reach[(Kind.F, s)] = {y for x in nxt[(Kind.F, s)] for y in (x, *reach[x])}
        return reach

    def _topological(self) -> list[Act]:
        """Every action after all it waits for: microbatch by microbatch, F up the stages, B down, then W."""
        order: list[Act] = []
        for j in range(self.m):
            order += [(Kind.F, s, j) for s in range(self.S)] + [(Kind.B, s, j) for s in reversed(range(self.S))]
            order += [(Kind.W, s, j) for s in range(self.S)]
        return order

    def windows(self) -> None:
        """``es[a]``: no plan starts ``a`` earlier (times from 0); ``tail[a]``: no plan ends sooner than ``tail[a]``
        after ``a`` starts.  Each is the longest dependency chain, or a set of the rank's actions that must all run
        between: before ``a``, every predecessor ``x`` on the rank with ``es[x] >= R`` runs after ``R`` and before
        ``a`` (for each threshold R); after ``a``, likewise the successors by ``tail[x] - dur(x)``."""
        order = self._topological()
        pos = {a: i for i, a in enumerate(order)}
        deps = {a: self.deps(a) for a in order}
        succs: dict[Act, list[tuple[Act, float]]] = {a: [] for a in order}
        for a in order:
            for x, gap in deps[a]:
                succs[x].append((a, gap))
        rank_of = [self.stage_to_rank[a[1]] for a in order]
        masks = [0] * self.p
        for i, r in enumerate(rank_of):
            masks[r] |= 1 << i
        dur = [self.dur(a[0], a[1]) for a in order]

        def closure(links: dict[Act, list[tuple[Act, float]]], seq: list[Act]) -> dict[Act, int]:
            bits: dict[Act, int] = {}
            for a in seq:
                v = 0
                for x, _ in links[a]:
                    v |= bits[x] | (1 << pos[x])
                bits[a] = v
            return bits

        def best_sum(own: int, key: list[float]) -> float:  # max over thresholds of key[x_k] + sum of dur[x_1..k]
            items = []
            while own:
                low = own & -own
                i = low.bit_length() - 1
                items.append((key[i], dur[i]))
                own ^= low
            best, acc = 0.0, 0.0
            for k, d in sorted(items, reverse=True):
                acc += d
                best = max(best, k + acc)
            return best

        es_list = [0.0] * len(order)
        pred = closure(deps, order)
        for a in order:
            i = pos[a]
            chain = max((es_list[pos[x]] + gap for x, gap in deps[a]), default=0.0)
            es_list[i] = max(chain, best_sum(pred[a] & masks[rank_of[i]], es_list))
        slack = [0.0] * len(order)  # tail - dur
        succ = closure(succs, order[::-1])
        for a in reversed(order):
            i = pos[a]
            chain = max((gap + slack[pos[y]] + dur[pos[y]] for y, gap in succs[a]), default=dur[i])
            slack[i] = max(chain, dur[i] + best_sum(succ[a] & masks[rank_of[i]], slack)) - dur[i]
        self.es = {a: es_list[pos[a]] for a in order}
        self.tail = {a: slack[pos[a]] + dur[pos[a]] for a in order}
