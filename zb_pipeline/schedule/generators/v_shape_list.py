"""The memory-capped list scheduler behind the V schedules (candidate 1 in ``v_shape``'s docstring).

It simulates time over any two-chunk placement; whenever a rank is free it runs one ready action by priority
(B before F, F before B, chunk-1 F first, ... per variant; the deferred W only when nothing else may run, so W
fills what would otherwise be bubbles), subject to the per-rank cap.  How room is checked is the variant's
*admission*:

- *Memory by reservation* ("staged", "full"): a microbatch enters only when every rank has room for it; these
  can never get stuck while one microbatch fits on every rank (the fallback).
- *Optimistic* ("optimistic"): room is checked per action, the oldest microbatch's remaining growth kept free,
  a hand-off sent only when its receiver has room, each peer's hand-offs consumed in its order; can get stuck
  (then dropped).
- *Local* ("local"): room checked per action on the rank that runs it (oldest microbatch's growth kept free),
  hand-offs taken in any order once arrived.  The globally oldest microbatch always fits, so it cannot stick.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind

_EPS = 1e-9


@dataclass(frozen=True)
class ListPolicy:
    """One variant of the list scheduler."""

    admission: str  # "staged": chunk-0 growth reserved on entry, the rest at the turn;  "full": all on entry;
    # "optimistic": room checked per action (oldest microbatch first), may get stuck and is then dropped
    order: str  # "bfw": B > F > W;  "fbw": F > B > W;  "f1bf0w": chunk-1 F > B > chunk-0 F > W
    pace: float = 0.0  # microbatch k enters no earlier than (k - burst) x pace x period (0: no pacing)
    burst: float = 0.0  # as a fraction of p (at least 1 when pacing)
    fifo: bool = True  # consume each peer's hand-offs in the order it sent them


LIST_POLICIES = tuple(
    [ListPolicy("local", o, fifo=False) for o in ("bfw", "fbw", "f1bf0w", "bf1f0w")]
    + [ListPolicy("optimistic", o, pace) for o in ("bfw", "fbw") for pace in (0, 1)]
    + [ListPolicy(adm, order) for adm in ("staged", "full") for order in ("bfw", "fbw")]
)


def plan_list_schedule(
    stage_to_rank: tuple[int, ...], m: int, costs: StageCosts, caps: list[float], policy: ListPolicy
) -> list[list[Action]] | None:
    """Each rank's order from one run of the memory-capped list scheduler with one policy (``None``: an optimistic
    variant got stuck)."""
    return _ListScheduler(stage_to_rank, m, costs, caps, policy).run()


class _ListScheduler:
    """Time-stepped list scheduler over any two-chunk placement (see the module docstring for the rules).

    Reservation variants ("staged", "full"; "optimistic" is described in the module docstring).  Memory is
    reserved, never overrun: a microbatch *enters* (its first F on stage 0) only when every rank has room
    for its chunk-0 growth plus one chunk-1 growth, and it *turns* (its first F of chunk 1, stage S/2) only when
    every rank has room for the rest of its growth; turns happen in microbatch order.  Every other action then runs
    on memory already reserved for it, so no hand-off ever waits for memory and the channels never block.  The
    oldest microbatch that has not turned can always turn once older ones finish, hence no deadlock as long as
    one microbatch fits on every rank.
    """

    def __init__(
        self, stage_to_rank: tuple[int, ...], m: int, costs: StageCosts, caps: list[float], policy: ListPolicy
    ):
        self.place, self.m, self.costs, self.caps, self.policy = stage_to_rank, m, costs, caps, policy
        self.S = S = len(stage_to_rank)
        self.p = p = max(stage_to_rank) + 1
        self.turn_stage = S // 2
        self.delta = {Kind.F: costs.mem_f, Kind.B: costs.mem_b, Kind.W: costs.mem_w}
        self.dur = {Kind.F: costs.f, Kind.B: costs.b, Kind.W: costs.w}
        stages_on = [[s for s in range(S) if stage_to_rank[s] == r] for r in range(p)]
        pos = [[max(0.0, self.delta[k][s]) for k in (Kind.F, Kind.B, Kind.W) for s in stages_on[r]] for r in range(p)]
        # growth of one microbatch on each rank before (g0) and from (g1) its turn
        self.g0 = [sum(max(0.0, costs.mem_f[s]) for s in stages_on[r] if s < self.turn_stage) for r in range(p)]
        self.g1 = [sum(pos[r]) - self.g0[r] for r in range(p)]
        self.need = [x + y for x, y in zip(self.g0, self.g1)]  # all of one microbatch's growth
        self.burst = max(1, int(policy.burst * p))
        self.period = max(sum(costs.f[s] + costs.b[s] + costs.w[s] for s in stages_on[r]) for r in range(p))
        self.fifo = policy.fifo
        self.reserving = policy.admission in ("staged", "full")
        # The run's state, per rank unless said otherwise.
        self.orders: list[list[Action]] = [[] for _ in range(p)]
        self.free_at = [0.0] * p
        self.mem = [0.0] * p
        self.reserved = [0.0] * p
        self.channels = {(a, b): deque() for a in range(p) for b in range(p) if a != b}  # (src, dst) -> hand-offs
        self.inbox = [[key for key in self.channels if key[1] == r] for r in range(p)]
        self.local: list[list[Action]] = [[] for _ in range(p)]
        self.pending_w: list[list[Action]] = [[] for _ in range(p)]
        self.next_new = self.next_turn = 0  # the next microbatch to enter, and to turn
        self.events: list[float] = []  # times something may change
        self.growth_left = [[self.g0[r] + self.g1[r]] * m for r in range(p)]  # [rank][microbatch]
        self.oldest = [0] * p
        self.incoming = [0.0] * p  # optimistic: growth promised to a rank for hand-offs already sent to it
        self.prepaid: set[Action] = set()

    def run(self) -> list[list[Action]] | None:
        p, S, m, pol = self.p, self.S, self.m, self.policy
        total, n_done, t = 3 * S * m, 0, 0.0
        events = self.events
        while n_done < total:
            for r in range(p):
                if self.free_at[r] > t + _EPS:
                    continue
                act = self._pick(r, t)
                if act is not None:
                    self._execute(r, act, t)
                    n_done += 1
            if n_done >= total:
                break
            if pol.pace and self.next_new < m:
                due = (self.next_new - self.burst) * pol.pace * self.period
                if due > t + _EPS:
                    heapq.heappush(events, due)
            while events and events[0] <= t + _EPS:
                heapq.heappop(events)
            if not events:
                if not self.reserving:
                    return None
                raise RuntimeError(f"V list scheduler stuck at t={t} with {total - n_done} actions left; this is a bug")
            t = heapq.heappop(events)
        return self.orders

    # ------------------------------------------------------------------------------------------------ choosing

    def _room(self, extra: list[float]) -> bool:
        return all(self.mem[r] + self.reserved[r] + extra[r] <= self.caps[r] + _EPS for r in range(self.p))

    def _fits(self, r: int, a: Action) -> bool:
        d = self.delta[a.kind][a.stage]
        if d <= 0 or a in self.prepaid:
            return True
        used = self.mem[r] + self.incoming[r] + d
        o = self.oldest[r]
        if a.microbatch != o and o < self.m:
            used += self.growth_left[r][o]
        return used <= self.caps[r] + _EPS

    def _can_run(self, a: Action) -> bool:
        admission = self.policy.admission
        if admission == "local":
            return self._fits(self.place[a.stage], a)
        if admission == "optimistic":
            # A hand-off is sent only once its receiver has room: channels are consumed in order, so a
            # message that could not be taken would block everything queued behind it.
            nxt = self._successor(a)
            r = self.place[a.stage]
            if nxt is not None and self.place[nxt.stage] != r and not self._fits(self.place[nxt.stage], nxt):
                return False
            return self._fits(r, a)
        if a.kind is Kind.F and a.stage == self.turn_stage and admission == "staged":
            return a.microbatch == self.next_turn and self._room(self.g1)
        return True

    def _key(self, a: Action) -> tuple:
        k, order = a.kind, self.policy.order
        if order == "bfw":
            cls = 0 if k is Kind.B else 1
        elif order == "fbw":
            cls = 0 if k is Kind.F else 1
        elif order == "f1bf0w":
            cls = 1 if k is Kind.B else (0 if a.stage >= self.turn_stage else 2)
        else:  # "bf1f0w"
            cls = 0 if k is Kind.B else (1 if a.stage >= self.turn_stage else 2)
        return (cls, a.microbatch, -a.stage if k is Kind.F else a.stage)

    def _candidates(self, r: int, t: float) -> list[tuple[tuple, Action, object]]:
        """What rank ``r`` may run at ``t``: (priority key, action, where it comes from), in a fixed order (the
        first of equal keys wins): arrived hand-offs by channel, local hand-offs, then a new microbatch."""
        cands: list[tuple[tuple, Action, object]] = []
        for ch in self.inbox[r]:
            q = self.channels[ch]
            if not self.fifo:
                for j, (msg, arrival) in enumerate(q):
                    if arrival <= t + _EPS and self._can_run(msg):
                        cands.append((self._key(msg), msg, (ch, j)))
            elif q and q[0][1] <= t + _EPS and self._can_run(q[0][0]):
                cands.append((self._key(q[0][0]), q[0][0], (ch, 0)))
        for i, a in enumerate(self.local[r]):
            if self._can_run(a):
                cands.append((self._key(a), a, i))
        pol = self.policy
        if r == self.place[0] and self.next_new < self.m:
            paced = pol.pace and t + _EPS < (self.next_new - self.burst) * pol.pace * self.period
            a = Action(0, Kind.F, self.next_new)
            admit = self._can_run(a) if not self.reserving else self._room(self.need)
            if not paced and admit:
                cands.append((self._key(a), a, None))
        return cands

    def _pick(self, r: int, t: float) -> Action | None:
        """Take rank ``r``'s next action off its source (reserving memory for a microbatch that enters or
        turns); else its oldest pending W; ``None`` if it has nothing to run."""
        cands = self._candidates(r, t)
        if not cands:
            return self.pending_w[r].pop(0) if self.pending_w[r] else None
        pol, p = self.policy, self.p
        _, act, src = min(cands, key=lambda c: c[0])
        if isinstance(src, tuple):
            del self.channels[src[0]][src[1]]
        elif isinstance(src, int):
            self.local[r].pop(src)
        else:
            self.next_new += 1
            if self.reserving:
                grab = self.g0 if pol.admission == "staged" else self.need
                for q in range(p):
                    self.reserved[q] += grab[q]
        if act.kind is Kind.F and act.stage == self.turn_stage and pol.admission == "staged":
            self.next_turn += 1
            for q in range(p):
                self.reserved[q] += self.g1[q]
        return act

    # ------------------------------------------------------------------------------------------------- running

    def _commit(self, r: int, a: Action, d: float) -> None:
        self.growth_left[r][a.microbatch] -= d
        while self.oldest[r] < self.m and self.growth_left[r][self.oldest[r]] <= _EPS:
            self.oldest[r] += 1

    def _execute(self, r: int, act: Action, t: float) -> None:
        """Run ``act`` on rank ``r`` from ``t``: its memory, its W to come, and the hand-off to its successor."""
        end = t + self.dur[act.kind][act.stage]
        self.orders[r].append(act)
        self.free_at[r] = end
        heapq.heappush(self.events, end)
        d = self.delta[act.kind][act.stage]
        self.mem[r] += d
        if d > 0:
            if self.reserving:
                self.reserved[r] -= d
            elif act in self.prepaid:
                self.prepaid.discard(act)
                self.incoming[r] -= d
            else:
                self._commit(r, act, d)
        if act.kind is Kind.B:
            self.pending_w[r].append(Action(act.stage, Kind.W, act.microbatch))
        nxt = self._successor(act)
        if nxt is None:
            return
        dst = self.place[nxt.stage]
        if dst == r:
            self.local[r].append(nxt)
            return
        dn = self.delta[nxt.kind][nxt.stage]
        if self.policy.admission == "optimistic" and dn > 0:
            self.prepaid.add(nxt)
            self.incoming[dst] += dn
            self._commit(dst, nxt, dn)
        self.channels[(r, dst)].append((nxt, end + self.costs.comm))
        heapq.heappush(self.events, end + self.costs.comm)

    def _successor(self, a: Action) -> Action | None:
        """The one action that ``a`` hands its output to (W and the first stage's B hand nothing on)."""
        if a.kind is Kind.F:
            if a.stage + 1 < self.S:
                return Action(a.stage + 1, Kind.F, a.microbatch)
            return Action(a.stage, Kind.B, a.microbatch)
        if a.kind is Kind.B and a.stage > 0:
            return Action(a.stage - 1, Kind.B, a.microbatch)
        return None
