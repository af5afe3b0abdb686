"""Parts (b), (c), (d) of ``tools/bench_pipeline.py``: a small GPT on real compute, every schedule timed against 1F1B.

Each rank profiles one split-backward schedule per layout, plans the cost-dependent schedules from it, then runs
every schedule's profiled window (peak memory) and the alternated timed runs (``bench_torch_pipelining``'s timing).
``run_real`` launches the ranks (pairwise with 1F1B, or all in one launch); ``bench_pipeline_analysis`` turns their
results into rows.
"""

from __future__ import annotations

import resource
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from bench_pipeline_analysis import aggregate_real, bootstrap_launches, log_real_row
from bench_pipeline_emulated import compute_span_ms

from megatron.model import build_gpt_stages
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.profiler import ActionProfiler
from zb_pipeline.runtime.replanner import regenerate
from zb_pipeline.runtime.trace import Tracer
from zb_pipeline.runtime.weight_grad_store import WeightGradStore
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.lowering import lower
from zb_pipeline.schedule.plan_file import plan_to_dict
from zb_pipeline.schedule.profile import Profile
from zb_pipeline.testing import run_multiprocess

try:  # BENCH's peer benchmark: the same GPT blocks, its alternated timing and torch's schedules
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
    # Medians of the same samples: the split's cost in place compares per-action costs, and a mean over a few
    # dozen actions follows the few a busy host preempted (bench_pipeline_analysis.split_ratio).
    own_median = {
        name: t.gather(comm_ms=profiles[layout_of(name)].comm, statistic="median").to_dict()
        for name, t in timers.items()
    }
    peaks = {name: prof.local_summary()["peak"] for name, prof in profilers.items()}
    dist.barrier()
    return {
        "times": times,
        "spans": spans,
        "own_profiles": own,
        "own_profiles_median": own_median,
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
        out["by_m"][str(m)] = _run_pairwise(
            model, m, names, torch_names, runs, log, warmup=warmup, profile_iters=profile_iters, pp=pp,
            keep_freed=keep_freed, launches=launches,
        )  # fmt: skip
    return out


def _run_pairwise(model: Any, m: int, names: list[str], torch_names: list[str], runs: int,
                  log: Callable[[str], None], *, warmup: int, profile_iters: int, pp: int, keep_freed: bool,
                  launches: int) -> dict:  # fmt: skip
    """One m of the pairwise method: every schedule (and torch's) launched ``launches`` times beside 1F1B; the
    block of rows (the 1F1B row: the median over all launches), profiles, latency and ceiling."""
    quiet: Callable[[str], None] = lambda _msg: None  # noqa: E731
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
            this = next(r for r in agg["rows"] if r["schedule"] == name)
            row = row or this
            if this.get("split_ratio"):
                row.setdefault("split_ratio_launches", []).append(this["split_ratio"])
            base_rows.append(next(r for r in agg["rows"] if r["schedule"] == "1f1b"))
            if agg["ceiling"]["own"]:  # a split-backward loop schedule: this pair's 1F1B, its own costs
                row.setdefault("launch_ceilings", []).append(agg["ceiling"]["own"]["ceiling"])
                ceilings.setdefault(name, agg["ceiling"])
        assert row is not None
        if len(row.get("split_ratio_launches", [])) > 1:  # per stage, the median over the launches
            per_stage = zip(*row["split_ratio_launches"], strict=True)
            row["split_ratio"] = [None if None in v else statistics.median(v) for v in per_stage]
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
        log_real_row(log, m, row)
    base = dict(base_rows[0])
    base["median_ms"] = statistics.median(r["median_ms"] for r in base_rows)
    base["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in base_rows)
    base["runs"] = sum(r["runs"] for r in base_rows)
    log_real_row(log, m, base)
    assert first is not None
    ceiling = ceilings.get("zb-h2") or next(iter(ceilings.values()), first["ceiling"])
    return {"rows": [base, *rows], "profiles": first["profiles"], "latency_ms": first["latency_ms"],
            "ceiling": ceiling}  # fmt: skip
