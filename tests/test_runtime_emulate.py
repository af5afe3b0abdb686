"""Emulated compute: the real executor and real P2P with sleeping F/B/W, measured against the simulator.

No timing assertions (a busy two-core machine); the measured numbers are printed (``pytest -s``) for the report.
What is asserted: the emulated run executes every planned action, and bad ``--emulate-compute`` values fail clearly.
"""

from __future__ import annotations

import time

import pytest
import torch
from runtime_models import posted_as_planned

from zb_pipeline.runtime.emulate import EmulatedCompute, EmulatedCosts
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.trace import Tracer, executed_actions, merge_traces
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.critical_path import critical_path
from zb_pipeline.schedule.lowering import CommBatch, lower
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.trace_timeline import measured_iteration
from zb_pipeline.testing import run_multiprocess

COSTS = "20,20,10,5"  # F, B, W, OPT in ms for a rank's whole share (the measurement issue's setting)
ITERATIONS = 2


def _emulated_rank(rank: int, world_size: int, name: str, m: int, costs_text: str) -> dict:
    torch.set_num_threads(1)
    sched = generate(name, world_size, m)
    lowered = lower(sched)
    specs = [TensorSpec((4, 16))] * (sched.num_stages - 1)
    tracer = Tracer(rank)
    p2p = PipelineP2P(pp_rank=rank, boundary_specs=specs, timeout_s=60, tracer=tracer)
    stages = {s: torch.nn.Identity() for s in sched.stages_of(rank)}
    ex = PipelineExecutor(
        lowered, rank, stages, p2p=p2p, input_fn=lambda mb: None, loss_fn=lambda out, mb: None, tracer=tracer
    )
    emu = EmulatedCompute(EmulatedCosts.parse(costs_text), chunks=sched.chunks, boundary_specs=specs)
    emu.attach(ex)
    iteration_s = []
    for it in range(ITERATIONS):
        tracer.align()  # barrier: every rank starts the iteration together
        t0 = time.perf_counter()
        ex.run(it)
        emu.optimizer_step()
        iteration_s.append(time.perf_counter() - t0)
    doc = merge_traces([tracer.chrome_events()])
    last = [
        ev
        for ev in doc["traceEvents"]
        if ev.get("tid") == 0 and ev.get("cat") in ("F", "B", "W", "BW") and ev["args"]["iteration"] == ITERATIONS - 1
    ]
    span_ms = (max(ev["ts"] + ev["dur"] for ev in last) - min(ev["ts"] for ev in last)) / 1e3
    return {
        "span_ms": span_ms,
        "iteration_ms": iteration_s[-1] * 1e3,
        "executed": executed_actions(doc, rank, iteration=ITERATIONS - 1),
        "events": tracer.chrome_events(),
    }


def test_emulated_costs_parse() -> None:
    assert EmulatedCosts.parse("20,20,10") == EmulatedCosts(20.0, 20.0, 10.0, 0.0)
    assert EmulatedCosts.parse(" 1.5, 2,3 ,4") == EmulatedCosts(1.5, 2.0, 3.0, 4.0)
    for bad in ("20,20", "a,b,c", "1,2,3,4,5", "1,-2,3"):
        with pytest.raises(ValueError, match="emulate-compute"):
            EmulatedCosts.parse(bad)


@pytest.mark.parametrize("name", [pytest.param("1f1b", marks=pytest.mark.slow), "zb-h2"])
def test_emulated_p4_m16_runs_the_plan_and_reports_time(name: str) -> None:
    p, m = 4, 16
    results = run_multiprocess(_emulated_rank, p, args=(name, m, COSTS), timeout_s=120)
    sched = generate(name, p, m)
    lowered = lower(sched)
    for rank, res in enumerate(results):
        planned = [a for st in lowered.ranks[rank] for a in (st.actions if isinstance(st, CommBatch) else (st,))]
        assert posted_as_planned(res["executed"], planned) is None, posted_as_planned(res["executed"], planned)
    c = EmulatedCosts.parse(COSTS)
    sim = simulate(sched, StageCosts.build(num_ranks=p, f=c.f_ms, b=c.b_ms, w=c.w_ms))
    span = max(r["span_ms"] for r in results)
    iteration = max(r["iteration_ms"] for r in results)
    # The measured critical path accounts for the whole span, link by link (no timing asserted).
    doc = merge_traces([r["events"] for r in results])
    path = critical_path(doc, sched, ITERATIONS - 1)
    assert path.span_ms == pytest.approx(measured_iteration(doc, sched, ITERATIONS - 1).span_ms, abs=1e-6)
    parts = path.start_ms + path.compute_ms + path.local_gap_ms + path.hop_ms
    assert parts == pytest.approx(path.span_ms, abs=0.01)
    assert path.hops >= 1 and path.posting_ms is not None
    for before, step in zip(path.steps, path.steps[1:]):
        assert (step.link == "hop") == (step.rank != before.rank), (before, step)
    print(f"\n[emulated] {name} {path.summary()}")
    print(
        f"\n[emulated] {name} p={p} m={m} F,B,W,OPT={COSTS} ms: measured span {span:.1f} ms "
        f"(simulated makespan {sim.makespan:.1f} ms, ratio {span / sim.makespan:.3f}); "
        f"iteration incl. OPT {iteration:.1f} ms"
    )
