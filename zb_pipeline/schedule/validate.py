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
    COMM_KINDS,
    SLOT_F,
    SLOT_G,
    CommBatch,
    EventOrder,
    LoweredSchedule,
    action_deps,
    event_order,
    kind_code,
    lower,
    no_gc,
)

_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_SEND_PV, _RECV_PV = Kind.SEND_PV, Kind.RECV_PV
_F, _B, _BW, _W = Kind.F, Kind.B, Kind.BW, Kind.W
_MAX_STUCK_LISTED = 4


class ScheduleError(ValueError):
    """A plan is invalid.  ``str()`` is one line; ``grid`` shows the plan with the failing step marked.

    ``rank`` and ``index`` locate the failing step (``index`` is a position in ``schedule.ranks[rank]``, or a step
    in a lowered plan's ``ranks[rank]``); either may be ``None`` when there is no such step (a missing action).
    The grid is rendered on first access, so searches that try many plans pay nothing for it.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        index: int | None = None,
        grid: str | None = None,
        plan: Schedule | LoweredSchedule | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self._grid = grid
        self._plan = plan

    @property
    def grid(self) -> str:
        if self._grid is None:
            mark = None if self.rank is None else (self.rank, self.index)
            self._grid = "" if self._plan is None else render_grid(self._plan, mark=mark)
        return self._grid


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


def _fail(
    plan: Schedule | LoweredSchedule, message: str, rank: int | None = None, index: int | None = None
) -> ScheduleError:
    sched = plan.schedule if isinstance(plan, LoweredSchedule) else plan
    return ScheduleError(f"{sched.name}: {message}", rank=rank, index=index, plan=plan)


# --------------------------------------------------------------------------------------------- compute plan
# Where each compute action sits: where[(stage * m + mb) * 4 + code] = its position on its stage's rank (-1: none),
# with code 0..3 for F, B, W, BW (lowering.kind_code).  The rank is the stage's owner (checked first).
_KIND_OF_CODE = (Kind.F, Kind.B, Kind.W, Kind.BW)


def _check_structure(schedule: Schedule) -> list[int]:
    """Steps 1 and 2 of the module docstring; returns ``where`` (see above)."""
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    where = [-1] * (S * m * 4)

    def at(r: int, i: int) -> str:
        return f"rank {r} position {i} ({schedule.ranks[r][i]})"

    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise _fail(schedule, f"rank {r} position {i}: {a!r} is not an Action", r, i)
            code = kind_code(a.kind)
            s, mb = a.stage, a.microbatch
            if code < 0:
                raise _fail(
                    schedule, f"{at(r, i)}: plans hold compute actions only (lowering adds communication)", r, i
                )
            if s >= S:
                raise _fail(schedule, f"{at(r, i)}: stage {s} is out of range 0..{S - 1}", r, i)
            if mb >= m:
                raise _fail(schedule, f"{at(r, i)}: microbatch {mb} is out of range 0..{m - 1}", r, i)
            if owner[s] != r:
                raise _fail(schedule, f"{at(r, i)}: stage {s} lives on rank {owner[s]} (stage_to_rank), not {r}", r, i)
            key = (s * m + mb) * 4 + code
            if where[key] >= 0:
                raise _fail(schedule, f"{at(r, i)}: duplicate; {a} already ran at position {where[key]}", r, i)
            where[key] = i

    for s in range(S):
        o = owner[s]
        for mb in range(m):
            key = (s * m + mb) * 4
            f, b, w, bw = where[key], where[key + 1], where[key + 2], where[key + 3]
            if f < 0:
                raise _fail(schedule, f"rank {o}: missing {s}F{mb} (stage {s} lives on rank {o})", o)
            if bw >= 0 and (b >= 0 or w >= 0):
                i = b if b >= 0 else w
                raise _fail(schedule, f"{at(o, i)}: {s}BW{mb} at position {bw} already does this work", o, i)
            if bw < 0:
                if b < 0 and w < 0:
                    msg = f"rank {o}: missing the backward of {s}F{mb} (neither {s}BW{mb} nor {s}B{mb} + {s}W{mb})"
                    raise _fail(schedule, msg, o)
                if w < 0:
                    raise _fail(schedule, f"{at(o, b)}: missing {s}W{mb} (every B needs its W)", o, b)
                if b < 0:
                    raise _fail(schedule, f"{at(o, w)}: missing {s}B{mb} (every W needs its B)", o, w)

    return where


def _check_dependencies(schedule: Schedule, where: list[int]) -> EventOrder:
    """Steps 2 and 3: run the plan once; if it gets stuck, say why (a misordered rank, else a cross-rank cycle)."""
    order = event_order(schedule)
    if not order.stuck:
        return order
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    # An action placed before something it needs on its own rank is the most specific diagnosis.
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            for ev in action_deps(a.kind, a.stage, a.microbatch, S, m):
                key = _event_action(ev, where)
                if owner[key // 4 // m] == r and where[key] > i:
                    msg = (
                        f"rank {r} position {i} ({a}): comes before {_spell(key, m)} (position {where[key]}) "
                        "that it depends on"
                    )
                    raise _fail(schedule, msg, r, i)
    parts = []
    for r, i, event in order.stuck[:_MAX_STUCK_LISTED]:
        key = _event_action(event, where)
        parts.append(
            f"rank {r} position {i} ({schedule.ranks[r][i]}) waits for {_spell(key, m)} "
            f"(rank {owner[key // 4 // m]} position {where[key]})"
        )
    more = len(order.stuck) - _MAX_STUCK_LISTED
    tail = f"; ... and {more} more ranks" if more > 0 else ""
    r0, i0, _ = order.stuck[0]
    raise _fail(schedule, "dependency cycle across ranks (deadlock): " + "; ".join(parts) + tail, r0, i0)


def _event_action(event: int, where: list[int]) -> int:
    """The ``where`` key of the action whose end is lowering's event key ``event``."""
    sm, slot = divmod(event, 3)
    if slot == SLOT_F:
        return sm * 4
    if slot == SLOT_G:
        return sm * 4 + 1 if where[sm * 4 + 1] >= 0 else sm * 4 + 3
    return sm * 4 + 2


