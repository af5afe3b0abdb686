"""The cost simulator: when would each action of a plan start and end, given per-stage costs?

A compute-only discrete-event model.  Each rank runs its actions strictly in plan order; an action starts at the
later of (a) the end of the previous action on its rank and (b) the end of each of its dependencies, plus
``costs.comm`` when that dependency ran on another rank.  Dependencies (``S`` virtual stages):

- ``F(s, mb)`` needs ``F(s - 1, mb)`` (nothing on stage 0);
- ``B(s, mb)`` and ``BW(s, mb)`` need ``F(s, mb)`` and the input gradient from stage ``s + 1`` -- its ``B`` or
  ``BW`` -- or, on the last stage, ``F(S - 1, mb)`` (the loss);
- ``W(s, mb)`` needs ``B(s, mb)``.

Durations: ``F`` costs ``costs.f[s]``, ``B`` costs ``costs.b[s]``, ``W`` costs ``costs.w[s]``, ``BW`` costs
``b + w``.  An overlapped pair (``ir.PairAction``: an ``F`` and a ``BW`` run together) starts once the inputs of both
halves are there, costs ``StageCosts.pair`` (the sum of its parts by default; ``overlap * (f + b + w)``, but never
less than its longer half, with an overlap factor), and both of its outputs exist at its end.  Memory: a rank's
running sum of ``mem_f`` / ``mem_b`` / ``mem_w`` over its actions in order (``memory.peak_memory``).

The simulation is a single pass over the actions (each rank resumes only when the one action it waits for
ends), so it runs in O(number of actions): fast enough for search loops over p = 64, m = 512 plans.
Communication actions in ``schedule.ranks`` (if any) are skipped: their time is what ``costs.comm`` models.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, PlanAction, Schedule
from zb_pipeline.schedule.lowering import no_gc
from zb_pipeline.schedule.memory import check_costs_match, peak_memory

# Keys of "this happened" events: (stage * m + microbatch) * 3 + slot.
_SLOT_F = 0  # F(s, mb) ended
_SLOT_G = 1  # input gradient of (s, mb) ready: B or BW ended
_SLOT_W = 2  # W(s, mb) ended (or the W half of a BW)
# Enum members as plain constants: the loop compares kinds by identity (hashing a str Enum is slow).
_F, _B, _W, _BW, _PAIR = Kind.F, Kind.B, Kind.W, Kind.BW, Kind.PAIR


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One compute action with its simulated start and end time."""

    rank: int
    index: int  # position in the rank's plan (compute and comm actions counted as in ``schedule.ranks``)
    action: PlanAction
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


# One rank's run, kept compact until someone reads the timeline: the position in the rank's plan, the start and the
# end of each compute action it ran, in execution order (a p = 512, m = 2048 plan has 3 million of them; most callers
# read only the makespan and the bubble).
_RankTimes = tuple[array, array, array]


@dataclass(frozen=True)
class SimResult:
    """What the simulator reports for one plan under one set of costs."""

    schedule: Schedule
    rank_span: tuple[float, ...]  # end of last action - start of first, per rank
    makespan: float  # max rank_span
    bubble_rate: float  # 1 - max_rank(total compute) / makespan
    peak_memory: tuple[float, ...]  # per rank, under StageCosts' mem deltas
    rank_compute: tuple[float, ...] = ()  # total busy time per rank
    _times: tuple[_RankTimes, ...] = field(default=(), repr=False, hash=False)  # per rank (_RankTimes), by simulate
    _by_action: dict[PlanAction, TimedAction] = field(default_factory=dict, repr=False, compare=False)

    @property
    def timeline(self) -> tuple[tuple[TimedAction, ...], ...]:
        """Per rank, the timed compute actions in execution order (built on first use, then kept)."""
        got = self.__dict__.get("_timeline")
        if got is None:
            got = tuple(
                tuple(map(TimedAction, repeat(r, len(idx)), idx, map(acts.__getitem__, idx), starts, ends))
                for r, (acts, (idx, starts, ends)) in enumerate(zip(self.schedule.ranks, self._times))
            )
            self.__dict__["_timeline"] = got
        return got

    def timed(self, action: PlanAction) -> TimedAction:
        """The timed entry of ``action`` (a half of a pair: the pair's entry; the lookup table is built on first
        use)."""
        if not self._by_action:
            for tl in self.timeline:
                for ta in tl:
                    self._by_action[ta.action] = ta
                    if ta.action.kind is _PAIR:
                        self._by_action[ta.action.forward] = self._by_action[ta.action.backward] = ta
        try:
            return self._by_action[action]
        except KeyError:
            raise KeyError(f"action {action} is not in schedule {self.schedule.name!r}") from None

    def rank_times(self, rank: int) -> _RankTimes:
        """Rank ``rank``'s (plan position, start, end) of each compute action, in execution order, without building
        the timeline of every rank."""
        return self._times[rank]

    def start(self, action: PlanAction) -> float:
        return self.timed(action).start

    def end(self, action: PlanAction) -> float:
        return self.timed(action).end

    @property
    def end_time(self) -> float:
        """The time the last action of the whole plan ends (all ranks start their clocks at 0)."""
        return max((ends[-1] for _, _, ends in self._times if ends), default=0.0)


