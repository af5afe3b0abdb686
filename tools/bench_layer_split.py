"""Even against auto layer split (``--pipeline-layer-split auto``) with real compute, on ``make train``'s model.

    python tools/bench_layer_split.py [--out bench/results] [--quick] [--rounds N] [--iters N] [--schedule NAME]

The model of ``tools/make_train.py`` (4 layers, hidden 128, 4 heads, sequence 128, vocabulary 4096) on pp = 2
ranks (torchrun, gloo, one thread each; mock data), 4 microbatches of 2 per iteration: the even split [2, 2] and the
stage planner's split are run alternately (even, auto, even, auto, ...), each run ``--iters`` iterations of which
the first two are dropped; per split the median of every kept iteration's "elapsed time per iteration", and the
ratio auto / even with a bootstrap 95% interval over runs.  Beside it the planner's prediction: its simulated
iteration over the even split's under the analytic cost model (the same ratio, predicted), and the predicted auto
time calibrated on the measured even time.  The losses of the two splits are compared too (same parameters from
the seed and global names; the split only moves layers between ranks).

Writes ``layer_split.md`` and ``layer_split.json`` under ``--out``.  Wall time: about 2 minutes (``--quick``: 1).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.arguments import parse_run_config  # noqa: E402

MODEL = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--mock-data", "--vocab-size", "4096",
]  # fmt: skip
WARMUP = 2  # iterations dropped from each run
ITER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: (\S+)")


def run_flags(schedule: str, iters: int) -> list[str]:
    return [
        *MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--log-interval", "1",
        "--eval-iters", "0", "--seed", "1234", "--distributed-timeout-seconds", "300",
    ]  # fmt: skip


def one_run(flags: list[str]) -> tuple[list[float], list[str]]:
    """(kept iteration times in ms, every iteration's loss text) of one torchrun launch on 2 ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--nproc-per-node", "2", str(ROOT / "pretrain_gpt.py"), *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"run failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    rows = [(int(i), float(ms), loss) for i, ms, loss in ITER_LINE.findall(res.stdout)]
    return [ms for i, ms, _ in rows if i > WARMUP], [loss for _, _, loss in rows]


def bootstrap_ratio(a: list[list[float]], b: list[list[float]], n: int = 2000) -> tuple[float, float]:
    """95% interval of median(b) / median(a), resampling whole runs."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        ra = [x for run in rng.choices(a, k=len(a)) for x in run]
        rb = [x for run in rng.choices(b, k=len(b)) for x in run]
        out.append(statistics.median(rb) / statistics.median(ra))
    out.sort()
    return out[int(0.025 * n)], out[int(0.975 * n) - 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="2 rounds of 8 iterations")
    ap.add_argument("--rounds", type=int, default=4, help="alternated (even, auto) pairs of runs")
    ap.add_argument("--iters", type=int, default=14, help="iterations per run (the first 2 dropped)")
    ap.add_argument("--schedule", default="zb-h1")
    args = ap.parse_args(argv)
    rounds, iters = (2, 8) if args.quick else (args.rounds, args.iters)

    base = run_flags(args.schedule, iters)
    layouts = {
        name: parse_run_config(base + extra, world_size=2).pipeline_layout
        for name, extra in (("even", []), ("auto", ["--pipeline-layer-split", "auto"]))
    }
    auto = layouts["auto"]
    predicted = auto.split_plan.iteration / auto.even_iteration
    times: dict[str, list[list[float]]] = {"even": [], "auto": []}
    losses: dict[str, list[str]] = {}
    t0 = time.time()
    for r in range(rounds):
        for name in ("even", "auto"):
            extra = ["--pipeline-layer-split", "auto"] if name == "auto" else []
            kept, loss = one_run(base + extra)
            times[name].append(kept)
            losses.setdefault(name, loss)
            print(f"round {r + 1}/{rounds} {name}: median {statistics.median(kept):.1f} ms over {len(kept)} iterations")
    med = {k: statistics.median([x for run in v for x in run]) for k, v in times.items()}
    ratio = med["auto"] / med["even"]
    lo, hi = bootstrap_ratio(times["even"], times["auto"])
    paired = sorted(
        statistics.median(a) / statistics.median(e) for e, a in zip(times["even"], times["auto"], strict=True)
    )  # each round's auto over the even run just before it: the load drifts less within a pair
    same_losses = losses["even"] == losses["auto"]
    result = {
        "schedule": args.schedule,
        "layers": {k: list(v.layers_per_stage) for k, v in layouts.items()},
        "median_ms": med,
        "ratio_auto_over_even": ratio,
        "ratio_95": [lo, hi],
        "paired_ratios": paired,
        "predicted_ratio": predicted,
        "predicted_auto_ms": med["even"] * predicted,
        "runs_per_split": rounds,
        "iterations_per_run": iters,
        "losses_identical": same_losses,
        "wall_s": time.time() - t0,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "command": " ".join([sys.executable, "tools/bench_layer_split.py", *(argv or sys.argv[1:])]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_split.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [
        "# Layer split: even against auto (`--pipeline-layer-split auto`)",
        "",
        f"make train's model, pp = 2 (CPU, gloo, 1 thread per rank), {args.schedule}, m = 4 microbatches of 2; "
        f"{rounds} alternated runs per split, {iters} iterations each (first {WARMUP} dropped).",
        "",
        "| split | layers per stage | median iteration (ms) |",
        "|---|---|---|",
        f"| even | {result['layers']['even']} | {med['even']:.1f} |",
        f"| auto | {result['layers']['auto']} | {med['auto']:.1f} |",
        "",
        f"Measured auto / even: **{ratio:.3f}** (95% bootstrap interval over runs [{lo:.3f}, {hi:.3f}]; per round, "
        f"auto over the even run before it: {', '.join(f'{x:.3f}' for x in paired)}).  The planner predicted "
        f"{predicted:.3f} (analytic FLOPs model, simulated {args.schedule} iteration): "
        f"{med['even'] * predicted:.1f} ms for auto calibrated on the measured even split.  Losses of the two splits "
        f"identical: {same_losses}.",
        "",
        f"Machine load at the end: `{result['uptime']}`.  Command: `{result['command']}`.",
        "",
    ]
    (out / "layer_split.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
