"""Post-validation through ``pretrain_gpt.py``: the sync/PV period ratio of real trainer launches vs the simulator.

    python tools/bench_post_validation.py --trainer [--out bench/results] [--quick] [--schedules zb-auto zb-h2]
        [--p 4 8] [--scales uniform last-1.5] [--launches 3] [--train-iters 14] [--tied no|yes|both] [--keep]

Every launch is ``torchrun --standalone --nproc-per-node P pretrain_gpt.py --model-config gpt-tiny --num-layers P
--mock-data --pipeline-model-parallel-size P --pipeline-schedule S --micro-batch-size 1 --global-batch-size M``
(M = 2P) with emulated compute ``--emulate-compute 20,20,10,10`` (F = B = 20 ms, W = 10 ms, OPT = 10 ms; ranks sleep
their costs, real gloo P2P), ``--emulate-stage-scale`` (uniform, or the last rank 1.5x), untied embeddings (the
issue's target; ``--tied`` adds the tied model beside it) and the profiling window
``--zero-bubble-pipeline-timers-start-iter 2 --zero-bubble-pipeline-timers-end-iter 4``, at whose end both schedules
are re-planned from the measured costs, as a user's run is.  Synchronised and post-validated
(``--enable-optimizer-post-validation``) launches alternate, ``--launches`` of each per cell.

The period is taken from the run's pipeline trace (``--pipeline-trace``): rank 0's iteration period, from the start
of one iteration's first compute action to the next one's, for every iteration from ``SETTLE`` iterations after the
re-plan to the last (the profiling window, the switch and the ranks' settling are left out).  The run logs only at
its end (``--log-interval`` = ``--train-iters``): a log line waits for the iteration's loss, which synchronises the
ranks and would take back part of what post-validation gains every ``--log-interval`` iterations.  A launch's period
is the median of its periods; a cell's, the median over its launches.

The simulator's prediction (``zb_pipeline.schedule.steady_state``) takes the plan each launch ran after the re-plan
(regenerated from the profile the window saved, ``zb_profile.json``, exactly as the trainer's ``WindowReplanner``
does) under the emulated costs: F, B, W times the rank's scale, T_comm ``--comm-ms`` (0.3 ms), the optimizer step
OPT = 10 ms, the synchronised optimizer's reduction ``--reduce-ms`` (1 ms).  Its ratio is the median over the
cell's launches.

Writes ``post_validation_trainer.md`` and ``.json`` under ``--out``; ``--keep`` adds this run's launches to the
ones already stored there (a grid measured in pieces, each under ``flock /tmp/wt/bench.lock``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_pipeline import environment  # noqa: E402

from zb_pipeline.runtime.replanner import regenerate  # noqa: E402
from zb_pipeline.schedule.costs import StageCosts  # noqa: E402
from zb_pipeline.schedule.ir import Schedule  # noqa: E402
from zb_pipeline.schedule.plan_file import plan_from_dict, plan_to_dict  # noqa: E402
from zb_pipeline.schedule.profile import Profile  # noqa: E402
from zb_pipeline.schedule.steady_state import steady_state  # noqa: E402

F_MS, B_MS, W_MS, OPT_MS = 20.0, 20.0, 10.0, 10.0
SCALES = {"uniform": 1.0, "last-1.5": 1.5}  # the last rank's factor on F, B, W
WINDOW = (2, 4)  # --zero-bubble-pipeline-timers-start-iter / -end-iter
SETTLE = 2  # iterations after the re-plan before the periods are measured
MODES = ("sync", "pv")
_COMPUTE = ("F", "B", "W", "BW")


def stage_scale(p: int, last: float) -> list[float]:
    return [1.0] * (p - 1) + [last]


def trainer_command(
    schedule: str, p: int, scale: str, *, tied: bool, pv: bool, train_iters: int, save: str
) -> list[str]:
    """The ``torchrun ... pretrain_gpt.py`` command line of one launch."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(p), os.path.join(REPO, "pretrain_gpt.py")]
    cmd += ["--model-config", "gpt-tiny", "--num-layers", str(p), "--mock-data"]
    cmd += ["--pipeline-model-parallel-size", str(p), "--pipeline-schedule", schedule]
    cmd += ["--micro-batch-size", "1", "--global-batch-size", str(2 * p), "--train-iters", str(train_iters)]
    cmd += ["--eval-iters", "0", "--lr", "1e-3", "--log-interval", str(train_iters)]
    cmd += ["--emulate-compute", f"{F_MS:g},{B_MS:g},{W_MS:g},{OPT_MS:g}"]
    cmd += ["--emulate-stage-scale", ",".join(f"{s:g}" for s in stage_scale(p, SCALES[scale]))]
    cmd += ["--zero-bubble-pipeline-timers-start-iter", str(WINDOW[0])]
    cmd += ["--zero-bubble-pipeline-timers-end-iter", str(WINDOW[1])]
    cmd += ["--save", save, "--save-interval", str(10 * train_iters)]  # the window saves zb_profile.json there
    cmd += ["--pipeline-trace", os.path.join(save, "trace.json")]
    if not tied:
        cmd.append("--untie-embeddings-and-output-weights")
    if pv:
        cmd.append("--enable-optimizer-post-validation")
    return cmd


