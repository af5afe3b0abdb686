"""Lowering pass for optimizer post-validation: the cross-iteration ``SEND_PV`` / ``RECV_PV`` chain.

With post-validation every pipeline rank steps its optimizer as soon as its own backward work is done, without
waiting for the other ranks' gradient statistics (``zb_pipeline.optim.post_validation``).  The statistics of that
step -- each rank's ``[sum of squared grads, non-finite count, pending]`` -- cross the pipeline at the start of the
*next* iteration's plan, which is why these actions are cross-iteration: the state a rank sends in iteration
``i + 1`` describes the gradients of iteration ``i``.

The chain, in the fixed pipeline-rank order that the synchronised optimizer also sums in:

- forward partial state (``microbatch`` field 0): rank ``r`` receives ``P(r-1)`` from rank ``r - 1``, adds its own
  local state in float64 (``P(r) = P(r-1) + L(r)``) and sends ``P(r)`` to rank ``r + 1``;
- fully reduced state back (``microbatch`` field 1): rank ``p - 1`` holds the total and sends it to ``p - 2``, each
  rank passes it on towards rank 0.

For these actions ``Action.stage`` is the pipeline *rank* that executes the action (not a virtual stage) and
``peer`` the rank it talks to, e.g. ``1RECV_PV0@0 1SEND_PV0@2 1RECV_PV1@2 1SEND_PV1@0`` on rank 1 of four.  Each op
is its own batch, placed before the rank's first compute action, in the order above, so the chain completes under
the strict model independently of the plan's other transfers (a chain has no cycle; the per-pair order is "PV ops
first" on both sides).  A rank validates (and, rarely, rolls back) when the fully reduced state arrives, before
its first forward of the new iteration uses the weights.
"""

from __future__ import annotations

from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule

PV_FORWARD, PV_BACK = 0, 1  # the ``microbatch`` field of a post-validation action: which chain it belongs to
PV_KINDS: frozenset[Kind] = frozenset({Kind.SEND_PV, Kind.RECV_PV})


def post_validation_ops(rank: int, num_ranks: int) -> tuple[Action, ...]:
    """Rank ``rank``'s post-validation ops in posting order (empty for a single rank: nothing to exchange)."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"{rank=} is outside the pipeline ranks 0..{num_ranks - 1}")
    ops = []
    if rank > 0:
        ops.append(Action(rank, Kind.RECV_PV, PV_FORWARD, rank - 1))
    if rank < num_ranks - 1:
        ops.append(Action(rank, Kind.SEND_PV, PV_FORWARD, rank + 1))
        ops.append(Action(rank, Kind.RECV_PV, PV_BACK, rank + 1))
    if rank > 0:
        ops.append(Action(rank, Kind.SEND_PV, PV_BACK, rank - 1))
    return tuple(ops)


def has_post_validation(lowered: LoweredSchedule) -> bool:
    """Whether ``lowered`` carries the post-validation chain (any ``SEND_PV``/``RECV_PV`` op)."""
    return any(
        a.kind in PV_KINDS for steps in lowered.ranks for st in steps if isinstance(st, CommBatch) for a in st.actions
    )


def add_post_validation(lowered: LoweredSchedule) -> LoweredSchedule:
    """``lowered`` with each rank's post-validation chain in front of its plan (module docstring).

    Raises ``ValueError`` if the plan already has post-validation ops (the pass is not idempotent by design: two
    chains would exchange two states per iteration).
    """
    if has_post_validation(lowered):
        raise ValueError(f"plan {lowered.schedule.name!r} already carries SEND_PV/RECV_PV actions; add them once")
    p = lowered.schedule.num_ranks
    ranks = []
    for r, steps in enumerate(lowered.ranks):
        prologue = tuple(CommBatch((a,)) for a in post_validation_ops(r, p))
        ranks.append(prologue + tuple(steps))
    return LoweredSchedule(lowered.schedule, tuple(ranks))
