"""The validator: is a plan complete, dependency-valid, deadlock-free under strict P2P, and within memory?

``validate(schedule)`` runs, in order, and stops at the first problem:

1. *Structure*: compute actions only, stages and microbatches in range, every action on the rank that owns its
   stage, nothing twice; then *counts*: every (stage, microbatch) has exactly one F and either one B and one W or
   one BW.
2. *Dependencies within a rank*, by position: F of ``s`` after F of ``s - 1``; B after its own F and after the B
   (or BW) of ``s + 1`` (after its own F on the last stage); W after its B.
3. *Dependencies across ranks*: the plan is run once (``lowering.event_order``); if some ranks wait on each other
   forever, the cycle is reported.
4. *Lowering* (``lowering.lower``) and ``validate_lowered`` on the result: every hand-off that crosses ranks has
   exactly one send and one receive with the right peers, a send after its producer and a receive before its
   consumer; between every pair of ranks the k-th send and the k-th receive are the same transfer; and the strict
   model (no buffering, batches posted as a unit, see ``lowering``) finishes without deadlock.
5. *Memory*: each rank's peak of the running sum of memory deltas (``peak_memory``) against ``mem_limit``.

A failure raises ``ScheduleError``: ``str(err)`` is one line (rank, position, action, reason), ``err.grid`` is
the rank x step grid with the failing step in ``[brackets]``.  Everything is O(number of actions).
"""

from __future__ import annotations

from collections.abc import Sequence

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule
from zb_pipeline.schedule.lowering import (
    SLOT_F,
    SLOT_G,
    CommBatch,
    LoweredSchedule,
    action_deps,
    event_order,
    lower,
)

# The receive that matches each send kind, and how the stage changes from sender to receiver.
_MATCHING_RECV = {Kind.SEND_F: (Kind.RECV_F, +1), Kind.SEND_B: (Kind.RECV_B, -1)}
_MAX_STUCK_LISTED = 4


