"""Hand-made plans and independent reference checkers for the validator and lowering tests.

Nothing here imports the validator or the lowering pass: the plans are built from the dependency rules directly,
and the checkers (pairing, strict and buffered P2P) are deliberately naive re-implementations, so that the tests
do not grade the code with itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from zb_pipeline.schedule.ir import BW, B, F, Kind, Schedule, W, loop_placement, v_placement
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule


def one_f_one_b(p: int, m: int, *, split: bool = False) -> Schedule:
    """1F1B, written out independently of the generators; ``split`` runs B then W right away instead of BW."""
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [F(r, mb) for mb in range(warmup)]
        backward = [(B(r, mb), W(r, mb)) if split else (BW(r, mb),) for mb in range(m)]
        for i in range(m - warmup):
            acts.append(F(r, warmup + i))
            acts.extend(backward[i])
        for mb in range(m - warmup, m):
            acts.extend(backward[mb])
        ranks.append(acts)
    return Schedule("test-1f1b", p, p, m, loop_placement(p), ranks)


def v_gpipe(p: int, m: int) -> Schedule:
    """V placement with two chunks: chunk 0 forwards, chunk 1 forwards, chunk 1 backwards, chunk 0 backwards,
    with split B/W (W right after its B)."""
    place = v_placement(p, 2)
    ranks = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r  # this rank's stages in chunk 0 and chunk 1
        acts = [F(s0, mb) for mb in range(m)] + [F(s1, mb) for mb in range(m)]
        for s in (s1, s0):
            for mb in range(m):
                acts += [B(s, mb), W(s, mb)]
        ranks.append(acts)
    return Schedule("test-v", p, 2 * p, m, place, ranks)


def random_placement(p: int, chunks: int, rng: random.Random) -> tuple[int, ...]:
    """Each rank gets ``chunks`` virtual stages, in a random order."""
    stages = [r for r in range(p) for _ in range(chunks)]
    rng.shuffle(stages)
    return tuple(stages)


def list_schedule(
    p: int, m: int, stage_to_rank: Sequence[int], *, seed: int, split: float = 0.5, name: str = "test-random"
) -> Schedule:
    """A random dependency-valid plan: in unit-time ticks each rank runs one random ready action.

    Each (stage, microbatch) uses split B/W with probability ``split``, else a fused BW.  Ready means every
    dependency ended in an earlier tick, so the plan can always finish.
    """
    rng = random.Random(seed)
    S = len(stage_to_rank)
    use_split = {(s, mb): rng.random() < split for s in range(S) for mb in range(m)}
    todo: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    for s in range(S):
        for mb in range(m):
            todo[stage_to_rank[s]].append(("F", s, mb))
            todo[stage_to_rank[s]] += [("B", s, mb), ("W", s, mb)] if use_split[(s, mb)] else [("BW", s, mb)]
    done: set[tuple[str, int, int]] = set()  # "F" / "G" (input gradient ready) / "W", stage, mb

    def ready(kind: str, s: int, mb: int) -> bool:
        if kind == "F":
            return s == 0 or ("F", s - 1, mb) in done
        if kind == "W":
            return ("G", s, mb) in done
        return ("F", s, mb) in done and (s == S - 1 or ("G", s + 1, mb) in done)

    ranks: list[list] = [[] for _ in range(p)]
    make = {"F": F, "B": B, "W": W, "BW": BW}
    while any(todo):
        finished = []
        for r in range(p):
            cands = [a for a in todo[r] if ready(*a)]
            if not cands:
                continue
            kind, s, mb = rng.choice(cands)
            todo[r].remove((kind, s, mb))
            ranks[r].append(make[kind](s, mb))
            finished += {"F": [("F", s, mb)], "B": [("G", s, mb)], "W": [("W", s, mb)], "BW": [("G", s, mb)]}[kind]
        done.update(finished)
    return Schedule(name, p, S, m, tuple(stage_to_rank), ranks)


# ------------------------------------------------------------------------------------------ reference checks


def expected_transfers(schedule: Schedule) -> set[tuple[str, int, int, int, int]]:
    """(direction, producing stage, mb, src rank, dst rank) of every hand-off that crosses ranks."""
    out = set()
    S, owner = schedule.num_stages, schedule.stage_to_rank
    for mb in range(schedule.num_microbatches):
        for s in range(S):
            if s + 1 < S and owner[s + 1] != owner[s]:
                out.add(("F", s, mb, owner[s], owner[s + 1]))
            if s > 0 and owner[s - 1] != owner[s]:
                out.add(("B", s, mb, owner[s], owner[s - 1]))
    return out


def transfer_of(rank: int, a) -> tuple[str, int, int, int, int]:
    """The hand-off a comm action takes part in, named like ``expected_transfers``."""
    k = a.kind
    if k is Kind.SEND_F:
        return ("F", a.stage, a.microbatch, rank, a.peer)
    if k is Kind.RECV_F:
        return ("F", a.stage - 1, a.microbatch, a.peer, rank)
    if k is Kind.SEND_B:
        return ("B", a.stage, a.microbatch, rank, a.peer)
    assert k is Kind.RECV_B, a
    return ("B", a.stage + 1, a.microbatch, a.peer, rank)


def pair_lists(lowered: LoweredSchedule) -> tuple[dict, dict]:
    """Per (src, dst): the transfers of src's sends and of dst's receives, each in posting order."""
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for r, steps in enumerate(lowered.ranks):
        for st in steps:
            if isinstance(st, CommBatch):
                for a in st.actions:
                    t = transfer_of(r, a)
                    if a.kind in (Kind.SEND_F, Kind.SEND_B):
                        sends.setdefault((r, a.peer), []).append(t)
                    else:
                        recvs.setdefault((a.peer, r), []).append(t)
    return sends, recvs


def run_p2p(lowered: LoweredSchedule, *, buffered: bool) -> list[int]:
    """Naive fixed-point run of the P2P model; returns the ranks that never finish (empty: the plan completes).

    Strict: an op completes once both its side and its partner's side are posted (the k-th send from src to dst
    pairs with the k-th receive at dst from src); a rank leaves a batch when all its ops completed.  Buffered (as
    gloo): a send completes as soon as it is posted.  Compute steps never block.
    """
    counters: dict[tuple[str, int, int], int] = {}
    where = {}  # (rank, step, slot) -> op id
    for r, steps in enumerate(lowered.ranks):
        for j, st in enumerate(steps):
            if isinstance(st, CommBatch):
                for slot, a in enumerate(st.actions):
                    is_send = a.kind in (Kind.SEND_F, Kind.SEND_B)
                    pair = (r, a.peer) if is_send else (a.peer, r)
                    c = ("s" if is_send else "r", *pair)
                    k = counters.get(c, 0)
                    counters[c] = k + 1
                    where[(r, j, slot)] = ("s" if is_send else "r", *pair, k)
    ptr = [0] * len(lowered.ranks)
    posted: set = set()  # op ids posted
    completed: set = set()
    changed = True
    while changed:
        changed = False
        for r, steps in enumerate(lowered.ranks):
            while ptr[r] < len(steps):
                st = steps[ptr[r]]
                if not isinstance(st, CommBatch):
                    ptr[r] += 1
                    changed = True
                    continue
                ids = [where[(r, ptr[r], slot)] for slot in range(len(st.actions))]
                before = (len(posted), len(completed))
                posted.update(ids)
                for op in ids:
                    side, src, dst, k = op
                    other = ("r" if side == "s" else "s", src, dst, k)
                    if other in posted or (buffered and side == "s"):
                        completed.add(op)
                changed |= (len(posted), len(completed)) != before
                if all(op in completed for op in ids):
                    ptr[r] += 1
                    changed = True
                else:
                    break
    return [r for r, steps in enumerate(lowered.ranks) if ptr[r] < len(steps)]


def data_ready(lowered: LoweredSchedule) -> bool:
    """Every send comes after the action that produces its data, every receive before the one that consumes it."""
    for steps in lowered.ranks:
        pos = {}
        for j, st in enumerate(steps):
            if not isinstance(st, CommBatch):
                key = "F" if st.kind is Kind.F else ("G" if st.kind in (Kind.B, Kind.BW) else "W")
                pos[(key, st.stage, st.microbatch)] = j
        for j, st in enumerate(steps):
            if isinstance(st, CommBatch):
                for a in st.actions:
                    key = ("F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "G", a.stage, a.microbatch)
                    if a.kind in (Kind.SEND_F, Kind.SEND_B) and not pos[key] < j:
                        return False
                    if a.kind in (Kind.RECV_F, Kind.RECV_B) and not pos[key] > j:
                        return False
    return True


def producing_step_ends(result) -> dict[tuple[int, bool, int], float]:
    """(stage, forward?, microbatch) -> when the plan step producing that output ends in a ``simulate`` result (a
    pair's halves both at the pair's end; W produces nothing)."""
    from zb_pipeline.schedule.ir import halves

    return {
        (h.stage, h.kind is Kind.F, h.microbatch): x.end
        for line in result.timeline
        for x in line
        for h in halves(x.action)
        if h.kind is not Kind.W
    }


def events_as_simulated(
    sched: Schedule, result, costs, comm_ms: float, ev: Callable[..., dict], post_ms: float | None = None
) -> list[list[dict]]:
    """Each rank's trace events of ``sched`` run exactly as ``result`` (its ``simulate`` under ``costs``) times it:
    every cross-rank input waited for from the rank's previous end to its arrival (the producing plan step's end +
    ``comm_ms``), a pair's halves as an F and then a BW event (both with ``pair=str(step)``); with ``post_ms``, every
    cross-rank send posted ``post_ms`` after its plan step ends (a pair: after its backward half, as lowered).
    ``ev(rank, cat, stage, microbatch, start_ms, dur_ms, tid=0, **args)`` builds one event."""
    from zb_pipeline.schedule.ir import halves

    owner, last = sched.stage_to_rank, sched.num_stages - 1
    ends = producing_step_ends(result)
    traces = []
    for r, line in enumerate(result.timeline):
        evs, free = [], 0.0
        for x in line:
            t, hs = x.start, halves(x.action)
            pair = {"pair": str(x.action)} if len(hs) > 1 else {}
            for h in hs:
                fwd = h.kind is Kind.F
                if h.kind is not Kind.W:
                    src = h.stage - 1 if fwd else h.stage + 1
                    if 0 <= src <= last and owner[src] != r:
                        arrival = ends[(src, fwd, h.microbatch)] + comm_ms
                        recv = "RECV_F" if fwd else "RECV_B"
                        evs.append(ev(r, "wait", h.stage, h.microbatch, free, max(arrival - free, 0.0), kind=recv))
                        free = max(free, arrival)
                    dst = h.stage + 1 if fwd else h.stage - 1
                    if post_ms is not None and 0 <= dst <= last and owner[dst] != r:
                        send = "SEND_F" if fwd else "SEND_B"
                        evs.append(ev(r, send, h.stage, h.microbatch, x.end + post_ms, 0.0, tid=1))
                dur = x.end - t if h is hs[-1] else costs.f[h.stage]  # a pair: its F, then its BW
                evs.append(ev(r, h.kind.value, h.stage, h.microbatch, t, dur, **pair))
                t += dur
            free = x.end
        traces.append(evs)
    return traces
