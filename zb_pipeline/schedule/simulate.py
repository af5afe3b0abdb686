"""The cost simulator: when would each action of a plan start and end, given per-stage costs?

A compute-only discrete-event model.  Each rank runs its actions strictly in plan order; an action starts at the
later of (a) the end of the previous action on its rank and (b) the end of each of its dependencies, plus
``costs.comm`` when that dependency ran on another rank.  Dependencies (``S`` virtual stages):

- ``F(s, mb)`` needs ``F(s - 1, mb)`` (nothing on stage 0);
- ``B(s, mb)`` and ``BW(s, mb)`` need ``F(s, mb)`` and the input gradient from stage ``s + 1`` -- its ``B`` or
  ``BW`` -- or, on the last stage, ``F(S - 1, mb)`` (the loss);
- ``W(s, mb)`` needs ``B(s, mb)``.

Durations: ``F`` costs ``costs.f[s]``, ``B`` costs ``costs.b[s]``, ``W`` costs ``costs.w[s]``, ``BW`` costs
``b + w``.  Memory: a rank's running sum of ``mem_f`` / ``mem_b`` / ``mem_w`` over its actions in order.

The simulation is a single pass over the actions (each rank resumes only when the one action it waits for
ends), so it runs in O(number of actions): fast enough for search loops over p = 64, m = 512 plans.
Communication actions in ``schedule.ranks`` (if any) are skipped: their time is what ``costs.comm`` models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule

# Keys of "this happened" events: (stage * m + microbatch) * 3 + slot.
_SLOT_F = 0  # F(s, mb) ended
_SLOT_G = 1  # input gradient of (s, mb) ready: B or BW ended
_SLOT_W = 2  # W(s, mb) ended (or the W half of a BW)
_SLOTS_OF = {Kind.F: (_SLOT_F,), Kind.B: (_SLOT_G,), Kind.W: (_SLOT_W,), Kind.BW: (_SLOT_G, _SLOT_W)}


@dataclass(frozen=True)
class TimedAction:
    """One compute action with its simulated start and end time."""

    rank: int
    index: int  # position in the rank's plan (compute and comm actions counted as in ``schedule.ranks``)
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class SimResult:
    """What the simulator reports for one plan under one set of costs."""

    schedule: Schedule
    timeline: tuple[tuple[TimedAction, ...], ...]  # per rank, in execution order (compute actions only)
    rank_span: tuple[float, ...]  # end of last action - start of first, per rank
    makespan: float  # max rank_span
    bubble_rate: float  # 1 - max_rank(total compute) / makespan
    peak_memory: tuple[float, ...]  # per rank, under StageCosts' mem deltas
    rank_compute: tuple[float, ...] = ()  # total busy time per rank
    _by_action: dict[Action, TimedAction] = field(default_factory=dict, repr=False, compare=False)

    def timed(self, action: Action) -> TimedAction:
        try:
            return self._by_action[action]
        except KeyError:
            raise KeyError(f"action {action} is not in schedule {self.schedule.name!r}") from None

    def start(self, action: Action) -> float:
        return self.timed(action).start

    def end(self, action: Action) -> float:
        return self.timed(action).end

    @property
    def end_time(self) -> float:
        """The time the last action of the whole plan ends (all ranks start their clocks at 0)."""
        return max((tl[-1].end for tl in self.timeline if tl), default=0.0)


def _duration(action: Action, costs: StageCosts) -> float:
    s = action.stage
    k = action.kind
    if k is Kind.F:
        return costs.f[s]
    if k is Kind.B:
        return costs.b[s]
    if k is Kind.W:
        return costs.w[s]
    return costs.b[s] + costs.w[s]  # BW


def _mem_delta(action: Action, costs: StageCosts) -> float:
    s = action.stage
    k = action.kind
    if k is Kind.F:
        return costs.mem_f[s]
    if k is Kind.B:
        return costs.mem_b[s]
    if k is Kind.W:
        return costs.mem_w[s]
    return costs.mem_b[s] + costs.mem_w[s]  # BW


def rank_peak_memory(schedule: Schedule, costs: StageCosts) -> tuple[float, ...]:
    """Each rank's peak of the running sum of memory deltas over its compute actions (0 if it never rises)."""
    _check_costs(schedule, costs)
    peaks = []
    for acts in schedule.ranks:
        cur = peak = 0.0
        for a in acts:
            if a.kind.is_compute:
                cur += _mem_delta(a, costs)
                if cur > peak:
                    peak = cur
        peaks.append(peak)
    return tuple(peaks)


def _check_costs(schedule: Schedule, costs: StageCosts) -> None:
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"costs are given for {costs.num_stages} virtual stages, but schedule {schedule.name!r} has "
            f"{schedule.num_stages}"
        )


