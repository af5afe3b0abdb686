"""The papers' warm-up and alternating steady state for the V placement (a candidate of ``v_shape``).

ZB-V as the zero-bubble paper constructs it: every rank first runs forwards of chunk 0 until the chunk-1 forward of
the first microbatch comes back up the V, keeping room for the chunk-1 forwards that will arrive before its first
backward (rank ``r`` runs about ``2r + 1`` of them: the gradient of the first microbatch needs ``r`` hops up and
``r`` hops back); then chunk-1 and chunk-0 forwards alternate until that backward arrives.  From there each rank
*alternates* one backward and one forward (the one-forward-one-backward steady state of 1F1B, over both chunks), so
the number of forwards in flight that the warm-up built is kept; the deferred weight-gradient work (W) fills every
wait for an input and is forced only when memory is short.  When the forwards run out, the backwards and the W's
left finish the plan.

This is a pass of an event-driven list scheduler: whenever a rank is free it takes its next action by the rules
above, looking at the arrival times of inputs whose producer is already planned.  Its knobs (``AltKnobs``):

- ``reserve``: the warm-up keeps room for ``reserve(r)`` chunk-1 forwards on rank ``r`` (``2r + 1`` is the
  paper's count; more leaves more room for the alternation, less fills the warm-up);
- ``approve``: a W fills a wait only if it ends before the awaited input arrives, or if the wait is longer than
  ``approve`` x T_F (a W that overruns a short wait would delay the critical path);
- ``early_f``: in a backward's turn with no backward ready, a ready forward may go first (0: never; 1: a chunk-1
  forward, whose gradient comes back soonest; 2: also a chunk-0 forward when the wait is long);
- ``f1_wait``: a forward's turn waits (filling with W) for a chunk-1 forward already on its way instead of taking
  a chunk-0 forward that is ready.  Otherwise rank 0, whose chunk-1 forwards come back one per microbatch, issues
  its chunk-0 forwards far ahead of the pipeline and idles at the end; with it the lead stays what the warm-up
  built (the zero-bubble paper's schedule puts a chunk-1 forward first whenever its producer is placed).

Every rank's peak memory stays within its cap: a forward or backward that would overrun it waits for a W (or, with
no W pending, for the rank's backwards).  A pass that cannot finish (a rank waits for an input that waits for it)
returns ``None``; ``v_shape`` then keeps its other candidates.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape_codes import Codes, cost_args, cpp, to_codes
from zb_pipeline.schedule.ir import Action, Kind

_EPS = 1e-9
_INF = math.inf


@dataclass(frozen=True)
class AltKnobs:
    """One variant of the alternating V scheduler (see the module docstring)."""

    reserve: str = "2r+1"  # "2r+1", "2r+2" or "2r": chunk-1 forwards the warm-up keeps room for on rank r
    approve: float = 0.5  # a W may overrun a wait longer than approve x T_F
    early_f: int = 0  # 0, 1 or 2 (see the module docstring)
    f1_wait: bool = False  # a forward's turn waits for a chunk-1 forward already on its way rather than take a chunk-0

    def reserve_of(self, r: int) -> int:
        return {"2r+1": 2 * r + 1, "2r+2": 2 * r + 2, "2r": 2 * r}[self.reserve]


def alternate_plan(p: int, m: int, costs: StageCosts, caps: list[float], knobs: AltKnobs) -> list[list[Action]] | None:
    """Each rank's order from one pass with ``knobs`` (``None``: the pass got stuck); the Python reference."""
    return _Pass(p, m, costs, caps, knobs).run()


def alternate_codes(
    p: int, m: int, costs: StageCosts, caps: list[float], knobs: AltKnobs, backend: str
) -> Codes | None:
    """``alternate_plan`` as codes (``v_shape_codes``), compiled when ``backend == "cpp"``."""
    if backend == "cpp":
        reserve = [knobs.reserve_of(r) for r in range(p)]
        return cpp.alternate(p, m, *cost_args(costs), caps, reserve, knobs.approve, knobs.early_f, knobs.f1_wait)
    plan = alternate_plan(p, m, costs, caps, knobs)
    return None if plan is None else to_codes(plan, m)


