"""Part (a) of ``tools/bench_pipeline.py``: the runtime on emulated compute against the simulator.

Every F, B and W sleeps its cost (``zb_pipeline.runtime.emulate``) with real gloo P2P between ``p`` processes, for
every registered schedule planned for those costs; the measured span of an iteration (from the trace) is compared
with the simulator's makespan under T_comm = the measured gloo latency, and with the per-hop cost measured inside
the running pipeline.  Every case is planned before any is run, and the cases run in turns (one iteration of each
per round), each iteration starting with a barrier.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from zb_pipeline.runtime.emulate import EmulatedCompute, EmulatedCosts, spin_for
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.profile_gather import measure_p2p_latency
from zb_pipeline.runtime.trace import Tracer, merge_traces
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.critical_path import critical_path
from zb_pipeline.schedule.ir import Kind, Schedule
from zb_pipeline.schedule.lowering import lower
from zb_pipeline.schedule.plan_file import plan_from_dict, plan_to_dict
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.testing import run_multiprocess

EMU_COSTS = EmulatedCosts(20.0, 20.0, 10.0, 5.0)  # the default; ``--emulated-costs F,B,W,OPT`` sets others
EMU_SPEC = (4, 16)
IDLE_S = 0.01  # how long a receiver waits idle before each hop when T_comm is measured (about one action)


def compute_span_ms(tracer: Tracer, iteration: int) -> float:
    evs = [
        e
        for e in tracer.events
        if e.get("tid") == 0 and e.get("cat") in ("F", "B", "W", "BW") and e["args"]["iteration"] == iteration
    ]
    if not evs:
        return 0.0
    return (max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)) / 1e3


def emulated_costs(name: str, p: int, comm_ms: float, emu: EmulatedCosts = EMU_COSTS) -> StageCosts:
    """The emulated costs ``emu`` (F, B, W per rank's share, T_comm ``comm_ms``) over schedule ``name``'s stages."""
    chunks = registry.get(name).default_chunks
    return StageCosts.build(
        num_ranks=p,
        chunks=chunks,
        stage_to_rank=registry.placement_of(name, p, chunks),
        f=emu.f_ms,
        b=emu.b_ms,
        w=emu.w_ms,
        comm=comm_ms,
    )


def emulated_plan(name: str, p: int, m: int, comm_ms: float, emu: EmulatedCosts = EMU_COSTS) -> Schedule:
    """Schedule ``name`` planned for the emulated costs, as the trainer plans the cost-dependent schedules from
    measured costs."""
    costs = emulated_costs(name, p, comm_ms, emu)
    return registry.generate(name, p, m, chunks=costs.num_stages // p, costs=costs)


def _plan_cases(
    rank: int, world: int, cases: list[tuple[str, int]], latency: float, emu_costs: EmulatedCosts
) -> dict[str, Schedule]:
    """Every case planned before any is run (a rank planning while others run a measured iteration takes a core
    from them): rank ``r`` plans cases ``r``, ``r + world``, ...; the plans are gathered on every rank (the group's
    timeout).  The latency is agreed, so the plans are those every rank would make."""
    mine = {
        f"{name}/{m}": plan_to_dict(emulated_plan(name, world, m, latency, emu_costs))
        for i, (name, m) in enumerate(cases)
        if i % world == rank
    }
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    merged = {key: d for part in gathered for key, d in part.items()}
    return {f"{name}/{m}": plan_from_dict(merged[f"{name}/{m}"]) for name, m in cases}  # in the cases' order


def _emulated_rank(
    rank: int, world: int, cases: list[tuple[str, int]], iterations: int, emu_costs: EmulatedCosts, spin_s: float
) -> dict:
    torch.set_num_threads(1)
    specs_shape = EMU_SPEC
    # T_comm for the simulator: a hop to a receiver that has been waiting idle (as a rank in a bubble does); the
    # back-to-back round trip (idle_s = 0) is reported beside it.
    latency = measure_p2p_latency(
        pp_rank=rank, pp_ranks=list(range(world)), shape=specs_shape, repeats=30, idle_s=IDLE_S
    )
    hot = measure_p2p_latency(pp_rank=rank, pp_ranks=list(range(world)), shape=specs_shape, repeats=30)
    timeline: list[tuple[str, str, int, float, float]] = []  # (plan | run, case, iteration, start, end), monotonic
    t_plan = time.monotonic()
    plans = _plan_cases(rank, world, cases, latency, emu_costs)
    timeline.append(("plan", "*", -1, t_plan, time.monotonic()))
    runs = {}  # every case's executor, kept alive over the rounds
    for key, sched in plans.items():
        specs = [TensorSpec(specs_shape)] * (sched.num_stages - 1)
        tracer = Tracer(rank)
        p2p = PipelineP2P(pp_rank=rank, boundary_specs=specs, timeout_s=120, tracer=tracer)
        stages = {s: torch.nn.Identity() for s in sched.stages_of(rank)}
        ex = PipelineExecutor(
            lower(sched), rank, stages, p2p=p2p, input_fn=lambda mb: None, loss_fn=lambda o, mb: None, tracer=tracer
        )
        emu = EmulatedCompute(emu_costs, chunks=sched.chunks, boundary_specs=specs, spin_s=spin_s)
        emu.attach(ex)
        runs[key] = (ex, emu, tracer)
    out = {"latency_ms": latency, "hot_latency_ms": hot, "cases": {}, "timeline": timeline}
    for key in plans:
        out["cases"][key] = {"spans": [], "iterations": [], "sends": [], "waits": [], "trace": []}
        if rank == 0:
            out["cases"][key]["plan"] = plan_to_dict(plans[key])
    # Round-robin: every case runs one iteration per round, so a stretch of host noise hits one iteration of many
    # cases rather than many iterations of one.  ``align`` starts each iteration with a barrier (the group's timeout).
    for it in range(iterations):
        for key, (ex, emu, tracer) in runs.items():
            res = out["cases"][key]
            tracer.align()
            t_run = time.monotonic()
            ex.run(it)
            emu.optimizer_step()
            t_end = time.monotonic()
            res["iterations"].append((t_end - t_run) * 1e3)
            timeline.append(("run", key, it, t_run, t_end))
            res["spans"].append(compute_span_ms(tracer, it))
            if it > 0 or iterations == 1:
                got_sends, got_waits = _transfer_times(tracer.events, tracer._t0, it)
                res["sends"] += got_sends
                res["waits"] += got_waits
            if it == iterations - 1:  # the last iteration's trace: its critical path is walked in the parent
                res["trace"] = list(tracer.events)
            tracer.events.clear()
    out["max_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier()
    return out


def _transfer_times(events: list[dict], t0: float, iteration: int) -> tuple[list, list]:
    """Host-clock begin of every plan step that produces a transfer, keyed like each transfer it produces, with
    its kind (F, B, BW; ``F+BW`` for both halves of an overlapped pair, begun at its forward half: lowering posts a
    pair's outputs after the pair), and (start, end) of every wait."""
    produced, waits = [], []
    pair_begin: dict[str, float] = {}  # a pair (its text) -> its forward half's begin
    for e in events:
        cat, a = e.get("cat"), e.get("args", {})
        if cat in ("F", "B", "BW") and e.get("tid") == 0:
            d = 0 if cat == "F" else 1
            begin = t0 + e["ts"] / 1e6
            pair = a.get("pair")
            if pair is not None:
                cat, begin = Kind.PAIR.value, pair_begin.setdefault(pair, begin)  # the forward half is traced first
            produced.append(((iteration, d, a["stage"], a["microbatch"]), cat, begin))
        elif cat == "wait" and a.get("kind") in ("RECV_F", "RECV_B"):
            d, s = (0, a["stage"] - 1) if a["kind"] == "RECV_F" else (1, a["stage"] + 1)
            start = t0 + e["ts"] / 1e6
            waits.append(((iteration, d, s, a["microbatch"]), start, start + e["dur"] / 1e6))
    return produced, waits


def in_pipeline_latency_ms(results: list[dict], key: str, chunks: int, emu: EmulatedCosts = EMU_COSTS) -> float | None:
    """Effective cost of one cross-rank hop inside the running pipeline: for every receive that blocked, the end of
    the wait minus the moment the producing plan step was due to end (its start + its emulated cost; an overlapped
    pair's: its forward half's start + F + BW, as the simulator times it, since the pair posts both outputs at its
    end).  It holds what the ping-pong misses: the sender oversleeping before it posts, the transfer, and the
    receiver's wake-up.  The mean over the blocked receives: a critical path of n hops costs n times the mean, not
    the median."""
    cost = {"F": emu.f_ms, "B": emu.b_ms, "BW": emu.b_ms + emu.w_ms, Kind.PAIR.value: emu.f_ms + emu.b_ms + emu.w_ms}
    due = {}
    for r in results:
        for k, kind, begin in r["cases"][key]["sends"]:
            due[tuple(k)] = begin + cost[kind] / chunks / 1e3
    samples = []
    for r in results:
        for k, start, end in r["cases"][key]["waits"]:
            t = due.get(tuple(k))
            if t is not None and end - start > 2e-4:
                samples.append((end - t) * 1e3)
    return max(0.0, statistics.fmean(samples)) if samples else None  # a chain of hops adds up their mean


def run_emulated(
    ps: Sequence[int],
    ms: Sequence[int],
    iterations: int,
    log: Callable[[str], None],
    *,
    emu: EmulatedCosts = EMU_COSTS,
    spin_s: float | None = None,
) -> dict:
    """Every schedule at every (p, m) under the emulated costs ``emu``; ``spin_s`` as in ``sleep_until`` (``None``:
    ``spin_for(p)``, no spin when the ranks outnumber the cores)."""
    rows = []
    latencies, hot_latencies, spins, rss = {}, {}, {}, {}
    for p in ps:
        cases = []
        for m in ms:
            for name in registry.available():
                try:
                    registry.generate(name, p, m)
                except ValueError as err:
                    log(f"  emulated p={p} m={m}: {name} skipped ({str(err).splitlines()[0]})")
                    continue
                cases.append((name, m))
        log(f"(a) emulated compute, p={p}: {len(cases)} runs of {iterations} iterations")
        spin = spin_for(p) if spin_s is None else spin_s
        spins[p] = spin * 1e3
        res = run_multiprocess(_emulated_rank, p, args=(cases, iterations, emu, spin), timeout_s=1800)
        lat = statistics.median(r["latency_ms"] for r in res)
        latencies[p] = lat
        hot_latencies[p] = statistics.median(r["hot_latency_ms"] for r in res)
        rss[p] = sum(r["max_rss_kib"] for r in res) / 1024  # every rank's peak resident set, summed
        log(f"  p={p}: the ranks' peak resident memory sums to {rss[p]:.0f} MiB")
        for name, m in cases:
            key = f"{name}/{m}"
            # skip the first round (warm-up); per iteration the slowest rank, then the median over iterations
            its = range(1 if iterations > 1 else 0, iterations)
            spans = [max(r["cases"][key]["spans"][i] for r in res) for i in range(iterations)]  # slowest rank's
            span = statistics.median(spans[i] for i in its)
            whole = statistics.median(max(r["cases"][key]["iterations"][i] for r in res) for i in its)
            sched = plan_from_dict(res[0]["cases"][key]["plan"])  # what the ranks ran
            costs = emulated_costs(name, p, lat, emu)  # the plan came from rank 0: no second search
            sim = simulate(sched, costs)
            lat_in = in_pipeline_latency_ms(res, key, sched.chunks, emu)
            sim_in = simulate(sched, replace(costs, comm=lat_in)) if lat_in is not None else sim
            hops = simulate(sched, replace(costs, comm=costs.comm + 1.0)).makespan - sim.makespan  # per ms of T_comm
            path = critical_path(merge_traces([r["cases"][key]["trace"] for r in res]), sched, iterations - 1)
            rows.append(
                {
                    "p": p,
                    "m": m,
                    "schedule": name,
                    "measured_span_ms": span,
                    "iteration_spans_ms": spans,  # every iteration's, the warm-up included
                    "simulated_ms": sim.makespan,
                    "error": span / sim.makespan - 1,
                    "in_pipeline_latency_ms": lat_in,
                    "simulated_in_pipeline_ms": sim_in.makespan,
                    "critical_hops": hops,
                    "path": {  # the measured critical path of the last iteration (``critical_path``)
                        "span_ms": path.span_ms,
                        "start_ms": path.start_ms,
                        "compute_ms": path.compute_ms,
                        "local_gap_ms": path.local_gap_ms,
                        "hops": path.hops,
                        "hop_ms": path.hop_ms,
                        "posting_ms": path.posting_ms,
                    },
                    "error_in_pipeline": span / sim_in.makespan - 1,
                    "iteration_ms": whole,
                    "simulated_bubble": sim.bubble_rate,
                }
            )
            err, err_in = span / sim.makespan - 1, span / sim_in.makespan - 1
            log(
                f"  p={p} m={m} {name:<16} span {span:8.1f} ms  sim {sim.makespan:8.1f} ms  ({err:+.1%}); in-pipeline "
                f"T_comm {lat_in or 0:.2f} ms: sim {sim_in.makespan:8.1f} ms ({err_in:+.1%})"
            )
    for row in rows:
        base = next((r for r in rows if r["p"] == row["p"] and r["m"] == row["m"] and r["schedule"] == "1f1b"), None)
        if base is not None:
            row["speedup"] = base["measured_span_ms"] / row["measured_span_ms"]
            row["simulated_speedup"] = base["simulated_ms"] / row["simulated_ms"]
    return {
        "rows": rows,
        "latency_ms": latencies,
        "hot_latency_ms": hot_latencies,
        "idle_s": IDLE_S,
        "costs_ms": asdict(emu),
        "spin_ms": spins,
        "rank_rss_mib": rss,
    }
