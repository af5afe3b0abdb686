"""Checks of a lowered plan's communication (step 4 of ``validate``'s docstring).

The compute plan inside is assumed checked.  Every hand-off that crosses ranks has exactly one send and one
receive with the right peers, a send after its producer and a receive before its consumer; the post-validation
chain (``post_validation_pass``), if present, is complete and placed right; between every pair of ranks the k-th
send and the k-th receive are the same transfer; and the strict model (no buffering, batches posted as a unit, see
``lowering``) finishes without deadlock.  Failures raise ``ScheduleError``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.lowering import COMM_KINDS, CommBatch, LoweredSchedule
from zb_pipeline.schedule.schedule_error import MAX_STUCK_LISTED, ScheduleError, plan_error

_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_SEND_PV, _RECV_PV = Kind.SEND_PV, Kind.RECV_PV
_F, _B, _BW, _W, _PAIR = Kind.F, Kind.B, Kind.BW, Kind.W, Kind.PAIR
# Where a transfer was posted: rank * _BIG + step (pos >> _SHIFT is the rank, pos & _STEP the step).
_SHIFT = 32
_BIG = 1 << _SHIFT
_STEP = _BIG - 1


def check_lowered_comms(lowered: LoweredSchedule) -> None:
    """The communication checks of a lowered plan (module docstring); raises ``ScheduleError``."""
    sched = lowered.schedule
    if len(lowered.ranks) != sched.num_ranks:
        raise plan_error(lowered, f"lowered plan has {len(lowered.ranks)} ranks, its schedule {sched.num_ranks}")
    fstep, gstep = _compute_steps(lowered)
    ops = _collect_ops(lowered, fstep, gstep)
    _check_handoffs(lowered, ops, fstep, gstep)
    if _check_pv_complete(lowered, ops.sent, ops.recvd, ops.pv_base):
        _check_pv_placement(lowered)
    _match_in_order(lowered, ops)
    ops.sends = ops.recvs = {}  # not needed past the matching
    _simulate_strict(lowered, ops)


def _compute_steps(lowered: LoweredSchedule) -> tuple[list[int], list[int]]:
    """Check that each rank's compute actions are the schedule's; return the step of each F (``fstep``) and of
    each B/BW (``gstep``) in the lowered plan, indexed stage * m + mb."""
    sched = lowered.schedule
    S, m = sched.num_stages, sched.num_microbatches
    fstep, gstep = [-1] * (S * m), [-1] * (S * m)
    for r, steps in enumerate(lowered.ranks):
        compute = [st for st in steps if type(st) is not CommBatch]
        if tuple(compute) != sched.ranks[r]:
            n = min(len(compute), len(sched.ranks[r]))
            k = next((k for k in range(n) if compute[k] != sched.ranks[r][k]), n)
            idx = [j for j, st in enumerate(steps) if type(st) is not CommBatch]
            msg = f"rank {r}: the lowered plan's compute actions differ from the schedule's at compute position {k}"
            raise plan_error(lowered, msg, r, idx[k] if k < len(idx) else None)
        for j, st in enumerate(steps):
            if type(st) is CommBatch:
                if not st.actions:
                    raise plan_error(lowered, f"rank {r} step {j}: empty CommBatch", r, j)
                continue
            kind = st.kind
            if kind is _F:
                fstep[st.stage * m + st.microbatch] = j
            elif kind is _B or kind is _BW:
                gstep[st.stage * m + st.microbatch] = j
            elif kind is _PAIR:  # both halves at the pair's step
                fstep[st.forward.stage * m + st.forward.microbatch] = j
                gstep[st.backward.stage * m + st.backward.microbatch] = j
    return fstep, gstep


@dataclass
class _Ops:
    """Every comm op of a lowered plan, by transfer: hand-offs first, then the post-validation chain links
    (2 chains x p source ranks, from ``pv_base``)."""

    pv_base: int
    sent: list[int]  # transfer id -> rank * _BIG + step of its send (-1: none)
    recvd: list[int]  # transfer id -> rank * _BIG + step of its receive (-1: none)
    # src * p + dst -> transfer ids in posting order, only for pairs of ranks that talk (a dict, not a p x p table:
    # a plan's cost stays O(actions + messages) however many ranks it has).
    sends: dict[int, list[int]]
    recvs: dict[int, list[int]]
    # [rank][step] -> the transfer ids of a batch's ops in slot order (None: a compute step); an op's partner is the
    # other end of its transfer (sent / recvd).
    tids: list[list[list[int] | None]] = field(default_factory=list)


def _collect_ops(lowered: LoweredSchedule, fstep: list[int], gstep: list[int]) -> _Ops:
    """Each op: right rank and peer, a send after its producer, a receive before its consumer, nothing twice.
    (Fast path here; ``_bad_op`` says what exactly is wrong.)"""
    sched = lowered.schedule
    S, m, owner, p = sched.num_stages, sched.num_microbatches, sched.stage_to_rank, sched.num_ranks
    pv_base = S * m * 2
    ops = _Ops(
        pv_base,
        [-1] * (pv_base + 2 * p),
        [-1] * (pv_base + 2 * p),
        defaultdict(list),
        defaultdict(list),
        [[None] * len(steps) for steps in lowered.ranks],
    )
    sent, recvd, sends, recvs = ops.sent, ops.recvd, ops.sends, ops.recvs
    for r, steps in enumerate(lowered.ranks):
        for j, st in enumerate(steps):
            if type(st) is not CommBatch:
                continue
            batch_tids: list[int] = []
            ops.tids[r][j] = batch_tids
            here = r * _BIG + j  # one int per batch, shared by its ops' entries in sent / recvd
            for a in st.actions:
                if type(a) is not Action:
                    raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                kind, s, mb, peer = a.kind, a.stage, a.microbatch, a.peer
                if kind is _SEND_PV or kind is _RECV_PV:
                    _check_pv_op(lowered, r, j, a, sent if kind is _SEND_PV else recvd, pv_base)
                    is_send = kind is _SEND_PV
                    tid = pv_base + mb * p + (r if is_send else peer)
                    (sent if is_send else recvd)[tid] = here
                    if is_send:
                        sends[r * p + peer].append(tid)
                    else:
                        recvs[peer * p + r].append(tid)
                    batch_tids.append(tid)
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
                    sent[tid] = here
                    sends[r * p + peer].append(tid)
                else:
                    if recvd[tid] >= 0 or data[sm] < j:
                        raise _bad_op(lowered, r, j, a, fstep, gstep, sent, recvd)
                    recvd[tid] = here
                    recvs[peer * p + r].append(tid)
                batch_tids.append(tid)
    return ops


def _check_handoffs(lowered: LoweredSchedule, ops: _Ops, fstep: list[int], gstep: list[int]) -> None:
    """Every hand-off between ranks is communicated: a send at its producer, a receive at its consumer."""
    sched = lowered.schedule
    S, m, owner = sched.num_stages, sched.num_microbatches, sched.stage_to_rank
    sent, recvd = ops.sent, ops.recvd
    for s in range(S):
        for mb in range(m):
            if s + 1 < S and owner[s + 1] != owner[s]:
                tid = (s * m + mb) * 2
                r, q = owner[s], owner[s + 1]
                if sent[tid] < 0:
                    j = fstep[s * m + mb]
                    msg = f"rank {r} step {j} ({s}F{mb}): no {s}SEND_F{mb}@{q} sends its output to rank {q}"
                    raise plan_error(lowered, msg, r, j)
                if recvd[tid] < 0:
                    j = fstep[(s + 1) * m + mb]
                    msg = f"rank {q} step {j} ({s + 1}F{mb}): no {s + 1}RECV_F{mb}@{r} receives its input before it"
                    raise plan_error(lowered, msg, q, j)
            if s > 0 and owner[s - 1] != owner[s]:
                tid = (s * m + mb) * 2 + 1
                r, q = owner[s], owner[s - 1]
                if sent[tid] < 0:
                    j = gstep[s * m + mb]
                    msg = f"rank {r} step {j} ({lowered.ranks[r][j]}): no {s}SEND_B{mb}@{q} sends its input gradient"
                    raise plan_error(lowered, msg, r, j)
                if recvd[tid] < 0:
                    j = gstep[(s - 1) * m + mb]
                    msg = f"rank {q} step {j} ({lowered.ranks[q][j]}): no {s - 1}RECV_B{mb}@{r} receives its gradient"
                    raise plan_error(lowered, msg, q, j)


def _match_in_order(lowered: LoweredSchedule, ops: _Ops) -> None:
    """The k-th send from src to dst is matched with the k-th receive at dst from src: the same transfer.
    (Both lists have the same length here: every transfer has exactly one send and one receive.)"""
    p = lowered.schedule.num_ranks
    for key, sends in sorted(ops.sends.items()):  # (src, dst) order, as a diagnosis reads
        recvs = ops.recvs.get(key, [])
        if sends == recvs:
            continue
        src, dst = divmod(key, p)
        for k, (ts, tr) in enumerate(zip(sends, recvs)):
            if ts != tr:
                js, jr = ops.sent[ts] & _STEP, ops.recvd[tr] & _STEP
                sa, ra = _op_of(lowered, ops, src, js, ts), _op_of(lowered, ops, dst, jr, tr)
                msg = (
                    f"rank {dst} step {jr} ({ra}): receive #{k} from rank {src} is matched (by order, no tags) "
                    f"with send #{k} from rank {src} to rank {dst}, which is {sa} (rank {src} step {js}): the two "
                    "sides post their transfers in different orders"
                )
                raise plan_error(lowered, msg, dst, jr)


def _op_of(lowered: LoweredSchedule, ops: _Ops, r: int, j: int, tid: int) -> Action:
    """The op of transfer ``tid`` in rank ``r``'s batch at step ``j`` (diagnosis only)."""
    return lowered.ranks[r][j].actions[ops.tids[r][j].index(tid)]


