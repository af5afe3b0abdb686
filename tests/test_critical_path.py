"""The measured critical path of a trace: exact on a hand-made trace, and consistent on a real emulated run."""

from __future__ import annotations

import pytest
from schedule_test_plans import events_as_simulated

from zb_pipeline.schedule.critical_path import critical_path
from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.registry import generate


def _ev(pid: int, cat: str, stage: int, mb: int, start_ms: float, dur_ms: float, tid: int = 0, **args) -> dict:
    return {
        "name": f"{stage}{cat}{mb}",
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start_ms * 1e3,
        "dur": dur_ms * 1e3,
        "args": {"stage": stage, "microbatch": mb, "iteration": 0, "kind": args.get("kind", cat), "action": "x"},
    }


def _gpipe_p2_m1_trace() -> dict:
    """Rank 0: F0 [0, 10], sends at 10.3, waits for the gradient, B0 [31, 41]; rank 1: waits, F1 [10.8, 20.8], a
    0.2 ms gap, B1 [21, 30.5], sends at 30.7."""
    return {
        "traceEvents": [
            _ev(0, "F", 0, 0, 0.0, 10.0),
            _ev(0, "SEND_F", 0, 0, 10.3, 0.0, tid=1),
            _ev(0, "wait", 0, 0, 10.5, 20.5, kind="RECV_B"),
            _ev(0, "B", 0, 0, 31.0, 10.0),
            _ev(1, "wait", 1, 0, 0.1, 10.7, kind="RECV_F"),
            _ev(1, "F", 1, 0, 10.8, 10.0),
            _ev(1, "B", 1, 0, 21.0, 9.5),
            _ev(1, "SEND_B", 1, 0, 30.7, 0.0, tid=1),
        ]
    }


def test_hand_made_trace_splits_exactly() -> None:
    path = critical_path(_gpipe_p2_m1_trace(), generate("gpipe", 2, 1), 0)
    assert [s.action for s in path.steps] == [
        Action(0, Kind.F, 0),
        Action(1, Kind.F, 0),
        Action(1, Kind.B, 0),
        Action(0, Kind.B, 0),
    ]
    assert [s.link for s in path.steps] == ["start", "hop", "local", "hop"]
    assert path.span_ms == pytest.approx(41.0)
    assert path.compute_ms == pytest.approx(39.5)
    assert path.local_gap_ms == pytest.approx(0.2)
    assert path.hops == 2
    assert path.hop_ms == pytest.approx(0.8 + 0.5)
    assert path.posting_ms == pytest.approx(0.3 + 0.2)
    assert "2 hops" in path.summary()


def test_short_wait_is_not_a_hop() -> None:
    """A receive that waited less than blocked_ms did not hold its consumer: the rank's own gap is the link."""
    doc = _gpipe_p2_m1_trace()
    for ev in doc["traceEvents"]:
        if ev["cat"] == "wait" and ev["pid"] == 0:
            ev["dur"] = 100.0  # 0.1 ms
    path = critical_path(doc, generate("gpipe", 2, 1), 0)
    assert path.steps[-1].link == "local"
    assert path.steps[-1].link_ms == pytest.approx(31.0 - 10.0)
    assert path.span_ms == pytest.approx(path.start_ms + path.compute_ms + path.local_gap_ms + path.hop_ms)


def test_missing_send_events_leave_posting_unknown() -> None:
    doc = _gpipe_p2_m1_trace()
    doc["traceEvents"] = [ev for ev in doc["traceEvents"] if ev["cat"] != "SEND_B"]
    path = critical_path(doc, generate("gpipe", 2, 1), 0)
    assert path.hops == 2 and path.posting_ms is None


def _trace_as_simulated(name: str, p: int, m: int, *, comm_ms: float, post_ms: float) -> tuple[dict, float]:
    """A trace of ``name`` run exactly as the simulator times it at T_comm ``comm_ms`` (F 2, B 3, W 1.5 ms per stage):
    every send posted ``post_ms`` after its plan step ends (a pair: after its backward half, as lowered), every
    receive waited from the rank's previous end to the arrival.  Returns it and the simulated makespan."""
    from zb_pipeline.schedule.costs import StageCosts
    from zb_pipeline.schedule.simulate import simulate

    sched = generate(name, p, m)
    costs = StageCosts.build(
        num_ranks=p, chunks=sched.chunks, stage_to_rank=sched.stage_to_rank, f=2.0, b=3.0, w=1.5, comm=comm_ms
    )
    res = simulate(sched, costs)
    traces = events_as_simulated(sched, res, costs, comm_ms, _ev, post_ms=post_ms)
    return {"traceEvents": [e for evs in traces for e in evs]}, res.makespan


@pytest.mark.parametrize("name", ["dualpipev", "zb-v", "1f1b"])
def test_a_trace_run_as_simulated_has_every_hop_cost_t_comm(name: str) -> None:
    """Run exactly as simulated, every hop on the path costs T_comm, split into the posting delay and the rest --
    also where the producer is an overlapped pair's forward half, whose output the pair posts after its backward
    half (dualpipev: the hop starts at the pair's end, and the backward half's compute stays on the path)."""
    comm, post = 0.5, 0.125
    doc, makespan = _trace_as_simulated(name, 4, 8, comm_ms=comm, post_ms=post)
    path = critical_path(doc, generate(name, 4, 8), 0)
    hops = [s for s in path.steps if s.link == "hop"]
    assert hops and all(s.link_ms == pytest.approx(comm) and s.posting_ms == pytest.approx(post) for s in hops)
    assert path.span_ms == pytest.approx(makespan)
    assert path.local_gap_ms == pytest.approx(0.0, abs=1e-9)
    assert path.span_ms == pytest.approx(path.start_ms + path.compute_ms + path.hop_ms)