def simulate(schedule: Schedule, costs: StageCosts) -> SimResult:
    """Simulate ``schedule`` under ``costs``; raises ``ValueError`` if the plan is malformed or can never finish."""
    _check_costs(schedule, costs)
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    placement = schedule.stage_to_rank
    comm = costs.comm

    # Static checks that keep the event loop simple: every action in range, on its stage's rank, at most once.
    seen: dict[tuple[int, int, int], tuple[int, int, Action]] = {}  # (stage, mb, slot) -> (rank, position, action)
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                continue
            if a.stage >= S or a.microbatch >= m:
                raise ValueError(
                    f"rank {r} position {i}: {a} is outside the plan (stages 0..{S - 1}, microbatches 0..{m - 1})"
                )
            if placement[a.stage] != r:
                raise ValueError(f"rank {r} position {i}: {a} belongs to stage {a.stage} on rank {placement[a.stage]}")
            for slot in _SLOTS_OF[a.kind]:
                key = (a.stage, a.microbatch, slot)
                if key in seen:
                    r0, i0, a0 = seen[key]
                    raise ValueError(f"rank {r} position {i}: {a} repeats work of {a0} at rank {r0} position {i0}")
                seen[key] = (r, i, a)

    done_time: dict[int, float] = {}  # event key -> end time
    done_rank: dict[int, int] = {}  # event key -> rank that produced it
    waiting: dict[int, list[int]] = {}  # event key -> ranks blocked on it
    blocked_on: list[int | None] = [None] * p
    pos = [0] * p
    clock = [0.0] * p
    timelines: list[list[TimedAction]] = [[] for _ in range(p)]
    by_action: dict[Action, TimedAction] = {}

    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        blocked_on[r] = None
        acts = schedule.ranks[r]
        i = pos[r]
        t_rank = clock[r]
        n = len(acts)
        while i < n:
            a = acts[i]
            kind = a.kind
            if not kind.is_compute:
                i += 1
                continue
            s, mb = a.stage, a.microbatch
            base = (s * m + mb) * 3
            # The dependencies of this action, as event keys.
            if kind is Kind.F:
                deps: tuple[int, ...] = (base - 3 * m + _SLOT_F,) if s > 0 else ()
            elif kind is Kind.W:
                deps = (base + _SLOT_G,)
            else:  # B or BW
                upstream = base + 3 * m + _SLOT_G if s < S - 1 else base + _SLOT_F
                deps = (base + _SLOT_F, upstream) if s < S - 1 else (base + _SLOT_F,)
            start = t_rank
            missing = None
            for key in deps:
                t = done_time.get(key)
                if t is None:
                    missing = key
                    break
                if done_rank[key] != r:
                    t += comm
                if t > start:
                    start = t
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                blocked_on[r] = missing
                break
            end = start + _duration(a, costs)
            ta = TimedAction(r, i, a, start, end)
            timelines[r].append(ta)
            by_action[a] = ta
            t_rank = end
            if kind is Kind.F:
                produced: tuple[int, ...] = (base + _SLOT_F,)
            elif kind is Kind.B:
                produced = (base + _SLOT_G,)
            elif kind is Kind.W:
                produced = (base + _SLOT_W,)
            else:
                produced = (base + _SLOT_G, base + _SLOT_W)
            for key in produced:
                done_time[key] = end
                done_rank[key] = r
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
            i += 1
        pos[r] = i
        clock[r] = t_rank

    stuck = [r for r in range(p) if blocked_on[r] is not None]
    if stuck:
        parts = []
        for r in stuck:
            a = schedule.ranks[r][pos[r]]
            parts.append(f"rank {r} waits at position {pos[r]} ({a}) for {_describe(blocked_on[r], m)}")
        raise ValueError("plan can never finish: " + "; ".join(parts))

    spans, busy = [], []
    for tl in timelines:
        spans.append(tl[-1].end - tl[0].start if tl else 0.0)
        busy.append(sum(ta.end - ta.start for ta in tl))
    makespan = max(spans, default=0.0)
    bubble = 1.0 - max(busy) / makespan if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        timeline=tuple(tuple(tl) for tl in timelines),
        rank_span=tuple(spans),
        makespan=makespan,
        bubble_rate=bubble,
        peak_memory=rank_peak_memory(schedule, costs),
        rank_compute=tuple(busy),
        _by_action=by_action,
    )


def _describe(key: int | None, m: int) -> str:
    """Name the event a blocked rank waits for, the way a reader of the plan thinks of it."""
    assert key is not None
    sm, slot = divmod(key, 3)
    s, mb = divmod(sm, m)
    if slot == _SLOT_F:
        return f"{s}F{mb}"
    if slot == _SLOT_G:
        return f"{s}B{mb} (or {s}BW{mb})"
    return f"{s}W{mb}"
