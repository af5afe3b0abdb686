"""``interleaved-zb``: interleaved 1F1B on loop-placed chunks with B and W split and W deferred into bubbles.

This is the idea of PyTorch's interleaved zero-bubble schedule (ZB1P): keep the forward/backward order of
interleaved 1F1B (Megatron's microbatch-group order, ``chunks >= 2`` virtual stages per rank, stage ``s`` on rank
``s % p``), but split every backward into B (input gradient, on the critical path) and W (weight gradient, local),
and run each W only when the rank would otherwise wait.

Order.  Microbatches are taken in groups of ``p``.  Each rank runs the forwards of a group chunk by chunk (chunk 0
of every microbatch in the group, then chunk 1, ...), and the backwards of a group in the reverse chunk order.
Rank ``r`` first runs ``(p - r - 1) * 2 + (chunks - 1) * p`` forwards (warm-up, capped at ``m * chunks``), then
alternates one forward and one backward, then drains the backwards.  When ``m`` is not a multiple of ``p`` the last
group is short; if that order cannot finish (checked by simulation) the warm-up is lengthened until it can.

W placement, planned with the real per-stage costs: a time-stepped simulation runs the fixed F/B order on every
rank; whenever a rank's next F or B is not ready yet it runs its oldest pending W instead (if a previous pass says
the W ends before that F/B becomes ready; one pass without that test), and before an F it runs pending Ws while
the F would lift memory above the cap.  The plain "W right after its B" placement (interleaved 1F1B itself) is
also planned, and the shortest simulated makespan wins.

Memory: as ZB-H1 is to 1F1B, every rank may use the peak that interleaved 1F1B (the same F/B order with each W
right after its B) reaches on its fullest rank, rank 0: ``interleaved-zb``'s peak on every rank is at most
``max_r peak_r(interleaved 1F1B)`` (tested); the other ranks use their slack to hold deferred Ws.
``mem_limit`` may lower the cap down to each rank's own interleaved-1F1B peak.  Bubble: never worse than the
W-right-after-B plan under the simulated costs (it is one of the candidates); measured at F = B = W, T_comm = 0:
zero for m >= 2p with p <= 4 and about 2% of the makespan at p = 8, m = 4p (chunks 2).
"""

from __future__ import annotations

import heapq

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, Schedule, loop_placement
from zb_pipeline.schedule.registry import register

_EPS = 1e-9
SUPPORTED_CHUNKS = (2, 3, 4, 5, 6, 7, 8)
_PASSES = 3


def fb_order(p: int, m: int, v: int, rank: int, warmup: int) -> list[Action]:
    """Rank ``rank``'s forward/backward sequence (no W) in interleaved-1F1B order with ``warmup`` forwards first."""
    fwd: list[Action] = []
    bwd: list[Action] = []
    for g0 in range(0, m, p):
        group = range(g0, min(m, g0 + p))
        for c in range(v):
            fwd.extend(Action(c * p + rank, Kind.F, mb) for mb in group)
        for c in reversed(range(v)):
            bwd.extend(Action(c * p + rank, Kind.B, mb) for mb in group)
    n = len(fwd)
    warmup = min(warmup, n)
    out = fwd[:warmup]
    for i in range(n - warmup):
        out.append(fwd[warmup + i])
        out.append(bwd[i])
    out.extend(bwd[n - warmup :])
    return out


def _deps(a: Action, num_stages: int) -> tuple[Action, ...]:
    if a.kind is Kind.F:
        return (Action(a.stage - 1, Kind.F, a.microbatch),) if a.stage > 0 else ()
    if a.kind is Kind.B:
        own_f = Action(a.stage, Kind.F, a.microbatch)
        return (Action(a.stage + 1, Kind.B, a.microbatch) if a.stage + 1 < num_stages else own_f, own_f)
    return (Action(a.stage, Kind.B, a.microbatch),)


def _finishes(seqs: list[list[Action]], num_stages: int) -> bool:
    """Whether per-rank sequences can all run to the end (dependencies only, unlimited buffering)."""
    done: set[Action] = set()
    pos = [0] * len(seqs)
    moved = True
    while moved:
        moved = False
        for r, seq in enumerate(seqs):
            while pos[r] < len(seq) and all(d in done for d in _deps(seq[pos[r]], num_stages)):
                done.add(seq[pos[r]])
                pos[r] += 1
                moved = True
    return all(pos[r] == len(seq) for r, seq in enumerate(seqs))


def _channels_in_order(seqs: list[list[Action]], num_stages: int) -> bool:
    """Whether every rank consumes each peer's hand-offs in the order that peer produced them."""
    p = len(seqs)
    at = {a: i for seq in seqs for i, a in enumerate(seq)}
    for r, seq in enumerate(seqs):
        last: dict[int, int] = {}
        for a in seq:
            for d in _deps(a, num_stages):
                src = d.stage % p
                if src != r:
                    if at[d] < last.get(src, -1):
                        return False
                    last[src] = at[d]
    return True