def _check_plan(schedule: Schedule) -> None:
    """Every compute action in range, on its stage's rank, and no work done twice (B and BW, W and BW); a pair's
    halves hold different microbatches."""
    S, m = schedule.num_stages, schedule.num_microbatches
    placement = schedule.stage_to_rank
    seen = bytearray(S * m * 3)
    for r, acts in enumerate(schedule.ranks):
        for i, step in enumerate(acts):
            if step.kind is _PAIR:
                if step.forward.microbatch == step.backward.microbatch:
                    raise ValueError(f"rank {r} position {i}: {step} pairs the F and the BW of one microbatch")
                todo: tuple[Action, ...] = (step.forward, step.backward)
            else:
                todo = (step,)
            for a in todo:
                k, s, mb = a.kind, a.stage, a.microbatch
                # The event slots this action produces: slot and slot2 (-1: none).
                if k is _F:
                    slot, slot2 = _SLOT_F, -1
                elif k is _B:
                    slot, slot2 = _SLOT_G, -1
                elif k is _W:
                    slot, slot2 = _SLOT_W, -1
                elif k is _BW:
                    slot, slot2 = _SLOT_G, _SLOT_W
                else:
                    continue
                if s >= S or mb >= m:
                    raise ValueError(
                        f"rank {r} position {i}: {a} is outside the plan (stages 0..{S - 1}, microbatches 0..{m - 1})"
                    )
                if placement[s] != r:
                    raise ValueError(f"rank {r} position {i}: {a} belongs to stage {s} on rank {placement[s]}")
                base = (s * m + mb) * 3
                if seen[base + slot] or (slot2 >= 0 and seen[base + slot2]):
                    what = ("F", "B", "W")[slot if seen[base + slot] else slot2]
                    raise ValueError(f"rank {r} position {i}: {a} repeats the {what} work of stage {s} microbatch {mb}")
                seen[base + slot] = 1
                if slot2 >= 0:
                    seen[base + slot2] = 1


def simulate(schedule: Schedule, costs: StageCosts, *, rank_start: Sequence[float] | None = None) -> SimResult:
    """Simulate ``schedule`` under ``costs``; raises ``ValueError`` if the plan is malformed or can never finish.

    ``rank_start[r]``: the earliest time rank ``r`` may start its first action (default: every rank at 0).
    """
    check_costs_match(schedule, costs)
    _check_plan(schedule)
    p = schedule.num_ranks
    if rank_start is not None and len(rank_start) != p:
        raise ValueError(f"rank_start has {len(rank_start)} entries, the plan has {p} ranks")
    clock = [0.0] * p if rank_start is None else [float(t) for t in rank_start]
    with no_gc():  # many small objects, none in a cycle: the collector's scans would cost more than the run
        times, busy = _run(schedule, costs, clock)
        peaks = peak_memory(schedule, costs)
    spans = [ends[-1] - starts[0] if ends else 0.0 for _, starts, ends in times]
    makespan = max(spans, default=0.0)
    bubble = 1.0 - max(busy) / makespan if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        rank_span=tuple(spans),
        makespan=makespan,
        bubble_rate=bubble,
        peak_memory=peaks,
        rank_compute=tuple(busy),
        _times=tuple(times),
    )


