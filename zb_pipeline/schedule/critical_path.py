"""Where a measured iteration's time went: its critical path, walked back through a ``--pipeline-trace``.

The simulator's makespan is a chain of compute actions joined by local successions and cross-rank hops (each
costing ``T_comm``).  A measured span longer than it is the same kind of chain with something added; this module
finds the measured chain and splits it, so the difference can be attributed instead of guessed:

- start at the compute action that ended last; step back to whatever released it -- the producer of its input if
  the action had to *wait* for that input (a receive wait longer than ``blocked_ms``; a *hop*), else the previous
  action on its rank (a *local gap*: the runtime's time between two actions: posting transfers, bookkeeping);
- every hop splits at the moment the producer's send was posted (the trace's comm event, stamped once ``isend``
  returned): *posting* = producer end -> send posted (the sender's runtime path and the send call itself),
  *transit* = send posted -> consumer start (the transfer, the receiver's wake-up and its bookkeeping);
- an overlapped pair (``ir.PairAction``, traced as its two halves) is one step, as lowering makes it: it receives
  both halves' inputs before its forward half and posts both outputs after its backward half.  So a hop from either
  half leaves at the pair's end (the backward half stays on the path as compute, not as posting), and the pair's
  inputs, whichever half they feed, release its forward half.

So ``span = start + compute + local gaps + hops`` holds exactly (up to the trace's microsecond rounding), and
``hops`` is the measured counterpart of the simulator's ``hops x T_comm``.  Times are the trace's own (each rank's
clock zeroed by a barrier, ``Tracer.align``), so a hop's two halves carry the ranks' alignment error (the barrier's
exit skew, tens of microseconds on one host); their sum per hop does too, the path's total does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zb_pipeline.schedule.ir import Action, Kind, PairAction, Schedule, halves
from zb_pipeline.schedule.lowering import SLOT_F, action_deps
from zb_pipeline.schedule.trace_timeline import measured_iteration

BLOCKED_MS = 0.2  # a receive wait shorter than this did not hold its consumer up (the data was there)


@dataclass(frozen=True)
class PathStep:
    """One compute action on the critical path and the link that released it (``"start"`` for the first)."""

    rank: int
    action: Action
    start_ms: float
    end_ms: float
    link: str  # "start", "local" (previous action on the rank), "hop" (a waited-for transfer), "local-dep"
    link_ms: float  # the link's length: gap before this action (local) or producer end -> this start (hop)
    posting_ms: float | None = None  # hops: producer end -> its send posted (None if the trace has no comm events)


@dataclass(frozen=True)
class CriticalPath:
    """The measured critical path of one iteration, first action first (milliseconds)."""

    iteration: int
    steps: tuple[PathStep, ...]

    @property
    def span_ms(self) -> float:
        return self.steps[-1].end_ms if self.steps else 0.0

    @property
    def start_ms(self) -> float:
        return self.steps[0].start_ms if self.steps else 0.0

    @property
    def compute_ms(self) -> float:
        return sum(s.end_ms - s.start_ms for s in self.steps)

    def _links(self, kind: str) -> list[PathStep]:
        return [s for s in self.steps if s.link == kind]

    @property
    def local_gap_ms(self) -> float:
        return sum(s.link_ms for s in self._links("local") + self._links("local-dep"))

    @property
    def hops(self) -> int:
        return len(self._links("hop"))

    @property
    def hop_ms(self) -> float:
        return sum(s.link_ms for s in self._links("hop"))

    @property
    def posting_ms(self) -> float | None:
        """Sum over hops of producer end -> send posted; ``None`` when some hop's send is not in the trace."""
        parts = [s.posting_ms for s in self._links("hop")]
        return None if any(p is None for p in parts) else sum(parts)

    def summary(self) -> str:
        n = max(self.hops, 1)
        text = (
            f"critical path of iteration {self.iteration}: span {self.span_ms:.2f} ms = start {self.start_ms:.2f} + "
            f"compute {self.compute_ms:.2f} + local gaps {self.local_gap_ms:.2f} + {self.hops} hops "
            f"{self.hop_ms:.2f} (mean {self.hop_ms / n:.3f} ms"
        )
        posting = self.posting_ms
        if posting is not None and self.hops:
            text += f": posting {posting / n:.3f} + transit {(self.hop_ms - posting) / n:.3f}"
        return text + ")"


