"""The stage planner: how many transformer layers each (virtual) stage holds, and which stages recompute.

Inputs: the model's per-part costs per microbatch (``model_costs.ModelCosts``: one transformer layer's F/B/W times
and activation memory, the embedding's (on the first virtual stage) and the output head with the loss (on the last),
optional recompute options, ``RecomputeOption``); the pipeline shape (p, a registered schedule, m, chunks); an
optional per-rank activation-memory limit.  The per-part model's names stay importable from here.
Output (``StagePlan``): layers and recompute choice per virtual stage that minimise the *simulated* iteration
(``simulate(...).end_time`` of the registry's plan under the candidate's per-stage costs) among candidates whose
peak activation memory (``memory.peak_memory``) fits the limit.  Each stage holds at least ``min_layers`` layers.

Search: a depth-first branch and bound over the virtual stages in order, each branch a (layer count, recompute
option) of the next stage.  A partial candidate is cut when a lower bound already reaches the best simulated
iteration: every rank is busy ``m * (f + b + w)`` of its stages, the stage cannot start before the forward chain
reaches it, and the work still to place lands on the ranks of the later stages (the busiest of them has at least
their average); a complete candidate is simulated only if ``bounds.iteration_lower_bound`` is below the best.
Memory cuts a branch once a rank is over the limit: for a plan that does not depend on costs its peak without the
recompute transients (which only add) is known as soon as its stages are fixed (and the stages fixed so far bound it
from below -- every stage adds ``>= 0`` at every point while ``mem_f >= 0`` and ``mem_f + mem_b >= 0``); for a
cost-dependent plan (zb-auto, zb-h2, the V schedules) each stage's own microbatch bounds it, and the plan is generated
per candidate.  A complete candidate's peak, transients included, comes from its plan (``order_peak``). The worst case
enumerates all ``C(L - 1, S - 1) * (R + 1)^S`` candidates (L layers, S virtual stages, R options), each an O(S m)
simulation; in practice only candidates whose busiest rank is within the bubble of the best are simulated (tens to
hundreds).  ``max_evaluations`` caps the simulations (5000, or 200 when each generates a plan); a capped search says so
(``StagePlan.exact`` is False).  Measured on the loaded 2-core development machine: p = 4, 16 layers, m = 8, zb-h1: 6-12
simulations, 0.1 s; p = 8, 32 layers, m = 32: 566 simulations, 16 s; zb-v at p = 4 (a plan per candidate): 416 plans,
145 s.

An infeasible memory limit raises ``PlannerError`` naming the smallest limit that works (the same search,
minimising the peak instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.bounds import iteration_lower_bound
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.memory import order_peak
from zb_pipeline.schedule.model_costs import (  # the per-part model, importable from here too
    NO_RECOMPUTE,
    ModelCosts,
    PartCosts,
    RecomputeOption,
    StepShare,
)
from zb_pipeline.schedule.simulate import simulate

__all__ = [
    "DEFAULT_EVALUATIONS",
    "DEFAULT_PLAN_EVALUATIONS",
    "NO_RECOMPUTE",
    "ModelCosts",
    "PartCosts",
    "PlannerError",
    "RecomputeOption",
    "StagePlan",
    "StepShare",
    "evaluate_split",
    "even_split",
    "plan_stages",
    "smallest_mem_limit",
]
DEFAULT_EVALUATIONS = 5000  # simulations of a fixed plan (about a millisecond each at p = 8, m = 32 on an idle CPU)
DEFAULT_PLAN_EVALUATIONS = 200  # candidates of a cost-dependent schedule (each generates a plan)


class PlannerError(ValueError):
    """No candidate fits: the message names the smallest memory limit that works (``smallest``, when known)."""

    def __init__(self, message: str, *, smallest: float | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest


@dataclass(frozen=True)
class StagePlan:
    """The planner's answer."""

    schedule_name: str
    layers: tuple[int, ...]  # per virtual stage
    recompute: tuple[str, ...]  # per virtual stage: an option name or "none"
    iteration: float  # simulated end of the iteration (SimResult.end_time) plus the model's ``step_time``
    peak_memory: tuple[float, ...]  # per rank
    schedule: Schedule
    costs: StageCosts
    evaluations: int  # candidates simulated
    exact: bool  # False: max_evaluations stopped the search before it proved the answer optimal

    def layer_ranges(self) -> tuple[range, ...]:
        """Each virtual stage's contiguous layer indices."""
        out, start = [], 0
        for n in self.layers:
            out.append(range(start, start + n))
            start += n
        return tuple(out)

    def describe(self) -> str:
        rec = "" if all(r == NO_RECOMPUTE for r in self.recompute) else f", recompute {list(self.recompute)}"
        return f"layers {list(self.layers)}{rec}"


