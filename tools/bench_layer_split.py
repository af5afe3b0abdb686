"""The stage planner measured through ``pretrain_gpt.py`` on ``make train``'s model (issue 22's balance targets).

    python tools/bench_layer_split.py [--out bench/results] [--rounds N] [--iters N] [--quick]
    python tools/bench_layer_split.py --recompute [--limit-gb X|midpoint] [--out DIR] [--rounds N] [--iters N]

Set-up (both modes): ``make train``'s model (``tools/make_train.py``'s ``MODEL_FLAGS``: 4 layers, hidden 128, 4
heads, sequence 128, no dropout) with ``--mock-data --vocab-size 4096``, micro-batch 2, global batch 8 (m = 4), on
pp = 2 ranks through torchrun (gloo, one thread per rank), one log line per iteration.  Launches of the cases are
alternated (case A, case B, case A, ...) so the machine's drift falls on every case alike; each case's iteration
time is the median of its launches' logged "elapsed time per iteration" after ``--skip`` iterations (past the
profiling window and the re-split); ratios carry a 95% bootstrap interval over launches.

Default mode, even against auto split (zb-h1): ``--pipeline-layer-split even`` against ``auto`` with the profiling
window ``--zero-bubble-pipeline-timers-start-iter 3 --zero-bubble-pipeline-timers-end-iter 8``, at whose end the
trainer re-decides the split from the measured per-part costs and logs its prediction (``MeasuredSplit.summary``:
the predicted iteration of the chosen split and of the even split, simulated under the measured costs plus the
measured time per iteration outside the pipeline's actions).  Reported: measured auto / even, predicted auto /
even, measured over predicted auto iteration, and whether the losses of the two splits are identical.  Writes
``layer_split.md`` / ``.json``.

``--recompute``, the recompute choice under a memory limit (zb-auto): ``--pipeline-memory-limit-gb X``
(``--limit-gb``, by default ``RECOMPUTE_LIMIT_GB``: below ZB-H1's peak, where the planner recomputes the first stage;
between ZB-H1's and ZB-H2's peaks it takes no recompute on this model; ``--limit-gb midpoint`` takes their midpoint;
the peaks, on the auto split without recompute, are measured in a profiling window by one launch of each, and the
report says where the limit lies against them) for three cases, each with
``--pipeline-layer-split auto``: the planner's ``--recompute-granularity auto``, whose split and per-stage choice the
profiling window re-decides from measured costs; full recompute everywhere (``full``, ``uniform``, 1 layer); no
recompute, where zb-auto plans within the same limit (the largest memory that fits).  Reported: each case's
iteration, each launch's choice after the window, and auto over the better of the other two.  Writes
``layer_split_recompute.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from make_train import MODEL_FLAGS  # noqa: E402

from megatron.arguments import parse_run_config  # noqa: E402
from megatron.pipeline.layer_split import GIB, PREDICTION  # noqa: E402

DATA = ["--mock-data", "--vocab-size", "4096"]
WINDOW = (3, 8)  # the profiling window, iterations [3, 8)
ITER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: (\S+)")
RECOMPUTE_LIMIT_GB = "0.0072"  # --recompute's default --limit-gb (docs/planner.md, docs/benchmarks.md cite its run)
RECOMPUTE = {
    "auto": ["--recompute-granularity", "auto"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "none": [],
}


def base_flags(schedule: str, iters: int) -> list[str]:
    return [
        *MODEL_FLAGS, *DATA, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "1e-3", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
        "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--distributed-timeout-seconds", "300",
        "--zero-bubble-pipeline-timers-start-iter", str(WINDOW[0]),
        "--zero-bubble-pipeline-timers-end-iter", str(WINDOW[1]),
    ]  # fmt: skip


def one_run(flags: list[str], skip: int) -> dict:
    """One torchrun launch on 2 ranks: kept iteration times (ms), every loss, the trainer's logged prediction."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--nproc-per-node", "2", str(ROOT / "pretrain_gpt.py"), *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"run failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout[-3000:]}{res.stderr[-2000:]}")
    rows = [(int(i), float(ms), loss) for i, ms, loss in ITER_LINE.findall(res.stdout)]
    pred = PREDICTION.search(res.stdout)
    prediction = None
    if pred:
        layers = [int(x) for x in pred.group(1).split(",")]
        even = float(pred.group(3)) if pred.group(3) else None
        prediction = {"layers": layers, "ms": float(pred.group(2)), "even_ms": even}
    return {
        "kept": [ms for i, ms, _ in rows if i > skip],
        "losses": [loss for _, _, loss in rows],
        "prediction": prediction,
        "split_line": next((ln for ln in res.stdout.splitlines() if "layers per stage" in ln), ""),
        "recompute_line": next((ln for ln in res.stdout.splitlines() if "activation recomputation" in ln), ""),
        "stdout": res.stdout,
    }


