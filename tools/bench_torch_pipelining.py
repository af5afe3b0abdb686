"""torch.distributed.pipelining's schedules on our GPT blocks: tokens/s per schedule, CPU gloo, one thread per rank.

    python tools/bench_torch_pipelining.py [--out bench/results] [--quick] [--runs 10] [--m 4 8]

The peer comparison of the measurement issue.  Each rank builds its (virtual) stages from ``megatron.model``
(``build_gpt_stages``: the embedding on the first stage, transformer layers, the final norm and output head on the
last, vocab-parallel cross-entropy as the loss), wraps them in ``torch.distributed.pipelining.PipelineStage`` and runs
torch's schedules: GPipe and 1F1B (one stage per rank), interleaved 1F1B and interleaved zero bubble (two stages per
rank, loop placement), ZBV and DualPipeV (two stages per rank, V placement).  Every layout splits the same model the
same way (the same layers, the same seed), so all schedules compute the same losses and gradients; the test
``tests/test_bench_torch_pipelining.py`` checks that against a single-process run of the same blocks.

Linears.  By default the torch side runs our modules with their linears and embeddings routed through plain
autograd nodes, the B/W split torch expects; ``--linears deferrable`` keeps our ``deferrable_linear`` (see
``bench_torch_pipelining_stages``, which builds the stages and one torch schedule; this file times, launches and
reports).

Timing: every schedule is built once; after ``--warmup`` iterations each, ``--runs`` rounds run every schedule once
per round in a rotating order (alternated, so load drift on a shared machine hits all alike).  An iteration is
timed between two barriers and its time is the slowest rank's.  Reported: median tokens/s and a bootstrap 95%
interval of each schedule's tokens/s ratio to 1F1B.  ``time_alternated`` and ``torch_schedule_steps`` are what the
ours-vs-theirs benchmark reuses to put both in one process group and one alternation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_torch_pipelining_stages import (  # noqa: E402
    QUICK_MODEL,
    TORCH_SCHEDULES,
    BenchModel,
    ContiguousOutput,
    TorchRunner,
    available_schedules,
    build_modules,
    build_torch_runner,
    make_batch,
    make_loss_fn,
    reference_losses_and_grads,
    stage_indices,
    torch_schedule_steps,
    use_autograd_linears,
)

__all__ = [  # the stage building is re-exported: callers (tests, bench_pipeline*) use this module alone
    "QUICK_MODEL",
    "TORCH_SCHEDULES",
    "BenchModel",
    "ContiguousOutput",
    "TorchRunner",
    "available_schedules",
    "bootstrap_ratio_ci",
    "build_modules",
    "build_torch_runner",
    "environment",
    "main",
    "make_batch",
    "make_loss_fn",
    "measure_torch_pipelining",
    "reference_losses_and_grads",
    "stage_indices",
    "summarize",
    "time_alternated",
    "to_markdown",
    "torch_losses_and_grads",
    "torch_schedule_steps",
    "use_autograd_linears",
    "write_report",
]


# ---------------------------------------------------------------------------------------------------- timing
def time_alternated(
    steps: dict[str, Callable[[], None]], *, warmup: int, runs: int, cuda: bool = False
) -> dict[str, list[float]]:
    """Seconds per iteration of each step function (collective: every rank calls this with the same keys).

    ``warmup`` untimed iterations each, then ``runs`` rounds; round ``r`` runs the schedules in an order rotated by
    ``r``.  Each iteration sits between two barriers and counts as the slowest rank's time; ``cuda``: the device is
    synchronised before the clock stops (the reduction then runs on the GPU, as NCCL needs).
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    dist.barrier()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            if cuda:
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device="cuda" if cuda else "cpu")
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(float(dt))
    return times


