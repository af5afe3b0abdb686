"""Our pipeline runtime against the simulator, and every schedule against 1F1B: emulated and real compute.

    python tools/bench_pipeline.py [--out bench/results] [--quick] [--parts emulated,real]
                                   [--runs 10] [--m 4 8] [--p 4 8] [--emulated-m 16 32]

(a) emulated compute (``zb_pipeline.runtime.emulate``: every F, B, W sleeps its cost, with real gloo P2P):
    p in {4, 8}, m in {16, 32}, F = B = 20 ms, W = 10 ms, OPT = 5 ms, every schedule.  The measured span of an
    iteration (the slowest rank's first compute start to last compute end, from the trace) against the simulator's
    makespan with T_comm = the measured gloo latency; the measured speed-up over 1F1B against the simulated one; the
    whole iteration (optimizer step included).
(b) real compute: a small GPT (``megatron.model``) on CPU, pp = 2, m in {4, 8}, one thread per rank, every schedule
    in its own launch alternated with 1F1B
    (zb-auto planned from the profile of this very run), plus torch.distributed.pipelining's schedules on the same
    blocks when ``tools/bench_torch_pipelining.py`` is importable; >= 10 alternated runs each; median tokens/s and
    a bootstrap 95% interval of the ratio to 1F1B.
(c) prediction: the profiler's per-stage costs (``zb_pipeline.runtime.profiler``, from a split-backward schedule of
    the same layout) fed to the simulator, against the measured span of every schedule.
(d) memory: the measured peak activation bytes per rank (saved-tensor bytes, see the profiler) against the
    simulator's prediction under the profiled memory deltas, and against 1F1B's peak.

Writes ``pipeline.md``, ``pipeline.json`` and ``pipeline_*.png`` under ``--out`` with the machine, versions, load
average and settings.  On a multi-GPU node use ``examples/benchmark_zb_vs_1f1b.sh`` (torchrun, NCCL), which runs
part (b)/(c)/(d) of this script with ``--launcher torchrun``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_pipeline_emulated import compute_span_ms, run_emulated  # noqa: E402
from bench_pipeline_report import plot, to_markdown  # noqa: E402

from megatron.model import build_gpt_stages  # noqa: E402
from zb_pipeline.runtime.executor import PipelineExecutor  # noqa: E402
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory  # noqa: E402
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec  # noqa: E402
from zb_pipeline.runtime.profiler import ActionProfiler  # noqa: E402
from zb_pipeline.runtime.replanner import regenerate  # noqa: E402
from zb_pipeline.runtime.trace import Tracer  # noqa: E402
from zb_pipeline.runtime.weight_grad_store import WeightGradStore  # noqa: E402
from zb_pipeline.schedule import registry  # noqa: E402
from zb_pipeline.schedule.bounds import iteration_lower_bound, theory_ceiling  # noqa: E402
from zb_pipeline.schedule.ir import Schedule  # noqa: E402
from zb_pipeline.schedule.lowering import lower  # noqa: E402
from zb_pipeline.schedule.memory import peak_memory  # noqa: E402
from zb_pipeline.schedule.plan_file import plan_from_dict, plan_to_dict  # noqa: E402
from zb_pipeline.schedule.profile import Profile, costs_for, predict_makespan  # noqa: E402
from zb_pipeline.schedule.simulate import simulate  # noqa: E402
from zb_pipeline.testing import run_multiprocess  # noqa: E402

try:  # BENCH's peer benchmark: the same GPT blocks, its alternated timing and bootstrap
    import bench_torch_pipelining as tp_bench
except Exception:  # pragma: no cover - depends on the checkout
    tp_bench = None

# Split-backward schedule whose profile plans each layout (placement, chunks).
LAYOUT_PROFILER = {("loop", 1): "zb-h1", ("loop", 2): "interleaved-zb", ("v", 2): "zb-v"}


def all_schedules() -> list[str]:
    return registry.available()


def layout_of(name: str) -> tuple[str, int]:
    spec = registry.get(name)
    return spec.placement, spec.default_chunks


def environment() -> dict[str, Any]:
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "system": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "load_average": load,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def bootstrap_ratio(times: Sequence[float], base: Sequence[float], *, samples: int = 2000, seed: int = 0):
    """``median(base) / median(times)`` (throughput ratio) and its bootstrap 95% interval, runs paired by round."""
    if tp_bench is not None:
        return tp_bench.bootstrap_ratio_ci(times, base, samples=samples, seed=seed)
    a, b = np.asarray(times, float), np.asarray(base, float)
    n = min(len(a), len(b))
    idx = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    r = np.median(b[:n][idx], axis=1) / np.median(a[:n][idx], axis=1)
    lo, hi = np.percentile(r, [2.5, 97.5])
    return float(np.median(b) / np.median(a)), float(lo), float(hi)


def bootstrap_launches(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], *, samples: int = 2000, seed: int = 0):
    """Throughput ratio over several launches, each a pair (schedule's times, its 1F1B times), runs paired by round.

    The estimate is the median of the launches' ratios; the 95% interval resamples launches, then runs within each
    resampled launch, so it carries the launch-to-launch spread (fresh processes land differently on a shared host)
    that one launch's run bootstrap cannot see.  With one launch this is ``bootstrap_ratio``.
    """
    if len(pairs) == 1:
        return bootstrap_ratio(*pairs[0], samples=samples, seed=seed)
    rng = np.random.default_rng(seed)
    arrays = []
    for times, base in pairs:
        n = min(len(times), len(base))
        arrays.append((np.asarray(times[:n], float), np.asarray(base[:n], float)))
    point = float(np.median([np.median(b) / np.median(a) for a, b in arrays]))
    estimates = np.empty(samples)
    for k in range(samples):
        ratios = []
        for i in rng.integers(0, len(arrays), size=len(arrays)):
            a, b = arrays[i]
            j = rng.integers(0, len(a), size=len(a))
            ratios.append(np.median(b[j]) / np.median(a[j]))
        estimates[k] = np.median(ratios)
    lo, hi = np.percentile(estimates, [2.5, 97.5])
    return point, float(lo), float(hi)


# ------------------------------------------------------------------------------------ (b, c, d) real compute
class _Real:
    """One rank's GPT stages per layout and an executor per schedule (schedules of a layout share stages)."""

    def __init__(self, rank: int, world: int, model: Any, m: int, device: str = "cpu") -> None:
        self.rank, self.world, self.model, self.m, self.device = rank, world, model, m, torch.device(device)
        g = torch.Generator().manual_seed(7)
        t = torch.randint(0, model.vocab_size, (m * model.micro_batch, model.seq_length + 1), generator=g)
        self.tokens, self.labels = t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)
        self.layouts: dict[tuple[str, int], tuple[dict[int, torch.nn.Module], WeightGradStore]] = {}

    def _mb(self, tensor: torch.Tensor, mb: int) -> torch.Tensor:
        b = self.model.micro_batch
        return tensor[mb * b : (mb + 1) * b]

    def executor(self, sched: Schedule, *, tracer: Tracer | None = None) -> PipelineExecutor:
        layout = (sched.placement, sched.chunks)
        S = sched.num_stages
        if layout not in self.layouts:
            cfg = self.model.gpt_config()
            mine = sched.stages_of(self.rank)
            mods = build_gpt_stages(cfg, S, stages=list(mine), seed=self.model.seed)
            mods = [mod.to(self.device) for mod in mods]
            self.layouts[layout] = (dict(zip(mine, mods)), WeightGradStore())
        stages, store = self.layouts[layout]
        cfg = self.model.gpt_config()
        specs = [TensorSpec((cfg.seq_length, self.model.micro_batch, cfg.hidden_size))] * (S - 1)
        p2p = PipelineP2P(pp_rank=self.rank, boundary_specs=specs, timeout_s=300, tracer=tracer, device=self.device)
        m = self.m

        def forward_fn(module: torch.nn.Module, x: torch.Tensor, s: int, mb: int) -> torch.Tensor:
            if s == S - 1:
                return module(x, labels=self._mb(self.labels, mb))
            return module(x)

        def loss_fn(out: torch.Tensor, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            loss = out.mean()
            return loss / m, loss

        return PipelineExecutor(
            lower(sched),
            self.rank,
            stages,
            p2p=p2p,
            store=store,
            input_fn=lambda mb: self._mb(self.tokens, mb),
            loss_fn=loss_fn,
            forward_fn=forward_fn,
            tracer=tracer,
        )

    def zero_grad(self, sched: Schedule) -> None:
        for mod in self.layouts[(sched.placement, sched.chunks)][0].values():
            for prm in mod.parameters():
                prm.grad = None


def _real_rank(rank: int, world: int, model: Any, m: int, names: list[str], torch_names: list[str], warmup: int,
               profile_iters: int, runs: int, device: str = "cpu", keep_freed: bool = True) -> dict:  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if device == "cpu" and keep_freed:  # as the trainer does: malloc keeps freed activations (no page faults)
        keep_freed_host_memory()
    real = _Real(rank, world, model, m, device)
    # 1. Profile one split-backward schedule per layout; plan the cost-dependent schedules from their layout's profile.
    profiles: dict[tuple[str, int], Profile] = {}
    layouts = sorted({layout_of(n) for n in names})
    for layout in layouts:
        pname = LAYOUT_PROFILER[layout]
        sched = registry.generate(pname, world, m)
        ex = real.executor(sched)
        prof = ActionProfiler(ex, start_iter=warmup, end_iter=warmup + profile_iters)
        for it in range(warmup + profile_iters):
            real.zero_grad(sched)
            ex.run(it)
        profiles[layout] = prof.gather()
    plans: dict[str, Schedule] = {}
    for name in names:
        if registry.get(name).uses_costs:  # as the trainer re-plans them after its profiling window
            plans[name] = regenerate(profiles[layout_of(name)], m, name=name).schedule
        else:
            plans[name] = registry.generate(name, world, m)
    # 2. Every schedule: a profiled window for its measured peak memory, then the alternated timed runs, whose
    #    every action a time-only profiler records (its costs predict the runs' span: same iterations, no drift).
    executors, tracers, profilers, timers, steps = {}, {}, {}, {}, {}
    for name, sched in plans.items():
        tracer = Tracer(rank)
        ex = real.executor(sched, tracer=tracer)
        ex.p2p.tracer = tracer
        profilers[name] = ActionProfiler(ex, start_iter=0, end_iter=profile_iters)
        for it in range(profile_iters):
            real.zero_grad(sched)
            ex.run(it)
        tracer.events.clear()
        executors[name], tracers[name] = ex, tracer
        timers[name] = ActionProfiler(ex, start_iter=profile_iters + 1, memory="none")  # after the warm-up run

        def step(name: str = name, ex: PipelineExecutor = ex, sched: Schedule = sched) -> None:
            real.zero_grad(sched)
            ex.run()

        steps[name] = step
    if torch_names and tp_bench is not None and device == "cpu":
        steps.update(tp_bench.torch_schedule_steps(rank, world, model, torch_names, m))
    faults: dict[str, list[int]] = {name: [] for name in steps}
    for name, inner in list(steps.items()):

        def counted(inner: Callable[[], None] = inner, out: list[int] = faults[name]) -> None:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            inner()
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

        steps[name] = counted
    times = tp_bench.time_alternated(steps, warmup=1, runs=runs, cuda=device != "cpu")
    spans = {}
    for name, tracer in tracers.items():
        its = sorted({e["args"]["iteration"] for e in tracer.events if "args" in e})
        spans[name] = [compute_span_ms(tracer, it) for it in its[1:]]  # the warm-up run is not timed
    # Means, not medians: a span is a sum of actions and gaps (ActionProfiler.gather).
    own = {
        name: t.gather(comm_ms=profiles[layout_of(name)].comm, statistic="mean").to_dict() for name, t in timers.items()
    }
    peaks = {name: prof.local_summary()["peak"] for name, prof in profilers.items()}
    dist.barrier()
    return {
        "times": times,
        "spans": spans,
        "own_profiles": own,
        "page_faults": {name: statistics.median(v[1:]) for name, v in faults.items() if len(v) > 1},
        "peaks": peaks,
        "profiles": {f"{k[0]}/{k[1]}": v.to_dict() for k, v in profiles.items()},
        "plans": {n: plan_to_dict(s) for n, s in plans.items()},
    }


def _schedules_for(pp: int, m: int, log: Callable[[str], None]) -> list[str]:
    names = []
    for name in all_schedules():
        try:
            registry.generate(name, pp, m)
            names.append(name)
        except ValueError as err:
            log(f"  real pp={pp} m={m}: {name} skipped ({str(err).splitlines()[0]})")
    return names


def run_real(model: Any, ms: Sequence[int], runs: int, torch_names: list[str], log: Callable[[str], None],
             *, warmup: int = 2, profile_iters: int = 6, pp: int = 2, schedules: Sequence[str] | None = None,
             keep_freed: bool = True, one_launch: bool = False, launches: int = 1) -> dict:  # fmt: skip
    """Each schedule in its own launch, alternated with our 1F1B (pairwise); ``one_launch``: all of them
    alternated in one launch (one pair of processes, one shared 1F1B baseline).

    Why pairwise by default: a user runs one schedule per job, so each schedule gets fresh processes and its own 1F1B
    baseline; the ratios of different pairs share the 1F1B reference, not the same runs.  (All-in-one runs once
    slowed the split-backward schedules by 22-36%; that was a profiler leak, since fixed: see ``--one-launch``.)
    ``launches`` > 1 (pairwise only): every pair is launched that many times; the ratio is the median of the
    launches' ratios with an interval that resamples launches (``bootstrap_launches``); the other columns come
    from the first launch.
    """
    method = (
        "one launch: every schedule alternated"
        if one_launch
        else "pairwise: each schedule alternated with 1f1b in its own launch"
    )
    if one_launch and launches != 1:
        raise ValueError("--launches applies to the pairwise method; drop it or --one-launch")
    out: dict[str, Any] = {"pp": pp, "model": asdict(model), "runs": runs, "device": "cpu", "by_m": {},
                           "method": method, "host_malloc": "keep" if keep_freed else "default",
                           "launches": launches}  # fmt: skip
    quiet: Callable[[str], None] = lambda _msg: None  # noqa: E731
    for m in ms:
        names = [n for n in _schedules_for(pp, m, log) if schedules is None or n in schedules or n == "1f1b"]
        if one_launch:
            log(f"(b) real compute pp={pp} m={m}: {len(names)} of ours + {len(torch_names)} of torch's alternated in "
                f"one launch, {runs} runs each")  # fmt: skip
            res = run_multiprocess(
                _real_rank,
                pp,
                args=(model, m, names, list(torch_names), warmup, profile_iters, runs, "cpu", keep_freed),
                timeout_s=3600,
            )
            out["by_m"][str(m)] = aggregate_real(res, model, m, log)
            continue
        others = [n for n in names if n != "1f1b"]
        log(f"(b) real compute pp={pp} m={m}: {len(others)} of ours + {len(torch_names)} of torch's, each alternated "
            f"with 1f1b in its own launch, {runs} runs each")  # fmt: skip
        rows: list[dict] = []
        base_rows: list[dict] = []
        first: dict | None = None
        ceilings: dict[str, dict] = {}  # per split-backward schedule: the ceiling of its first launch
        for name in others + [f"torch:{t}" for t in torch_names]:
            ours, theirs = (["1f1b", name], []) if not name.startswith("torch:") else (["1f1b"], [name[6:]])
            pairs: list[tuple[list[float], list[float]]] = []
            row: dict | None = None
            for _ in range(launches):
                res = run_multiprocess(
                    _real_rank,
                    pp,
                    args=(model, m, ours, theirs, warmup, profile_iters, runs, "cpu", keep_freed),
                    timeout_s=3600,
                )
                pairs.append((res[0]["times"][name], res[0]["times"]["1f1b"]))
                agg = aggregate_real(res, model, m, quiet)
                first = first or agg
                row = row or next(r for r in agg["rows"] if r["schedule"] == name)
                base_rows.append(next(r for r in agg["rows"] if r["schedule"] == "1f1b"))
                if agg["ceiling"]["own"]:  # a split-backward loop schedule: this pair's 1F1B, its own costs
                    row.setdefault("launch_ceilings", []).append(agg["ceiling"]["own"]["ceiling"])
                    ceilings.setdefault(name, agg["ceiling"])
            assert row is not None
            if launches > 1:
                ratio, lo, hi = bootstrap_launches(pairs)
                all_times = [t for times, _ in pairs for t in times]
                row.update(
                    ratio=ratio,
                    ratio_lo=lo,
                    ratio_hi=hi,
                    launch_ratios=[statistics.median(b) / statistics.median(t) for t, b in pairs],
                    median_ms=statistics.median(all_times) * 1e3,
                    tokens_per_s=m * model.micro_batch * model.seq_length / statistics.median(all_times),
                    runs=len(all_times),
                )
            rows.append(row)
            _log_real_row(log, m, row)
        base = dict(base_rows[0])
        base["median_ms"] = statistics.median(r["median_ms"] for r in base_rows)
        base["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in base_rows)
        base["runs"] = sum(r["runs"] for r in base_rows)
        _log_real_row(log, m, base)
        assert first is not None
        ceiling = ceilings.get("zb-h2") or next(iter(ceilings.values()), first["ceiling"])
        out["by_m"][str(m)] = {"rows": [base, *rows], "profiles": first["profiles"], "latency_ms": first["latency_ms"],
                               "ceiling": ceiling}  # fmt: skip
    return out


def _log_real_row(log: Callable[[str], None], m: int, r: dict) -> None:
    log(
        f"  m={m} {r['schedule']:<22} {r['tokens_per_s']:9.0f} tok/s  x{r['ratio']:.3f} "
        f"[{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]"
        + (
            f"  span {r['measured_span_ms']:.1f} pred {r['predicted_span_ms']:.1f} ms "
            f"({r['prediction_error']:+.1%})  peak {max(r['peak_bytes']) / 2**20:.2f} MiB "
            f"(pred err {r['memory_error']:.1%})"
            if "peak_bytes" in r
            else ""
        )
    )


def aggregate_real(res: list[dict], model: Any, m: int, log: Callable[[str], None]) -> dict:
    """Rows of (b), (c), (d) for one m from every rank's ``_real_rank`` result."""
    if True:
        tokens = m * model.micro_batch * model.seq_length
        times = res[0]["times"]
        base = times["1f1b"]
        rows = []
        profiles = {k: Profile.from_dict(v) for k, v in res[0]["profiles"].items()}
        for name, ts in times.items():
            ratio, lo, hi = bootstrap_ratio(ts, base)
            row: dict[str, Any] = {
                "schedule": name,
                "median_ms": statistics.median(ts) * 1e3,
                "tokens_per_s": tokens / statistics.median(ts),
                "ratio": ratio,
                "ratio_lo": lo,
                "ratio_hi": hi,
                "runs": len(ts),
                "page_faults": [r.get("page_faults", {}).get(name) for r in res],
            }
            if name in res[0]["plans"]:
                sched = plan_from_dict(res[0]["plans"][name])
                layout = (sched.placement, sched.chunks)
                prof = profiles[f"{layout[0]}/{layout[1]}"]
                _, costs = costs_for(prof, name, chunks=sched.chunks)
                sim = simulate(sched, costs)
                n_it = min(len(r["spans"][name]) for r in res)
                span = statistics.median(max(r["spans"][name][i] for r in res) for i in range(n_it))
                peaks = [r["peaks"][name] for r in res]
                pred = peak_memory(sched, costs)
                own = Profile.from_dict(res[0]["own_profiles"][name])
                predicted = predict_makespan(own, sched)
                planned = predict_makespan(prof, sched)
                row.update(
                    measured_span_ms=span,
                    predicted_span_ms=predicted,
                    prediction_error=predicted / span - 1,
                    own_profile=res[0]["own_profiles"][name],
                    launch_profile_ms=planned,
                    launch_profile_error=planned / span - 1,
                    simulated_bubble=sim.bubble_rate,
                    peak_bytes=peaks,
                    predicted_peak_bytes=list(pred),
                    memory_error=max(abs(p / q - 1) if q else 0.0 for p, q in zip(peaks, pred)),
                )
                # In microbatches of each rank's own activation (its stages' profiled mem_f): the unit the
                # schedules' memory bounds are stated in (stages of unequal size skew a comparison of bytes).
                units = [sum(prof.mem_f[st] for st in sched.stages_of(r)) for r in range(sched.num_ranks)]
                counts = [pk / u for pk, u in zip(peaks, units) if u > 0]
                row.update(peak_microbatches=max(counts) if counts else None,
                           stated_bound=stated_memory_bound(name, sched.num_ranks, m))  # fmt: skip
            rows.append(row)
        one = next(r for r in rows if r["schedule"] == "1f1b")
        for r in rows:
            if "peak_bytes" in r:
                r["peak_vs_1f1b"] = max(r["peak_bytes"]) / max(one["peak_bytes"])
            _log_real_row(log, m, r)
        ceiling = speedup_ceiling(profiles["loop/1"], rows, res[0]["plans"], m)
        own_cap = f", x{ceiling['own']['ceiling']:.3f} (the runs' own costs)" if ceiling["own"] else ""
        log(f"  m={m} ceiling over 1F1B for any schedule of the loop layout: x{ceiling['launch']['ceiling']:.3f} "
            f"(launch profile){own_cap}")  # fmt: skip
        return {"rows": rows, "profiles": res[0]["profiles"], "latency_ms": profiles["loop/1"].comm,
                "ceiling": ceiling}  # fmt: skip


def speedup_ceiling(launch_profile: Profile, rows: list[dict], plans: dict[str, dict], m: int) -> dict[str, Any]:
    """The largest ratio to 1F1B any schedule with one stage per rank could reach (``iteration_lower_bound``).

    ``launch``: 1F1B's simulated iteration (``SimResult.end_time``: barrier to barrier) over the bound, both under the
    launch's profile (medians, the runtime's per-action overhead added).  ``own``: the same under the timed runs' own
    costs -- 1F1B's own profile for its iteration, the split-backward costs ZB-H2 (else zb-h1, zb-auto) measured in
    its runs for the bound -- the ceiling its measured ratio is to be read against.  ``split_end_ms``: each
    split-backward loop schedule's simulated iteration under its own costs, and ``theory`` the F = B = 2W ceiling.
    """
    p = launch_profile.num_ranks
    place = tuple(range(p))
    fixed_1f1b = registry.generate("1f1b", p, m)

    def one_pass(split: Profile, fused: Profile) -> dict[str, float]:
        bound = iteration_lower_bound(split.to_stage_costs(stage_to_rank=place, overhead=True), place, m)
        end = simulate(fixed_1f1b, fused.to_stage_costs(stage_to_rank=place, fused=True, overhead=True)).end_time
        return {"bound_ms": bound.time, "bound_rank": bound.rank, "bound_reason": bound.reason, "one_f_one_b_ms": end,
                "ceiling": end / bound.time}  # fmt: skip

    out: dict[str, Any] = {"launch": one_pass(launch_profile, launch_profile), "own": None,
                           "theory": theory_ceiling(p, m), "split_end_ms": {}}  # fmt: skip
    by_name = {r["schedule"]: r for r in rows if "own_profile" in r}
    split_rows = [by_name[n] for n in ("zb-h2", "zb-h1", "zb-auto") if n in by_name]
    if "1f1b" in by_name and split_rows:
        ref = Profile.from_dict(split_rows[0]["own_profile"])
        out["own"] = {"from": split_rows[0]["schedule"],
                      **one_pass(ref, Profile.from_dict(by_name["1f1b"]["own_profile"]))}  # fmt: skip
    for r in split_rows:
        own = Profile.from_dict(r["own_profile"]).to_stage_costs(stage_to_rank=place, overhead=True)
        out["split_end_ms"][r["schedule"]] = simulate(plan_from_dict(plans[r["schedule"]]), own).end_time
    return out


def stated_memory_bound(name: str, p: int, m: int) -> float | None:
    """The peak activation memory a schedule states, in microbatches of a rank's own share (None: not stated)."""
    bounds = {
        "gpipe": m,
        "1f1b": min(p, m),
        "zb-h1": min(p, m),
        "zb-h2": min(2 * p - 1, m),
        "zb-auto": min(2 * p - 1, m),  # the default memory limit
        "zb-v": min(p, m),
        "v-half": (p + 1) / 2,
        "v-min": (math.ceil(2 * p / 3) + 1) / 2,
    }
    return bounds.get(name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"), help="output directory")
    ap.add_argument("--quick", action="store_true", help="small settings for a smoke run (minutes)")
    ap.add_argument("--parts", default="emulated,real", help="comma list of: emulated, real")
    ap.add_argument("--p", type=int, nargs="+", default=None, help="emulated: pipeline sizes (default 4 8)")
    ap.add_argument("--emulated-m", type=int, nargs="+", default=None, help="emulated: microbatches (default 16 32)")
    ap.add_argument(
        "--emulated-iterations",
        type=int,
        default=None,
        help="emulated: iterations per schedule, the first one not counted (default 6)",
    )
    ap.add_argument(
        "--m", "--microbatches", dest="m", type=int, nargs="+", default=None, help="real: microbatches (default 4 8)"
    )
    ap.add_argument("--runs", type=int, default=None, help="real: alternated runs per schedule (default 10)")
    ap.add_argument("--no-torch", action="store_true", help="real: leave out torch.distributed.pipelining")
    ap.add_argument("--schedules", nargs="+", default=None, help="real: only these of ours (1f1b always runs)")
    ap.add_argument(
        "--torch-schedules", nargs="+", default=None, help="real: only these of torch.distributed.pipelining's"
    )
    ap.add_argument(
        "--one-launch", action="store_true", help="real: alternate all schedules in one launch (default: pairwise)"
    )
    ap.add_argument(
        "--launches",
        type=int,
        default=1,
        help="real, pairwise: launch every schedule's pair with 1F1B this many times; the ratio's interval then "
        "resamples launches too (default 1)",
    )
    ap.add_argument(
        "--host-malloc",
        choices=("keep", "default"),
        default="keep",
        help="real: keep freed host memory in the process (keep_freed_host_memory, as the trainer does) or leave "
        "glibc's defaults (to measure what they cost: page faults per iteration are reported)",
    )
    ap.add_argument(
        "--launcher",
        choices=("local", "torchrun"),
        default="local",
        help="local: spawn gloo ranks on this machine; torchrun: this process is one rank of a torchrun job "
        "(pp = world size, NCCL on GPUs), runs parts (b)-(d) only",
    )
    args = ap.parse_args(argv)
    if args.launcher == "torchrun":
        return main_torchrun(args, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    bad = parts - {"emulated", "real"}
    if bad:
        print(f"bench_pipeline: error: --parts {sorted(bad)} unknown; use emulated and/or real", file=sys.stderr)
        return 2
    if args.launches < 1 or (args.launches > 1 and args.one_launch):
        print("bench_pipeline: error: --launches must be >= 1 and goes with the pairwise method (not --one-launch)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.emulated_iterations is not None and args.emulated_iterations < 2:
        print("bench_pipeline: error: --emulated-iterations must be >= 2 (the first is a warm-up)", file=sys.stderr)
        return 2
    quick = args.quick
    ps = args.p or ([4] if quick else [4, 8])
    ems = args.emulated_m or ([16] if quick else [16, 32])
    ms = args.m or ([4] if quick else [4, 8])
    runs = args.runs or (3 if quick else 10)
    model = None
    if tp_bench is not None:
        # 4 layers of hidden 256 over two ranks: about 10 ms per F per rank, small enough for >= 10 alternated runs
        # of 16 schedules on a shared two-core machine.
        model = tp_bench.QUICK_MODEL if quick else tp_bench.BenchModel(num_layers=4)
    torch_names: list[str] = []
    if tp_bench is not None and not args.no_torch:
        avail = tp_bench.available_schedules()
        wanted = args.torch_schedules or (["1f1b"] if quick else avail)
        unknown = sorted(set(wanted) - set(avail))
        if unknown:
            print(f"bench_pipeline: error: --torch-schedules {unknown} not available here; choose from {avail}",
                  file=sys.stderr)  # fmt: skip
            return 2
        torch_names = list(wanted)
    os.makedirs(args.out, exist_ok=True)
    report: dict[str, Any] = {
        "environment": environment(),
        "settings": {"argv": argv, "quick": quick, "emulated_p": ps, "emulated_m": ems, "real_m": ms, "runs": runs},
    }
    t0 = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {line}", flush=True)

    if "emulated" in parts:
        report["emulated"] = run_emulated(ps, ems, args.emulated_iterations or (2 if quick else 6), log)
    if "real" in parts:
        if model is None:
            log("(b) real compute skipped: tools/bench_torch_pipelining.py (the shared GPT settings) is not importable")
        else:
            report["real"] = run_real(
                model,
                ms,
                runs,
                torch_names,
                log,
                schedules=args.schedules,
                keep_freed=args.host_malloc == "keep",
                one_launch=args.one_launch,
                launches=args.launches,
            )
    try:
        report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        report["load_average_end"] = None
    report["seconds"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "pipeline.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "pipeline.md"), "w", encoding="utf-8") as f:
        f.write(to_markdown(report))
    for path in plot(report, args.out):
        log(f"wrote {path}")
    log(f"wrote {os.path.join(args.out, 'pipeline.md')} and pipeline.json")
    return 0


def main_torchrun(args: argparse.Namespace, argv: list[str]) -> int:
    """One rank of ``torchrun --nproc-per-node N tools/bench_pipeline.py --launcher torchrun``: pp = N."""
    from datetime import timedelta

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if tp_bench is None:
        print("bench_pipeline: tools/bench_torch_pipelining.py is needed for the model settings", file=sys.stderr)
        return 2
    model = tp_bench.QUICK_MODEL if args.quick else tp_bench.BenchModel()
    ms = args.m or ([2 * world] if args.quick else [2 * world, 4 * world])
    runs = args.runs or (3 if args.quick else 10)
    device = f"cuda:{local}" if cuda else "cpu"

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    report: dict[str, Any] = {
        "environment": {**environment(), "gpu": torch.cuda.get_device_name(local) if cuda else None},
        "settings": {"argv": argv, "launcher": "torchrun", "world": world, "real_m": ms, "runs": runs},
        "real": {"pp": world, "model": asdict(model), "runs": runs, "device": device, "by_m": {}},
    }
    for m in ms:
        names = _schedules_for(world, m, log)
        mine = _real_rank(rank, world, model, m, names, [], 2, 3, runs, device)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            report["real"]["by_m"][str(m)] = aggregate_real(gathered, model, m, log)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        report["load_average_end"] = environment()["load_average"]
        stem = os.path.join(args.out, "pipeline_torchrun")
        with open(stem + ".json", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(to_markdown(report))
        print(f"wrote {stem}.md and {stem}.json", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
