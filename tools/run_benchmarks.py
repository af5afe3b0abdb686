"""The `make bench` driver: run every benchmark script that is present, then index the results.

    python tools/run_benchmarks.py [--out bench/results] [--quick] [--only NAME ...] [--skip NAME ...]

Each benchmark runs in its own subprocess (its own session, killed with its children at its timeout) and the
driver carries on past failures, timeouts and missing scripts.  A script gets ``--out DIR`` and, with ``--quick``,
``--quick`` only if its ``--help`` lists them, so scripts with other flags still run.  stdout and stderr go to
``DIR/logs/<name>.log``.  At the end ``DIR/README.md`` indexes what ran (status, wall time, log) and every result
file in DIR, with the machine, the versions (python, torch, numpy) and the date.  Exit status 1 if any benchmark
that was present failed, else 0.

To add a benchmark, append a ``Benchmark`` to ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str  # relative to the repository root
    what: str
    timeout_s: float = 1800.0
    quick_timeout_s: float = 600.0
    extra_args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    skipped_marker: str | None = None  # a line in the log of a successful run that means "nothing to measure here"


BENCHMARKS: list[Benchmark] = [
    Benchmark("schedules", "tools/bench_schedules.py", "schedule generators: simulated bubble rate and memory"),
    Benchmark("exact_gap", "tools/bench_exact_gap.py", "generators against the exact MILP optimum"),
    Benchmark("data", "tools/bench_data.py", "data pipeline: preprocessing, sample index, random reads"),
    Benchmark(
        "torch_pipelining",
        "tools/bench_torch_pipelining.py",
        "torch.distributed.pipelining's schedules on our GPT blocks (CPU, pp = 2)",
        timeout_s=3600.0,
    ),
    Benchmark(
        "pipeline",
        "tools/bench_pipeline.py",
        "our runtime: every schedule, emulated and real compute, against the simulator and torch",
        timeout_s=3600.0,
    ),
    Benchmark(
        "overhead",
        "tools/bench_overhead.py",
        "the runtime's own gap between actions vs the backend's send/recv calls: pp = 2, 4, emulated and real",
        timeout_s=1800.0,
    ),
    Benchmark(
        "post_validation",
        "tools/bench_post_validation.py",
        "optimizer post-validation vs the synchronised optimizer: zb-auto, p = 8, m = 24, emulated compute",
        timeout_s=1800.0,
    ),
    Benchmark(
        "post_validation_trainer",
        "tools/bench_post_validation.py",
        "post-validation through pretrain_gpt.py: zb-auto and ZB-H2, p = 4 and 8, m = 2p, emulated compute",
        timeout_s=3600.0,
        extra_args=("--trainer",),
    ),
    Benchmark(
        "layer_split",
        "tools/bench_layer_split.py",
        "even against auto layer split (--pipeline-layer-split auto) on make train's model, real compute, pp = 2",
        timeout_s=1800.0,
    ),
    Benchmark(
        "layer_split_recompute",
        "tools/bench_layer_split.py",
        "--recompute-granularity auto against full and no recompute under a memory limit below ZB-H1's peak (the "
        "tool's default --limit-gb), make train's model, zb-auto, pp = 2",
        timeout_s=1800.0,
        extra_args=("--recompute",),
    ),
    Benchmark(
        "recompute",
        "tools/bench_recompute.py",
        "activation recomputation (none / selective / full) with every schedule: tokens/s, peak activation memory, "
        "recompute's time per layer; real compute, pp = 2",
        timeout_s=1800.0,
    ),
    Benchmark(
        "gpu_check",
        "tools/gpu_check.py",
        "one stage's F, B, W on CUDA (bf16): time, MFU, split cost",
        timeout_s=600.0,
        skipped_marker="no CUDA device available",
    ),
]

RESULT_SUFFIXES = (".md", ".png", ".json", ".csv", ".svg")


@dataclass
class Outcome:
    bench: Benchmark
    status: str  # ok | failed (rc) | timeout | missing
    seconds: float = 0.0
    log: str | None = None
    command: list[str] = field(default_factory=list)


def supported_flags(python: str, script_path: str, *, timeout_s: float = 120.0) -> set[str]:
    """The long options a script's ``--help`` mentions (empty if ``--help`` fails)."""
    try:
        res = subprocess.run(
            [python, script_path, "--help"], capture_output=True, text=True, timeout=timeout_s, cwd=REPO
        )
    except (subprocess.TimeoutExpired, OSError):
        return set()
    if res.returncode != 0:
        return set()
    return {tok.strip("[],=").split("=")[0] for tok in res.stdout.split() if tok.startswith("--")}


def build_command(python: str, bench: Benchmark, out_dir: str, *, quick: bool, flags: set[str]) -> list[str]:
    cmd = [python, os.path.join(REPO, bench.script)]
    if "--out" in flags:
        cmd += ["--out", out_dir]
    if quick and "--quick" in flags:
        cmd.append("--quick")
    cmd += list(bench.extra_args)
    if quick:
        cmd += list(bench.quick_args)
    return cmd