def pooled_median(runs: list[list[float]]) -> float:
    return statistics.median([x for run in runs for x in run])


def bootstrap(stat, groups: list[list], n: int = 2000) -> tuple[float, float]:
    """95% interval of ``stat(*groups)`` resampling each group's launches."""
    rng = random.Random(0)
    out = sorted(stat(*[rng.choices(g, k=len(g)) for g in groups]) for _ in range(n))
    return out[int(0.025 * n)], out[int(0.975 * n) - 1]


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"


def alternate(cases: dict[str, list[str]], rounds: int, skip: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, flags in cases.items():
            got = one_run(flags, skip)
            runs[name].append(got)
            print(f"round {r + 1}/{rounds} {name}: median {statistics.median(got['kept']):.1f} ms", flush=True)
    return runs


def split_mode(args: argparse.Namespace, load_start: str) -> tuple[dict, list[str]]:
    base = base_flags("zb-h1", args.iters)
    cases = {name: base + ["--pipeline-layer-split", name] for name in ("even", "auto")}
    startup = parse_run_config(cases["auto"], world_size=2).pipeline_layout
    analytic = startup.split_plan.iteration / startup.even_iteration
    t0 = time.time()
    runs = alternate(cases, args.rounds, args.skip)
    even, auto = [r["kept"] for r in runs["even"]], [r["kept"] for r in runs["auto"]]
    preds = [r["prediction"] for r in runs["auto"]]
    if any(p is None or p["even_ms"] is None for p in preds):
        raise SystemExit("an auto run logged no prediction at the end of its profiling window")
    med = {"even": pooled_median(even), "auto": pooled_median(auto)}
    pred_ms = statistics.median(p["ms"] for p in preds)
    pred_ratio = statistics.median(p["ms"] / p["even_ms"] for p in preds)
    pairs = list(zip(auto, [p["ms"] for p in preds], strict=True))
    result = {
        "mode": "split",
        "schedule": "zb-h1",
        "startup_split": list(startup.layers_per_stage),
        "chosen_splits": [p["layers"] for p in preds],
        "median_ms": med,
        "ratio_auto_over_even": med["auto"] / med["even"],
        "ratio_95": bootstrap(lambda a, e: pooled_median(a) / pooled_median(e), [auto, even]),
        "predicted_auto_ms": pred_ms,
        "predicted_auto_ms_per_run": [p["ms"] for p in preds],
        "predicted_even_ms_per_run": [p["even_ms"] for p in preds],
        "predicted_ratio": pred_ratio,
        "analytic_predicted_ratio": analytic,
        "measured_over_predicted_auto": med["auto"] / pred_ms,
        "measured_over_predicted_95": bootstrap(
            lambda ps: pooled_median([a for a, _ in ps]) / statistics.median(p for _, p in ps), [pairs]
        ),
        "per_run_ms": {k: [statistics.median(r) for r in v] for k, v in (("even", even), ("auto", auto))},
        "losses_identical": all(r["losses"] == runs["even"][0]["losses"] for r in runs["even"] + runs["auto"]),
    }
    lo, hi = result["ratio_95"]
    mlo, mhi = result["measured_over_predicted_95"]
    counts = Counter(str(p["layers"]) for p in preds)  # the window's choice per launch
    chosen = ", ".join(f"{k} ({n} of {len(preds)} launches)" for k, n in counts.most_common())
    md = [
        "# Layer split: even against auto (`--pipeline-layer-split auto`)",
        "",
        f"make train's model (4 layers, hidden 128, vocabulary 4096, mock data) through `pretrain_gpt.py`, pp = 2 "
        f"(CPU, gloo, 1 thread per rank), zb-h1, m = 4 microbatches of 2; profiling window iterations "
        f"{WINDOW[0]}-{WINDOW[1] - 1}, where the trainer re-decides the split from measured per-part costs.  "
        f"{args.rounds} alternated launches per split, {args.iters} iterations each, iterations {args.skip + 1}-"
        f"{args.iters} kept.",
        "",
        "| split | layers per stage | measured iteration (ms) | predicted at the re-split (ms) |",
        "|---|---|---|---|",
        f"| even | [2, 2] | {med['even']:.1f} | {statistics.median(result['predicted_even_ms_per_run']):.1f} |",
        f"| auto | {chosen} | {med['auto']:.1f} | {pred_ms:.1f} |",
        "",
        f"- measured auto / even: **{result['ratio_auto_over_even']:.3f}** (95% bootstrap over launches "
        f"[{lo:.3f}, {hi:.3f}])",
        f"- predicted auto / even (at the re-split, measured costs): **{pred_ratio:.3f}** (the start-up analytic "
        f"FLOPs model: {analytic:.3f})",
        f"- measured / predicted auto iteration: **{result['measured_over_predicted_auto']:.3f}** "
        f"([{mlo:.3f}, {mhi:.3f}])",
        f"- per launch (ms): even {', '.join(f'{x:.1f}' for x in result['per_run_ms']['even'])}; auto "
        f"{', '.join(f'{x:.1f}' for x in result['per_run_ms']['auto'])}; predicted auto "
        f"{', '.join(f'{x:.1f}' for x in result['predicted_auto_ms_per_run'])}",
        f"- losses of every launch identical: {result['losses_identical']}",
        "",
    ]
    return {**result, "wall_s": time.time() - t0}, md


# The window's decision: the split and, under --recompute-granularity auto, each stage's recompute.
WINDOW_CHOICE = re.compile(
    r"(?<=layer split from measured per-part costs: )\[[\d, ]+\](?=.*?recompute per stage ([\w, ]+) \()?"
)
REPLANNED = re.compile(r"replanned \S+ .*?peak activation memory per rank \[([0-9., ]+)\] MiB")


def measured_peaks_gb(iters: int) -> dict[str, float]:
    """ZB-H1's and ZB-H2's peaks (GiB, the busiest rank) on the auto split without recompute, simulated under the
    activation memory measured in a profiling window (what the runtime's zb-auto plans against): one launch each."""
    out = {}
    for name in ("zb-h1", "zb-h2"):
        flags = base_flags(name, WINDOW[1] + 1) + ["--pipeline-layer-split", "auto"]
        found = REPLANNED.search(one_run(flags, iters)["stdout"])
        if found is None:
            raise SystemExit(f"{name}: the profiling window logged no re-plan with its peak memory")
        out[name] = max(float(x) for x in found.group(1).split(",")) * 2**20 / GIB
    return out


def recompute_mode(args: argparse.Namespace, load_start: str) -> tuple[dict, list[str]]:
    peaks = measured_peaks_gb(args.iters)
    h1, h2 = peaks["zb-h1"], peaks["zb-h2"]
    limit = float(f"{(h1 + h2) / 2:.6g}") if args.limit_gb == "midpoint" else float(args.limit_gb)
    base = base_flags("zb-auto", args.iters) + ["--pipeline-layer-split", "auto", "--pipeline-memory-limit-gb"]
    cases = {name: base + [f"{limit:g}", *flags] for name, flags in RECOMPUTE.items()}
    t0 = time.time()
    runs = alternate(cases, args.rounds, args.skip)
    kept = {name: [r["kept"] for r in rs] for name, rs in runs.items()}
    med = {name: pooled_median(v) for name, v in kept.items()}
    better = min(("full", "none"), key=lambda n: med[n])

    def ratio(a: list, f: list, n: list) -> float:
        return pooled_median(a) / min(pooled_median(f), pooled_median(n))

    where = "below ZB-H1's" if limit < h1 else "above ZB-H2's" if limit > h2 else "between ZB-H1's and ZB-H2's"

    def after_window(r: dict) -> str:
        found = WINDOW_CHOICE.search(r["stdout"])
        if found is None:
            return "kept (no decision logged)"
        return found.group(0) + (f" {found.group(1).replace(', ', '/')}" if found.group(1) else "")

    result = {
        "mode": "recompute",
        "schedule": "zb-auto",
        "limit_gb": limit,
        "limit_against_peaks": where,
        "after_window": {k: [after_window(r) for r in rs] for k, rs in runs.items()},
        "measured_peaks_gb": peaks,
        "median_ms": med,
        "better_of_others": better,
        "ratio_auto_over_better": ratio(kept["auto"], kept["full"], kept["none"]),
        "ratio_95": bootstrap(ratio, [kept["auto"], kept["full"], kept["none"]]),
        "per_run_ms": {k: [statistics.median(r) for r in v] for k, v in kept.items()},
        "choices": {k: [rs[0]["split_line"].strip(), rs[0]["recompute_line"].strip()] for k, rs in runs.items()},
    }
    lo, hi = result["ratio_95"]
    md = [
        "# Recompute choice under a memory limit (`--recompute-granularity auto`)",
        "",
        f"make train's model through `pretrain_gpt.py`, pp = 2 (CPU, gloo, 1 thread per rank), zb-auto, m = 4 "
        f"microbatches of 2, `--pipeline-memory-limit-gb {limit:g}` with `--pipeline-layer-split auto` ({where} "
        f"peak: ZB-H1's is {h1:.5f} GiB, ZB-H2's {h2:.5f} GiB, on the auto split without recompute under the "
        f"activation memory measured in a profiling window).  The start-up plan follows the analytic model; at the "
        f"end of the profiling window (iterations {WINDOW[0]}-{WINDOW[1] - 1}) the split -- and for auto each "
        f"stage's recompute -- is re-decided from the measured costs and zb-auto re-planned within the limit.  "
        f"{args.rounds} alternated launches per case, {args.iters} iterations each, iterations {args.skip + 1}-"
        f"{args.iters} kept.",
        "",
        "| case | at start-up (analytic model) | after the window, per launch | median iteration (ms) |",
        "|---|---|---|---|",
        *(
            f"| {k} | {'; '.join(x for x in result['choices'][k] if x)} | "
            f"{', '.join(f'{c} ({n})' for c, n in Counter(result['after_window'][k]).most_common())} | {med[k]:.1f} |"
            for k in RECOMPUTE
        ),
        "",
        f"- auto over the better of full and none ({better}): **{result['ratio_auto_over_better']:.3f}** "
        f"(95% bootstrap over launches [{lo:.3f}, {hi:.3f}])",
        "- per launch (ms): "
        + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in result["per_run_ms"].items()),
        "",
    ]
    return {**result, "wall_s": time.time() - t0}, md