def base_orders(p: int, m: int, v: int) -> list[list[Action]]:
    """The interleaved-1F1B F/B order of every rank, warm-up lengthened until the order can finish with every
    channel consumed in production order (only short last groups with p = 2 need it)."""
    S = p * v
    extra = 0
    while True:
        seqs = [fb_order(p, m, v, r, (p - r - 1) * 2 + (v - 1) * p + extra) for r in range(p)]
        if _finishes(seqs, S) and _channels_in_order(seqs, S):
            return seqs
        if extra > m * v:  # all forwards first always finishes; cannot get here
            raise RuntimeError(f"interleaved order for p={p} m={m} chunks={v} cannot finish; this is a bug")
        extra += 1


def _peak_with_w_after_b(seq: list[Action], costs: StageCosts) -> float:
    """The peak of an F/B order (no W in it) with each W freeing its memory right after its B: measured after
    every F and B, the W's own delta only carried forward.  Not ``memory.order_peak`` of an order with the Ws
    inserted: that also measures after each W, which differs when a W adds memory (``mem_f + mem_b < 0``)."""
    cur = peak = 0.0
    for a in seq:
        cur += costs.mem_f[a.stage] if a.kind is Kind.F else costs.mem_b[a.stage]
        peak = max(peak, cur)
        if a.kind is Kind.B:
            cur += costs.mem_w[a.stage]
    return peak


def place_w(
    seqs: list[list[Action]],
    costs: StageCosts,
    caps: list[float],
    *,
    defer: bool,
    hint: dict[Action, float] | None = None,
) -> tuple[list[list[Action]], float, dict[Action, float]]:
    """Insert the Ws into the fixed F/B sequences by simulating time.

    With ``defer`` a W runs while the rank's next F/B is not ready, but only if it ends before the time ``hint``
    expects that F/B to become ready (from a previous pass), so that W never delays the critical path as planned.
    Returns the per-rank plans, the makespan and the time each F/B became ready (the next pass's hint).
    """
    sim = _WPlacement(seqs, costs, caps, defer=defer, hint=hint)
    while sim.left:
        sim.start_free_ranks()
        if not sim.left:
            break
        sim.advance_to_next_event()
    return sim.out, max(sim.free_at[r] - sim.first[r] for r in range(sim.p)), sim.seen_ready


class _WPlacement:
    """The state of ``place_w``'s time-stepped simulation: per-rank plans, clocks, memory and pending Ws."""

    def __init__(
        self,
        seqs: list[list[Action]],
        costs: StageCosts,
        caps: list[float],
        *,
        defer: bool,
        hint: dict[Action, float] | None,
    ) -> None:
        p = len(seqs)
        self.seqs, self.costs, self.caps, self.defer, self.hint, self.p = seqs, costs, caps, defer, hint, p
        self.num_stages = costs.num_stages
        self.rank_of = [s % p for s in range(self.num_stages)]
        self.dur = {Kind.F: costs.f, Kind.B: costs.b, Kind.W: costs.w}
        self.delta = {Kind.F: costs.mem_f, Kind.B: costs.mem_b, Kind.W: costs.mem_w}
        self.seen_ready: dict[Action, float] = {}
        self.end: dict[Action, float] = {}
        self.out: list[list[Action]] = [[] for _ in range(p)]
        self.pos = [0] * p
        self.free_at = [0.0] * p
        self.first = [0.0] * p
        self.mem = [0.0] * p
        self.pending: list[list[Action]] = [[] for _ in range(p)]
        self.events: list[float] = []
        self.t = 0.0
        self.left = sum(len(s) for s in seqs) * 3 // 2  # F/B plus one W per B

    def ready_at(self, a: Action) -> float | None:
        """When ``a``'s inputs have arrived (``None`` while one is not computed yet)."""
        at = 0.0
        for d in _deps(a, self.num_stages):
            if d not in self.end:
                return None
            hop = self.costs.comm if self.rank_of[d.stage] != self.rank_of[a.stage] else 0.0
            at = max(at, self.end[d] + hop)
        return at

    def next_action(self, r: int) -> Action | None:
        """What rank ``r`` starts now: its next F/B if ready (after Ws that make room under the cap), else its
        oldest pending W unless the hint says that W would delay the F/B; ``None`` to wait."""
        pending, seq, t = self.pending[r], self.seqs[r], self.t
        if not self.defer and pending:
            return pending.pop(0)  # plain interleaved 1F1B: W right after its B
        if self.pos[r] < len(seq):
            nxt = seq[self.pos[r]]
            at = self.ready_at(nxt)
            if at is not None and at <= t + _EPS:
                d = self.delta[nxt.kind][nxt.stage]
                if d > 0 and self.mem[r] + d > self.caps[r] + _EPS and pending:
                    return pending.pop(0)  # make room first
                self.pos[r] += 1
                return nxt
        if pending and self.pos[r] < len(seq) and self.hint is not None:
            nxt = seq[self.pos[r]]
            w = pending[0]
            if t + self.dur[Kind.W][w.stage] > self.hint.get(nxt, float("inf")) + _EPS:
                return None  # wait for the F/B instead
        return pending.pop(0) if pending else None

    def start(self, r: int, act: Action) -> None:
        """Run ``act`` on rank ``r`` from now: record it, its end (and the hand-off's) as events, its memory."""
        t = self.t
        if not self.out[r]:
            self.first[r] = t
        if act.kind is not Kind.W:
            self.seen_ready[act] = self.ready_at(act) or 0.0
        self.out[r].append(act)
        self.end[act] = self.free_at[r] = t + self.dur[act.kind][act.stage]
        heapq.heappush(self.events, self.end[act])
        heapq.heappush(self.events, self.end[act] + self.costs.comm)
        self.mem[r] += self.delta[act.kind][act.stage]
        self.left -= 1
        if act.kind is Kind.B:
            self.pending[r].append(Action(act.stage, Kind.W, act.microbatch))

    def start_free_ranks(self) -> None:
        """Every rank idle at the current time starts what ``next_action`` picks, if anything."""
        for r in range(self.p):
            if self.free_at[r] > self.t + _EPS:
                continue
            act = self.next_action(r)
            if act is not None:
                self.start(r, act)

    def advance_to_next_event(self) -> None:
        while self.events and self.events[0] <= self.t + _EPS:
            heapq.heappop(self.events)
        if not self.events:
            raise RuntimeError("interleaved-zb W placement got stuck; this is a bug")
        self.t = heapq.heappop(self.events)