def _run(schedule: Schedule, costs: StageCosts, clock: list[float]) -> tuple[list[_RankTimes], list[float]]:
    """The event-driven pass: each rank runs until it waits for an event not yet produced, and resumes when it is.
    Returns per rank its times (``_RankTimes``) and its busy time; ``ValueError`` names what the stuck ranks wait
    for."""
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    comm = costs.comm
    f_cost, b_cost, w_cost = costs.f, costs.b, costs.w
    step = 3 * m  # key distance between neighbouring stages

    done_time = [-1.0] * (S * m * 3)  # event key -> end time (-1: not yet)
    # Every event is produced on its stage's rank (_check_plan), so whether a dependency crosses ranks is a fact of
    # the stages: of stage s - 1 (an F's input) and of stage s + 1 (a backward's gradient).
    owner = schedule.stage_to_rank
    cross_prev = [s > 0 and owner[s - 1] != owner[s] for s in range(S)]
    cross_next = [s < S - 1 and owner[s + 1] != owner[s] for s in range(S)]
    last = S - 1
    waiting: dict[int, list[int]] = {}  # event key -> ranks blocked on it
    blocked_on: list[int] = [-1] * p
    pos = [0] * p
    busy = [0.0] * p
    times: list[_RankTimes] = [(array("l"), array("d"), array("d")) for _ in range(p)]

    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        blocked_on[r] = -1
        acts = schedule.ranks[r]
        idx_r, starts_r, ends_r = times[r]
        put_i, put_s, put_e = idx_r.append, starts_r.append, ends_r.append
        i = pos[r]
        t_rank = clock[r]
        work = busy[r]
        n = len(acts)
        while i < n:
            a = acts[i]
            k = a.kind
            if k is _PAIR:
                fa, ba = a.forward, a.backward
                fbase, bbase = (fa.stage * m + fa.microbatch) * 3, (ba.stage * m + ba.microbatch) * 3
                deps = [fbase - step] if fa.stage > 0 else []
                deps.append(bbase)
                if ba.stage < S - 1:
                    deps.append(bbase + step + _SLOT_G)
                start = t_rank
                missing = next((d for d in deps if done_time[d] < 0), -1)
                if missing >= 0:
                    waiting.setdefault(missing, []).append(r)
                    blocked_on[r] = missing
                    break
                for d in deps:
                    t = done_time[d] + (comm if owner[d // step] != r else 0.0)
                    if t > start:
                        start = t
                dur = costs.pair(fa.stage, ba.stage)
                end = start + dur
                put_i(i)
                put_s(start)
                put_e(end)
                t_rank = end
                work += dur
                for key in (fbase + _SLOT_F, bbase + _SLOT_G, bbase + _SLOT_W):
                    done_time[key] = end
                    if key in waiting:
                        ready.extend(waiting.pop(key))
                i += 1
                continue
            s = a.stage
            base = (s * m + a.microbatch) * 3
            start = t_rank
            # Wait for the dependencies (``dep``: the event not produced yet), then produce ``key`` (and ``key2``).
            # The event of another stage adds ``comm`` if that stage lives on another rank.
            key2 = -1
            if k is _F:
                if s > 0:
                    t = done_time[base - step]
                    if t < 0:
                        dep = base - step
                        waiting.setdefault(dep, []).append(r)
                        blocked_on[r] = dep
                        break
                    if cross_prev[s]:
                        t += comm
                    if t > start:
                        start = t
                dur = f_cost[s]
                key = base
            elif k is _W:
                t = done_time[base + _SLOT_G]
                if t < 0:
                    dep = base + _SLOT_G
                    waiting.setdefault(dep, []).append(r)
                    blocked_on[r] = dep
                    break
                if t > start:
                    start = t
                dur = w_cost[s]
                key = base + _SLOT_W
            elif k is _B or k is _BW:
                t = done_time[base]  # own F
                if t < 0:
                    waiting.setdefault(base, []).append(r)
                    blocked_on[r] = base
                    break
                if t > start:
                    start = t
                if s < last:
                    t = done_time[base + step + _SLOT_G]
                    if t < 0:
                        dep = base + step + _SLOT_G
                        waiting.setdefault(dep, []).append(r)
                        blocked_on[r] = dep
                        break
                    if cross_next[s]:
                        t += comm
                    if t > start:
                        start = t
                key = base + _SLOT_G
                if k is _B:
                    dur = b_cost[s]
                else:
                    dur = b_cost[s] + w_cost[s]
                    key2 = base + _SLOT_W
            else:  # communication: modelled by costs.comm
                i += 1
                continue
            end = start + dur
            put_i(i)
            put_s(start)
            put_e(end)
            t_rank = end
            work += dur
            done_time[key] = end
            if waiting:
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
            if key2 >= 0:
                done_time[key2] = end
                if waiting:
                    woken = waiting.pop(key2, None)
                    if woken:
                        ready.extend(woken)
            i += 1
        pos[r] = i
        clock[r] = t_rank
        busy[r] = work

    if any(key >= 0 for key in blocked_on):
        raise _stuck_error(schedule, pos, blocked_on)
    return times, busy


def _stuck_error(schedule: Schedule, pos: list[int], blocked_on: list[int]) -> ValueError:
    parts = []
    for r, key in enumerate(blocked_on):
        if key >= 0:
            a = schedule.ranks[r][pos[r]]
            parts.append(f"rank {r} waits at position {pos[r]} ({a}) for {_describe(key, schedule.num_microbatches)}")
    return ValueError("plan can never finish: " + "; ".join(parts))


def _describe(key: int, m: int) -> str:
    """Name the event a blocked rank waits for, the way a reader of the plan thinks of it."""
    sm, slot = divmod(key, 3)
    s, mb = divmod(sm, m)
    if slot == _SLOT_F:
        return f"{s}F{mb}"
    if slot == _SLOT_G:
        return f"{s}B{mb} (or {s}BW{mb})"
    return f"{s}W{mb}"