def run_one(bench: Benchmark, out_dir: str, *, quick: bool, python: str = sys.executable) -> Outcome:
    """Run one benchmark in its own session with a timeout; never raises for the benchmark's own failures."""
    path = os.path.join(REPO, bench.script)
    if not os.path.exists(path):
        return Outcome(bench, "missing")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{bench.name}.log")
    cmd = build_command(python, bench, out_dir, quick=quick, flags=supported_flags(python, path))
    timeout = bench.quick_timeout_s if quick else bench.timeout_s
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            status = f"timeout ({timeout:.0f} s)"
    if status == "ok" and bench.skipped_marker is not None:
        with open(log_path) as log:
            if bench.skipped_marker in log.read():
                status = f"skipped ({bench.skipped_marker})"
    return Outcome(bench, status, time.perf_counter() - t0, log_path, cmd)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmark's own session: it and the ranks it started
    except ProcessLookupError:
        pass
    proc.wait()


# --------------------------------------------------------------------------------------------- the index
def machine_description() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        mem = f"{pages * page / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    desc = {"cpu": f"{cpu}, {os.cpu_count()} CPUs", "memory": mem, "os": platform.platform()}
    versions = {"python": platform.python_version()}
    try:
        import numpy

        versions["numpy"] = numpy.__version__
    except ImportError:
        versions["numpy"] = "not installed"
    try:
        import torch

        versions["torch"] = torch.__version__
        if torch.cuda.is_available():
            desc["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    except ImportError:
        versions["torch"] = "not installed"
    desc["versions"] = ", ".join(f"{k} {v}" for k, v in versions.items())
    try:
        load = os.getloadavg()
        desc["load"] = f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}"
    except OSError:
        pass
    return desc


def result_files(out_dir: str) -> list[str]:
    """Result files under ``out_dir`` (logs and the index itself excluded), relative paths, sorted."""
    found = []
    for root, dirs, files in os.walk(out_dir):
        dirs[:] = sorted(d for d in dirs if d != "logs")
        for name in files:
            if name.endswith(RESULT_SUFFIXES) and not (root == out_dir and name == "README.md"):
                found.append(os.path.relpath(os.path.join(root, name), out_dir))
    return sorted(found)


def write_index(out_dir: str, outcomes: Sequence[Outcome], *, quick: bool, started: float) -> str:
    desc = machine_description()
    lines = [
        "# Benchmark results",
        "",
        f"Written by `python tools/run_benchmarks.py{' --quick' if quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}.",
        "",
        f"- Machine: {desc['cpu']}" + (f", {desc['memory']}" if desc.get("memory") else ""),
        f"- GPU: {desc.get('gpu', 'none')}",
        f"- OS: {desc['os']}",
        f"- Versions: {desc['versions']}",
    ]
    if "load" in desc:
        lines.append(f"- Load average at the end: {desc['load']} (timings on a shared machine are noisy)")
    lines += ["", "| benchmark | what | status | wall time | log |", "|---|---|---|---|---|"]
    for o in outcomes:
        log = f"[log]({os.path.relpath(o.log, out_dir)})" if o.log else "-"
        wall = f"{o.seconds:.0f} s" if o.status != "missing" else "-"
        status = "not present yet" if o.status == "missing" else o.status
        lines.append(f"| `{o.bench.script}` | {o.bench.what} | {status} | {wall} | {log} |")
    files = result_files(out_dir)
    lines += ["", "## Result files", ""]
    if files:
        for rel in files:
            mtime = os.path.getmtime(os.path.join(out_dir, rel))
            when = "this run" if mtime >= started else time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime))
            lines.append(f"- [{rel}]({rel}) ({when})")
    else:
        lines.append("(none)")
    lines.append("")
    path = os.path.join(out_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    names = [b.name for b in BENCHMARKS]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="each benchmark's --quick version, shorter timeouts")
    ap.add_argument("--only", nargs="+", choices=names, default=None)
    ap.add_argument("--skip", nargs="+", choices=names, default=())
    args = ap.parse_args(argv)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    chosen = [b for b in BENCHMARKS if (args.only is None or b.name in args.only) and b.name not in args.skip]
    started = time.time()
    outcomes = []
    for bench in chosen:
        print(f"[bench] {bench.name}: {bench.script} ...", flush=True)
        outcome = run_one(bench, out_dir, quick=args.quick)
        outcomes.append(outcome)
        print(f"[bench] {bench.name}: {outcome.status}" + (f" in {outcome.seconds:.0f} s" if outcome.log else ""))
    index = write_index(out_dir, outcomes, quick=args.quick, started=started)
    print(f"[bench] wrote {index}")
    failed = [o.bench.name for o in outcomes if o.status != "missing" and not o.status.startswith(("ok", "skipped"))]
    if failed:
        print(f"[bench] failed: {', '.join(failed)} (see {os.path.join(out_dir, 'logs')})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
