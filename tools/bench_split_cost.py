"""Where the split's cost goes: every B, W and BW timed inside the pipeline, against the same ops run alone.

One launch of ``tools/bench_pipeline.py``'s real-compute set-up (the small GPT, pp = 2, gloo, one thread per rank):
1F1B and the split-backward schedules alternated round by round (``bench_torch_pipelining.time_alternated``), every
compute action of the timed runs recorded per (schedule, kind, stage, microbatch) with its own input wait left out
(the clock starts at the executor's ``input_ready`` hook, as ``ActionProfiler`` does).  Then, in the same processes,
each rank runs its own stage alone, alternated: F then BW; F, B, W back to back; and three microbatches' F and B
before their three Ws (a late W, as ZB-H2 runs it).

Per stage it prints (B + W) / BW four ways -- by the samples' mean (what ``ActionProfiler`` with
``statistic="mean"`` gives the benchmark), by their median, normalised by each schedule's own F (the same work in
both runs, so what the two schedules' different overlap of the ranks does to every op cancels), and alone -- plus
W split by how late it ran (actions between its B and it).

    python tools/bench_split_cost.py [--m 4] [--runs 20] [--schedules zb-h2 zb-auto] [--alone-reps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tools")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_torch_pipelining as tp_bench  # noqa: E402
from bench_pipeline_real import LAYOUT_PROFILER, _Real  # noqa: E402

from zb_pipeline.runtime.executor import PipelineExecutor  # noqa: E402
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory  # noqa: E402
from zb_pipeline.runtime.profiler import ActionProfiler  # noqa: E402
from zb_pipeline.runtime.replanner import regenerate  # noqa: E402
from zb_pipeline.schedule import registry  # noqa: E402
from zb_pipeline.schedule.ir import Kind  # noqa: E402
from zb_pipeline.testing import run_multiprocess  # noqa: E402

KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)


class ActionRecorder:
    """Every compute action's time (ms, input wait excluded) with its stage, microbatch and position on the rank."""

    def __init__(self, ex: PipelineExecutor) -> None:
        self.on = False
        # (kind, stage, microbatch, position, wall ms, this thread's CPU ms)
        self.rows: list[tuple[str, int, int, int, float, float]] = []
        self._start = self._cpu = 0.0
        self._pos = 0
        ex.hooks.input_ready.append(self._ready)
        ex.hooks.iteration_start.append(self._begin)
        for kind in KINDS:
            if kind in ex.handlers:
                ex.wrap_handler(kind, lambda inner, kind=kind: self._wrap(kind, inner))

    def _begin(self, ex: Any) -> None:
        self._pos = 0

    def _ready(self, a: Any) -> None:
        self._start, self._cpu = time.perf_counter(), time.thread_time()

    def _wrap(self, kind: Kind, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def handler(ex: Any, a: Any) -> Any:
            self._start, self._cpu = time.perf_counter(), time.thread_time()
            out = inner(ex, a)
            if self.on:
                wall, cpu = (time.perf_counter() - self._start) * 1e3, (time.thread_time() - self._cpu) * 1e3
                self.rows.append((kind.value, a.stage, a.microbatch, self._pos, wall, cpu))
            self._pos += 1
            return out

        return handler


def _alone(real: _Real, stage: int, module: torch.nn.Module, store: Any, reps: int, depth: int = 3) -> dict:
    """This rank's stage alone: F then BW, F B W back to back, and ``depth`` F/B pairs before their Ws."""
    model, m = real.model, real.m
    g = torch.Generator().manual_seed(11 + stage)
    last = stage == real.world - 1  # one stage per rank (the loop layout)
    shape = (model.seq_length, model.micro_batch, model.hidden_size)

    def forward(mb: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if stage == 0:
            x = real._mb(real.tokens, mb)
        else:
            x = torch.randn(shape, generator=g).requires_grad_()
        if last:
            out = module(x, labels=real._mb(real.labels, mb))
            return out.mean() / m, None, x
        return module(x), torch.randn(shape, generator=g), x

    def backward(root: torch.Tensor, grad: torch.Tensor | None, key: tuple[int, int] | None) -> tuple[float, float]:
        t, c = time.perf_counter(), time.thread_time()
        if key is None:
            torch.autograd.backward([root], None if grad is None else [grad])
        else:
            with store.defer(*key):
                torch.autograd.backward([root], None if grad is None else [grad])
        return (time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3

    def w(key: tuple[int, int]) -> tuple[float, float]:
        t, c = time.perf_counter(), time.thread_time()
        store.run(*key)
        return (time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3

    out: dict[str, list[tuple[float, float]]] = {"BW": [], "B": [], "W": [], "B_late": [], "W_late": []}

    def zero() -> None:  # each variant starts from no gradient, as a pipeline iteration's first microbatch does
        for prm in module.parameters():
            prm.grad = None

    def fused() -> dict[str, list[tuple[float, float]]]:
        zero()
        root, grad, _ = forward(0)
        return {"BW": [backward(root, grad, None)]}

    def split() -> dict[str, list[tuple[float, float]]]:
        zero()
        root, grad, _ = forward(0)
        return {"B": [backward(root, grad, (stage, 0))], "W": [w((stage, 0))]}

    def late() -> dict[str, list[tuple[float, float]]]:
        zero()
        pending = []
        for k in range(depth):
            root, grad, _ = forward(k)
            pending.append(backward(root, grad, (stage, k)))
        return {"B_late": pending, "W_late": [w((stage, k)) for k in range(depth)]}

    variants = [fused, split, late]
    for rep in range(reps + 2):
        k = rep % len(variants)  # rotate the order, as the pipeline runs are
        for variant in variants[k:] + variants[:k]:
            got = variant()
            if rep >= 2:
                for key, values in got.items():
                    out[key].extend(values)
    return out


def _rank(rank: int, world: int, model: Any, m: int, names: list[str], runs: int, reps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    keep_freed_host_memory()
    real = _Real(rank, world, model, m)
    prof_sched = registry.generate(LAYOUT_PROFILER[("loop", 1)], world, m)
    ex = real.executor(prof_sched)
    prof = ActionProfiler(ex, start_iter=2, end_iter=6)
    for it in range(6):
        real.zero_grad(prof_sched)
        ex.run(it)
    profile = prof.gather()
    recorders: dict[str, ActionRecorder] = {}
    steps: dict[str, Callable[[], None]] = {}
    for name in ["1f1b", *names]:
        sched = regenerate(profile, m, name=name).schedule if registry.get(name).uses_costs else None
        sched = sched or registry.generate(name, world, m)
        ex = real.executor(sched)
        recorders[name] = ActionRecorder(ex)

        def step(ex: PipelineExecutor = ex, sched: Any = sched, rec: ActionRecorder = recorders[name]) -> None:
            real.zero_grad(sched)
            ex.run()
            rec.on = True  # the warm-up run (the first call) is not recorded

        steps[name] = step
    times = tp_bench.time_alternated(steps, warmup=1, runs=runs)
    stages, store = real.layouts[("loop", 1)]
    alone = {s: _alone(real, s, mod, store, reps) for s, mod in stages.items()}
    return {"times": times, "rows": {n: r.rows for n, r in recorders.items()}, "alone": alone}


def _stat(values: Sequence[float], how: str) -> float:
    return float(statistics.fmean(values) if how == "mean" else statistics.median(values))


def ratio_interval(b: Sequence[float], w: Sequence[float], bw: Sequence[float], *, samples: int = 1000,
                   seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """Bootstrap 95% interval of (median B + median W) / median BW, each sample set resampled on its own."""
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(v, float) for v in (b, w, bw)]
    est = np.empty(samples)
    for k in range(samples):
        mb, mw, mbw = (np.median(a[rng.integers(0, len(a), len(a))]) for a in arrays)
        est[k] = (mb + mw) / mbw
    lo, hi = np.percentile(est, [2.5, 97.5])
    return float(lo), float(hi)


def analyse(res: list[dict], names: Sequence[str], clock: str) -> dict[str, Any]:
    """Per stage and split schedule: (B + W) / BW by mean, by median, F-normalised, and alone; W by lateness.
    ``clock``: ``"wall"`` (perf_counter) or ``"cpu"`` (the rank's thread CPU time: what preemption leaves out)."""
    col = 4 if clock == "wall" else 5
    out: dict[str, Any] = {}
    for r in res:
        for name in names:
            rows = r["rows"][name]
            base = r["rows"]["1f1b"]
            for s in sorted({row[1] for row in rows}):

                def get(rs: list, kind: str, s: int = s) -> list[float]:
                    return [row[col] for row in rs if row[0] == kind and row[1] == s]

                b, w, f = get(rows, "B"), get(rows, "W"), get(rows, "F")
                bw, f1 = get(base, "BW"), get(base, "F")
                entry: dict[str, Any] = {"n": len(b), "n_bw": len(bw)}
                for how in ("mean", "median"):
                    entry[how] = {
                        k: _stat(v, how) for k, v in (("F", f), ("B", b), ("W", w), ("F_1f1b", f1), ("BW", bw))
                    }
                    e = entry[how]
                    entry[f"ratio_{how}"] = (e["B"] + e["W"]) / e["BW"]
                    entry[f"ratio_{how}_per_F"] = ((e["B"] + e["W"]) / e["F"]) / (e["BW"] / e["F_1f1b"])
                entry["ratio_median_ci"] = ratio_interval(b, w, bw)
                # W's lateness: compute actions between its B and it on this rank
                lat: dict[str, list[float]] = {"next": [], "later": []}
                bs = [(row[2], row[3]) for row in rows if row[0] == "B" and row[1] == s]
                ws = [(row[2], row[3], row[col]) for row in rows if row[0] == "W" and row[1] == s]
                for (mb_b, pb), (mb_w, pw, ms) in zip(bs, ws):  # one B and one W per microbatch, same order per run
                    assert mb_b == mb_w, "Bs and Ws of a stage ran in different microbatch orders"
                    lat["next" if pw - pb == 1 else "later"].append(ms)
                entry["W_by_lateness"] = {k: (len(v), _stat(v, "median") if v else None) for k, v in lat.items()}
                a = r["alone"][s]
                am = {k: _stat([x[col - 4] for x in v], "median") for k, v in a.items()}
                entry["alone_median"] = am
                entry["alone_ratio"] = (am["B"] + am["W"]) / am["BW"]
                entry["alone_ratio_ci"] = ratio_interval(*([x[col - 4] for x in a[k]] for k in ("B", "W", "BW")))
                entry["alone_ratio_late"] = (am["B_late"] + am["W_late"]) / am["BW"]
                out.setdefault(name, {})[s] = entry
    return out


def _ci(lo_hi: Sequence[float]) -> str:
    return f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--schedules", nargs="+", default=["zb-h2", "zb-auto"])
    ap.add_argument("--alone-reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="write split_cost.json here")
    args = ap.parse_args(argv)
    model = tp_bench.BenchModel(num_layers=4)
    load0 = os.getloadavg()
    t0 = time.time()
    res = run_multiprocess(
        _rank, 2, args=(model, args.m, list(args.schedules), args.runs, args.alone_reps), timeout_s=1800
    )
    report = {clock: analyse(res, args.schedules, clock) for clock in ("wall", "cpu")}
    load1 = os.getloadavg()
    print(f"m = {args.m}, {args.runs} runs; load {load0} -> {load1}; {time.time() - t0:.0f} s")
    for clock, name, per in ((c, n, p) for c, r in report.items() for n, p in r.items()):
        for s, e in per.items():
            med, mean, am = e["median"], e["mean"], e["alone_median"]
            print(
                f"{clock:4s} {name:8s} stage {s}: (B+W)/BW mean {e['ratio_mean']:.3f} median {e['ratio_median']:.3f} "
                f"per-F median {e['ratio_median_per_F']:.3f} | alone {e['alone_ratio']:.3f} {_ci(e['alone_ratio_ci'])} "
                f"(late W {e['alone_ratio_late']:.3f}) | med F {med['F']:.2f}/{med['F_1f1b']:.2f} B {med['B']:.2f} "
                f"W {med['W']:.2f} BW {med['BW']:.2f}; mean B {mean['B']:.2f} W {mean['W']:.2f} BW {mean['BW']:.2f} "
                f"| alone B {am['B']:.2f} W {am['W']:.2f} BW {am['BW']:.2f} Blate {am['B_late']:.2f} "
                f"Wlate {am['W_late']:.2f} | W next/later {e['W_by_lateness']}"
            )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"split_cost_m{args.m}.json"), "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "load": [load0, load1], "report": report,
                       "times": res[0]["times"], "rows": [r["rows"] for r in res]}, f)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
