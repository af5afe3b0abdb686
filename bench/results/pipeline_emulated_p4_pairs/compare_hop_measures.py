"""The hop measures before and after DualPipeV's pairs were counted as one step, on the same emulated traces.

    python bench/results/pipeline_emulated_p4_pairs/compare_hop_measures.py [--base COMMIT] [--p 4] [--m 8]

Runs every registered schedule at p ranks on emulated compute (``tools/bench_pipeline_emulated._emulated_rank``,
4 iterations) and, on the last iteration's traces, computes the in-pipeline T_comm and the measured critical path's
hops (posting + transit) with the code of ``--base`` (``git show``) and with this tree's.  Writes
``compare.md`` beside itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

import bench_pipeline_emulated as new_bench  # noqa: E402

from zb_pipeline.runtime.trace import merge_traces  # noqa: E402
from zb_pipeline.schedule import critical_path as new_cp  # noqa: E402
from zb_pipeline.schedule import registry  # noqa: E402
from zb_pipeline.schedule.plan_file import plan_from_dict  # noqa: E402
from zb_pipeline.testing import run_multiprocess  # noqa: E402


def _old(base: str, path: str, name: str) -> types.ModuleType:
    src = subprocess.check_output(["git", "-C", ROOT, "show", f"{base}:{path}"], text=True)
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, f"{base}:{path}", "exec"), mod.__dict__)
    return mod


def _latency(bench: types.ModuleType, res: list[dict], key: str, chunks: int, it: int) -> float | None:
    """``bench``'s in-pipeline T_comm from the last iteration's traces only (every rank's clock zeroed by the
    iteration's barrier: a common axis)."""
    fake = []
    for r in res:
        sends, waits = bench._transfer_times(r["cases"][key]["trace"], 0.0, it)
        fake.append({"cases": {key: {"sends": sends, "waits": waits}}})
    return bench.in_pipeline_latency_ms(fake, key, chunks)


def _path(mod: types.ModuleType, res: list[dict], key: str, sched, it: int) -> str:
    path = mod.critical_path(merge_traces([r["cases"][key]["trace"] for r in res]), sched, it)
    n = max(path.hops, 1)
    post = path.posting_ms
    split = f"{post / n:.2f} + {(path.hop_ms - post) / n:.2f}" if post is not None else "-"
    return f"{path.hops}, {path.hop_ms / n:.2f} = {split}; compute {path.compute_ms:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="e32da9c")
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    args = ap.parse_args()
    iterations = 4
    old_bench = _old(args.base, "tools/bench_pipeline_emulated.py", "old_bench_pipeline_emulated")
    old_cp = _old(args.base, "zb_pipeline/schedule/critical_path.py", "old_critical_path")
    cases = []
    for name in registry.available():
        try:
            registry.generate(name, args.p, args.m)
        except ValueError:
            continue
        cases.append((name, args.m))
    load0, t0 = open("/proc/loadavg").read().split()[:3], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res = run_multiprocess(
        new_bench._emulated_rank,
        args.p,
        args=(cases, iterations, new_bench.EMU_COSTS, new_bench.spin_for(args.p)),
        timeout_s=900,
    )
    load1 = open("/proc/loadavg").read().split()[:3]
    it = iterations - 1
    lines = [
        f"# Hop measures before ({args.base}) and after, on the same traces: p = {args.p}, m = {args.m}",
        "",
        f"`python bench/results/pipeline_emulated_p4_pairs/compare_hop_measures.py --base {args.base} --p {args.p} "
        f"--m {args.m}` -- {t0}, load {' '.join(load0)} at the start, {' '.join(load1)} at the end. Emulated F, B, "
        f"W = {new_bench.EMU_COSTS.f_ms}, {new_bench.EMU_COSTS.b_ms}, {new_bench.EMU_COSTS.w_ms} ms per rank's "
        "share; ping-pong T_comm (idle receiver) "
        f"{statistics.median(r['latency_ms'] for r in res):.3f} ms.",
        "",
        "In-pipeline T_comm: mean over blocked receives of wait end - producing step's due end; *all iterations* is "
        "the tool's own (iterations 1-3, this tree); *last, before / after*: iteration 3's traces only, with the "
        "base's code and this tree's. Path: the measured critical path of iteration 3: hops, mean hop ms = posting "
        "+ transit; the compute on the path (ms).",
        "",
        "| schedule | in-pipeline T_comm ms: all iterations | last: before | last: after | path before | path after |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in cases:
        key = f"{name}/{m}"
        sched = plan_from_dict(res[0]["cases"][key]["plan"])
        tool = new_bench.in_pipeline_latency_ms(res, key, sched.chunks)
        before = _latency(old_bench, res, key, sched.chunks, it)
        after = _latency(new_bench, res, key, sched.chunks, it)

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        lines.append(
            f"| {name} | {ms(tool)} | {ms(before)} | {ms(after)} | {_path(old_cp, res, key, sched, it)} | "
            f"{_path(new_cp, res, key, sched, it)} |"
        )
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare.md")
    with open(out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
