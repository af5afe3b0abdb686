"""V-shaped zero-bubble schedules: ``zb-v``, ``v-half`` and ``v-min`` (two chunks per rank, V placement).

Placement: with ``p`` ranks there are ``S = 2p`` virtual stages; chunk 0 (stages ``0..p-1``) goes down the ranks and
chunk 1 (stages ``p..2p-1``) comes back up, so rank ``r`` holds stages ``r`` and ``2p-1-r``.  The hand-off between
the two chunks on rank ``p-1`` (forward) and the loss on rank 0 (stage ``2p-1``, whose backward starts where its
forward ended) are local: no communication.

Memory caps are the papers' (zero-bubble paper for ZB-V; "Pipeline Parallelism with Controllable Memory" for V-Half
and V-Min), in microbatches of a rank's whole-share activation ``M_r = mem_f[r] + mem_f[2p-1-r]``
(``cap_units`` counts half-units, one chunk's forward, so ``cap_units / 2 x M_r``; never below one microbatch's
footprint on the rank):

- ``zb-v``:   ``p``               (1F1B's activation memory);
- ``v-half``: ``floor((p + 2) / 2)`` (about half of 1F1B's);
- ``v-min``:  ``floor((p + 4) / 3)`` (about a third).

How a plan is built.  Candidates are made from the *real* per-virtual-stage costs (``StageCosts``: T_F, T_B, T_W
per stage and T_comm on every hand-off between ranks), each is timed by the simulator, and the shortest makespan
within the caps is kept (ties: the first):

1. *The papers' warm-up and alternating steady state* (``v_shape_alternate``): chunk-0 forwards fill each rank's
   wait for the first chunk-1 forward (room kept for the chunk-1 forwards that come before the first backward),
   then one backward and one forward in turn, W in the waits.  This is what reaches ZB-V's (near) zero bubble.  A
   few knob settings (``_ALT_KNOBS``) are tried.
2. *The building block repeated and squeezed* (``v_shape_block``): one microbatch's F/B offsets derived from the
   costs and T_comm by modulo scheduling, repeated at the shortest period whose memory fits the cap, squeezed by an
   event-driven pass with W's in the waits.  This is what V-Half and V-Min are made of.
3. *Today's candidates*, kept: the memory-capped list scheduler (``v_shape_list``) and the modulo template with W's
   (``v_shape_template``), and for small plans the order polish (``order_polish``).  Under the previous, tighter
   caps (``_legacy_cap_units``) they are exactly the plans of the earlier version, so no plan gets longer than it
   was (on plans of at most ``_LEGACY_MAX_ACTIONS`` compute actions, where they run); the template also runs under
   the new caps.
4. *The best of these with the tail of rank 0 re-ordered* (``first_stage_tail``): after rank 0's last F and last
   B of stage 2p-1 nothing it runs feeds another rank, so W's may fill its waits for the stage-0 B's even where they
   overrun them; kept where that is strictly shorter (one W at the end of the zero-bubble paper's p = 16 rows).
5. *zb-v: the tip's hold at its last forward* (``tip_hold``): the tip (rank p-1) at its cap runs two B's before
   its last forward and three W's after it where the gradients can be back in time (the rank that feeds it runs
   those B's a slot earlier); kept where that is strictly shorter (3W - 2B per chunk at the paper's rows).

Large plans: knob settings and block variants are first compared on a shortened plan (``_PROBE_M``
microbatches; warm-up and cool-down do not depend on m beyond that), then only the best few are run at full length.

Hand-offs: lowering posts every receive when its data is produced, i.e. in the sender's order, so a rank may
consume its peers' hand-offs in any order; ``check_and_lower`` checks the strict one-order-per-pair model on the result.

A ``mem_limit`` lowers the cap to the limit minus the rank's largest B transient (recomputation: what a B holds
while it rebuilds a unit), so the predicted peak stays within the limit; one below a single microbatch's footprint
plus that transient is rejected with the smallest limit that works.  Measured results (the issue's table, the
uniform-cost bound, generation times) are in docs/schedules.md.
"""

from __future__ import annotations

from collections.abc import Callable

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.first_stage_tail import tail_candidate
from zb_pipeline.schedule.generators.order_polish import polish_orders
from zb_pipeline.schedule.generators.tip_hold import tip_hold
from zb_pipeline.schedule.generators.v_shape_alternate import AltKnobs, alternate_codes
from zb_pipeline.schedule.generators.v_shape_block import block_codes
from zb_pipeline.schedule.generators.v_shape_codes import Codes, makespan, resolve_backend, to_codes, to_schedule
from zb_pipeline.schedule.generators.v_shape_list import LIST_POLICIES, plan_list_schedule
from zb_pipeline.schedule.generators.v_shape_template import template_plans
from zb_pipeline.schedule.ir import Action, Schedule, v_placement
from zb_pipeline.schedule.registry import register
from zb_pipeline.schedule.simulate import simulate