def limit_gb_arg(text: str) -> str:
    """``--limit-gb``: a positive number of GiB or ``midpoint``, checked before any launch."""
    if text != "midpoint":
        try:
            ok = float(text) > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of GiB or 'midpoint'")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="2 rounds of 14 iterations")
    ap.add_argument("--rounds", type=int, default=4, help="alternated launches per case")
    ap.add_argument("--iters", type=int, default=24, help="iterations per launch")
    ap.add_argument("--skip", type=int, default=WINDOW[1] + 2, help="iterations dropped from each launch")
    ap.add_argument("--recompute", action="store_true", help="the recompute choice under a memory limit")
    ap.add_argument(
        "--limit-gb",
        default=RECOMPUTE_LIMIT_GB,
        type=limit_gb_arg,
        help=f"--recompute: the limit in GiB, or 'midpoint' of ZB-H1's and ZB-H2's peaks ({RECOMPUTE_LIMIT_GB})",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.iters = 2, 14
    load_start = loadavg()
    result, md = (recompute_mode if args.recompute else split_mode)(args, load_start)
    command = " ".join(["python", "tools/bench_layer_split.py", *(argv if argv is not None else sys.argv[1:])])
    result.update(load_start=load_start, load_end=loadavg(), command=command)
    md += [f"Load (/proc/loadavg) at the start `{load_start}`, at the end `{result['load_end']}`.  Command: "
           f"`{command}`.", ""]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "layer_split_recompute" if args.recompute else "layer_split"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
