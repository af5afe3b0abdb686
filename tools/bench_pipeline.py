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

This file is the command line; the parts live beside it: ``bench_pipeline_emulated`` (a), ``bench_pipeline_real``
(the launches of (b)-(d)), ``bench_pipeline_analysis`` (their rows, bootstrap intervals, the speed-up ceiling) and
``bench_pipeline_report`` (markdown and pictures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from bench_pipeline_analysis import aggregate_real  # noqa: E402
from bench_pipeline_emulated import EMU_COSTS, run_emulated  # noqa: E402
from bench_pipeline_real import _real_rank, _schedules_for, run_real  # noqa: E402
from bench_pipeline_report import plot, to_markdown  # noqa: E402

from zb_pipeline.runtime.emulate import EmulatedCosts  # noqa: E402

try:  # BENCH's peer benchmark: the same GPT blocks, its alternated timing and bootstrap
    import bench_torch_pipelining as tp_bench
except Exception:  # pragma: no cover - depends on the checkout
    tp_bench = None


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


def _parser() -> argparse.ArgumentParser:
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
        "--emulated-costs", default=None, help="emulated: F,B,W,OPT in ms per rank's share (default 20,20,10,5)"
    )
    ap.add_argument(
        "--emulated-spin-ms",
        type=float,
        default=None,
        help="emulated: the spun end of every sleep (default 0.3 ms while every rank has a core, else 0)",
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
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.launcher == "torchrun":
        return main_torchrun(args, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    error = _arg_error(args, parts)
    if error is not None:
        print(f"bench_pipeline: error: {error}", file=sys.stderr)
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
        report["emulated"] = run_emulated(
            ps,
            ems,
            args.emulated_iterations or (2 if quick else 6),
            log,
            emu=EMU_COSTS if args.emulated_costs is None else EmulatedCosts.parse(args.emulated_costs),
            spin_s=None if args.emulated_spin_ms is None else args.emulated_spin_ms / 1e3,
        )
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
    _write_report(report, args.out, log)
    return 0


def _arg_error(args: argparse.Namespace, parts: set[str]) -> str | None:
    """What is wrong with the flags of a local run (``None``: nothing)."""
    bad = parts - {"emulated", "real"}
    if bad:
        return f"--parts {sorted(bad)} unknown; use emulated and/or real"
    if args.launches < 1 or (args.launches > 1 and args.one_launch):
        return "--launches must be >= 1 and goes with the pairwise method (not --one-launch)"
    if args.emulated_iterations is not None and args.emulated_iterations < 2:
        return "--emulated-iterations must be >= 2 (the first is a warm-up)"
    if args.emulated_spin_ms is not None and not args.emulated_spin_ms >= 0:
        return "--emulated-spin-ms must be >= 0"
    if args.emulated_costs is not None:
        try:
            EmulatedCosts.parse(args.emulated_costs)
        except ValueError as err:
            return str(err).replace("--emulate-compute", "--emulated-costs")
    return None


def _write_report(report: dict[str, Any], out: str, log: Callable[[str], None]) -> None:
    """``pipeline.json``, ``pipeline.md`` and the pictures under ``out``."""
    with open(os.path.join(out, "pipeline.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "pipeline.md"), "w", encoding="utf-8") as f:
        f.write(to_markdown(report))
    for path in plot(report, out):
        log(f"wrote {path}")
    log(f"wrote {os.path.join(out, 'pipeline.md')} and pipeline.json")


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