def _producer(a: Action, num_stages: int, m: int, ran: Mapping[tuple[int, Kind, int], Any]) -> Any:
    """Key of the action whose output ``a`` consumes (``None`` for stage 0's F): of ``a``'s dependencies
    (``lowering.action_deps``) the one on another stage if any -- the input -- else its own stage's."""
    deps = action_deps(a.kind, a.stage, a.microbatch, num_stages, m)
    if not deps:
        return None
    stage_mb, slot = divmod(next((k for k in deps if k // (3 * m) != a.stage), deps[-1]), 3)
    s, mb = divmod(stage_mb, m)
    if slot == SLOT_F:
        return (s, Kind.F, mb)
    return (s, Kind.B, mb) if (s, Kind.B, mb) in ran else (s, Kind.BW, mb)


def _key(a: Action) -> tuple[int, Kind, int]:
    return (a.stage, a.kind, a.microbatch)


def _pairs(schedule: Schedule) -> dict[tuple[int, Kind, int], PairAction]:
    """Each half of an overlapped pair of ``schedule`` -> the pair (the trace records the halves as two actions)."""
    return {_key(h): step for acts in schedule.ranks for step in acts if type(step) is PairAction for h in halves(step)}


def critical_path(
    doc: Mapping[str, Any], schedule: Schedule, iteration: int, *, blocked_ms: float = BLOCKED_MS
) -> CriticalPath:
    """The critical path of ``iteration`` in trace ``doc`` (a merged ``--pipeline-trace``) run with ``schedule``."""
    meas = measured_iteration(doc, schedule, iteration)
    ran: dict[tuple[int, Kind, int], tuple[int, Any]] = {}
    before: dict[tuple[int, Kind, int], Any] = {}
    for r, spans in enumerate(meas.compute):
        prev = None
        for sp in spans:
            key = _key(sp.action)
            ran[key] = (r, sp)
            before[key] = prev
            prev = sp
    # Receive waits and send postings of the iteration, on the same time axis as measured_iteration's spans.
    waited: dict[tuple[str, int, int], float] = {}
    posted: dict[tuple[str, int, int], float] = {}
    for ev in doc.get("traceEvents", ()):
        a, cat = ev.get("args", {}), ev.get("cat")
        if ev.get("ph") != "X" or a.get("iteration") != iteration:
            continue
        if cat == "wait" and a.get("kind") in ("RECV_F", "RECV_B"):
            key = (a["kind"], a["stage"], a["microbatch"])
            waited[key] = max(waited.get(key, 0.0), ev.get("dur", 0.0) / 1e3)
        elif cat in ("SEND_F", "SEND_B"):
            posted[(cat, a["stage"], a["microbatch"])] = (ev["ts"] - meas.t0_us) / 1e3
    if not ran:
        return CriticalPath(iteration, ())
    pairs = _pairs(schedule)
    S, m = schedule.num_stages, schedule.num_microbatches

    def step_end(k: tuple[int, Kind, int]) -> tuple[int, Kind, int]:
        """The key of the half that ends ``k``'s plan step: a pair posts both outputs after its backward half."""
        pair = pairs.get(k)
        return k if pair is None else _key(pair.backward)

    key = max(ran, key=lambda k: ran[k][1].end)
    steps: list[PathStep] = []
    while True:
        r, sp = ran[key]
        a = sp.action
        prev = before[key]
        pair = pairs.get(key)
        # What the step waited for: a pair's inputs all came before its forward half (lowering), so the forward half
        # takes both halves' inputs and the backward half only follows it.
        consumers = (a,) if pair is None else (pair.forward, pair.backward) if a.kind is Kind.F else ()
        link, link_ms, posting, nxt = "start", 0.0, None, None
        hop = local_dep = None
        for c in consumers:
            dep = _producer(c, S, m, ran)
            if dep is None or dep not in ran:
                continue
            src = step_end(dep)
            if ran[dep][0] != r:
                recv = "RECV_F" if c.kind is Kind.F else "RECV_B"
                blocked = waited.get((recv, c.stage, c.microbatch), 0.0) > blocked_ms or prev is None
                if blocked and (hop is None or ran[src][1].end > ran[hop[1]][1].end):
                    hop = (recv, src, dep)
            elif prev is None or ran[src][1].end > prev.end:
                if local_dep is None or ran[src][1].end > ran[local_dep][1].end:
                    local_dep = src
        if hop is not None:
            recv, src, dep = hop
            psp = ran[src][1]
            link, link_ms, nxt = "hop", sp.start - psp.end, src
            send = ("SEND_F" if recv == "RECV_F" else "SEND_B", dep[0], dep[2])
            if send in posted:
                posting = posted[send] - psp.end
        elif local_dep is not None:
            link, link_ms, nxt = "local-dep", sp.start - ran[local_dep][1].end, local_dep
        if link == "start" and prev is not None:
            link, link_ms = "local", sp.start - prev.end
            nxt = _key(prev.action)
        steps.append(PathStep(r, a, sp.start, sp.end, link, link_ms, posting))
        if nxt is None:
            break
        key = nxt
    steps.reverse()
    return CriticalPath(iteration, tuple(steps))