@dataclass(frozen=True)
class _Shape:
    name: str
    p: int
    m: int
    chunks: int
    stage_to_rank: tuple[int, ...]
    fixed_plan: Schedule | None  # the plan when it does not depend on the costs
    takes_limit: bool

    @property
    def num_stages(self) -> int:
        return self.p * self.chunks


def _shape(name: str, p: int, m: int, chunks: int | None) -> _Shape:
    spec = registry.get(name)
    c = spec.default_chunks if chunks is None else chunks
    placement = registry.placement_of(name, p, c)
    fixed = None if spec.uses_costs else registry.generate(name, p, m, chunks=c)
    return _Shape(name, p, m, c, tuple(placement), fixed, spec.takes_mem_limit)


def _plan_for(shape: _Shape, costs: StageCosts, mem_limit: float | None) -> Schedule | None:
    """The plan a candidate runs (None: the generator cannot serve it under ``mem_limit``)."""
    if shape.fixed_plan is not None:
        return shape.fixed_plan
    try:
        limit = mem_limit if shape.takes_limit else None
        return registry.generate(shape.name, shape.p, shape.m, chunks=shape.chunks, costs=costs, mem_limit=limit)
    except ValueError:
        return None


def _peak(plan: Schedule, costs: StageCosts) -> tuple[float, ...]:
    return tuple(order_peak(acts, costs) for acts in plan.ranks)


# A leaf evaluator: (layers, options, costs) -> (objective, result) or None (infeasible).
_Evaluate = Callable[[tuple[int, ...], tuple[int, ...], StageCosts], "tuple[float, object] | None"]


def _search(
    model: ModelCosts,
    shape: _Shape,
    *,
    min_layers: int,
    partial_bound: Callable[[list[int], list[int], list], float],
    leaf_bound: Callable[[StageCosts], float],
    evaluate: _Evaluate,
    max_evaluations: int,
) -> tuple[object | None, int, bool]:
    """Branch and bound over (layers, option) per virtual stage: the best ``evaluate`` result, the number of
    evaluations, and whether the search finished (exact).  The options per stage: no recompute (0), then each of
    ``model.recompute`` (1, 2, ...)."""
    S, L = shape.num_stages, model.num_layers
    options = range(1, 2) if model.fixed_recompute else range(len(model.recompute) + 1)
    if L < S * min_layers:
        raise ValueError(
            f"{L} layers cannot give each of {S} virtual stages at least {min_layers} layer(s); use fewer stages"
        )
    best: list = [math.inf, None]
    count = [0, True]
    layers: list[int] = []
    opts: list[int] = []
    parts: list[PartCosts] = []
    cache: dict[tuple[int, int, bool, bool], PartCosts] = {}

    def part(n: int, o: int, s: int) -> PartCosts:
        key = (n, o, s == 0, s == S - 1)
        if key not in cache:
            cache[key] = model.stage_part(n, o, first=s == 0, last=s == S - 1)
        return cache[key]

    def rec(left: int) -> None:
        s = len(layers)
        if s == S - 1:
            choices = [left]
        else:
            hi = left - (S - 1 - s) * min_layers
            target = left / (S - s)
            choices = sorted(range(min_layers, hi + 1), key=lambda n: (abs(n - target), n))
        for n in choices:
            for o in options:
                layers.append(n)
                opts.append(o)
                parts.append(part(n, o, s))
                if partial_bound(layers, opts, parts) < best[0]:
                    if s == S - 1:
                        _leaf()
                    else:
                        rec(left - n)
                layers.pop()
                opts.pop()
                parts.pop()
                if not count[1]:
                    return

    def _leaf() -> None:
        costs = model.stage_costs(layers, opts)
        if leaf_bound(costs) >= best[0]:
            return
        if count[0] >= max_evaluations:
            count[1] = False
            return
        count[0] += 1
        got = evaluate(tuple(layers), tuple(opts), costs)
        if got is not None and got[0] < best[0]:
            best[0], best[1] = got

    rec(L)
    return best[1], count[0], bool(count[1])