def _spell(key: int, m: int) -> str:
    sm, code = divmod(key, 4)
    s, mb = divmod(sm, m)
    return f"{s}{_KIND_OF_CODE[code].value}{mb}"


def validate(schedule: Schedule, *, costs: StageCosts | None = None, mem_limit: float | None = None) -> LoweredSchedule:
    """Check ``schedule`` completely (module docstring) and return its lowered form; raises ``ScheduleError``.

    Without ``costs`` the memory model is the default one: ``mem_f = 1`` for a rank's whole share of layers
    (``1 / chunks`` per virtual stage), ``mem_b = 0``, ``mem_w = -mem_f``.
    """
    with no_gc():
        order = _check_dependencies(schedule, _check_structure(schedule))
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


def _mem_deltas(costs: StageCosts) -> tuple[Sequence[float], ...]:
    """Memory deltas indexed by ``kind_code`` (F, B, W, BW), then by stage."""
    bw = tuple(b + w for b, w in zip(costs.mem_b, costs.mem_w))
    return (costs.mem_f, costs.mem_b, costs.mem_w, bw)


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
            code = kind_code(a.kind)
            if code >= 0:
                cur += delta[code][a.stage]
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
                cur += delta[kind_code(a.kind)][a.stage]
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
    with no_gc():
        _check_dependencies(lowered.schedule, _check_structure(lowered.schedule))
        _check_lowered(lowered)


def _transfer_id(kind: Kind, stage: int, mb: int, m: int) -> int:
    """The hand-off a comm op belongs to: (producing stage * m + mb) * 2 + (0 forward, 1 backward); -1 if not comm."""
    if kind is _SEND_F:
        return (stage * m + mb) * 2
    if kind is _RECV_F:
        return ((stage - 1) * m + mb) * 2
    if kind is _SEND_B:
        return (stage * m + mb) * 2 + 1
    if kind is _RECV_B:
        return ((stage + 1) * m + mb) * 2 + 1
    return -1


