"""Lowering: add the point-to-point communication a compute plan needs, in an order that is safe on NCCL.

What comes out
--------------
``lower(schedule)`` returns a ``LoweredSchedule``: each rank's compute actions (unchanged, same order) with
``CommBatch`` steps between them.  A batch holds ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B`` actions (stage
conventions in ``ir.py``; ``Action.peer`` is the other rank) that the runtime posts together
(``batch_isend_irecv``).  Only hand-offs between *different* ranks are communicated: with V placement the
activation of stage ``p - 1`` goes to stage ``p`` on the same rank locally, and so does anything else placed on one
rank.

The communication model (strict, as NCCL imposes it)
----------------------------------------------------
- Per ordered pair of ranks ``(src, dst)`` the k-th send from ``src`` to ``dst`` is matched with the k-th receive
  at ``dst`` from ``src``; there are no tags, so both sides must list their transfers in the same order.
- A send completes only once its matching receive has been posted (no buffering).
- A rank posts a ``CommBatch`` as a unit and blocks until every op in it has completed; compute actions never
  block (their inputs arrived in an earlier batch).
``lowered_checks.check_lowered_comms`` simulates exactly this model.

Dependencies (the same for the validator and the simulator)
-----------------------------------------------------------
F of ``(s, mb)`` needs F of ``(s - 1, mb)``; B or BW of ``(s, mb)`` needs its own F and the B or BW of
``(s + 1, mb)`` (on the last stage only its own F: the loss); W needs its B.  An overlapped pair
(``ir.PairAction``) is one step: it needs everything its F and its BW need, and both of its outputs exist at its end
(its halves never feed each other: they hold different microbatches).

The algorithm
-------------
1. *Event order.*  Run the compute plan once under unit costs (F = B = W = 1, BW = 2, a pair 3, no communication):
   each rank executes its actions in order, each action starting when the previous one on its rank and all of its
   dependencies have ended.  This gives every compute action an integer end time ``end`` and a global completion
   index ``seq``; it is O(number of actions) (a rank that waits is parked on the one event it waits for).  If
   the plan can never finish this way it is not dependency-valid and ``lower`` raises ``ValueError``.
2. *Transfers.*  Each hand-off that crosses ranks (F of ``s`` feeding F of ``s + 1``; B or BW of ``s`` feeding the
   backward of ``s - 1``) gets the key ``(end, seq)`` of the action that produces it.  The producer's rank gets the
   send, the consumer's rank the receive, *both with the same key*.  A pair's two transfers share its key, the
   forward's first: so a pair receives both of its inputs before it starts and sends both outputs after it ends
   (DualPipe's pattern).
3. *Placement.*  On every rank, all transfers whose producer ends at time ``t`` form one batch, posted after the
   rank's compute actions that end at or before ``t`` and before those that end after ``t``; inside a batch (and
   so between every pair of ranks) transfers are ordered by key.  A send therefore comes right after its producer,
   and a receive is posted at the moment its data comes into existence in the simulated run -- the earliest
   point that is safe for every plan -- which is often well before the consumer, so the runtime can overlap the
   transfer with compute.  Sends and receives that fall on the same instant share one batch (in 1F1B's steady
   state this is Megatron's ``send_forward_recv_backward`` pairing).

Why it never deadlocks: batches on every rank are sorted by their time ``t``, and a batch's partner ops sit in
the partners' batches of the *same* ``t`` (same key on both sides).  Suppose some batch never completes and take
the stuck batch with the smallest ``t``: each partner rank has completed all its batches with smaller times
(minimality), compute never blocks, so every partner reaches -- and posts -- its batch at ``t``, and every op of
the stuck batch is matched.  Contradiction.  Receives posted earlier than the producer's end (for example at
the start of the rank's program) would break this argument: the receiver would block before work that the
producer may itself be waiting for.

Merging batches that are adjacent on a rank (no compute between them) is also safe, since posting ops earlier
never prevents a match; we do not do it, so a receive's completion never waits on an unrelated later send.
"""

from __future__ import annotations

import gc
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from zb_pipeline.schedule.ir import Action, Kind, PairAction, PlanAction, Schedule, unchecked_action

# Event slots: key = (stage * m + microbatch) * 3 + slot.
SLOT_F = 0  # F(s, mb) ended: its activation exists
SLOT_G = 1  # B or BW of (s, mb) ended: the gradient of its input exists
SLOT_W = 2  # W of (s, mb) ended (or the W half of a BW)
COMM_KINDS: frozenset[Kind] = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# Enum members as plain module constants: the hot loops compare kinds by identity (Enum hashing is slow).
_F, _B, _W, _BW, _PAIR = Kind.F, Kind.B, Kind.W, Kind.BW, Kind.PAIR
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_new = object.__new__


