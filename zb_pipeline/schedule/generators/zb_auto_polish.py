"""zb-auto's local improvement of the best variant: first its per-rank knobs, then the plan's order itself.

``improve_knobs`` moves one knob (warm, ahead, lag) of one rank by one while that shortens the makespan; on small
shapes (``POLISH_MAX_ACTIONS``) ``polish`` then swaps neighbouring actions of the plan.  Both spend a budget of
simulated actions and keep a change only when it is strictly better.
"""

from __future__ import annotations

from dataclasses import replace

from zb_pipeline.schedule.generators.zb_auto_family import variant
from zb_pipeline.schedule.generators.zb_auto_passes import EPS, Engine, Policy, tol

# Polish only plans of at most this many actions (3pm): each trial is a full simulation.
POLISH_MAX_ACTIONS = 1536

# Sweeps of the local search on knobs (each sweep tries up to 6p moves).
_SWEEPS = 3


def improve_knobs(eng: Engine, best: tuple[float, Policy], budget: float) -> tuple[tuple[float, Policy], int, int]:
    """Local search on the best variant's per-rank knobs: warm-up budget, ``ahead`` and ``lag``, one step at a time.

    A move changes one knob of one rank by one; a move that shortens the makespan is kept at once (and the next
    move tried from there).  Sweeps over ranks from the last to the first repeat while they find something, at most
    ``_SWEEPS`` times, within ``budget`` simulated actions (trial passes are cut by the best makespan, so moves that
    cannot win stop early).  The warm-up budget starts at what the plan actually used before its first B (a budget
    above it changes nothing).  Returns ((makespan, policy), passes, actions simulated).
    """
    span, pol = best
    plans, _, _, _ = eng.run(pol, want_plan=True)
    assert plans is not None
    m = eng.m
    p = len(plans)
    knobs = {"warm": _warm_used(plans, m), "ahead": [min(a, m) for a in pol.ahead], "lag": [min(x, m) for x in pol.lag]}
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
                        trial = variant(trial.warm, trial.ahead, trial.lag, 0.0, False, False, trial.label, True)
                    _, _, t_span, w = eng.run(trial, cut=span - tol(span))
                    passes += 1
                    work += w
                    if t_span < span - tol(span):
                        span, pol, found = t_span, trial, True
                    else:
                        v[r] -= delta
        if not found:
            break
    return (span, pol), passes, work


def _warm_used(plans: list[list[int]], m: int) -> list[int]:
    """Per rank: the forwards the plan ran before its first B (at least 1)."""
    used = []
    for codes in plans:
        n = 0
        for code in codes:
            if code >= m:
                break
            n += 1
        used.append(max(1, n))
    return used


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
                if ka == kb or ja == jb or mem + deltas[kb][r] > cap + EPS or work + size > budget:
                    mem += deltas[ka][r]
                    continue
                plan[i], plan[i + 1] = b, a
                work += size
                try:
                    trial = eng.spans(plans)
                except ValueError:  # the swap deadlocks
                    trial = None
                if trial is not None and (
                    max(trial) < key[0] - tol(key[0])
                    or (max(trial) <= key[0] + tol(key[0]) and sum(trial) < key[1] - tol(key[1]))
                ):
                    key, improved = (min(max(trial), key[0]), sum(trial)), True
                    mem += deltas[kb][r]
                else:
                    plan[i], plan[i + 1] = a, b
                    mem += deltas[ka][r]
    return plans, key[0], work