def plan_stages(
    model: ModelCosts,
    *,
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    chunks: int | None = None,
    mem_limit: float | None = None,
    min_layers: int = 1,
    max_evaluations: int | None = None,
) -> StagePlan:
    """The split and recompute choice with the shortest simulated iteration whose peak fits ``mem_limit`` (per
    rank, the units of the parts' memory); ``PlannerError`` naming the smallest limit that works if none fits.
    ``max_evaluations`` (default ``DEFAULT_EVALUATIONS``, fewer when each candidate generates its own plan) caps the
    simulations; past it the best so far is returned with ``exact=False``."""
    shape = _shape(schedule, num_ranks, num_microbatches, chunks)
    if max_evaluations is None:
        max_evaluations = DEFAULT_EVALUATIONS if shape.fixed_plan is not None else DEFAULT_PLAN_EVALUATIONS
    m, p, place = shape.m, shape.p, shape.stage_to_rank
    limit = math.inf if mem_limit is None else float(mem_limit)
    layer_work = model.layer.f + model.layer.b + model.layer.w  # the cheapest a layer can be (recompute adds)
    head_work = model.head.f + model.head.b + model.head.w

    # Ranks of the stages after stage s (their busy time is where the work still to place goes).
    later_ranks = [sorted(set(place[s + 1 :])) for s in range(shape.num_stages)]

    def time_bound(layers: list[int], opts: list[int], parts: list[PartCosts]) -> float:
        s = len(parts) - 1
        if limit < math.inf and _memory_bound(shape, parts, model.comm) > limit:
            return math.inf
        busy = [0.0] * p
        arrival, bound = 0.0, 0.0
        for k, q in enumerate(parts):
            work = m * (q.f + q.b + q.w)
            busy[place[k]] += work
            bound = max(bound, arrival + work)
            arrival += q.f + (model.comm if k + 1 < shape.num_stages and place[k] != place[k + 1] else 0.0)
        bound = max(bound, max(busy))
        ranks = later_ranks[s]
        if ranks:  # the work left lands on these ranks: the busiest of them has at least their average
            rest = (model.num_layers - sum(layers)) * layer_work + head_work
            bound = max(bound, (sum(busy[r] for r in ranks) + m * rest) / len(ranks))
        return bound

    def evaluate(layers: tuple[int, ...], opts: tuple[int, ...], costs: StageCosts):
        plan = _plan_for(shape, costs, mem_limit)
        if plan is None:
            return None
        peak = _peak(plan, costs)
        if max(peak) > limit:
            return None
        end = simulate(plan, costs).end_time + model.step_time(layers, place)  # the bounds on end_time bound it
        return end, (layers, opts, end, peak, plan, costs)

    best, n, exact = _search(
        model,
        shape,
        min_layers=min_layers,
        partial_bound=time_bound,
        leaf_bound=lambda costs: iteration_lower_bound(costs, place, m).time,
        evaluate=evaluate,
        max_evaluations=max_evaluations,
    )
    if best is None and not exact:
        raise PlannerError(
            f"the stage planner stopped after {n} candidates without one that fits the memory limit {mem_limit:g}; "
            "raise max_evaluations or the limit"
        )
    if best is None:
        if mem_limit is None:
            raise PlannerError(f"schedule {schedule!r} cannot serve p={p}, m={m} with any layer split")
        smallest = smallest_mem_limit(
            model, schedule=schedule, num_ranks=p, num_microbatches=m, chunks=shape.chunks, min_layers=min_layers
        )
        raise PlannerError(
            f"no layer split{' or recompute choice' if model.recompute and not model.fixed_recompute else ''} of "
            f"{model.num_layers} layers fits "
            f"the memory limit {mem_limit:g} per rank with {schedule} (p={p}, m={m}); the smallest limit that works "
            f"is {smallest:g}",
            smallest=smallest,
        )
    layers, opts, end, peak, plan, costs = best
    names = model.option_names()
    return StagePlan(schedule, layers, tuple(names[o] for o in opts), end, peak, plan, costs, n, exact)


