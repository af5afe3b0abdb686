"""Lowering pass for optimizer post-validation: the cross-iteration ``SEND_PV`` / ``RECV_PV`` chain.

With post-validation every pipeline rank steps its optimizer as soon as its own backward work is done, without
waiting for the other ranks' gradient statistics (``zb_pipeline.optim.post_validation``).  The statistics of that
step -- each rank's ``[sum of squared grads, ranks pending, ranks that stepped]`` -- cross the pipeline during
the *next* iteration's plan, which is why these actions are cross-iteration: the state a rank sends in iteration
``i + 1`` describes the gradients of iteration ``i``.

The chain, in the fixed pipeline-rank order that the synchronised optimizer also sums in:

- forward partial state (``microbatch`` field 0), in each rank's prologue: rank ``r`` receives ``P(r-1)`` from rank
  ``r - 1``, adds its own local state in float64 (``P(r) = P(r-1) + L(r)``) and sends ``P(r)`` to rank ``r + 1``.
  The last rank holds the total before its first forward and validates there.  (A rank's first forward needs the
  previous rank to have started the iteration anyway, so this adds one tiny hop of latency, no wait.)
- fully reduced state back (``microbatch`` field 1), at each rank's *validation point*: rank ``r`` receives the
  total from ``r + 1``, validates, and passes it on to ``r - 1``.

The validation point ``cut[r]`` (``validation_cut``) is as late as the warm-up allows: before the rank's first
backward action (B, BW or W -- gradients are zeroed at validation, and nothing may accumulate before that), moved
earlier where needed so that the prefixes ``steps[:cut[r]]`` form a *consistent cut*: for every ordered pair of
ranks the sends in the sender's prefix are exactly the receives in the receiver's prefix.  So the warm-up forwards
before the cut run with the optimistically updated weights while the state travels, and in the rare case that
validation changes some rank's weights (a rollback, or a step held back that now happens) every rank -- they all
see the same total -- drains the prefix's transfers (they all match, by consistency), restores the iteration's RNG
state and replays the iteration from its first action (``PipelineExecutor``'s replay; the plan without the PV ops).

For these actions ``Action.stage`` is the pipeline *rank* that executes the action (not a virtual stage) and
``peer`` the rank it talks to, e.g. on rank 1 of four: ``1RECV_PV0@0 1SEND_PV0@2`` first, ``1RECV_PV1@2
1SEND_PV1@0`` at its validation point.  Each op is its own batch.  Why the plan stays deadlock-free under the strict
model: the prefixes complete on their own (a consistent cut of a plan that completes); per pair of ranks the back
link is then the first transfer after the prefix on both sides; the back chain starts at the last rank, which has
the total from the prologue.  ``validate.validate_lowered`` checks all of it by simulation (``lowered_checks``).
"""

from __future__ import annotations

from bisect import bisect_left

from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule

PV_FORWARD, PV_BACK = 0, 1  # the ``microbatch`` field of a post-validation action: which chain it belongs to
PV_KINDS: frozenset[Kind] = frozenset({Kind.SEND_PV, Kind.RECV_PV})
_BACKWARD_KINDS = frozenset({Kind.B, Kind.BW, Kind.W, Kind.PAIR})
_SENDS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.SEND_PV})


def prologue_ops(rank: int, num_ranks: int) -> tuple[Action, ...]:
    """Rank ``rank``'s forward-chain ops, posted before anything else of the iteration."""
    _check_rank(rank, num_ranks)
    ops = []
    if rank > 0:
        ops.append(Action(rank, Kind.RECV_PV, PV_FORWARD, rank - 1))
    if rank < num_ranks - 1:
        ops.append(Action(rank, Kind.SEND_PV, PV_FORWARD, rank + 1))
    return tuple(ops)


def validation_ops(rank: int, num_ranks: int) -> tuple[Action, ...]:
    """Rank ``rank``'s back-chain ops, posted at its validation point."""
    _check_rank(rank, num_ranks)
    ops = []
    if rank < num_ranks - 1:
        ops.append(Action(rank, Kind.RECV_PV, PV_BACK, rank + 1))
    if rank > 0:
        ops.append(Action(rank, Kind.SEND_PV, PV_BACK, rank - 1))
    return tuple(ops)


def post_validation_ops(rank: int, num_ranks: int) -> tuple[Action, ...]:
    """Rank ``rank``'s post-validation ops in posting order (empty for a single rank: nothing to exchange)."""
    return prologue_ops(rank, num_ranks) + validation_ops(rank, num_ranks)


def _check_rank(rank: int, num_ranks: int) -> None:
    if not 0 <= rank < num_ranks:
        raise ValueError(f"{rank=} is outside the pipeline ranks 0..{num_ranks - 1}")


def has_post_validation(lowered: LoweredSchedule) -> bool:
    """Whether ``lowered`` carries the post-validation chain (any ``SEND_PV``/``RECV_PV`` op)."""
    return any(
        a.kind in PV_KINDS for steps in lowered.ranks for st in steps if isinstance(st, CommBatch) for a in st.actions
    )