def _check_lowered(lowered: LoweredSchedule) -> None:
    """The communication checks of step 4 (module docstring); the compute plan is assumed checked."""
    sched = lowered.schedule
    S, m, owner, p = sched.num_stages, sched.num_microbatches, sched.stage_to_rank, sched.num_ranks
    if len(lowered.ranks) != p:
        raise _fail(lowered, f"lowered plan has {len(lowered.ranks)} ranks, its schedule {p}")

    # The step of each compute action in the lowered plan: fstep for F, gstep for B/BW (index stage * m + mb).
    fstep, gstep = [-1] * (S * m), [-1] * (S * m)
    for r, steps in enumerate(lowered.ranks):
        compute = [st for st in steps if type(st) is not CommBatch]
        if tuple(compute) != sched.ranks[r]:
            n = min(len(compute), len(sched.ranks[r]))
            k = next((k for k in range(n) if compute[k] != sched.ranks[r][k]), n)
            idx = [j for j, st in enumerate(steps) if type(st) is not CommBatch]
            msg = f"rank {r}: the lowered plan's compute actions differ from the schedule's at compute position {k}"
            raise _fail(lowered, msg, r, idx[k] if k < len(idx) else None)
        for j, st in enumerate(steps):
            if type(st) is CommBatch:
                if not st.actions:
                    raise _fail(lowered, f"rank {r} step {j}: empty CommBatch", r, j)
                continue
            kind = st.kind
            if kind is _F:
                fstep[st.stage * m + st.microbatch] = j
            elif kind is _B or kind is _BW:
                gstep[st.stage * m + st.microbatch] = j

    # Each op: right rank and peer, a send after its producer, a receive before its consumer, nothing twice.
    # (Fast path here; _bad_op says what exactly is wrong.)
    big = 1 << 32
    # Transfer ids: hand-offs first, then the post-validation chain links (2 chains x p source ranks).
    pv_base = S * m * 2
    sent, recvd = [-1] * (pv_base + 2 * p), [-1] * (pv_base + 2 * p)  # transfer id -> rank * big + step
    sends = [[[] for _ in range(p)] for _ in range(p)]  # [src][dst] -> [(transfer id, step, slot)] in order
    recvs = [[[] for _ in range(p)] for _ in range(p)]  # [src][dst] -> [(transfer id, step, slot)] in order
    partner: list[list[list | None]] = [[None] * len(steps) for steps in lowered.ranks]
    for r, steps in enumerate(lowered.ranks):
        sends_r = sends[r]
        for j, st in enumerate(steps):
            if type(st) is not CommBatch:
                continue
            partner[r][j] = [None] * len(st.actions)
            for slot, a in enumerate(st.actions):
                if type(a) is not Action:
                    raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                kind, s, mb, peer = a.kind, a.stage, a.microbatch, a.peer
                if kind is _SEND_PV or kind is _RECV_PV:
                    _check_pv_op(lowered, r, j, a, sent if kind is _SEND_PV else recvd, pv_base)
                    is_send = kind is _SEND_PV
                    tid = pv_base + mb * p + (r if is_send else peer)
                    (sent if is_send else recvd)[tid] = r * big + j
                    (sends_r[peer] if is_send else recvs[peer][r]).append((tid, j, slot))
                    continue
                sm = s * m + mb
                if kind is _SEND_F:
                    other, tid, data, is_send = s + 1, sm * 2, fstep, True
                elif kind is _RECV_F:
                    other, tid, data, is_send = s - 1, (sm - m) * 2, fstep, False
                elif kind is _SEND_B:
                    other, tid, data, is_send = s - 1, sm * 2 + 1, gstep, True
                elif kind is _RECV_B:
                    other, tid, data, is_send = s + 1, (sm + m) * 2 + 1, gstep, False
                else:
                    raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                if s >= S or mb >= m or not 0 <= other < S or owner[s] != r or owner[other] != peer or peer == r:
                    raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                if is_send:
                    if sent[tid] >= 0 or data[sm] > j:
                        raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                    sent[tid] = r * big + j
                    sends_r[peer].append((tid, j, slot))
                else:
                    if recvd[tid] >= 0 or data[sm] < j:
                        raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                    recvd[tid] = r * big + j
                    recvs[peer][r].append((tid, j, slot))

    # Every hand-off between ranks is communicated: a send at its producer, a receive at its consumer.
    for s in range(S):
        for mb in range(m):
            if s + 1 < S and owner[s + 1] != owner[s]:
                tid = (s * m + mb) * 2
                r, q = owner[s], owner[s + 1]
                if sent[tid] < 0:
                    j = fstep[s * m + mb]
                    msg = f"rank {r} step {j} ({s}F{mb}): no {s}SEND_F{mb}@{q} sends its output to rank {q}"
                    raise _fail(lowered, msg, r, j)
                if recvd[tid] < 0:
                    j = fstep[(s + 1) * m + mb]
                    msg = f"rank {q} step {j} ({s + 1}F{mb}): no {s + 1}RECV_F{mb}@{r} receives its input before it"
                    raise _fail(lowered, msg, q, j)
            if s > 0 and owner[s - 1] != owner[s]:
                tid = (s * m + mb) * 2 + 1
                r, q = owner[s], owner[s - 1]
                if sent[tid] < 0:
                    j = gstep[s * m + mb]
                    msg = f"rank {r} step {j} ({lowered.ranks[r][j]}): no {s}SEND_B{mb}@{q} sends its input gradient"
                    raise _fail(lowered, msg, r, j)
                if recvd[tid] < 0:
                    j = gstep[(s - 1) * m + mb]
                    msg = f"rank {q} step {j} ({lowered.ranks[q][j]}): no {s - 1}RECV_B{mb}@{r} receives its gradient"
                    raise _fail(lowered, msg, q, j)

    if _check_pv_complete(lowered, sent, recvd, pv_base):
        _check_pv_placement(lowered)

    # Order: the k-th send from src to dst is matched with the k-th receive at dst from src.  (Both lists have the
    # same length here: every transfer has exactly one send and one receive.)
    for src in range(p):
        for dst in range(p):
            for k, ((ts, js, ss), (tr, jr, sr)) in enumerate(zip(sends[src][dst], recvs[src][dst])):
                if ts != tr:
                    sa, ra = lowered.ranks[src][js].actions[ss], lowered.ranks[dst][jr].actions[sr]
                    msg = (
                        f"rank {dst} step {jr} ({ra}): receive #{k} from rank {src} is matched (by order, no tags) "
                        f"with send #{k} from rank {src} to rank {dst}, which is {sa} (rank {src} step {js}): the two "
                        "sides post their transfers in different orders"
                    )
                    raise _fail(lowered, msg, dst, jr)
                partner[src][js][ss] = (dst, jr, sr)
                partner[dst][jr][sr] = (src, js, ss)

    _simulate_strict(lowered, partner)