_EPS = 1e-9
V_NAMES = ("zb-v", "v-half", "v-min")


def cap_units(name: str, p: int) -> int:
    """Memory cap of V schedule ``name`` for ``p`` ranks, in half-units (``M_r / 2``: one chunk's forward).

    ``zb-v``: ``2p`` (= p x M_r).  ``v-half``: ``2 floor((p + 2) / 2)``.  ``v-min``: ``2 floor((p + 4) / 3)``.
    Never below 2 (one microbatch through both chunks) nor above ``2p``.
    """
    if name == "zb-v":
        whole = p
    elif name == "v-half":
        whole = (p + 2) // 2
    elif name == "v-min":
        whole = (p + 4) // 3
    else:
        raise ValueError(f"unknown V schedule {name!r}; known: {', '.join(V_NAMES)}")
    return max(2, min(2 * whole, 2 * p))


def _legacy_cap_units(name: str, p: int) -> int:
    """The caps of the earlier version (half-units): zb-v 2p, v-half p + 1, v-min ceil(2p / 3) + 1; its plans are
    kept as candidates under them."""
    units = {"zb-v": 2 * p, "v-half": p + 1, "v-min": -(-2 * p // 3) + 1}[name]
    return max(2, min(units, 2 * p))


# Knob settings of the alternating scheduler, most often best first (measured on the table, uniform and
# heterogeneous costs).
_ALT_KNOBS: tuple[AltKnobs, ...] = (
    AltKnobs("2r+1", 0.5, 0, True),
    AltKnobs("2r+1", 1.0, 0, True),
    AltKnobs("2r+1", 0.0, 0, False),
    AltKnobs("2r+1", 0.5, 0, False),
    AltKnobs("2r+2", 0.5, 1, True),
    AltKnobs("2r", 0.25, 2, False),
)
# Plans with at most this many compute actions get the best candidate polished by local search (``order_polish``).
_POLISH_MAX_ACTIONS = 240
_POLISH_WORK = 300_000  # actions timed in all, summed over the candidate orders tried (about 0.5 s)
# The earlier version's list scheduler runs up to this many compute actions (its cost grows with p x actions).
_LEGACY_MAX_ACTIONS = 6144
# Beyond this many compute actions the knob settings are compared on a plan of _PROBE_M(p) microbatches first.
_PROBE_ABOVE = 12_000
_PROBE_KEEP = 2  # settings run at full length after the probe


def _probe_m(p: int) -> int:
    return 3 * p


def rank_caps(
    name: str, p: int, costs: StageCosts, mem_limit: float | None, *, units: int | None = None
) -> list[float]:
    """Per-rank cap on the resident memory of V schedule ``name`` (in the units of the mem deltas), ``mem_limit``
    applied; ``units`` overrides ``cap_units(name, p)``.  A B that recomputes holds its stage's
    ``mem_b_transient`` above the resident sum while it runs, so under ``mem_limit`` the cap is the limit minus the
    rank's largest transient (as zb-auto's): the peak, transient included (``memory.running_memory``), fits the
    limit.  Without a limit the cap is the paper's, in microbatches of the activation measured with the
    recomputation in force, so it keeps its ratio to 1F1B with the same recomputation."""
    S = 2 * p
    place = v_placement(p, 2)
    units = cap_units(name, p) if units is None else units
    mems = (costs.mem_f, costs.mem_b, costs.mem_w)

    def need_of(q: int) -> tuple[float, float]:
        """(one microbatch through both chunks of rank q, the largest B transient of its stages)."""
        stages = [s for s in range(S) if place[s] == q]
        return sum(max(0.0, d[s]) for s in stages for d in mems), max(costs.mem_b_transient[s] for s in stages)

    caps = []
    for r in range(p):
        whole = sum(costs.mem_f[s] for s in range(S) if place[s] == r)
        need, transient = need_of(r)
        cap = max(units * whole / 2.0, need)
        if mem_limit is not None:
            if mem_limit + _EPS < need + transient:
                smallest = max(sum(need_of(q)) for q in range(p))
                held = f"{need:g}" + (f" plus a B's recompute transient {transient:g}" if transient else "")
                raise ValueError(
                    f"mem_limit={mem_limit:g} is below what {name} needs on rank {r} (one microbatch through both "
                    f"chunks: {held}); the smallest limit that works is {smallest:g}"
                )
            cap = min(cap, mem_limit - transient)
        caps.append(cap)
    return caps


def peak_caps(p: int, costs: StageCosts, caps: list[float]) -> list[float]:
    """Caps on the peak *with* the B transient (what ``memory.order_peak`` counts, used by the template and the
    polish) from caps on the resident memory (what the list, alternating and block passes count): each rank's cap
    plus its largest transient, the limit again under ``mem_limit``."""
    place = v_placement(p, 2)
    t = costs.mem_b_transient
    return [cap + max(t[s] for s in range(2 * p) if place[s] == r) for r, cap in enumerate(caps)]


def _timed(name: str, p: int, m: int, costs: StageCosts, ranks: list[list[Action]]) -> tuple[float, Schedule]:
    sched = Schedule(name, p, 2 * p, m, v_placement(p, 2), ranks)
    return simulate(sched, costs).makespan, sched


def _legacy_variants(name: str, p: int, m: int, costs: StageCosts, caps: list[float]) -> list[tuple[float, Schedule]]:
    """The earlier version's candidates and polish, exactly (under the caps it is given)."""
    place = v_placement(p, 2)
    out = []
    for policy in LIST_POLICIES:
        ranks = plan_list_schedule(place, m, costs, caps, policy)
        if ranks is not None:
            out.append(_timed(name, p, m, costs, ranks))
    for ranks in template_plans(p, m, costs, peak_caps(p, costs, caps)):
        out.append(_timed(name, p, m, costs, ranks))
    if name != "zb-v" and 6 * p * m <= _POLISH_MAX_ACTIONS:
        best = min(out, key=lambda c: c[0])[1]
        polished = polish_orders(best, costs, peak_caps(p, costs, caps), budget=_POLISH_WORK // (6 * p * m))
        out.append((simulate(polished, costs).makespan, polished))
    return out


def _new_codes(
    name: str, p: int, m: int, costs: StageCosts, caps: list[float], backend: str, only: set[int] | None = None
) -> list[tuple[int, Codes]]:
    """(index, plan) of every alternating-pass knob setting and block variant that finishes (``only``: those
    indices).  zb-v's cap leaves the block nothing to add to the alternating pass (measured on the issue's table
    and the regression grid), so only V-Half and V-Min search it."""
    out = []
    for i, knobs in enumerate(_ALT_KNOBS):
        if only is None or i in only:
            codes = alternate_codes(p, m, costs, caps, knobs, backend)
            if codes is not None:
                out.append((i, codes))
    if name != "zb-v" and (only is None or any(i >= len(_ALT_KNOBS) for i in only)):
        for j, codes in enumerate(block_codes(p, m, costs, caps, backend)):
            if only is None or len(_ALT_KNOBS) + j in only:
                out.append((len(_ALT_KNOBS) + j, codes))
    return out


def _first_best(cands: list[tuple[float, Callable[[], Schedule]]]) -> tuple[float, Callable[[], Schedule]]:
    """The candidate with the shortest makespan (ties: the first)."""
    best = cands[0]  # the block's squeeze and the template always finish
    for cand in cands[1:]:
        if cand[0] < best[0] - _EPS:
            best = cand
    return best


def _candidates(
    name: str, p: int, m: int, costs: StageCosts, caps: list[float], backend: str
) -> list[tuple[float, Callable[[], Schedule]]]:
    """(makespan, build the Schedule) of every candidate, in tie-break order (see the module docstring)."""
    out: list[tuple[float, Callable[[], Schedule]]] = []

    def add_codes(codes: Codes) -> None:
        out.append((makespan(p, m, costs, codes, backend), lambda: to_schedule(name, p, m, codes)))

    def add_plan(span: float, sched: Schedule) -> None:
        out.append((span, lambda: sched))

    n = 6 * p * m
    if backend == "cpp" or n <= _PROBE_ABOVE or _probe_m(p) >= m:
        for _, codes in _new_codes(name, p, m, costs, caps, backend):
            add_codes(codes)
    else:  # the Python passes: compare the settings on a shorter plan, run the best few at full length
        pm = _probe_m(p)
        scored = sorted(
            (makespan(p, pm, costs, c, backend), i) for i, c in _new_codes(name, p, pm, costs, caps, backend)
        )
        for _, codes in _new_codes(name, p, m, costs, caps, backend, {i for _, i in scored[:_PROBE_KEEP]}):
            add_codes(codes)
    small = n <= _LEGACY_MAX_ACTIONS
    if small:  # the earlier caps, lowered to ``caps`` where these are lower (a memory limit)
        legacy = rank_caps(name, p, costs, None, units=_legacy_cap_units(name, p))
        for span, sched in _legacy_variants(name, p, m, costs, [min(a, b) for a, b in zip(caps, legacy)]):
            add_plan(span, sched)
    if small and name != "zb-v":  # the earlier template under the new caps (beyond: the block search does better)
        for ranks in template_plans(p, m, costs, peak_caps(p, costs, caps)):
            add_codes(to_codes(ranks, m))
    if name != "zb-v" and n <= _POLISH_MAX_ACTIONS:
        best = min(out, key=lambda c: c[0])[1]()
        polished = polish_orders(best, costs, peak_caps(p, costs, caps), budget=_POLISH_WORK // n)
        add_plan(simulate(polished, costs).makespan, polished)
    # The best plan with the tail of stage 0's rank (rank 0) re-ordered, where that is strictly shorter.
    best_span, best = _first_best(out)
    best = best()
    tailed = tail_candidate(name, p, m, costs, best, peak_caps(p, costs, caps)[0], backend)
    if tailed is not None:
        add_plan(*tailed)
        best_span, best = tailed
    # Then the tip's hold at its last forward re-planned (zb-v: the tip at its cap; the Python reference only where
    # the other passes run at full length), where that is strictly shorter.
    if name == "zb-v" and (backend == "cpp" or n <= _PROBE_ABOVE):
        held = tip_hold(p, m, costs, to_codes(best.ranks, m), best_span, peak_caps(p, costs, caps), backend)
        if held is not None:
            span, codes = held
            out.append((span, lambda: to_schedule(name, p, m, codes)))
    return out


def plan_variants(
    name: str, p: int, m: int, costs: StageCosts, caps: list[float], *, backend: str | None = None
) -> list[tuple[float, Schedule]]:
    """Every candidate plan with its simulated makespan under ``costs``, each within ``caps`` (see the module
    docstring; the earlier version's candidates run under its own caps lowered to ``caps``)."""
    return [(span, build()) for span, build in _candidates(name, p, m, costs, caps, resolve_backend(backend))]


def plan_v(
    name: str, p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None, backend: str | None = None
) -> Schedule:
    """Shared entry point of the three V schedules (``backend``: ``"cpp"``, ``"python"`` or ``None`` for the
    compiled passes when built)."""
    if chunks != 2:
        raise ValueError(f"{name} uses V placement with exactly 2 chunks per rank, got chunks={chunks}")
    if costs.num_stages != 2 * p:
        raise ValueError(f"{name}: costs are given for {costs.num_stages} virtual stages, expected 2p={2 * p}")
    for s in range(2 * p):
        if costs.mem_f[s] < 0:
            raise ValueError(f"{name}: mem_f of stage {s} is {costs.mem_f[s]}; forward memory must be >= 0")
    caps = rank_caps(name, p, costs, mem_limit)
    return _first_best(_candidates(name, p, m, costs, caps, resolve_backend(backend)))[1]()


# What the three V schedules register alike: each fixes its own memory bound, so no memory limit applies.
_V_SPEC = dict(chunks=(2,), placement="v", uses_costs=True, takes_mem_limit=False)
# Action limit (limits.py) of V-Half and V-Min: their block search costs 20-30 us of CPU per action (p = 128,
# m = 512 and 1024), so a million actions take about 20 s.  ZB-V's alternating pass (~4 us per action) keeps the
# global limit.
_V_HALF_MIN_MAX_ACTIONS = 1_000_000


@register(
    "zb-v",
    **_V_SPEC,
    memory_bound=lambda p, m: min(p, m),
    description="ZB-V: V placement, split B/W, 1F1B memory (p x M)",
)
def zb_v(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """ZB-V: peak memory at most p x the rank's whole-share mem_f; about zero bubble once m >= 2p."""
    return plan_v("zb-v", p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)


@register(
    "v-half",
    **_V_SPEC,
    max_actions=_V_HALF_MIN_MAX_ACTIONS,
    memory_bound=lambda p, m: (p + 2) // 2,
    description="V-Half: V placement, about half of 1F1B's memory (floor((p+2)/2) x M)",
)
def v_half(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """V-Half: peak memory at most floor((p + 2) / 2) x the rank's whole-share mem_f."""
    return plan_v("v-half", p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)


@register(
    "v-min",
    **_V_SPEC,
    max_actions=_V_HALF_MIN_MAX_ACTIONS,
    memory_bound=lambda p, m: (p + 4) // 3,
    description="V-Min: V placement, about a third of 1F1B's memory (floor((p+4)/3) x M)",
)
def v_min(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """V-Min: peak memory at most floor((p + 4) / 3) x the rank's whole-share mem_f."""
    return plan_v("v-min", p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)