def trace_periods(doc: dict[str, Any]) -> list[float]:
    """Rank 0's iteration periods (ms) from a pipeline trace, from ``SETTLE`` iterations after the re-plan on: the
    start of an iteration's first compute action to the next iteration's."""
    starts: dict[int, float] = {}
    for ev in doc["traceEvents"]:
        if ev.get("ph") == "X" and ev.get("pid") == 0 and ev.get("tid") == 0 and ev.get("cat") in _COMPUTE:
            it = ev["args"]["iteration"]
            starts[it] = min(starts.get(it, float("inf")), ev["ts"])
    its = sorted(starts)[WINDOW[1] + SETTLE :]
    return [(starts[b] - starts[a]) / 1e3 for a, b in zip(its, its[1:])]


def nominal_costs(p: int, scale: str, comm_ms: float) -> StageCosts:
    s = stage_scale(p, SCALES[scale])
    return StageCosts.build(
        num_ranks=p, f=[F_MS * x for x in s], b=[B_MS * x for x in s], w=[W_MS * x for x in s], comm=comm_ms
    )


def replanned_plan(profile_path: str, schedule: str, m: int) -> Schedule:
    """The plan the trainer switched to at the window's end (``WindowReplanner``: no memory limit here)."""
    return regenerate(Profile.load(profile_path), m, name=schedule).schedule


def launch(schedule: str, p: int, scale: str, *, tied: bool, pv: bool, train_iters: int, timeout_s: float) -> dict:
    """One trainer launch: its measured windows and the re-planned plan's order of actions."""
    save = tempfile.mkdtemp(prefix="pv_trainer_")
    cmd = trainer_command(schedule, p, scale, tied=tied, pv=pv, train_iters=train_iters, save=save)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    record: dict[str, Any] = {"schedule": schedule, "p": p, "m": 2 * p, "scale": scale, "tied": tied,
                              "mode": "pv" if pv else "sync", "load_start": load, "command": cmd[1:]}  # fmt: skip
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
        text, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as err:
        text, rc = str(err.stdout or ""), 124
    record.update(rc=rc, wall_s=round(time.time() - t0, 1), periods_ms=[])
    profile, trace = os.path.join(save, "zb_profile.json"), os.path.join(save, "trace.json")
    replanned = any(line.startswith("replanned ") for line in text.splitlines())
    if rc == 0 and replanned and os.path.exists(profile) and os.path.exists(trace):
        record["plan"] = plan_to_dict(replanned_plan(profile, schedule, 2 * p))
        with open(trace, encoding="utf-8") as fh:
            record["periods_ms"] = [round(x, 2) for x in trace_periods(json.load(fh))]
    else:
        record["error"] = text[-2000:]
    shutil.rmtree(save, ignore_errors=True)
    return record