def validation_cut(lowered: LoweredSchedule) -> list[int]:
    """Per rank, the step index of its validation point (module docstring): the largest consistent cut that puts
    every rank's point at or before its first backward action.

    Start from the first backward step of every rank; while some ordered pair ``(src, dst)`` has more sends in
    ``src``'s prefix than receives in ``dst``'s (or the other way round), move the longer side's cut back to the
    batch holding the first unmatched op.  Cuts only move back, so this ends; consistent cuts are closed under the
    element-wise minimum, so the result is the largest consistent one below the start.
    """
    cut = []
    for steps in lowered.ranks:
        first = next(
            (j for j, st in enumerate(steps) if not isinstance(st, CommBatch) and st.kind in _BACKWARD_KINDS),
            len(steps),
        )
        cut.append(first)
    # sends[(src, dst)] / recvs[(src, dst)]: step indices (one per op, in posting order) on src / on dst; only pairs
    # of ranks that talk (no p x p table).
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for r, steps in enumerate(lowered.ranks):
        for j, st in enumerate(steps):
            if isinstance(st, CommBatch):
                for a in st.actions:
                    if a.kind in PV_KINDS:
                        raise ValueError(f"plan {lowered.schedule.name!r} already carries SEND_PV/RECV_PV actions")
                    if a.kind in _SENDS:
                        sends.setdefault((r, a.peer), []).append(j)
                    else:
                        recvs.setdefault((a.peer, r), []).append(j)
    pairs = sorted(set(sends) | set(recvs))
    pairs_of: dict[int, list[tuple[int, int]]] = {}  # rank -> the pairs it is a side of
    for pair in pairs:
        for r in set(pair):
            pairs_of.setdefault(r, []).append(pair)
    # A worklist: a pair is looked at again only when the cut of one of its sides moved.
    todo, queued = list(reversed(pairs)), set(pairs)
    while todo:
        pair = todo.pop()
        queued.discard(pair)
        src, dst = pair
        s_steps, r_steps = sends.get(pair, []), recvs.get(pair, [])
        n_send = bisect_left(s_steps, cut[src])  # sends posted before the cut
        n_recv = bisect_left(r_steps, cut[dst])
        if n_send > n_recv:
            moved, cut[src] = src, s_steps[n_recv]
        elif n_recv > n_send:
            moved, cut[dst] = dst, r_steps[n_send]
        else:
            continue
        for other in pairs_of[moved]:
            if other not in queued:
                queued.add(other)
                todo.append(other)
    return cut


PLACEMENTS = ("cut", "prologue")


def add_post_validation(lowered: LoweredSchedule, *, at: str = "cut") -> LoweredSchedule:
    """``lowered`` with the post-validation chain: the forward links first, the back links at ``validation_cut``
    (``at="cut"``), or every link in the prologue (``at="prologue"``: each rank validates before its first action,
    so nothing is ever replayed, at the price of the chain's latency before the first forward -- the variant for
    iterations that will likely change weights at validation).

    Raises ``ValueError`` if the plan already has post-validation ops (the pass is not idempotent by design: two
    chains would exchange two states per iteration).
    """
    if at not in PLACEMENTS:
        raise ValueError(f"{at=} must be one of {PLACEMENTS}")
    if has_post_validation(lowered):
        raise ValueError(f"plan {lowered.schedule.name!r} already carries SEND_PV/RECV_PV actions; add them once")
    p = lowered.schedule.num_ranks
    cut = validation_cut(lowered) if at == "cut" else [0] * p
    ranks = []
    for r, steps in enumerate(lowered.ranks):
        head = tuple(CommBatch((a,)) for a in prologue_ops(r, p))
        point = tuple(CommBatch((a,)) for a in validation_ops(r, p))
        ranks.append(head + tuple(steps[: cut[r]]) + point + tuple(steps[cut[r] :]))
    return LoweredSchedule(lowered.schedule, tuple(ranks))


def strip_post_validation(lowered: LoweredSchedule) -> LoweredSchedule:
    """``lowered`` without its post-validation ops (the plan ``add_post_validation`` started from)."""
    return LoweredSchedule(lowered.schedule, tuple(without_post_validation(steps) for steps in lowered.ranks))


def without_post_validation(steps: tuple) -> tuple:
    """A rank's lowered steps with the post-validation batches removed (what a replayed iteration runs)."""
    return tuple(st for st in steps if not (isinstance(st, CommBatch) and st.actions[0].kind in PV_KINDS))


def replay_point(steps: tuple) -> int | None:
    """Index of the step after this rank's last post-validation batch (where a replay may start), or ``None``."""
    last = None
    for j, st in enumerate(steps):
        if isinstance(st, CommBatch) and any(a.kind in PV_KINDS for a in st.actions):
            last = j
    return None if last is None else last + 1