def _check_pv_op(lowered: LoweredSchedule, r: int, j: int, a: Action, seen: list[int], pv_base: int) -> None:
    """A post-validation op (``post_validation_pass``): its own rank, a neighbour in the chain's direction, once."""
    p = lowered.schedule.num_ranks
    chain, peer = a.microbatch, a.peer
    if a.stage != r:
        raise _fail(lowered, f"rank {r} step {j} ({a}): a post-validation op names its own rank {r} as stage", r, j)
    if chain not in (0, 1):
        raise _fail(lowered, f"rank {r} step {j} ({a}): the chain must be 0 (forward partial) or 1 (back)", r, j)
    # Forward chain: send to r + 1, receive from r - 1; back chain: the other way.
    downstream = (chain == 0) == (a.kind is _SEND_PV)
    want = r + 1 if downstream else r - 1
    if peer != want or not 0 <= want < p:
        raise _fail(lowered, f"rank {r} step {j} ({a}): the post-validation chain links rank {r} to rank {want}", r, j)
    src = r if a.kind is _SEND_PV else peer
    if seen[pv_base + chain * p + src] >= 0:
        raise _fail(lowered, f"rank {r} step {j} ({a}): duplicate post-validation op", r, j)


def _check_pv_complete(lowered: LoweredSchedule, sent: list[int], recvd: list[int], pv_base: int) -> bool:
    """Either no post-validation chain at all (False), or every link of both chains with one send and one receive
    (True)."""
    p = lowered.schedule.num_ranks
    links = [(chain, src) for chain in (0, 1) for src in (range(p - 1) if chain == 0 else range(1, p))]
    present = [sent[pv_base + c * p + s] >= 0 or recvd[pv_base + c * p + s] >= 0 for c, s in links]
    if not any(present):
        return False
    for c, src in links:
        dst = src + 1 if c == 0 else src - 1
        tid = pv_base + c * p + src
        if sent[tid] < 0:
            raise _fail(lowered, f"rank {src}: no {src}SEND_PV{c}@{dst} (the post-validation chain is incomplete)", src)
        if recvd[tid] < 0:
            raise _fail(lowered, f"rank {dst}: no {dst}RECV_PV{c}@{src} (the post-validation chain is incomplete)", dst)
    return True


