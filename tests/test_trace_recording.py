"""The tracer records cheap tuples and builds Chrome events on read: the events must be what was recorded then."""

from __future__ import annotations

from zb_pipeline.runtime.trace import COMM_TID, COMPUTE_TID, Tracer, executed_actions, merge_traces
from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.lowering import CommBatch


def test_events_keep_the_clock_and_iteration_of_their_recording() -> None:
    tr = Tracer(3)
    t0 = tr._t0
    f = Action(1, Kind.F, 0)
    send = Action(1, Kind.SEND_F, 0, 2)
    recv = Action(1, Kind.RECV_B, 0, 2)
    b = Action(1, Kind.B, 0)
    tr.begin_iteration(7)
    tr.compute(f, t0 + 0.001, t0 + 0.003)
    tr.comm_posted(CommBatch((send, recv)))
    tr.waited(recv, b, t0 + 0.004, t0 + 0.010)
    tr.compute(b, t0 + 0.004, t0 + 0.012)  # called before its input arrived: begins at the wait's end
    first = list(tr.events)  # built here
    tr.align()  # a new clock zero and a new iteration must not rewrite what was recorded before
    tr.begin_iteration(8)
    tr.mark("optimizer", tr._t0 + 0.001, tr._t0 + 0.002, step=1)
    evs = tr.events
    assert evs[: len(first)] == first
    fe, se, re, we, be, me = evs
    assert (fe["name"], fe["cat"], fe["tid"], fe["pid"]) == ("1F0", "F", COMPUTE_TID, 3)
    assert (fe["ts"], fe["dur"]) == (1000.0, 2000.0)
    assert fe["args"] == {"action": "1F0", "kind": "F", "stage": 1, "microbatch": 0, "iteration": 7}
    assert (se["name"], se["tid"], se["dur"], se["args"]["peer"]) == ("1SEND_F0@2", COMM_TID, 0.0, 2)
    assert re["name"] == "1RECV_B0@2" and re["ts"] == se["ts"]
    assert (we["cat"], we["name"], we["ts"], we["dur"]) == ("wait", "wait 1RECV_B0@2", 4000.0, 6000.0)
    assert we["args"]["waiter"] == "1B0" and we["args"]["iteration"] == 7
    assert (be["ts"], be["dur"]) == (10000.0, 2000.0)
    assert me == {
        "name": "optimizer",
        "cat": "other",
        "ph": "X",
        "pid": 3,
        "tid": COMPUTE_TID,
        "ts": 1000.0,
        "dur": 1000.0,
        "args": {"iteration": 8, "step": 1},
    }
    doc = merge_traces([tr.chrome_events()])
    assert executed_actions(doc, 3, iteration=7) == ["1F0", "1SEND_F0@2", "1RECV_B0@2", "1B0"]
    tr.events.clear()
    tr.compute(f, tr._t0, tr._t0 + 0.001)
    assert [e["name"] for e in tr.events] == ["1F0"]