@register(
    "interleaved-zb",
    chunks=SUPPORTED_CHUNKS,
    default_chunks=2,
    placement="loop",
    description="interleaved 1F1B with split B/W, W deferred into bubbles (ZB1P); interleaved-1F1B memory",
    uses_costs=True,
    max_actions=600_000,  # limits.py: its bubble filling costs ~70 us of CPU per action (p = 128, m = 256)
)
def interleaved_zb(p: int, m: int, *, chunks: int, costs: StageCosts, mem_limit: float | None = None) -> Schedule:
    """Interleaved zero-bubble schedule (loop placement, ``chunks`` in 2..8)."""
    if chunks not in SUPPORTED_CHUNKS:
        raise ValueError(f"interleaved-zb needs chunks in 2..8 (use zb-h1 for one chunk per rank), got {chunks=}")
    if costs.num_stages != p * chunks:
        raise ValueError(f"interleaved-zb: costs cover {costs.num_stages} stages, expected p*chunks={p * chunks}")
    seqs = base_orders(p, m, chunks)
    # Like ZB-H1 against 1F1B: every rank may use the peak that interleaved 1F1B reaches on its fullest rank.
    caps = [max(_peak_with_w_after_b(seq, costs) for seq in seqs)] * p
    if mem_limit is not None:
        floor = [_peak_with_w_after_b(seq, costs) for seq in seqs]
        r = max(range(p), key=lambda q: floor[q])
        if mem_limit + _EPS < floor[r]:
            raise ValueError(
                f"mem_limit={mem_limit:g} is below what interleaved-zb needs on rank {r} (the memory of interleaved "
                f"1F1B there, {floor[r]:g}); the smallest limit that works is {floor[r]:g}"
            )
        caps = [min(cap, max(mem_limit, f)) for cap, f in zip(caps, floor)]
    # Plain placement first (it is interleaved 1F1B itself), then deferred placements, each pass taught by the
    # previous one when the F/Bs become ready; keep the shortest.
    best = place_w(seqs, costs, caps, defer=False)
    hint = best[2]
    for _ in range(_PASSES):
        plan = place_w(seqs, costs, caps, defer=True, hint=hint)
        if plan[1] < best[1] - _EPS:
            best = plan
        hint = plan[2]
    plan = place_w(seqs, costs, caps, defer=True)  # W whenever idle, no hint
    if plan[1] < best[1] - _EPS:
        best = plan
    assert best is not None
    return Schedule(
        name="interleaved-zb",
        num_ranks=p,
        num_stages=p * chunks,
        num_microbatches=m,
        stage_to_rank=loop_placement(p, chunks),
        ranks=best[0],
    )