def simulated(record: dict, comm_ms: float, reduce_ms: float) -> tuple[float, float] | None:
    """(sync, PV) period of the launch's re-planned plan under the emulated costs."""
    if "plan" not in record:
        return None
    sched = plan_from_dict(record["plan"])
    pred = steady_state(sched, nominal_costs(record["p"], record["scale"], comm_ms), opt=OPT_MS, reduce_s=reduce_ms)
    return pred.synchronised, pred.post_validated


def summarise(records: list[dict], comm_ms: float, reduce_ms: float) -> list[dict]:
    """One row per (schedule, p, scale, tied): median periods, measured and simulated ratio."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["schedule"], r["p"], r["scale"], r["tied"]), []).append(r)
    rows = []
    for (schedule, p, scale, tied), recs in sorted(cells.items(), key=lambda kv: (kv[0][3], kv[0][1], kv[0][0])):
        per_mode = {mode: [statistics.median(r["periods_ms"]) for r in recs if r["mode"] == mode and r["periods_ms"]]
                    for mode in MODES}  # fmt: skip
        sims = [s for s in (simulated(r, comm_ms, reduce_ms) for r in recs) if s is not None]
        row: dict[str, Any] = {"schedule": schedule, "p": p, "m": 2 * p, "scale": scale, "tied": tied,
                               "launches": {mode: len(v) for mode, v in per_mode.items()},
                               "failed": sum(1 for r in recs if r["rc"] != 0 or not r["periods_ms"])}  # fmt: skip
        if per_mode["sync"] and per_mode["pv"] and sims:
            sync, pv = statistics.median(per_mode["sync"]), statistics.median(per_mode["pv"])
            sim_sync = statistics.median(s for s, _ in sims)
            sim_pv = statistics.median(v for _, v in sims)
            sim_ratio = statistics.median(s / v for s, v in sims)
            row.update(sync_ms=round(sync, 1), pv_ms=round(pv, 1), ratio=round(sync / pv, 4),
                       sim_sync_ms=round(sim_sync, 1), sim_pv_ms=round(sim_pv, 1), sim_ratio=round(sim_ratio, 4),
                       diff_points=round(100 * (sync / pv - sim_ratio), 2),
                       sync_launch_ms=[round(x, 1) for x in per_mode["sync"]],
                       pv_launch_ms=[round(x, 1) for x in per_mode["pv"]],
                       plans_differ=len({json.dumps(r.get("plan")) for r in recs}) > 1)  # fmt: skip
        rows.append(row)
    return rows


def to_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# Optimizer post-validation through `pretrain_gpt.py` (emulated compute)",
        "",
        f"`python tools/bench_post_validation.py --trainer` -- `torchrun pretrain_gpt.py --model-config gpt-tiny` "
        f"with `--emulate-compute {F_MS:g},{B_MS:g},{W_MS:g},{OPT_MS:g}` (F = B = {F_MS:g} ms, W = {W_MS:g} ms, "
        f"OPT = {OPT_MS:g} ms), m = 2p, the profiling window {WINDOW[0]}-{WINDOW[1]} (both schedules re-planned "
        "from the measured costs), synchronised and post-validated launches alternated.",
        f"Machine: {env['machine']}, {env['cpus']} CPUs, torch {env['torch']}; load average at the launches' starts "
        f"{report['load_range']}; {report['date_range']}.",
        f"Simulator: `steady_state` of each launch's re-planned plan under the emulated costs, T_comm = "
        f"{report['comm_ms']:g} ms, reduction = {report['reduce_ms']:g} ms, OPT = {OPT_MS:g} ms.",
        "",
        f"Period: rank 0's iteration period from the pipeline trace, iterations {WINDOW[1] + SETTLE} onwards (after "
        "the re-plan), median per launch, then median over launches; one log line, at the end. Difference = "
        "measured ratio - simulated ratio, in points (target: within 1.5, untied).",
        "",
        "| embeddings | schedule | p | m | last rank | sync ms | PV ms | measured sync/PV | simulated sync/PV "
        "| difference (points) | launches per mode |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        emb = "tied" if r["tied"] else "untied"
        last = "1x" if r["scale"] == "uniform" else "1.5x"
        n = min(r["launches"].values())
        if "ratio" not in r:
            lines.append(f"| {emb} | {r['schedule']} | {r['p']} | {r['m']} | {last} | - | - | - | - | - | {n} |")
            continue
        lines.append(
            f"| {emb} | {r['schedule']} | {r['p']} | {r['m']} | {last} | {r['sync_ms']} | {r['pv_ms']} | "
            f"{r['ratio']:.3f} | {r['sim_ratio']:.3f} | {r['diff_points']:+.1f} | {n} |"
        )
    failed = sum(r["failed"] for r in report["rows"])
    if failed:
        lines += ["", f"{failed} launch(es) failed or logged no window after the re-plan (see the .json)."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--quick", action="store_true", help="zb-h2, p = 4, last rank 1.5x, one launch per mode")
    ap.add_argument("--schedules", nargs="+", default=["zb-auto", "zb-h2"])
    ap.add_argument("--p", type=int, nargs="+", default=[4, 8], help="pipeline sizes (m = 2p)")
    ap.add_argument("--scales", nargs="+", default=list(SCALES), choices=list(SCALES))
    ap.add_argument("--launches", type=int, default=3, help="launches per cell and mode, alternated")
    ap.add_argument("--train-iters", type=int, default=20)
    ap.add_argument("--tied", choices=("no", "yes", "both"), default="no", help="tied embeddings too (default no)")
    ap.add_argument("--comm-ms", type=float, default=0.3, help="the simulator's T_comm")
    ap.add_argument("--reduce-ms", type=float, default=1.0, help="the simulator's reduction before a synced step")
    ap.add_argument("--keep", action="store_true", help="add to the launches stored in --out's json")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per launch")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.schedules, args.p, args.scales, args.launches, args.train_iters = ["zb-h2"], [4], ["last-1.5"], 1, 12
    need = WINDOW[1] + SETTLE + 4
    if args.launches < 1 or args.train_iters < need or min(args.p) < 2:
        print(f"bench_post_validation --trainer: need --launches >= 1, --train-iters >= {need}, --p >= 2",
              file=sys.stderr)  # fmt: skip
        return 2
    path = os.path.join(args.out, "post_validation_trainer.json")
    records: list[dict] = []
    if args.keep and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            records = json.load(fh)["launches"]
    ties = {"no": [False], "yes": [True], "both": [False, True]}[args.tied]
    cells = list(itertools.product(args.p, args.schedules, args.scales, ties))
    for i in range(args.launches):
        for p, schedule, scale, tied in cells:
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                rec = launch(schedule, p, scale, tied=tied, pv=mode == "pv", train_iters=args.train_iters,
                             timeout_s=args.timeout_s)  # fmt: skip
                records.append(rec)
                med = statistics.median(rec["periods_ms"]) if rec["periods_ms"] else float("nan")
                emb = "tied" if tied else "untied"
                print(f"{schedule} p={p} {scale} {emb} {mode}: {med:.1f} ms (rc {rec['rc']}, {rec['wall_s']} s, "
                      f"load {rec['load_start']})", flush=True)  # fmt: skip
    loads = [r["load_start"][0] for r in records]
    report = {
        "environment": environment(),
        "comm_ms": args.comm_ms,
        "reduce_ms": args.reduce_ms,
        "load_range": f"{min(loads):.1f}-{max(loads):.1f}",
        "date_range": f"{time.strftime('%Y-%m-%d %H:%M %Z')} (end)",
        "rows": summarise(records, args.comm_ms, args.reduce_ms),
        "launches": records,
    }
    os.makedirs(args.out, exist_ok=True)
    md = to_markdown(report)
    with open(os.path.join(args.out, "post_validation_trainer.md"), "w", encoding="utf-8") as fh:
        fh.write(md)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
