"""``zb-auto``: search for the split-backward plan with the smallest makespan under a per-rank memory limit.

The search plans from the costs of every virtual stage as given (``T_F``, ``T_B``, ``T_W`` per stage and
``T_comm``): a first stage that embeds tokens or a last stage that carries the output head keeps its own cost.

How it searches
---------------
The building block is a pass of the list scheduler (``zb_auto_passes``): every rank picks its next action by a
policy whenever it is free, and the pass records the plan with its simulated timing.  The search runs the anchors
(ZB-H1 and ZB-H2 as members of the family, ``zb_auto_family``), then the family of variants, and keeps the plan
with the smallest makespan (scored with the simulator's as-soon-as-possible timing of the plan; ties: the earlier
variant).  Then a local search moves one knob of one rank by one while that shortens the makespan, and on small
shapes ``polish`` swaps neighbouring actions of the plan itself (``zb_auto_polish``).

Pruning: ``lower_bound`` (``zb_auto_bound``) is a makespan no plan can beat; a plan that reaches it is optimal and
ends the search at once.  A pass stops as soon as some rank's time used plus its remaining work exceeds the best
makespan so far.  The effort is bounded (``SEARCH_BUDGET`` simulated actions, cut passes counting what they ran):
the anchors and the variants that were most often best on a measured grid (``FIRST``) always run, the rest while
the budget lasts.

With stage costs that differ, the same search is also run on the median view of the costs (every stage at the
median) and its plan, scored with the true costs, is one more candidate: the passes decide locally, and on a few
shapes the smoother view decides better.  The result is therefore never worse than a plan searched from median
costs.

``mem_limit`` is per rank in the units of the memory deltas; ``None`` means 2p - 1 microbatches' worth
(``zb_auto_bound``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.zb_auto_bound import lower_bound, resolve_mem_limit
from zb_pipeline.schedule.generators.zb_auto_family import FIRST, anchors, policies
from zb_pipeline.schedule.generators.zb_auto_passes import (
    INF,
    Engine,
    Policy,
    StageArrays,
    codes_to_schedule,
    resolve_backend,
    tol,
)
from zb_pipeline.schedule.generators.zb_auto_polish import POLISH_MAX_ACTIONS, improve_knobs, polish
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.registry import register
from zb_pipeline.schedule.simulate import simulate

# Search effort in simulated actions: about 0.2 s of C++ passes on the 2-core reference machine.
SEARCH_BUDGET = 1.2e6


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
    anchors and the first ``len(FIRST)`` variants always run, the rest while the budget lasts.
    """
    if costs.num_stages != p:
        raise ValueError(f"zb-auto plans one chunk per rank: costs have {costs.num_stages} stages, expected p={p}")
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    be = resolve_backend(backend)
    st = StageArrays.of(costs, resolve_mem_limit(p, costs, mem_limit))
    eng = Engine(be, m, st)
    floor = lower_bound(m, st)
    span, pol, plans, passes, work = _search_view(p, m, costs, eng, improve, budget, floor)
    if median_view and not _stage_uniform(costs) and span > floor + tol(floor):
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
        if v_span < span - tol(span):
            span, pol, plans = v_span, replace(v_pol, label=v_pol.label + " (median view)"), v_plans
    seconds, cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
    return SearchResult(codes_to_schedule("zb-auto", p, m, plans), span, pol, passes, be, seconds, cpu, work, floor)


