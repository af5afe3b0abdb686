"""The in-pipeline hop cost of ``tools/bench_pipeline_emulated.py`` on a made-up trace: every receive waited until
its producer's plan step ended plus an injected T_comm, so the measured cost must be that T_comm exactly -- also where
the producer is a DualPipeV overlapped pair (both outputs due at the pair's start + F + BW)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zb_pipeline.runtime.emulate import EmulatedCosts
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_pipeline_emulated import _transfer_times, emulated_costs, in_pipeline_latency_ms  # noqa: E402
from schedule_test_plans import events_as_simulated  # noqa: E402

EMU = EmulatedCosts(4.0, 6.0, 3.0)  # F, B, W of a rank's whole share, ms
T0 = 1000.0  # the tracer's host-clock origin, s
ITERATION = 1


def _rank_traces(name: str, p: int, m: int, comm_ms: float) -> list[list[dict]]:
    """Each rank's trace events of ``name`` run as the simulator times it under ``EMU`` and T_comm ``comm_ms``: a
    pair's halves traced as an F and a BW event naming the pair, every cross-rank input waited for from the rank's
    previous end to its arrival (the producing plan step's end + ``comm_ms``)."""
    sched = generate(name, p, m)
    costs = emulated_costs(name, p, comm_ms, EMU)
    res = simulate(sched, costs)

    def ev(rank: int, cat: str, stage: int, mb: int, start_ms: float, dur_ms: float, **args: object) -> dict:
        return {
            "cat": cat,
            "tid": 0,
            "ts": start_ms * 1e3,
            "dur": dur_ms * 1e3,
            "args": {"stage": stage, "microbatch": mb, "iteration": ITERATION, **args},
        }

    return events_as_simulated(sched, res, costs, comm_ms, ev)


@pytest.mark.parametrize("name", ["dualpipev", "zb-h1"])
def test_in_pipeline_latency_is_the_injected_hop_cost(name: str) -> None:
    comm, p, m = 0.75, 4, 8
    traces = _rank_traces(name, p, m, comm)
    results, kind_of, blocked = [], {}, []
    for evs in traces:
        sends, waits = _transfer_times(evs, T0, ITERATION)
        kind_of.update({k: kind for k, kind, _ in sends})
        blocked += [k for k, start, end in waits if end - start > 2e-4]
        results.append({"cases": {"x": {"sends": sends, "waits": waits}}})
    # the blocked receives of dualpipev include outputs of pairs (their forward halves': a pair's backward output
    # never holds its consumer here), due at the pair's start + F + BW
    from_pairs = sum(kind_of[k] == Kind.PAIR.value for k in blocked)
    assert (from_pairs > 0) == (name == "dualpipev"), (from_pairs, len(blocked))
    chunks = generate(name, p, m).chunks
    assert in_pipeline_latency_ms(results, "x", chunks, EMU) == pytest.approx(comm, abs=1e-6)