class ScheduleError(ValueError):
    """A plan is invalid.  ``str()`` is one line; ``grid`` shows the plan with the failing step marked."""

    def __init__(self, message: str, *, rank: int | None = None, index: int | None = None, grid: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.grid = grid


# ----------------------------------------------------------------------------------------------------- grid


_COLORS = {Kind.F: "34", Kind.B: "32", Kind.W: "33", Kind.BW: "36"}


def _cell(step: Action | CommBatch) -> str:
    return str(step)


def _color_of(step: Action | CommBatch) -> str:
    if isinstance(step, CommBatch) or step.kind.is_comm:
        return "90"
    return _COLORS[step.kind]


def render_grid(
    plan: Schedule | LoweredSchedule, *, mark: tuple[int, int | None] | None = None, color: bool = False
) -> str:
    """The rank x step grid of a plan, columns aligned; ``mark=(rank, index)`` puts that step in ``[brackets]``.

    With ``index=None`` the rank's label is marked instead.  ``color=True`` adds ANSI colours per kind (the mark in
    red).  Batches of a lowered plan print as ``{op,op}``.
    """
    lowered = isinstance(plan, LoweredSchedule)
    sched = plan.schedule if lowered else plan
    rows: list[list[Action | CommBatch]] = [list(r) for r in plan.ranks]
    cells = [[_cell(step) for step in row] for row in rows]
    mr, mi = mark if mark is not None else (None, None)
    if mr is not None and mi is not None and 0 <= mr < len(cells) and 0 <= mi < len(cells[mr]):
        cells[mr][mi] = f"[{cells[mr][mi]}]"
    ncols = max((len(row) for row in cells), default=0)
    widths = [0] * ncols
    for row in cells:
        for j, c in enumerate(row):
            if len(c) > widths[j]:
                widths[j] = len(c)
    label_w = len(str(len(cells) - 1))
    kind = "lowered, steps" if lowered else "positions"
    lines = [
        f"{sched.name}: p={sched.num_ranks} S={sched.num_stages} m={sched.num_microbatches} "
        f"({sched.placement}; {kind} from 0)"
    ]
    for r, row in enumerate(cells):
        parts = []
        for j, c in enumerate(row):
            text = c.ljust(widths[j])
            if color:
                code = "1;41" if (r == mr and j == mi) else _color_of(rows[r][j])
                text = f"\x1b[{code}m{c}\x1b[0m" + " " * (widths[j] - len(c))
            parts.append(text)
        flag = "*" if (r == mr and mi is None) else " "
        lines.append(f"{flag}rank {r:>{label_w}}: " + " ".join(parts).rstrip())
    return "\n".join(lines)


def _fail(plan: Schedule | LoweredSchedule, message: str, rank: int | None = None, index: int | None = None):
    sched = plan.schedule if isinstance(plan, LoweredSchedule) else plan
    grid = render_grid(plan, mark=None if rank is None else (rank, index))
    return ScheduleError(f"{sched.name}: {message}", rank=rank, index=index, grid=grid)


# --------------------------------------------------------------------------------------------- compute plan


def _check_structure(schedule: Schedule) -> dict[tuple[int, Kind, int], tuple[int, int]]:
    """Steps 1 and 2 of the module docstring; returns where each action sits: (stage, kind, mb) -> (rank, pos)."""
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    where: dict[tuple[int, Kind, int], tuple[int, int]] = {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            at = f"rank {r} position {i} ({a})"
            if not isinstance(a, Action):
                raise _fail(schedule, f"rank {r} position {i}: {a!r} is not an Action", r, i)
            if not a.kind.is_compute:
                raise _fail(schedule, f"{at}: plans hold compute actions only (lowering adds communication)", r, i)
            if a.stage >= S:
                raise _fail(schedule, f"{at}: stage {a.stage} is out of range 0..{S - 1}", r, i)
            if a.microbatch >= m:
                raise _fail(schedule, f"{at}: microbatch {a.microbatch} is out of range 0..{m - 1}", r, i)
            if owner[a.stage] != r:
                raise _fail(
                    schedule, f"{at}: stage {a.stage} lives on rank {owner[a.stage]} (stage_to_rank), not {r}", r, i
                )
            key = (a.stage, a.kind, a.microbatch)
            if key in where:
                r0, i0 = where[key]
                raise _fail(schedule, f"{at}: duplicate; {a} already ran at rank {r0} position {i0}", r, i)
            where[key] = (r, i)

    for s in range(S):
        o = owner[s]
        for mb in range(m):
            if (s, Kind.F, mb) not in where:
                raise _fail(schedule, f"rank {o}: missing {s}F{mb} (stage {s} lives on rank {o})", o)
            b, w, bw = where.get((s, Kind.B, mb)), where.get((s, Kind.W, mb)), where.get((s, Kind.BW, mb))
            if bw is not None and (b is not None or w is not None):
                r, i = b if b is not None else w
                msg = f"rank {r} position {i} ({schedule.ranks[r][i]}): {s}BW{mb} at position {bw[1]} already does it"
                raise _fail(schedule, msg, r, i)
            if bw is None:
                if b is None and w is None:
                    raise _fail(
                        schedule,
                        f"rank {o}: missing the backward of stage {s} microbatch {mb} "
                        f"(neither {s}BW{mb} nor {s}B{mb} + {s}W{mb})",
                        o,
                    )
                if w is None:
                    raise _fail(
                        schedule, f"rank {o} position {b[1]} ({s}B{mb}): missing {s}W{mb} (a B needs its W)", o, b[1]
                    )
                if b is None:
                    raise _fail(
                        schedule, f"rank {o} position {w[1]} ({s}W{mb}): missing {s}B{mb} (a W needs its B)", o, w[1]
                    )

    # Dependencies between actions of the same rank, by position.
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            for key in action_deps(a.kind, a.stage, a.microbatch, S, m):
                dep = _event_action(key, m, where)
                dr, di = where[dep]
                if dr == r and di > i:
                    raise _fail(
                        schedule,
                        f"rank {r} position {i} ({a}): comes before {_spell(dep)} (position {di}) that it depends on",
                        r,
                        i,
                    )
    return where


def _event_action(key: int, m: int, where: dict) -> tuple[int, Kind, int]:
    sm, slot = divmod(key, 3)
    s, mb = divmod(sm, m)
    if slot == SLOT_F:
        return (s, Kind.F, mb)
    if slot == SLOT_G:
        return (s, Kind.B, mb) if (s, Kind.B, mb) in where else (s, Kind.BW, mb)
    return (s, Kind.W, mb)


def _spell(key: tuple[int, Kind, int]) -> str:
    return f"{key[0]}{key[1].value}{key[2]}"


def validate(schedule: Schedule, *, costs: StageCosts | None = None, mem_limit: float | None = None) -> LoweredSchedule:
    """Check ``schedule`` completely (module docstring) and return its lowered form; raises ``ScheduleError``.

    Without ``costs`` the memory model is the default one: ``mem_f = 1`` for a rank's whole share of layers
    (``1 / chunks`` per virtual stage), ``mem_b = 0``, ``mem_w = -mem_f``.
    """
    where = _check_structure(schedule)
    m = schedule.num_microbatches
    order = event_order(schedule)
    if order.stuck:
        parts = []
        for r, i, key in order.stuck[:_MAX_STUCK_LISTED]:
            dep = _event_action(key, m, where)
            dr, di = where[dep]
            parts.append(
                f"rank {r} position {i} ({schedule.ranks[r][i]}) waits for {_spell(dep)} (rank {dr} position {di})"
            )
        more = len(order.stuck) - _MAX_STUCK_LISTED
        tail = f"; ... and {more} more ranks" if more > 0 else ""
        r0, i0, _ = order.stuck[0]
        raise _fail(schedule, "dependency cycle across ranks (deadlock): " + "; ".join(parts) + tail, r0, i0)
    lowered = lower(schedule, order=order)
    _check_lowered(lowered)
    if mem_limit is not None:
        if costs is None:
            costs = StageCosts.build(
                num_ranks=schedule.num_ranks, chunks=schedule.chunks, stage_to_rank=schedule.stage_to_rank
            )
        _check_memory(schedule, costs, mem_limit)
    return lowered


# --------------------------------------------------------------------------------------------------- memory


def _mem_deltas(costs: StageCosts) -> dict[Kind, Sequence[float]]:
    bw = tuple(b + w for b, w in zip(costs.mem_b, costs.mem_w))
    return {Kind.F: costs.mem_f, Kind.B: costs.mem_b, Kind.W: costs.mem_w, Kind.BW: bw}


def _check_costs(schedule: Schedule, costs: StageCosts) -> None:
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"costs are given for {costs.num_stages} virtual stages, but schedule {schedule.name!r} has "
            f"{schedule.num_stages}"
        )


def peak_memory(schedule: Schedule, costs: StageCosts) -> tuple[float, ...]:
    """Each rank's peak of the running sum of memory deltas over its compute actions, in order (0 at the start)."""
    _check_costs(schedule, costs)
    delta = _mem_deltas(costs)
    peaks = []
    for acts in schedule.ranks:
        cur = peak = 0.0
        for a in acts:
            if a.kind.is_compute:
                cur += delta[a.kind][a.stage]
                if cur > peak:
                    peak = cur
        peaks.append(peak)
    return tuple(peaks)


def min_mem_limit(schedule: Schedule, costs: StageCosts) -> float:
    """The smallest ``mem_limit`` that ``schedule`` fits in: its largest per-rank peak."""
    return max(peak_memory(schedule, costs), default=0.0)


def _check_memory(schedule: Schedule, costs: StageCosts, mem_limit: float) -> None:
    peaks = peak_memory(schedule, costs)
    tol = 1e-9 * max(1.0, abs(mem_limit))
    for r, peak in enumerate(peaks):
        if peak > mem_limit + tol:
            delta = _mem_deltas(costs)
            cur = 0.0
            first = None
            for i, a in enumerate(schedule.ranks[r]):
                cur += delta[a.kind][a.stage]
                if cur > mem_limit + tol:
                    first = i
                    break
            a = schedule.ranks[r][first]
            raise _fail(
                schedule,
                f"rank {r} position {first} ({a}): memory reaches {cur:g} here and peaks at {peak:g} on this rank, "
                f"over mem_limit={mem_limit:g} (this plan needs at least {max(peaks):g})",
                r,
                first,
            )


# ------------------------------------------------------------------------------------------- lowered plan


def validate_lowered(lowered: LoweredSchedule) -> None:
    """Check a lowered plan (for instance a hand-made one): its compute plan, then its communication."""
    _check_structure(lowered.schedule)
    _check_lowered(lowered)


def _transfer_of(a: Action) -> tuple[Kind, int, int]:
    """The hand-off a comm op belongs to, named by its producer: (F or G, producing stage, mb)."""
    if a.kind is Kind.SEND_F:
        return (Kind.F, a.stage, a.microbatch)
    if a.kind is Kind.RECV_F:
        return (Kind.F, a.stage - 1, a.microbatch)
    if a.kind is Kind.SEND_B:
        return (Kind.B, a.stage, a.microbatch)
    return (Kind.B, a.stage + 1, a.microbatch)  # RECV_B


def _check_lowered(lowered: LoweredSchedule) -> None:
    """The communication checks of step 4 (module docstring); the compute plan is assumed checked."""
    sched = lowered.schedule
    S, m, owner, p = sched.num_stages, sched.num_microbatches, sched.stage_to_rank, sched.num_ranks
    if len(lowered.ranks) != p:
        raise _fail(lowered, f"lowered plan has {len(lowered.ranks)} ranks, its schedule {p}")

    # Per rank: the step at which each compute action sits; each op's location.
    step_of: list[dict[tuple[Kind, int, int], int]] = []  # (F or G, stage, mb) -> step
    sends: dict[tuple[int, int], list[tuple[int, int, Action]]] = {}  # (src, dst) -> [(step, slot, op)]
    recvs: dict[tuple[int, int], list[tuple[int, int, Action]]] = {}  # (src, dst) -> [(step, slot, op)]
    seen_ops: dict[tuple[Kind, int, int, bool], tuple[int, int]] = {}
    for r, steps in enumerate(lowered.ranks):
        compute = [st for st in steps if isinstance(st, Action)]
        if tuple(compute) != sched.ranks[r]:
            j = next(
                (k for k, (x, y) in enumerate(zip(compute, sched.ranks[r])) if x != y),
                min(len(compute), len(sched.ranks[r])),
            )
            step = [k for k, st in enumerate(steps) if isinstance(st, Action)]
            idx = step[j] if j < len(step) else None
            raise _fail(
                lowered,
                f"rank {r}: the lowered plan's compute actions differ from the schedule's at compute position {j}",
                r,
                idx,
            )
        where: dict[tuple[Kind, int, int], int] = {}
        for j, st in enumerate(steps):
            if isinstance(st, Action):
                if st.kind.is_comm:
                    raise _fail(lowered, f"rank {r} step {j} ({st}): communication must sit inside a CommBatch", r, j)
                kind = Kind.F if st.kind is Kind.F else (Kind.B if st.kind in (Kind.B, Kind.BW) else Kind.W)
                where[(kind, st.stage, st.microbatch)] = j
                continue
            if not isinstance(st, CommBatch) or not st.actions:
                raise _fail(
                    lowered, f"rank {r} step {j} ({st!r}): expected a compute Action or a non-empty CommBatch", r, j
                )
        step_of.append(where)

    for r, steps in enumerate(lowered.ranks):
        for j, st in enumerate(steps):
            if not isinstance(st, CommBatch):
                continue
            for slot, a in enumerate(st.actions):
                at = f"rank {r} step {j} ({a})"
                if not isinstance(a, Action) or a.kind not in _COMM_KINDS:
                    raise _fail(lowered, f"{at}: a CommBatch holds only SEND_F/RECV_F/SEND_B/RECV_B actions", r, j)
                s, mb, peer = a.stage, a.microbatch, a.peer
                if s >= S or mb >= m:
                    raise _fail(lowered, f"{at}: stage or microbatch out of range (S={S}, m={m})", r, j)
                if owner[s] != r:
                    raise _fail(lowered, f"{at}: stage {s} lives on rank {owner[s]}, not {r}", r, j)
                other = s + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else s - 1
                if not 0 <= other < S:
                    raise _fail(lowered, f"{at}: stage {s} has no neighbour stage {other} to talk to", r, j)
                if owner[other] == r:
                    raise _fail(lowered, f"{at}: stage {other} is on the same rank; that hand-off is local", r, j)
                if peer != owner[other]:
                    raise _fail(lowered, f"{at}: peer should be rank {owner[other]} (owner of stage {other})", r, j)
                is_send = a.kind in _MATCHING_RECV
                tkind, ps, _ = transfer = _transfer_of(a)
                dup_key = (*transfer, is_send)
                if dup_key in seen_ops:
                    r0, j0 = seen_ops[dup_key]
                    raise _fail(lowered, f"{at}: duplicate; the same op is already at rank {r0} step {j0}", r, j)
                seen_ops[dup_key] = (r, j)
                # A send goes after the action that produced its data; a receive before the one that consumes it.
                if is_send:
                    prod = step_of[r].get((tkind, ps, mb))
                    if prod is None or prod > j:
                        what = f"{ps}F{mb}" if tkind is Kind.F else f"the backward of stage {ps} microbatch {mb}"
                        raise _fail(lowered, f"{at}: sent before {what} produced it", r, j)
                    sends.setdefault((r, peer), []).append((j, slot, a))
                else:
                    cons = step_of[r].get((tkind, s, mb))
                    if cons is not None and cons < j:
                        raise _fail(lowered, f"{at}: received after its consumer at step {cons} already ran", r, j)
                    recvs.setdefault((peer, r), []).append((j, slot, a))

    # Every hand-off between ranks is communicated: its consumer has a receive and its producer a send.
    for s in range(S):
        for nxt, tkind, sk, rk in (
            (s + 1, Kind.F, Kind.SEND_F, Kind.RECV_F),
            (s - 1, Kind.B, Kind.SEND_B, Kind.RECV_B),
        ):
            if not 0 <= nxt < S or owner[nxt] == owner[s]:
                continue
            for mb in range(m):
                if (tkind, s, mb, True) not in seen_ops:
                    r = owner[s]
                    j = step_of[r].get((tkind, s, mb))
                    raise _fail(
                        lowered,
                        f"rank {r} step {j} ({_step_str(lowered, r, j)}): its output goes to "
                        f"rank {owner[nxt]} but there is no {s}{sk.value}{mb}@{owner[nxt]}",
                        r,
                        j,
                    )
                if (tkind, s, mb, False) not in seen_ops:
                    r = owner[nxt]
                    j = step_of[r].get((Kind.F if tkind is Kind.F else Kind.B, nxt, mb))
                    raise _fail(
                        lowered,
                        f"rank {r} step {j} ({_step_str(lowered, r, j)}): needs data from rank "
                        f"{owner[s]} but there is no {nxt}{rk.value}{mb}@{owner[s]} before it",
                        r,
                        j,
                    )

    # Order: the k-th send from src to dst is the k-th receive at dst from src.
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (rank, step, slot) -> the same of its match
    for (src, dst), sl in sends.items():
        rl = recvs.get((src, dst), [])
        for k, ((js, ss, sa), (jr, sr, ra)) in enumerate(zip(sl, rl)):
            if _transfer_of(sa) != _transfer_of(ra):
                raise _fail(
                    lowered,
                    f"rank {dst} step {jr} ({ra}): receive #{k} from rank {src} is matched (by order, no tags) with "
                    f"send #{k} of rank {src} to rank {dst}, which is {sa} (rank {src} step {js}): the two sides "
                    "post their transfers in different orders",
                    dst,
                    jr,
                )
            partner[(src, js, ss)] = (dst, jr, sr)
            partner[(dst, jr, sr)] = (src, js, ss)

    _simulate_strict(lowered, partner)


_COMM_KINDS = frozenset(_MATCHING_RECV) | {Kind.RECV_F, Kind.RECV_B}


def _step_str(lowered: LoweredSchedule, r: int, j: int | None) -> str:
    return "?" if j is None or j >= len(lowered.ranks[r]) else str(lowered.ranks[r][j])


def _simulate_strict(lowered: LoweredSchedule, partner: dict[tuple[int, int, int], tuple[int, int, int]]) -> None:
    """Run the strict model (no buffering; a batch blocks its rank until all of its ops completed)."""
    ranks = lowered.ranks
    p = len(ranks)
    ptr = [0] * p
    posted = [False] * p
    pending = [0] * p
    work = list(range(p - 1, -1, -1))
    while work:
        r = work.pop()
        steps = ranks[r]
        n = len(steps)
        while ptr[r] < n:
            st = steps[ptr[r]]
            if not isinstance(st, CommBatch):
                ptr[r] += 1
                continue
            if posted[r]:
                if pending[r]:
                    break
                posted[r] = False
                ptr[r] += 1
                continue
            # Post the batch: every op whose partner is already posted completes now, on both sides.
            posted[r] = True
            pending[r] = len(st.actions)
            j = ptr[r]
            for slot in range(len(st.actions)):
                q, jq, _ = partner[(r, j, slot)]
                if posted[q] and ptr[q] == jq:
                    pending[r] -= 1
                    pending[q] -= 1
                    if pending[q] == 0:
                        work.append(q)
    blocked = [r for r in range(p) if ptr[r] < len(ranks[r])]
    if not blocked:
        return
    parts = []
    for r in blocked[:_MAX_STUCK_LISTED]:
        j = ptr[r]
        st = ranks[r][j]
        for slot, a in enumerate(st.actions):
            q, jq, sq = partner[(r, j, slot)]
            if not (posted[q] and ptr[q] == jq):
                parts.append(
                    f"rank {r} step {j} ({a}) waits for rank {q} to post {ranks[q][jq].actions[sq]} at its step {jq}, "
                    f"but rank {q} is blocked at step {ptr[q]} ({_step_str(lowered, q, ptr[q])})"
                )
                break
    more = len(blocked) - _MAX_STUCK_LISTED
    tail = f"; ... and {more} more ranks" if more > 0 else ""
    raise _fail(
        lowered,
        "deadlock under strict P2P (no buffering, batches block): " + "; ".join(parts) + tail,
        blocked[0],
        ptr[blocked[0]],
    )