def _check_pv_placement(lowered: LoweredSchedule) -> None:
    """Post-validation order on each rank: a chain's receive before its send, and the validation point (the
    fully reduced state's arrival) before the rank's first backward action -- gradients are zeroed at validation."""
    p = lowered.schedule.num_ranks
    for r, steps in enumerate(lowered.ranks):
        where: dict[tuple[Kind, int], int] = {}
        first_backward = None
        for j, st in enumerate(steps):
            if type(st) is CommBatch:
                for a in st.actions:
                    if a.kind is _SEND_PV or a.kind is _RECV_PV:
                        where[(a.kind, a.microbatch)] = j
            elif first_backward is None and st.kind in (_B, _BW, _W):
                first_backward = j
        if not where:
            continue
        for chain in (0, 1):
            got, put = where.get((_RECV_PV, chain)), where.get((_SEND_PV, chain))
            if got is not None and put is not None and got > put:
                raise _fail(
                    lowered, f"rank {r} step {put}: passes on post-validation chain {chain} before receiving it", r, put
                )
        point = where.get((_RECV_PV, 1) if r < p - 1 else (_RECV_PV, 0))
        if point is not None and first_backward is not None and point > first_backward:
            raise _fail(
                lowered,
                f"rank {r} step {first_backward} ({steps[first_backward]}): backward work before the rank's "
                f"post-validation point (step {point}); gradients of the previous step are still pending there",
                r,
                first_backward,
            )


def _bad_op(
    lowered: LoweredSchedule, r: int, j: int, a: object, fstep: list[int], gstep: list[int], sent: list, recvd: list
) -> ScheduleError:
    """Say what is wrong with comm op ``a`` at rank ``r`` step ``j`` (the fast path found something)."""
    sched = lowered.schedule
    S, m, owner = sched.num_stages, sched.num_microbatches, sched.stage_to_rank

    def bad(reason: str) -> ScheduleError:
        return _fail(lowered, f"rank {r} step {j} ({a}): {reason}", r, j)

    if not isinstance(a, Action) or a.kind not in COMM_KINDS:
        return bad("a CommBatch holds only SEND_F/RECV_F/SEND_B/RECV_B (and SEND_PV/RECV_PV) actions")
    kind, s, mb, peer = a.kind, a.stage, a.microbatch, a.peer
    if s >= S or mb >= m:
        return bad(f"stage or microbatch out of range ({S=}, {m=})")
    if owner[s] != r:
        return bad(f"stage {s} lives on rank {owner[s]}, not {r}")
    other = s + 1 if kind in (Kind.SEND_F, Kind.RECV_B) else s - 1
    if not 0 <= other < S:
        return bad(f"stage {s} has no neighbour stage {other} to talk to")
    if owner[other] == r:
        return bad(f"stage {other} is on the same rank, so this hand-off is local (no communication)")
    if peer != owner[other]:
        return bad(f"the peer must be rank {owner[other]}, the owner of stage {other}")
    is_send = kind in (Kind.SEND_F, Kind.SEND_B)
    tid = _transfer_id(kind, s, mb, m)
    seen = (sent if is_send else recvd)[tid]
    if seen >= 0:
        return bad(f"duplicate; the same transfer is already at step {seen % (1 << 32)}")
    step = (fstep if kind in (Kind.SEND_F, Kind.RECV_F) else gstep)[s * m + mb]
    if is_send:
        return bad(f"sent before the action that produces it (step {step})")
    return bad(f"received after the action that needs it (step {step})")


def _step_str(lowered: LoweredSchedule, r: int, j: int | None) -> str:
    return "?" if j is None or j >= len(lowered.ranks[r]) else str(lowered.ranks[r][j])


def _simulate_strict(lowered: LoweredSchedule, partner: list[list[list | None]]) -> None:
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
        j = ptr[r]
        while j < n:
            links = partner[r][j]
            if links is None:  # compute: never blocks
                j += 1
                continue
            if posted[r]:
                if pending[r]:
                    break
                posted[r] = False
                j += 1
                continue
            # Post the batch: every op whose partner is already posted completes now, on both sides.
            posted[r] = True
            pending[r] = len(links)
            ptr[r] = j
            for q, jq, _ in links:
                if posted[q] and ptr[q] == jq:
                    pending[r] -= 1
                    pending[q] -= 1
                    if pending[q] == 0:
                        work.append(q)
        ptr[r] = j
    blocked = [r for r in range(p) if ptr[r] < len(ranks[r])]
    if not blocked:
        return
    parts = []
    for r in blocked[:_MAX_STUCK_LISTED]:
        j = ptr[r]
        for slot, (q, jq, sq) in enumerate(partner[r][j]):
            if not (posted[q] and ptr[q] == jq):
                parts.append(
                    f"rank {r} step {j} ({ranks[r][j].actions[slot]}) waits for rank {q} to post "
                    f"{ranks[q][jq].actions[sq]} at its step {jq}, but rank {q} is blocked at step {ptr[q]} "
                    f"({_step_str(lowered, q, ptr[q])})"
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