# ------------------------------------------------------------------------------------------ post-validation


def _check_pv_op(lowered: LoweredSchedule, r: int, j: int, a: Action, seen: list[int], pv_base: int) -> None:
    """A post-validation op (``post_validation_pass``): its own rank, a neighbour in the chain's direction, once."""
    p = lowered.schedule.num_ranks
    chain, peer = a.microbatch, a.peer
    if a.stage != r:
        raise plan_error(
            lowered, f"rank {r} step {j} ({a}): a post-validation op names its own rank {r} as stage", r, j
        )
    if chain not in (0, 1):
        raise plan_error(lowered, f"rank {r} step {j} ({a}): the chain must be 0 (forward partial) or 1 (back)", r, j)
    # Forward chain: send to r + 1, receive from r - 1; back chain: the other way.
    downstream = (chain == 0) == (a.kind is _SEND_PV)
    want = r + 1 if downstream else r - 1
    if peer != want or not 0 <= want < p:
        msg = f"rank {r} step {j} ({a}): the post-validation chain links rank {r} to rank {want}"
        raise plan_error(lowered, msg, r, j)
    src = r if a.kind is _SEND_PV else peer
    if seen[pv_base + chain * p + src] >= 0:
        raise plan_error(lowered, f"rank {r} step {j} ({a}): duplicate post-validation op", r, j)


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
            msg = f"rank {src}: no {src}SEND_PV{c}@{dst} (the post-validation chain is incomplete)"
            raise plan_error(lowered, msg, src)
        if recvd[tid] < 0:
            msg = f"rank {dst}: no {dst}RECV_PV{c}@{src} (the post-validation chain is incomplete)"
            raise plan_error(lowered, msg, dst)
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
            elif first_backward is None and st.kind in (_B, _BW, _W, _PAIR):
                first_backward = j
        if not where:
            continue
        for chain in (0, 1):
            got, put = where.get((_RECV_PV, chain)), where.get((_SEND_PV, chain))
            if got is not None and put is not None and got > put:
                msg = f"rank {r} step {put}: passes on post-validation chain {chain} before receiving it"
                raise plan_error(lowered, msg, r, put)
        point = where.get((_RECV_PV, 1) if r < p - 1 else (_RECV_PV, 0))
        if point is not None and first_backward is not None and point > first_backward:
            raise plan_error(
                lowered,
                f"rank {r} step {first_backward} ({steps[first_backward]}): backward work before the rank's "
                f"post-validation point (step {point}); gradients of the previous step are still pending there",
                r,
                first_backward,
            )