def bootstrap_ratio_ci(
    times: Sequence[float], base: Sequence[float], *, samples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Throughput ratio ``median(base) / median(times)`` and its bootstrap 95% interval (runs resampled in pairs)."""
    a, b = np.asarray(times, dtype=float), np.asarray(base, dtype=float)
    n = min(len(a), len(b))
    if n == 0:
        raise ValueError("bootstrap_ratio_ci needs at least one run of each")
    a, b = a[:n], b[:n]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))
    ratios = np.median(b[idx], axis=1) / np.median(a[idx], axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(np.median(b) / np.median(a)), float(lo), float(hi)


def summarize(
    times: dict[str, list[float]], tokens_per_iteration: int, *, baseline: str | None
) -> list[dict[str, object]]:
    """Rows ``{schedule, median_s, tokens_per_s, ratio, ratio_lo, ratio_hi, runs}``, ratio to ``baseline``."""
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row: dict[str, object] = {
            "schedule": name,
            "median_s": med,
            "tokens_per_s": tokens_per_iteration / med,
            "runs": len(ts),
        }
        if baseline is not None and baseline in times:
            row["ratio"], row["ratio_lo"], row["ratio_hi"] = bootstrap_ratio_ci(ts, times[baseline])
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ rank bodies
def _rank_bench(
    rank: int, world_size: int, model: BenchModel, names: list[str], m: int, linears: str, warmup: int, runs: int
) -> dict[str, list[float]]:
    torch.manual_seed(0)
    steps = torch_schedule_steps(rank, world_size, model, names, m, linears=linears)
    return time_alternated(steps, warmup=warmup, runs=runs)


def _rank_losses_and_grads(
    rank: int, world_size: int, model: BenchModel, names: list[str], m: int, linears: str
) -> dict[str, tuple[list[float], dict[str, np.ndarray]]]:
    """Per schedule: this rank's per-microbatch losses (last stage only) and gradients after one step."""
    out = {}
    for name in names:
        runner = build_torch_runner(rank, world_size, model, name, m, linears=linears)
        losses = runner.step()
        out[name] = (losses, runner.grads())
    return out


def torch_losses_and_grads(
    model: BenchModel, names: Sequence[str], m: int, *, pp: int = 2, linears: str = "autograd", timeout_s: float = 120
) -> dict[str, tuple[list[float], dict[str, np.ndarray]]]:
    """One step of each torch schedule on ``pp`` gloo ranks: losses (from the last stage) and all gradients."""
    from zb_pipeline.testing.harness import run_multiprocess

    per_rank = run_multiprocess(_rank_losses_and_grads, pp, args=(model, list(names), m, linears), timeout_s=timeout_s)
    out = {}
    for name in names:
        losses = [x for r in per_rank for x in r[name][0]]
        grads = {k: v for r in per_rank for k, v in r[name][1].items()}
        out[name] = (losses, grads)
    return out


# ------------------------------------------------------------------------------------------- the benchmark
def measure_torch_pipelining(
    model: BenchModel,
    *,
    ms: Sequence[int] = (4, 8),
    pp: int = 2,
    names: Sequence[str] | None = None,
    linears: str = "autograd",
    warmup: int = 2,
    runs: int = 10,
    timeout_s: float = 1800,
) -> dict[str, object]:
    """Run the benchmark; returns ``{"settings": ..., "results": {m: rows}}`` (rows as in ``summarize``)."""
    from zb_pipeline.testing.harness import run_multiprocess

    names = list(names or available_schedules())
    results = {}
    for m in ms:
        usable = [n for n in names if TORCH_SCHEDULES[n][0] != "ScheduleDualPipeV" or m >= 2 * pp]
        per_rank = run_multiprocess(
            _rank_bench, pp, args=(model, usable, m, linears, warmup, runs), timeout_s=timeout_s
        )
        times = per_rank[0]
        rows = summarize(times, model.tokens_per_iteration(m), baseline="torch:1f1b")
        results[m] = rows
    settings = {
        "model": asdict(model),
        "pp": pp,
        "ms": list(ms),
        "linears": linears,
        "warmup": warmup,
        "runs": runs,
        "threads_per_rank": 1,
        "backend": "gloo",
    }
    return {"settings": settings, "results": results, "environment": environment()}


def environment() -> dict[str, object]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "load_average": load,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def to_markdown(report: dict[str, object]) -> str:
    s, env = report["settings"], report["environment"]
    mdl = s["model"]
    load = env["load_average"]
    lines = [
        "# torch.distributed.pipelining on our GPT blocks",
        "",
        f"Machine: {env['machine']}, {env['cpus']} CPUs"
        + (f", load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end" if load else "")
        + f"; python {env['python']}, torch {env['torch']}, numpy {env['numpy']}; {env['date']}.",
        "",
        f"Model: {mdl['num_layers']} layers, hidden {mdl['hidden_size']}, {mdl['num_attention_heads']} heads, "
        f"seq {mdl['seq_length']}, vocab {mdl['vocab_size']}, micro-batch {mdl['micro_batch']} "
        f"(fp32, dropout 0). pp = {s['pp']} gloo ranks, {s['threads_per_rank']} thread each; linears: "
        f"{s['linears']}. Forward + backward per iteration (no optimizer); {s['warmup']} warm-up iterations, then "
        f"{s['runs']} alternated runs per schedule; time = slowest rank; ratio = tokens/s over torch 1F1B with a "
        "bootstrap 95% interval.",
        "",
        "| m | schedule | median iteration (s) | tokens/s | vs 1F1B [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for m, rows in report["results"].items():
        for row in rows:
            ratio = f"{row['ratio']:.3f} [{row['ratio_lo']:.3f}, {row['ratio_hi']:.3f}]" if "ratio" in row else "-"
            lines.append(f"| {m} | {row['schedule']} | {row['median_s']:.3f} | {row['tokens_per_s']:,.0f} | {ratio} |")
    lines += [
        "",
        "DualPipeV needs m >= 2 pp here; interleaved schedules use 2 stages per rank (loop placement), ZBV and "
        "DualPipeV 2 per rank in V placement, all over the same layers. Shared machine: other jobs ran concurrently.",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, object], out_dir: str, stem: str = "torch_pipelining") -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump({**report, "results": {str(k): v for k, v in report["results"].items()}}, f, indent=1)
    with open(md_path, "w") as f:
        f.write(to_markdown(report))
    return json_path, md_path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="a smaller model, m = 4 only, 3 runs (smoke test)")
    ap.add_argument("--m", type=int, nargs="+", default=None, help="microbatch counts (default 4 8)")
    ap.add_argument("--runs", type=int, default=None, help="alternated runs per schedule (default 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=None, choices=sorted(TORCH_SCHEDULES))
    ap.add_argument("--linears", choices=("autograd", "deferrable"), default="autograd")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = QUICK_MODEL if args.quick else BenchModel()
    for field, value in (
        ("num_layers", args.layers),
        ("hidden_size", args.hidden),
        ("seq_length", args.seq),
        ("micro_batch", args.micro_batch),
    ):
        if value is not None:
            if value < 1:
                ap.error(f"--{field}={value} must be >= 1")
            model = replace(model, **{field: value})
    if model.num_layers % 4:
        ap.error(f"--layers={model.num_layers} must be a multiple of 4 (pp = 2 ranks x 2 chunks)")
    ms = args.m or ([4] if args.quick else [4, 8])
    if any(m < 2 for m in ms):
        ap.error(f"--m {ms}: every microbatch count must be >= pp = 2")
    runs = args.runs or (3 if args.quick else 10)
    t0 = time.perf_counter()
    report = measure_torch_pipelining(
        model, ms=ms, names=args.schedules, linears=args.linears, warmup=args.warmup, runs=runs
    )
    paths = write_report(report, args.out)
    print(to_markdown(report))
    print(f"wrote {paths[0]} and {paths[1]} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    # Run through the importable module so that the rank bodies pickle by module name.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_torch_pipelining

    sys.exit(bench_torch_pipelining.main())