def evaluate_split(
    model: ModelCosts,
    layers: Sequence[int],
    *,
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    chunks: int | None = None,
    recompute: Sequence[str] | None = None,
    mem_limit: float | None = None,
) -> tuple[float, tuple[float, ...]]:
    """(simulated iteration plus the model's ``step_time``, per-rank peak) of one given split (and recompute choice,
    default none): what the planner's answer is compared with, e.g. the even split.  ``mem_limit``: a
    memory-capped cost-dependent schedule (zb-auto) plans within it, as the planner does (``ValueError`` if it
    cannot); other plans are simulated as they are."""
    shape = _shape(schedule, num_ranks, num_microbatches, chunks)
    if len(layers) != shape.num_stages or sum(layers) != model.num_layers:
        raise ValueError(f"split {list(layers)} is not {model.num_layers} layers over {shape.num_stages} stages")
    names = model.option_names()
    default = 1 if model.fixed_recompute else 0  # a fixed recompute is in force on every stage
    opts = [default] * len(layers) if recompute is None else [names.index(r) for r in recompute]
    costs = model.stage_costs(layers, opts)
    plan = _plan_for(shape, costs, mem_limit)
    if plan is None:
        within = "" if mem_limit is None or not shape.takes_limit else f" within the memory limit {mem_limit:g}"
        raise ValueError(f"schedule {schedule!r} cannot serve split {list(layers)}{within}")
    return simulate(plan, costs).end_time + model.step_time(layers, shape.stage_to_rank), _peak(plan, costs)


def even_split(num_layers: int, num_stages: int) -> tuple[int, ...] | None:
    """The even split, or ``None`` when the layers do not divide over the stages."""
    if num_layers % num_stages:
        return None
    return (num_layers // num_stages,) * num_stages


def _memory_bound(shape: _Shape, parts: list[PartCosts], comm: float) -> float:
    """A lower bound on the largest rank peak of any candidate starting with ``parts`` (module docstring)."""
    if shape.fixed_plan is None:
        return max(max(q.mem_f, q.mem_f + q.mem_b) for q in parts)
    r = shape.stage_to_rank[len(parts) - 1]  # only this rank's bound changed (the caller's earlier checks hold)
    S = shape.num_stages
    mf = [0.0] * S
    mb = [0.0] * S
    for k, q in enumerate(parts):
        if shape.stage_to_rank[k] == r:
            mf[k], mb[k] = q.mem_f, q.mem_b
    costs = StageCosts(
        f=(1.0,) * S, b=(1.0,) * S, w=(1.0,) * S, comm=comm, mem_f=tuple(mf), mem_b=tuple(mb),
        mem_w=tuple(-(x + y) for x, y in zip(mf, mb)),
    )  # fmt: skip
    return order_peak(shape.fixed_plan.ranks[r], costs)


def smallest_mem_limit(
    model: ModelCosts,
    *,
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    chunks: int | None = None,
    min_layers: int = 1,
    max_evaluations: int = 20000,
) -> float:
    """The smallest per-rank memory limit some candidate (split and recompute choice) fits: the same search,
    minimising the peak.  A cost-dependent plan that takes a limit is bisected per candidate (to 0.5%)."""
    shape = _shape(schedule, num_ranks, num_microbatches, chunks)

    def floor(costs: StageCosts) -> float:
        return max(max(f, f + b) for f, b in zip(costs.mem_f, costs.mem_b))

    def evaluate(layers: tuple[int, ...], opts: tuple[int, ...], costs: StageCosts):
        plan = _plan_for(shape, costs, None)
        if plan is None:
            return None
        top = max(_peak(plan, costs))
        if shape.fixed_plan is not None or not shape.takes_limit:
            return top, top

        def fits(limit: float) -> bool:  # the generator serves ``limit`` with a plan within it
            plan = _plan_for(shape, costs, limit)
            return plan is not None and max(_peak(plan, costs)) <= limit

        if not fits(top):  # the generator counts a recomputing B's transient on top of all it lets stay resident
            top += max(costs.mem_b_transient + costs.mem_bw_transient)
            if not fits(top):
                return None
        lo = floor(costs)
        while top - lo > 0.005 * top:  # the generator fits lo < limit <= top?
            mid = (lo + top) / 2
            if fits(mid):
                top = mid
            else:
                lo = mid
        return top, top

    best, _, _ = _search(
        model,
        shape,
        min_layers=min_layers,
        partial_bound=lambda layers, opts, parts: _memory_bound(shape, parts, model.comm),
        leaf_bound=floor,
        evaluate=evaluate,
        max_evaluations=max_evaluations,
    )
    if best is None:
        raise PlannerError(f"schedule {schedule!r} cannot serve p={num_ranks}, m={num_microbatches}")
    return float(best)
