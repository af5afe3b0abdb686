"""What every rank actually executed, as a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev).

Each rank's executor records into its own ``Tracer``:

- compute actions (F, B, W, BW) on thread 0 ("compute"), from the moment their inputs were available to their end;
  an overlapped pair as its two halves (an F and a BW event, each with ``args["pair"]`` naming the pair);
- communication ops on thread 1 ("comm"), one event per SEND/RECV action at the moment its batch was posted;
- waits for a receive on thread 0, category ``wait``, named after the receive and the action that waited.

Every event carries ``args`` with the action string, kind, stage, microbatch and iteration, so the measurement tools
can recover the executed plan (``executed_actions``) and compare it with the planned timeline.

Clocks: timestamps are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux, shared by all processes of a host) minus
the moment ``align()`` returned; ``align`` ends with a barrier on the given group, so ranks on different hosts line
up to within one barrier latency.  ``gather_trace`` collects every rank's events on one rank and writes one JSON file
with one process per rank.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from zb_pipeline import comm
from zb_pipeline.schedule.ir import Action, PairAction
from zb_pipeline.schedule.lowering import CommBatch

COMPUTE_TID, COMM_TID = 0, 1
_COMPUTE, _POSTED, _WAITED, _MARK, _HALF = range(5)  # kinds of recorded event (_HALF: a half of a pair)


def _args(a: Action, iteration: int) -> dict[str, Any]:
    return {
        "action": str(a),
        "kind": a.kind.value,
        "stage": a.stage,
        "microbatch": a.microbatch,
        "iteration": iteration,
    }


class Tracer:
    """Collects one rank's events (see the module docstring).

    Recording is on the critical path (between a compute action's end and the posting of its send, between a
    receive's arrival and its consumer's start), so it only appends a tuple; the Chrome dicts are built when
    ``events`` is first read after it.
    """

    def __init__(self, rank: int, *, label: str | None = None) -> None:
        self.rank = rank
        self.label = label or f"pipeline rank {rank}"
        self.iteration = 0
        self._raw: list[tuple] = []  # recorded, not yet built: (what, ..., iteration, clock zero)
        self._events: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._last_wait_end = 0.0

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event so far as Chrome trace dicts, in recording order (``events.clear()`` forgets them)."""
        raw = self._raw
        if raw:
            build, out = self._build, self._events
            for rec in raw:
                build(rec, out)
            raw.clear()
        return self._events

    def align(self, group: comm.ProcessGroup | None = None) -> None:
        """Reset the clock's zero to the end of a barrier on ``group`` (no barrier without torch.distributed)."""
        if comm.is_initialized():
            comm.barrier(group=group)
        self._t0 = time.perf_counter()

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def compute(self, action: Action, t_start: float, t_end: float, *, pair: PairAction | None = None) -> None:
        """A compute action that started (was called) at ``t_start``; it began working once its last wait ended.
        ``pair``: the overlapped pair ``action`` is a half of (recorded in the event's args)."""
        begin = t_start if t_start > self._last_wait_end else self._last_wait_end
        obj = action if pair is None else (action, pair)
        self._raw.append((_COMPUTE if pair is None else _HALF, obj, begin, t_end, self.iteration, self._t0))

    def comm_posted(self, batch: CommBatch) -> None:
        self._raw.append((_POSTED, batch, time.perf_counter(), 0.0, self.iteration, self._t0))

    def waited(self, recv: Action, waiter: Action | CommBatch, t_start: float, t_end: float) -> None:
        """A wait for ``recv`` by the action that consumes it (or, in checking mode, by the batch that posted it)."""
        self._last_wait_end = t_end
        self._raw.append((_WAITED, (recv, waiter), t_start, t_end, self.iteration, self._t0))

    def mark(self, name: str, t_start: float, t_end: float, **args: Any) -> None:
        """Any other span on the compute thread (e.g. the optimizer step)."""
        self._raw.append((_MARK, (name, args), t_start, t_end, self.iteration, self._t0))

    def _build(self, rec: tuple, out: list[dict[str, Any]]) -> None:
        what, obj, t_start, t_end, iteration, t0 = rec
        ts, dur = round((t_start - t0) * 1e6, 3), round((t_end - t_start) * 1e6, 3)
        if what == _COMPUTE:
            out.append(self._event(str(obj), obj.kind.value, COMPUTE_TID, ts, dur, _args(obj, iteration)))
        elif what == _HALF:
            a, pair = obj
            args = {**_args(a, iteration), "pair": str(pair)}
            out.append(self._event(str(a), a.kind.value, COMPUTE_TID, ts, dur, args))
        elif what == _POSTED:
            for a in obj.actions:
                out.append(
                    self._event(str(a), a.kind.value, COMM_TID, ts, 0.0, {**_args(a, iteration), "peer": a.peer})
                )
        elif what == _WAITED:
            recv, waiter = obj
            args = {**_args(recv, iteration), "peer": recv.peer, "waiter": str(waiter)}
            out.append(self._event(f"wait {recv}", "wait", COMPUTE_TID, ts, dur, args))
        else:
            name, extra = obj
            out.append(self._event(name, "other", COMPUTE_TID, ts, dur, {"iteration": iteration, **extra}))

    def _event(self, name: str, cat: str, tid: int, ts: float, dur: float, args: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid, "ts": ts, "dur": dur, "args": args}

    def metadata(self) -> list[dict[str, Any]]:
        return [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": self.label}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMM_TID, "args": {"name": "comm"}},
        ]

    def chrome_events(self) -> list[dict[str, Any]]:
        return self.metadata() + self.events


def merge_traces(per_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """One Chrome trace document from every rank's ``chrome_events()``."""
    events: list[dict[str, Any]] = []
    for evs in per_rank:
        events.extend(evs)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def gather_trace(
    tracer: Tracer, path: str | os.PathLike[str] | None, *, group: comm.ProcessGroup | None = None, dst: int = 0
) -> dict[str, Any] | None:
    """Collect every rank's events of ``group`` on global rank ``dst``, which writes ``path`` (if given).

    Returns the merged document on ``dst`` and ``None`` elsewhere.  Without torch.distributed, just this rank's.
    """
    mine = tracer.chrome_events()
    if comm.is_initialized():
        gathered: list[Any] = [None] * comm.world_size(group)
        comm.all_gather_object(gathered, mine, group=group)
        if comm.rank() != dst:
            return None
    else:
        gathered = [mine]
    doc = merge_traces(gathered)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
    return doc


def executed_actions(doc: dict[str, Any], rank: int, *, iteration: int | None = None) -> list[str]:
    """The action strings (compute and communication, no waits) rank ``rank`` executed, in execution order; the two
    halves of an overlapped pair count as the pair (``"1F5+6BW2"``, once)."""
    out = []
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X" or ev.get("pid") != rank or ev.get("cat") in ("wait", "other"):
            continue
        if iteration is not None and ev["args"].get("iteration") != iteration:
            continue
        pair = ev["args"].get("pair")
        if pair is not None:  # the pair once, at its forward half
            if pair.split("+")[0] == ev["args"]["action"]:
                out.append(pair)
            continue
        out.append(ev["args"]["action"])
    return out  # a rank's events are appended in execution order (a compute event once the action has ended)


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