class _Pass:
    """State of one pass.  Streams per rank: F0 (stage r), F1 (stage 2p-1-r), B1, B0, in microbatch order."""

    def __init__(self, p: int, m: int, costs: StageCosts, caps: list[float], knobs: AltKnobs):
        self.p, self.m, self.costs, self.caps, self.k = p, m, costs, caps, knobs
        S = self.S = 2 * p
        self.fin = [[_INF] * m for _ in range(S)]  # arrival of F(s, k)'s input (known once its producer is planned)
        self.gin = [[_INF] * m for _ in range(S)]  # arrival of B(s, k)'s input gradient
        self.fin[0] = [0.0] * m
        self.nF0, self.nF1, self.nB1, self.nB0 = [0] * p, [0] * p, [0] * p, [0] * p
        self.wq: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.wh = [0] * p
        self.mem = [0.0] * p
        self.free = [0.0] * p
        self.steady = [False] * p
        self.b_turn = [True] * p  # steady phase: a backward's turn next (else a forward's)
        self.plans: list[list[Action]] = [[] for _ in range(p)]
        self.heap = [(0.0, r) for r in range(p)]
        self.place = tuple(s if s < p else S - 1 - s for s in range(S))

    # ------------------------------------------------------------------------------------------------- actions

    def _emit(self, r: int, s: int, kind: Kind, k: int, t: float) -> None:
        c, S = self.costs, self.S
        if kind is Kind.F:
            end = t + c.f[s]
            self.mem[r] += c.mem_f[s]
            if s < S - 1:
                q = self.place[s + 1]
                at = end + (c.comm if q != r else 0.0)
                self.fin[s + 1][k] = at
                heapq.heappush(self.heap, (at, q))
            else:
                self.gin[s][k] = end  # the loss: its backward is local
        elif kind is Kind.B:
            end = t + c.b[s]
            self.mem[r] += c.mem_b[s]
            self.wq[r].append((s, k))
            if s > 0:
                q = self.place[s - 1]
                at = end + (c.comm if q != r else 0.0)
                self.gin[s - 1][k] = at
                heapq.heappush(self.heap, (at, q))
        else:
            end = t + c.w[s]
            self.mem[r] += c.mem_w[s]
        self.plans[r].append(Action(s, kind, k))
        self.free[r] = end
        heapq.heappush(self.heap, (end, r))

    def _w(self, r: int, t: float) -> None:
        s, k = self.wq[r][self.wh[r]]
        self.wh[r] += 1
        self._emit(r, s, Kind.W, k, t)

    def _f1(self, r: int, t: float) -> None:
        self.nF1[r] += 1
        self._emit(r, self.S - 1 - r, Kind.F, self.nF1[r] - 1, t)

    def _f0(self, r: int, t: float) -> None:
        self.nF0[r] += 1
        self._emit(r, r, Kind.F, self.nF0[r] - 1, t)

    # ------------------------------------------------------------------------------------------------ the pass

    def run(self) -> list[list[Action]] | None:
        heap, free = self.heap, self.free
        while heap:
            t, r = heapq.heappop(heap)
            if free[r] <= t + _EPS:
                self._step(r, t)
        if any(len(pl) != 6 * self.m for pl in self.plans):
            return None
        return self.plans

    def _wait_fill(self, r: int, t: float, due: float, pend: int) -> bool:
        """Run a pending W into a wait for an input due at ``due`` when the rules allow it."""
        if not pend:
            return False
        s, _ = self.wq[r][self.wh[r]]
        c = self.costs
        if due == _INF or t + c.w[s] <= due + _EPS or due - t > self.k.approve * c.f[s]:
            self._w(r, t)
            return True
        return False

    def _step(self, r: int, t: float) -> None:
        m, c, cap, S = self.m, self.costs, self.caps[r], self.S
        s0, s1 = r, S - 1 - r
        a0, a1 = c.mem_f[s0], c.mem_f[s1]
        mem = self.mem[r]
        pend = len(self.wq[r]) - self.wh[r]
        nF0, nF1, nB1, nB0 = self.nF0[r], self.nF1[r], self.nB1[r], self.nB0[r]
        # the next backward of each chunk, if its forward ran here: (arrival, microbatch, stage)
        bc = []
        if nB1 < nF1:
            bc.append((self.gin[s1][nB1], nB1, s1))
        if nB0 < nB1:
            bc.append((self.gin[s0][nB0], nB0, s0))
        ready_b = [x for x in bc if x[0] <= t + _EPS]
        due_b = min((x[0] for x in bc), default=_INF)
        f1_ready = nF1 < nF0 and self.fin[s1][nF1] <= t + _EPS
        f0_ready = nF0 < m and self.fin[s0][nF0] <= t + _EPS
        if not self.steady[r]:
            if not ready_b:
                if f1_ready:
                    if mem + a1 <= cap + _EPS:
                        self._f1(r, t)
                    return
                if f0_ready:
                    if nF1 == 0:
                        due_f1 = self.fin[s1][0] if nF0 > 0 else _INF
                        fits = t + c.f[s0] <= due_f1 + _EPS
                        room = nF0 == 0 or mem + a0 + self.k.reserve_of(r) * a1 <= cap + _EPS
                    else:
                        fits, room = True, mem + a0 + a1 <= cap + _EPS
                    if fits and room:
                        self._f0(r, t)
                return
            self.steady[r], self.b_turn[r] = True, True
        f_left = nF0 < m or nF1 < nF0
        if self.b_turn[r] and not bc and f_left:
            self.b_turn[r] = False
        if not self.b_turn[r] and not f_left:
            self.b_turn[r] = True
        if self.b_turn[r]:
            if ready_b:
                _, k, s = min(ready_b, key=lambda x: (x[1], -x[2]))  # older microbatch first, then chunk 1
                if mem + c.mem_b[s] > cap + _EPS and pend:
                    self._w(r, t)
                    return
                if s == s1:
                    self.nB1[r] += 1
                else:
                    self.nB0[r] += 1
                self._emit(r, s, Kind.B, k, t)
                self.b_turn[r] = not f_left
                return
            if self.k.early_f and (due_b == _INF or due_b > t + _EPS):
                if f1_ready and mem + a1 <= cap + _EPS:
                    self._f1(r, t)
                    return
                long_wait = due_b == _INF or due_b - t > self.k.approve * c.f[s0]
                if self.k.early_f > 1 and f0_ready and long_wait and mem + a0 + a1 <= cap + _EPS:
                    self._f0(r, t)
                    return
            if bc or not f_left:
                self._wait_fill(r, t, due_b, pend)
            return
        # a forward's turn
        f1_coming = self.k.f1_wait and nF1 < nF0 and self.fin[s1][nF1] < _INF
        if f1_ready or (f0_ready and not f1_coming):
            s, a = (s1, a1) if f1_ready else (s0, a0)
            if mem + a > cap + _EPS:
                if pend:
                    self._w(r, t)
                elif bc:
                    self.b_turn[r] = True
                    heapq.heappush(self.heap, (t, r))
                return
            if s == s1:
                self._f1(r, t)
            else:
                self._f0(r, t)
            self.b_turn[r] = True
            return
        due_f = min(self.fin[s1][nF1] if nF1 < nF0 else _INF, _INF if f1_coming or nF0 >= m else self.fin[s0][nF0])
        if not self._wait_fill(r, t, due_f, pend) and ready_b and due_f == _INF:
            self.b_turn[r] = True  # no forward is on its way yet: take the ready backward
            heapq.heappush(self.heap, (t, r))