@dataclass(frozen=True, slots=True)
class CommBatch:
    """Communication actions that one rank posts together and waits for as a unit."""

    actions: tuple[Action, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(self.actions))

    def __str__(self) -> str:
        return "{" + ",".join(str(a) for a in self.actions) + "}"

    def __len__(self) -> int:
        return len(self.actions)


LoweredStep = Action | CommBatch
_SET_ACTIONS = CommBatch.__dict__["actions"].__set__


def _batch(actions: tuple[Action, ...]) -> CommBatch:
    """``CommBatch(actions)`` for a tuple built here (no copy, no ``__init__``)."""
    b = _new(CommBatch)
    _SET_ACTIONS(b, actions)
    return b


@dataclass(frozen=True)
class LoweredSchedule:
    """A compute plan plus its communication: per rank, compute actions and ``CommBatch`` steps in posting order."""

    schedule: Schedule
    ranks: tuple[tuple[LoweredStep, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))

    def comm_actions(self, rank: int) -> list[Action]:
        """Every communication action of ``rank`` in posting order (batches flattened)."""
        return [a for step in self.ranks[rank] if isinstance(step, CommBatch) for a in step.actions]

    @property
    def num_batches(self) -> int:
        return sum(isinstance(step, CommBatch) for steps in self.ranks for step in steps)

    def __str__(self) -> str:
        s = self.schedule
        lines = [f"{s.name} (lowered): p={s.num_ranks} S={s.num_stages} m={s.num_microbatches} ({s.placement})"]
        for r, steps in enumerate(self.ranks):
            lines.append(f"  rank {r}: " + " ".join(str(step) for step in steps))
        return "\n".join(lines)


def action_deps(kind: Kind, stage: int, microbatch: int, num_stages: int, m: int) -> tuple[int, ...]:
    """The event keys a compute action waits for (the dependency rules of the module docstring)."""
    base = (stage * m + microbatch) * 3
    if kind is _F:
        return (base - 3 * m + SLOT_F,) if stage > 0 else ()
    if kind is _W:
        return (base + SLOT_G,)
    # B / BW: its own F, and the gradient from the next stage (the loss, i.e. its own F, on the last stage).
    if stage < num_stages - 1:
        return (base + SLOT_F, base + 3 * m + SLOT_G)
    return (base + SLOT_F,)


def step_deps(step: PlanAction, num_stages: int, m: int) -> tuple[int, ...]:
    """``action_deps`` of a plan step: a pair waits for what both of its halves wait for."""
    if step.kind is _PAIR:
        f, b = step.forward, step.backward
        f_deps = action_deps(_F, f.stage, f.microbatch, num_stages, m)
        return f_deps + action_deps(_BW, b.stage, b.microbatch, num_stages, m)
    return action_deps(step.kind, step.stage, step.microbatch, num_stages, m)


