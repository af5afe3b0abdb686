"""DualPipeV: DeepSeek's DualPipe folded onto p ranks in a V (``dualpipev``, chunks 2).

Rank ``r`` holds virtual stage ``r`` (chunk 0, on the way down) and stage ``2p - 1 - r`` (chunk 1, on the way back
up; rank 0 holds the loss), the V placement of ``ir.v_placement``.  In its steady state every step is an overlapped
pair (``ir.PairAction``): the forward of one chunk with the full backward of the other, whose communication is hidden
behind the other's compute on a real device.  The phases of rank ``r`` (``n = p``; each chunk takes its forwards and
its backwards in microbatch order; ``B`` defers its weight gradient to a ``W`` queue that ``W`` drains first in,
first out):

====  ===================  ===========================  ============================================================
step  repeats              does                         why
====  ===================  ===========================  ============================================================
1     ``2 (n - r - 1)``    F0                           fill the way down
2     ``r + 1``            F0, F1                       the first microbatches turn at the tip of the V
3     ``n - r - 1``        B1, W, F1                    zero-bubble: the W fills the wait for the next F1
4     ``m - 2n + r + 1``   (F0 + BW1), (F1 + BW0)       the steady state: two pairs per round
5     ``n - r - 1``        BW1, (F1 + BW0)              the forwards run out
6     ``r + 1``            B1, B0 (full, then split)    the second half of these defer their W (ZB)
7     ``n - r - 1``        W, B0                        W fills the wait for the next gradient
8     ``r + 1``            W                            drain the W queue
====  ===================  ===========================  ============================================================

In step 6 the backwards switch from full (``BW``) to split (``B``, W deferred) at round ``(r + 1) // 2``: before B1 on
odd ranks, before B0 on even ones, so exactly ``r + 1`` of them are split.  The last rank does not overlap its first
round of step 4 (F0 then BW1, as two steps): its BW1 needs a gradient that is still on its way back.

Shape: ``m >= 2p`` (the steady state needs at least one round on rank 0); fewer raises ``ValueError`` in one line.
Costs do not change the plan.

Idle time (the formula of DualPipe's README for the V variant, ``(PP/2 - 1)(F&B + B - 3W)``, with ``PP`` its number of
stages, ``2p`` here, ``F``/``B``/``W`` one chunk's forward, *full* backward and weight-gradient time, and ``F&B`` a
pair): under uniform per-chunk costs ``f, b, w`` and ``T_comm = 0`` every rank is idle for
``(p - 1)(F&B + (b + w) - 3w)`` with ``F&B = overlap * (f + b + w)`` (``StageCosts.overlap``; 1 = the sum of the
parts) -- ``tests/test_dualpipe_v.py`` asserts it exactly over a grid.

Peak activation memory (the default model: a microbatch's chunk activation lives from its F to its W): ``2p + 1``
chunk activations on every rank -- DualPipe's ``PP + 1`` -- reached inside the first pair of step 4, after its F and
before its BW frees; in units of a rank's whole share (two chunks) that is ``p + 1/2`` (the registry's
``memory_bound``).
"""

from __future__ import annotations

from collections import deque

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.classic import check_mem_limit
from zb_pipeline.schedule.ir import BW, B, F, PairAction, PlanAction, Schedule, W, v_placement
from zb_pipeline.schedule.registry import register

NAME = "dualpipev"


class _Rank:
    """One rank's plan as it is written down: per-chunk microbatch counters and the W queue."""

    def __init__(self, p: int, r: int) -> None:
        self.stage = (r, 2 * p - 1 - r)  # chunk 0 and chunk 1
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.pending_w: deque[tuple[int, int]] = deque()
        self.steps: list[PlanAction] = []

    def _f(self, chunk: int):
        mb = self.next_f[chunk]
        self.next_f[chunk] += 1
        return F(self.stage[chunk], mb)

    def _bw(self, chunk: int):
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        return BW(self.stage[chunk], mb)

    def forward(self, chunk: int) -> None:
        self.steps.append(self._f(chunk))

    def backward(self, chunk: int, *, split: bool) -> None:
        """A full backward, or (``split``) its input part with the W queued."""
        if not split:
            self.steps.append(self._bw(chunk))
            return
        s, mb = self.stage[chunk], self.next_b[chunk]
        self.next_b[chunk] += 1
        self.steps.append(B(s, mb))
        self.pending_w.append((s, mb))

    def weight(self) -> None:
        self.steps.append(W(*self.pending_w.popleft()))

    def pair(self, f_chunk: int, b_chunk: int) -> None:
        self.steps.append(PairAction(self._f(f_chunk), self._bw(b_chunk)))


def dualpipe_v_ranks(p: int, m: int) -> list[list[PlanAction]]:
    """Each rank's steps (module docstring's table)."""
    if m < 2 * p:
        raise ValueError(f"{NAME} needs m >= 2p microbatches: m={m} < 2 x p={p} (use m >= {2 * p})")
    ranks = []
    for r in range(p):
        me = _Rank(p, r)
        tail = p - r - 1  # ranks below this one
        for _ in range(2 * tail):  # 1
            me.forward(0)
        for _ in range(r + 1):  # 2
            me.forward(0)
            me.forward(1)
        for _ in range(tail):  # 3
            me.backward(1, split=True)
            me.weight()
            me.forward(1)
        for i in range(m - 2 * p + r + 1):  # 4
            if i == 0 and r == p - 1:
                me.forward(0)
                me.backward(1, split=False)
            else:
                me.pair(0, 1)
            me.pair(1, 0)
        for _ in range(tail):  # 5
            me.backward(1, split=False)
            me.pair(1, 0)
        half = (r + 1) // 2
        for i in range(r + 1):  # 6
            me.backward(1, split=i > half or (i == half and r % 2 == 1))
            me.backward(0, split=i >= half)
        for _ in range(tail):  # 7
            me.weight()
            me.backward(0, split=True)
        for _ in range(r + 1):  # 8
            me.weight()
        assert not me.pending_w and me.next_f == [m, m] and me.next_b == [m, m], (p, r, m)
        ranks.append(me.steps)
    return ranks


@register(
    NAME,
    chunks=(2,),
    placement="v",
    memory_bound=lambda p, m: p + 0.5,
    description="DualPipeV: V placement, overlapped F+BW pairs (DeepSeek); m >= 2p, peak memory p + 1/2",
)
def dualpipe_v(p: int, m: int, *, chunks: int = 2, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """DeepSeek's DualPipeV on ``p`` ranks (module docstring): ``m >= 2p``; peak memory ``p + 1/2`` rank shares."""
    if chunks != 2:
        raise ValueError(f"{NAME} runs 2 chunks per rank, got chunks={chunks}")
    sched = Schedule(
        name=NAME,
        num_ranks=p,
        num_stages=2 * p,
        num_microbatches=m,
        stage_to_rank=v_placement(p, 2),
        ranks=tuple(tuple(r) for r in dualpipe_v_ranks(p, m)),
    )
    check_mem_limit(sched, costs, mem_limit)
    return sched