# -------------------------------------------------------------------------------------------- diagnosis


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


def _bad_op(
    lowered: LoweredSchedule, r: int, j: int, a: object, fstep: list[int], gstep: list[int], sent: list, recvd: list
) -> ScheduleError:
    """Say what is wrong with comm op ``a`` at rank ``r`` step ``j`` (the fast path found something)."""
    sched = lowered.schedule
    S, m, owner = sched.num_stages, sched.num_microbatches, sched.stage_to_rank

    def bad(reason: str) -> ScheduleError:
        return plan_error(lowered, f"rank {r} step {j} ({a}): {reason}", r, j)

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
        return bad(f"duplicate; the same transfer is already at step {seen & _STEP}")
    step = (fstep if kind in (Kind.SEND_F, Kind.RECV_F) else gstep)[s * m + mb]
    if is_send:
        return bad(f"sent before the action that produces it (step {step})")
    return bad(f"received after the action that needs it (step {step})")


# ----------------------------------------------------------------------------------------- strict model


def _step_str(lowered: LoweredSchedule, r: int, j: int | None) -> str:
    return "?" if j is None or j >= len(lowered.ranks[r]) else str(lowered.ranks[r][j])


def _simulate_strict(lowered: LoweredSchedule, ops: _Ops) -> None:
    """Run the strict model (no buffering; a batch blocks its rank until all of its ops completed)."""
    ranks = lowered.ranks
    tids, sent, recvd = ops.tids, ops.sent, ops.recvd
    p = len(ranks)
    ptr = [0] * p
    posted = [False] * p
    pending = [0] * p
    work = list(range(p - 1, -1, -1))
    while work:
        r = work.pop()
        steps = ranks[r]
        tids_r = tids[r]
        n = len(steps)
        j = ptr[r]
        while j < n:
            links = tids_r[j]
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
            here = r * _BIG + j
            for tid in links:
                there = sent[tid]  # the other end of the transfer
                if there == here:
                    there = recvd[tid]
                q = there >> _SHIFT
                if posted[q] and ptr[q] == there & _STEP:
                    pending[r] -= 1
                    pending[q] -= 1
                    if pending[q] == 0:
                        work.append(q)
        ptr[r] = j
    blocked = [r for r in range(p) if ptr[r] < len(ranks[r])]
    if blocked:
        _raise_strict_deadlock(lowered, ops, blocked, ptr, posted)


def _raise_strict_deadlock(
    lowered: LoweredSchedule, ops: _Ops, blocked: list[int], ptr: list[int], posted: list[bool]
) -> None:
    ranks = lowered.ranks
    parts = []
    for r in blocked[:MAX_STUCK_LISTED]:
        j = ptr[r]
        for slot, tid in enumerate(ops.tids[r][j]):
            there = ops.sent[tid]
            if there == r * _BIG + j:
                there = ops.recvd[tid]
            q, jq = there >> _SHIFT, there & _STEP
            if not (posted[q] and ptr[q] == jq):
                parts.append(
                    f"rank {r} step {j} ({ranks[r][j].actions[slot]}) waits for rank {q} to post "
                    f"{_op_of(lowered, ops, q, jq, tid)} at its step {jq}, but rank {q} is blocked at step {ptr[q]} "
                    f"({_step_str(lowered, q, ptr[q])})"
                )
                break
    more = len(blocked) - MAX_STUCK_LISTED
    tail = f"; ... and {more} more ranks" if more > 0 else ""
    raise plan_error(
        lowered,
        "deadlock under strict P2P (no buffering, batches block): " + "; ".join(parts) + tail,
        blocked[0],
        ptr[blocked[0]],
    )