def _search_view(
    p: int, m: int, costs: StageCosts, eng: Engine, improve: bool, budget: float, floor: float
) -> tuple[float, Policy, list[list[int]], int, int]:
    """The variant family (cut by the best so far), the local search on knobs, then the polish of the plan:
    (makespan, policy, plans, passes, work)."""
    (span, pol), passes, work, optimal = _run_family(p, m, costs, eng, budget, floor)
    if not optimal and improve and p > 1 and work < budget:
        (span, pol), extra, extra_work = improve_knobs(eng, (span, pol), budget - work)
        passes += extra
        work += extra_work
    plans, _, again, _ = eng.run(pol, want_plan=True)
    assert plans is not None and again == span
    if improve and span > floor + tol(floor) and 3 * p * m <= POLISH_MAX_ACTIONS:
        plans, polished, extra_work = polish(eng, plans, span, max(0.0, budget - work))
        work += extra_work
        if polished < span - tol(span):
            span, pol = polished, replace(pol, label=pol.label + " +polish")
    return span, pol, plans, passes, work


def _run_family(
    p: int, m: int, costs: StageCosts, eng: Engine, budget: float, floor: float
) -> tuple[tuple[float, Policy], int, int, bool]:
    """Run the family in order, each pass cut by the best makespan so far (the anchors uncut), until the budget
    is spent or a plan reaches ``floor``: ((makespan, policy), passes, work, whether it reached ``floor``)."""
    family = policies(p, m, costs)
    n_anchor = len(anchors(p, m))
    min_passes = n_anchor + len(FIRST)
    best: tuple[float, Policy] | None = None
    passes = work = 0
    for i, pol in enumerate(family):
        if i >= min_passes and work >= budget:
            break
        cut = INF if best is None or i < n_anchor else best[0] - tol(best[0])
        _, _, score, w = eng.run(pol, cut=cut)
        passes += 1
        work += w
        if best is None or score < best[0] - tol(best[0]):
            best = (score, pol)
        if best[0] <= floor + tol(floor):  # no plan can do better
            return best, passes, work, True
    assert best is not None
    return best, passes, work, False


def _stage_uniform(costs: StageCosts) -> bool:
    return all(len(set(v)) <= 1 for v in (costs.f, costs.b, costs.w))


def _median(costs: StageCosts) -> StageCosts:
    """Every stage at the median cost (memory deltas kept per stage)."""
    p = costs.num_stages

    def med(v: tuple[float, ...]) -> tuple[float, ...]:
        return (statistics.median(v),) * p

    return replace(costs, f=med(costs.f), b=med(costs.b), w=med(costs.w))


@register(
    "zb-auto",
    uses_costs=True,
    chunks=(1,),
    memory_bound=lambda p, m: min(2 * p - 1, m),  # the default memory limit
    description="searched zero-bubble plan under a memory limit (default 2p-1 mb)",
)
def zb_auto(p: int, m: int, *, chunks: int = 1, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """Searched zero-bubble plan: smallest makespan found under ``mem_limit`` (default: 2p - 1 microbatches)."""
    if chunks != 1:
        raise ValueError(f"zb-auto plans one chunk per rank, got {chunks=}; use zb-v for two chunks")
    fused = _fused_candidate(p, m, costs, mem_limit)
    if fused is None:
        return search(p, m, costs, mem_limit).schedule
    try:
        plan = search(p, m, costs, mem_limit).schedule
    except ValueError:  # below one split microbatch: only the fused plan fits
        return fused
    span = simulate(plan, costs).makespan
    return fused if simulate(fused, costs).makespan < span - tol(span) else plan


def _fused_candidate(p: int, m: int, costs: StageCosts, mem_limit: float | None) -> Schedule | None:
    """With recomputation (a B transient) a split microbatch holds its W's recomputed GEMM operands until W, more
    than F keeps; under a limit near 1F1B's peak the fused plan (1F1B, every backward a BW) may be the only one that
    fits, or the faster one.  It is a candidate then, named zb-auto; without recomputation the search covers it."""
    if mem_limit is None or not any(costs.mem_b_transient):
        return None
    from zb_pipeline.schedule.generators.classic import one_f_one_b  # classic imports nothing of zb-auto's

    plan = one_f_one_b(p, m, costs=costs)
    if max(peak_memory(plan, costs)) > mem_limit * (1 + 1e-9):
        return None
    return replace(plan, name="zb-auto")