def _pair_events(pair: PairAction, num_stages: int, m: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A pair's dependencies, the events it produces and its unit cost (F 1 + BW 2)."""
    f, b = pair.forward, pair.backward
    fb, bb = (f.stage * m + f.microbatch) * 3, (b.stage * m + b.microbatch) * 3
    return step_deps(pair, num_stages, m), (fb + SLOT_F, bb + SLOT_G, bb + SLOT_W), 3


def describe_event(key: int, m: int) -> str:
    """The action (spelled as in the IR) whose end is event ``key``."""
    sm, slot = divmod(key, 3)
    s, mb = divmod(sm, m)
    return {SLOT_F: f"{s}F{mb}", SLOT_G: f"{s}B{mb}", SLOT_W: f"{s}W{mb}"}[slot]


@dataclass(frozen=True)
class EventOrder:
    """One run of a compute plan under unit costs.

    ``end[r][i]`` and ``seq[r][i]`` are the end time and global completion index of rank ``r``'s ``i``-th action.
    If the plan cannot finish, ``stuck`` lists ``(rank, position, event key it waits for)`` for each rank that is
    blocked (``end``/``seq`` then cover only what ran).
    """

    end: tuple[tuple[int, ...], ...]
    seq: tuple[tuple[int, ...], ...]
    stuck: tuple[tuple[int, int, int], ...]


def event_order(schedule: Schedule) -> EventOrder:
    """Run ``schedule`` under unit costs (O(actions)); assumes every action is a compute action, in range and unique."""
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    last = S - 1
    done = [-1] * (S * m * 3)  # event key -> end time (-1: not yet)
    waiting: dict[int, list[int]] = {}
    blocked: list[int | None] = [None] * p
    pos = [0] * p
    clock = [0] * p
    ends: list[list[int]] = [[] for _ in range(p)]
    seqs: list[list[int]] = [[] for _ in range(p)]
    counter = 0
    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        blocked[r] = None
        acts = schedule.ranks[r]
        i, t_rank, n = pos[r], clock[r], len(acts)
        end_r, seq_r = ends[r], seqs[r]
        while i < n:
            a = acts[i]
            kind = a.kind
            if kind is _PAIR:  # the F and the BW of a pair: every input before it starts, every output at its end
                deps, produced, cost = _pair_events(a, S, m)
                missing = next((d for d in deps if done[d] < 0), -1)
                if missing >= 0:
                    waiting.setdefault(missing, []).append(r)
                    blocked[r] = missing
                    break
                t_rank = max([t_rank] + [done[d] for d in deps]) + cost
            else:
                s, mb = a.stage, a.microbatch
                base = (s * m + mb) * 3
                # The events this action waits for (see action_deps), inlined: this loop is the hot path.
                if kind is _F:
                    d1, d2 = (base - 3 * m if s > 0 else -1), -1
                elif kind is _W:
                    d1, d2 = base + SLOT_G, -1
                else:
                    d1, d2 = base + SLOT_F, (base + 3 * m + SLOT_G if s < last else -1)
                start = t_rank
                missing = -1
                if d1 >= 0:
                    t = done[d1]
                    if t < 0:
                        missing = d1
                    elif t > start:
                        start = t
                if d2 >= 0 and missing < 0:
                    t = done[d2]
                    if t < 0:
                        missing = d2
                    elif t > start:
                        start = t
                if missing >= 0:
                    waiting.setdefault(missing, []).append(r)
                    blocked[r] = missing
                    break
                if kind is _F:
                    t_rank = start + 1
                    produced = (base + SLOT_F,)
                elif kind is _B:
                    t_rank = start + 1
                    produced = (base + SLOT_G,)
                elif kind is _W:
                    t_rank = start + 1
                    produced = (base + SLOT_W,)
                else:  # BW costs B + W
                    t_rank = start + 2
                    produced = (base + SLOT_G, base + SLOT_W)
            for key in produced:
                done[key] = t_rank
                if waiting:
                    woken = waiting.pop(key, None)
                    if woken:
                        ready.extend(woken)
            end_r.append(t_rank)
            seq_r.append(counter)
            counter += 1
            i += 1
        pos[r], clock[r] = i, t_rank
    stuck = tuple((r, pos[r], key) for r, key in enumerate(blocked) if key is not None)
    return EventOrder(tuple(map(tuple, ends)), tuple(map(tuple, seqs)), stuck)


def _transfers(
    a: Action, r: int, key: int, num_stages: int, owner: tuple[int, ...], mine: list, comm: list[list]
) -> None:
    """For one half of a pair on rank ``r``: the send of its output and the receive at its consumer's rank, both with
    sort key ``key`` (the pair's end, completion index and half; see ``_lower``), if the hand-off crosses ranks."""
    s, mb = a.stage, a.microbatch
    if a.kind is _F:
        if s + 1 < num_stages and owner[s + 1] != r:
            q = owner[s + 1]
            mine.append((key, _comm_action(s, _SEND_F, mb, q)))
            comm[q].append((key, _comm_action(s + 1, _RECV_F, mb, r)))
    elif s > 0 and owner[s - 1] != r:  # the BW half
        q = owner[s - 1]
        mine.append((key, _comm_action(s, _SEND_B, mb, q)))
        comm[q].append((key, _comm_action(s - 1, _RECV_B, mb, r)))


# ``Action(stage, kind, microbatch, peer)`` without re-checking its fields: lowering creates one per transfer end
# (millions for p = 512, m = 2048), all valid by construction.
_comm_action = unchecked_action


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small acyclic objects.

    Lowering a p = 64, m = 512 plan allocates ~10^6 tuples and actions; the collector's repeated scans of them
    would cost more than the work itself (about 3x here).  Nothing built here forms reference cycles.  On the way
    out, what was built is moved to the oldest generation unscanned (``gc.freeze`` then ``gc.unfreeze``; only when
    nobody else froze objects): otherwise the first collections after re-enabling would scan every object made here
    once more (about 10 s for p = 512, m = 2048).  Nothing is left frozen, and cycles are still collected (by the next
    full collection).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def kind_code(kind: Kind) -> int:
    """0..3 for F, B, W, BW; -1 for anything else (identity tests: cheaper than hashing the enum)."""
    if kind is _F:
        return 0
    if kind is _B:
        return 1
    if kind is _W:
        return 2
    if kind is _BW:
        return 3
    return -1


def _check_compute_only(schedule: Schedule) -> None:
    """The cheap structural checks ``lower`` relies on (``validate.check_and_lower`` gives the full diagnosis)."""
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    seen = bytearray(S * m * 4)
    for r, acts in enumerate(schedule.ranks):
        for i, step in enumerate(acts):
            if type(step) is PairAction and step.forward.microbatch == step.backward.microbatch:
                raise ValueError(f"cannot lower {schedule.name!r}: rank {r} position {i} ({step}) pairs one microbatch")
            for a in (step.forward, step.backward) if type(step) is PairAction else (step,):
                code = kind_code(a.kind)
                s, mb = a.stage, a.microbatch
                if code < 0 or s >= S or mb >= m or owner[s] != r:
                    raise ValueError(
                        f"cannot lower {schedule.name!r}: rank {r} position {i} ({step}) is not a compute action of a "
                        f"stage on that rank; run check_and_lower() for the full diagnosis"
                    )
                key = (s * m + mb) * 4 + code
                if seen[key]:
                    raise ValueError(f"cannot lower {schedule.name!r}: rank {r} position {i} repeats {a}")
                seen[key] = 1


def lower(schedule: Schedule, *, order: EventOrder | None = None) -> LoweredSchedule:
    """Add the communication ``schedule`` needs (see the module docstring for the algorithm and its guarantee).

    ``schedule`` must be dependency-valid (``check_and_lower`` checks that first and passes its ``order`` on);
    otherwise ``ValueError`` is raised.
    """
    with no_gc():
        return _lower(schedule, order)


def _lower(schedule: Schedule, order: EventOrder | None) -> LoweredSchedule:
    if order is None:
        _check_compute_only(schedule)
        order = event_order(schedule)
    if order.stuck:
        r, i, key = order.stuck[0]
        raise ValueError(
            f"cannot lower {schedule.name!r}: the plan never finishes (rank {r} position {i} "
            f"({schedule.ranks[r][i]}) waits for {describe_event(key, schedule.num_microbatches)}); "
            f"run check_and_lower() for the full diagnosis"
        )
    S, owner = schedule.num_stages, schedule.stage_to_rank
    # Per rank: (key, op) of every comm op it takes part in, key = (end << shift) | (seq << 1) | half: the order of
    # (end, seq, half) as one int.  (seq, half) is unique within a rank (each producer makes at most one transfer; a
    # pair's two halves one each), so sorting never compares the actions.
    shift = (2 * sum(map(len, schedule.ranks)) + 2).bit_length()
    comm: list[list[tuple[int, Action]]] = [[] for _ in range(schedule.num_ranks)]
    for r, acts in enumerate(schedule.ranks):
        end_r, seq_r = order.end[r], order.seq[r]
        mine = comm[r]
        for i, a in enumerate(acts):
            kind = a.kind
            if kind is _F:
                s = a.stage
                if s + 1 < S:
                    q = owner[s + 1]
                    if q != r:
                        key, mb = (end_r[i] << shift) | (seq_r[i] << 1), a.microbatch
                        mine.append((key, _comm_action(s, _SEND_F, mb, q)))
                        comm[q].append((key, _comm_action(s + 1, _RECV_F, mb, r)))
            elif kind is _PAIR:  # both halves' outputs leave at the pair's end: the forward's first
                key = (end_r[i] << shift) | (seq_r[i] << 1)
                _transfers(a.forward, r, key, S, owner, mine, comm)
                _transfers(a.backward, r, key | 1, S, owner, mine, comm)
            elif kind is not _W and a.stage > 0:  # B or BW
                s = a.stage
                q = owner[s - 1]
                if q != r:
                    key, mb = (end_r[i] << shift) | (seq_r[i] << 1), a.microbatch
                    mine.append((key, _comm_action(s, _SEND_B, mb, q)))
                    comm[q].append((key, _comm_action(s - 1, _RECV_B, mb, r)))

    ranks: list[tuple[LoweredStep, ...]] = []
    for r, acts in enumerate(schedule.ranks):
        ops = comm[r]
        ops.sort()
        comm[r] = []  # this rank's ops now live in its batches
        end_r = order.end[r]
        steps: list[LoweredStep] = []
        add = steps.append
        i, j, n_ops = 0, 0, len(ops)
        while j < n_ops:
            t = ops[j][0] >> shift
            i2 = bisect_right(end_r, t, i)  # end times increase along a rank
            if i2 > i:
                steps.extend(acts[i:i2])
                i = i2
            k = j + 1
            while k < n_ops and ops[k][0] >> shift == t:
                k += 1
            add(_batch(tuple([op[1] for op in ops[j:k]])))
            j = k
        steps.extend(acts[i:])
        ranks.append(tuple(steps))
    return LoweredSchedule(schedule, tuple(ranks))
