"""Optimizer post-validation against the synchronised optimizer: iteration time with emulated compute.

    python tools/bench_post_validation.py [--out bench/results] [--quick] [--p 8] [--m 24] [--runs 3]
                                          [--iterations 8] [--opt-ms 20] [--schedule zb-auto]

Every rank runs the same plan (zb-auto by default, planned for the costs below) with emulated compute
(``zb_pipeline.runtime.emulate``: F, B and W sleep their cost; real gloo P2P between the ranks) and a real
``MainParamOptimizer`` over a small parameter block whose update also sleeps ``--opt-ms`` (the optimizer step):

- **synchronised**: ``MainParamOptimizer.step`` -- the per-stage gradient statistics are gathered over the
  pipeline (the cross-stage wait), then the step;
- **post-validated**: the plan carries the ``SEND_PV``/``RECV_PV`` chain and ``PostValidator.step`` steps at once.

The two modes alternate, ``--runs`` times each, ``--iterations`` timed iterations per run after two warm-up ones.
The period (rank 0's time from one iteration's start to the next, optimizer included) is reported as the median
over all timed iterations, with the ratio synchronised / post-validated, next to the simulator's prediction
(``zb_pipeline.schedule.steady_state`` with T_comm = the measured gloo P2P latency and the reduction = the measured
all-gather time).  Two cost settings: uniform stages (F = B = 20 ms, W = 10 ms per microbatch and rank), and a
last stage 1.5x heavier (the LM head), where the ranks finish an iteration at different times.

Also measured per rank: the time the step call takes beyond ``--opt-ms`` -- the wait the synchronised optimizer
adds between a rank's last backward action and its update, which post-validation removes.

Writes ``post_validation.md``, ``post_validation.json`` and ``post_validation.png`` under ``--out``.

``--trainer`` measures the same through ``pretrain_gpt.py`` launches instead of a bare executor (zb-auto and ZB-H2,
p = 4 and 8, m = 2p; ``tools/bench_post_validation_trainer.py``, whose flags follow ``--trainer``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_pipeline import environment  # noqa: E402

from megatron.config.optimizer import OptimizerConfig  # noqa: E402
from megatron.config.precision import PrecisionConfig  # noqa: E402
from megatron.optimizer.main_params import MainParamOptimizer  # noqa: E402
from zb_pipeline.optim.post_validation import PostValidator, local_state  # noqa: E402
from zb_pipeline.runtime.emulate import EmulatedCompute, EmulatedCosts  # noqa: E402
from zb_pipeline.runtime.executor import PipelineExecutor  # noqa: E402
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec  # noqa: E402
from zb_pipeline.runtime.profile_gather import measure_p2p_latency  # noqa: E402
from zb_pipeline.schedule import registry  # noqa: E402
from zb_pipeline.schedule.costs import StageCosts  # noqa: E402
from zb_pipeline.schedule.lowering import lower  # noqa: E402
from zb_pipeline.schedule.post_validation_pass import add_post_validation  # noqa: E402
from zb_pipeline.schedule.steady_state import steady_state  # noqa: E402
from zb_pipeline.testing import run_multiprocess  # noqa: E402

F_MS, B_MS, W_MS = 20.0, 20.0, 10.0
SETTINGS = {"uniform": 1.0, "heavy last stage": 1.5}  # cost multiplier of the last rank
PARAMS = 4096  # elements of the real optimizer's parameter block


class EmulatedStepOptimizer(MainParamOptimizer):
    """The real optimizer; its update additionally sleeps the emulated optimizer-step time."""

    emulator: EmulatedCompute | None = None

    def apply_update(self, lr: float, coeff: float) -> None:
        if self.emulator is not None:
            self.emulator.optimizer_step()
        super().apply_update(lr, coeff)


def rank_costs(p: int, heavy: float) -> tuple[list[float], list[float], list[float]]:
    scale = [1.0] * (p - 1) + [heavy]
    return [F_MS * s for s in scale], [B_MS * s for s in scale], [W_MS * s for s in scale]


def plan_for(schedule: str, p: int, m: int, heavy: float, comm_ms: float):
    f, b, w = rank_costs(p, heavy)
    costs = StageCosts.build(num_ranks=p, f=f, b=b, w=w, comm=comm_ms)
    return registry.generate(schedule, p, m, costs=costs), costs


def _zeros(mb: int) -> torch.Tensor:
    return torch.zeros(4, 1, 8)


def _sum(out: torch.Tensor, mb: int) -> torch.Tensor:
    return out.sum()


def _allgather_ms(repeats: int = 30) -> float:
    state = local_state(None)  # the post-validation state the synchronised reduction all-gathers
    parts = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather(parts, state)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rank(rank: int, world: int, schedule: str, m: int, runs: int, iterations: int, opt_ms: float) -> dict:
    torch.set_num_threads(1)
    p = world
    comm_ms = measure_p2p_latency(pp_rank=rank, pp_ranks=list(range(p)), shape=(4, 1, 8))
    reduce_ms = _allgather_ms()
    spec = [TensorSpec((4, 1, 8))] * (p - 1)
    out: dict[str, Any] = {"comm_ms": comm_ms, "reduce_ms": reduce_ms, "settings": {}}
    for setting, heavy in SETTINGS.items():
        sched, _ = plan_for(schedule, p, m, heavy, comm_ms)
        f, b, w = rank_costs(p, heavy)
        emu_costs = EmulatedCosts(f[rank], b[rank], w[rank], opt_ms)
        periods: dict[str, list[float]] = {"synchronised": [], "post-validated": []}
        step_extra: dict[str, list[float]] = {"synchronised": [], "post-validated": []}
        for _ in range(runs):
            for mode in periods:
                lowered = lower(sched)
                if mode == "post-validated":
                    lowered = add_post_validation(lowered)
                p2p = PipelineP2P(pp_rank=rank, boundary_specs=spec, timeout_s=120)
                stages = {s: torch.nn.Identity() for s in sched.stages_of(rank)}
                ex = PipelineExecutor(lowered, rank, stages, p2p=p2p, input_fn=_zeros, loss_fn=_sum)
                emu = EmulatedCompute(emu_costs, chunks=sched.chunks, boundary_specs=spec)
                emu.attach(ex)
                param = torch.nn.Parameter(torch.zeros(PARAMS))
                param.main_grad = torch.zeros(PARAMS)
                opt = EmulatedStepOptimizer(
                    [("block", param)], OptimizerConfig(clip_grad=1.0), PrecisionConfig(), pp_group=dist.group.WORLD
                )
                opt.emulator = emu
                validator = None
                if mode == "post-validated":
                    validator = PostValidator(opt, pp_rank=rank, pp_size=p)
                    validator.attach(ex)
                dist.barrier()
                starts = []
                for it in range(iterations + 2):
                    starts.append(time.perf_counter())
                    ex.run(it)
                    t0 = time.perf_counter()
                    if validator is None:
                        opt.step(1e-3)
                    else:
                        validator.step(1e-3)
                    if it >= 2:
                        step_extra[mode].append((time.perf_counter() - t0) * 1e3 - opt_ms)
                starts.append(time.perf_counter())
                if validator is not None:
                    validator.flush(dist.group.WORLD)
                periods[mode] += [(b - a) * 1e3 for a, b in zip(starts[2:-1], starts[3:])]
        out["settings"][setting] = {"periods_ms": periods, "step_extra_ms": step_extra}
    return out


def summarise(results: list[dict], schedule: str, p: int, m: int, opt_ms: float) -> dict[str, Any]:
    comm_ms = statistics.median(r["comm_ms"] for r in results)
    reduce_ms = statistics.median(r["reduce_ms"] for r in results)
    rows = []
    for setting, heavy in SETTINGS.items():
        sched, costs = plan_for(schedule, p, m, heavy, comm_ms)
        pred = steady_state(sched, costs, opt=opt_ms, reduce_s=reduce_ms)
        per_rank = [r["settings"][setting] for r in results]
        sync = statistics.median(per_rank[0]["periods_ms"]["synchronised"])
        pv = statistics.median(per_rank[0]["periods_ms"]["post-validated"])
        wait = {
            mode: [round(statistics.median(pr["step_extra_ms"][mode]), 2) for pr in per_rank]
            for mode in ("synchronised", "post-validated")
        }
        rows.append(
            {
                "setting": setting,
                "last_rank_cost_factor": heavy,
                "measured_sync_ms": round(sync, 1),
                "measured_pv_ms": round(pv, 1),
                "measured_ratio": round(sync / pv, 4),
                "simulated_sync_ms": round(pred.synchronised, 1),
                "simulated_pv_ms": round(pred.post_validated, 1),
                "simulated_ratio": round(pred.speedup, 4),
                "makespan_ms": round(pred.makespan, 1),
                "step_wait_ms_per_rank": wait,
                "iterations_timed": len(per_rank[0]["periods_ms"]["synchronised"]),
            }
        )
    return {"schedule": schedule, "p": p, "m": m, "opt_ms": opt_ms, "comm_ms": round(comm_ms, 3),
            "reduce_ms": round(reduce_ms, 3), "rows": rows}  # fmt: skip


def to_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# Optimizer post-validation vs the synchronised optimizer (emulated compute)",
        "",
        f"`python tools/bench_post_validation.py` -- {report['schedule']}, p = {report['p']}, m = {report['m']}, "
        f"F = B = {F_MS:g} ms, W = {W_MS:g} ms per microbatch and rank, optimizer step {report['opt_ms']:g} ms; "
        f"{report['runs']} alternated runs x {report['iterations']} timed iterations per mode.",
        f"Machine: {env['machine']}, {env['cpus']} CPUs, load {env['load_average']}, torch {env['torch']}, "
        f"{env['date']}.  Measured gloo P2P latency {report['comm_ms']} ms, all-gather of the statistics "
        f"{report['reduce_ms']} ms (the simulator's T_comm and reduction).",
        "",
        "Period = time from one iteration's start to the next on rank 0, optimizer step included (median).",
        "",
        "| setting | sync (ms) | post-validated (ms) | measured sync/PV | simulated sync (ms) | simulated PV (ms) "
        "| simulated sync/PV |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['setting']} | {r['measured_sync_ms']} | {r['measured_pv_ms']} | {r['measured_ratio']:.3f} | "
            f"{r['simulated_sync_ms']} | {r['simulated_pv_ms']} | {r['simulated_ratio']:.3f} |"
        )
    lines += [
        "",
        "Time the step call takes beyond the optimizer's own work, per rank (median, ms): the synchronised",
        "optimizer's wait for the other stages, which post-validation removes.",
        "",
        "| setting | mode | rank 0 .. p-1 |",
        "|---|---|---|",
    ]
    for r in report["rows"]:
        for mode, waits in r["step_wait_ms_per_rank"].items():
            lines.append(f"| {r['setting']} | {mode} | {' '.join(f'{w:.1f}' for w in waits)} |")
    lines += ["", "![post-validation](post_validation.png)"]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str) -> str:
    """Bars: measured and simulated period per setting, synchronised vs post-validated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 4.2), squeeze=False)
    for ax, r in zip(axes[0], rows):
        labels = ["synchronised", "post-validated"]
        measured = [r["measured_sync_ms"], r["measured_pv_ms"]]
        simulated = [r["simulated_sync_ms"], r["simulated_pv_ms"]]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], simulated, width=0.4, color="#9bb7c0", label="simulated")
        ax.bar([x + 0.2 for x in xs], measured, width=0.4, color="#3465a4", label="measured")
        ax.set_xticks(list(xs), labels)
        low = 0.9 * min(measured + simulated)
        ax.set_ylim(low, 1.02 * max(measured + simulated))
        ax.set_ylabel("ms per iteration (optimizer step included)")
        ax.set_title(f"{r['setting']}: x{r['measured_ratio']:.3f} measured, x{r['simulated_ratio']:.3f} simulated")
        ax.legend(loc="lower right")
    fig.suptitle(f"{report['schedule']}, p={report['p']}, m={report['m']}, emulated compute + real optimizer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--trainer" in argv:
        from bench_post_validation_trainer import main as trainer_main

        return trainer_main([a for a in argv if a != "--trainer"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--quick", action="store_true", help="p = 4, m = 8, 1 run of 3 iterations (a smoke test)")
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--m", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--opt-ms", type=float, default=20.0)
    ap.add_argument("--schedule", default="zb-auto")
    ap.add_argument("--trainer", action="store_true", help="measure through pretrain_gpt.py launches (see above)")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from --out's post_validation.json")
    args = ap.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "post_validation.json"), encoding="utf-8") as fh:
            print("wrote", plot(json.load(fh), os.path.join(args.out, "post_validation.png")))
        return 0
    if args.quick:
        args.p, args.m, args.runs, args.iterations = 4, 8, 1, 3
    if args.p < 2 or args.m < 1 or args.runs < 1 or args.iterations < 1:
        print("bench_post_validation: need --p >= 2 and positive --m, --runs, --iterations", file=sys.stderr)
        return 2
    t0 = time.time()
    results = run_multiprocess(
        _rank,
        args.p,
        args=(args.schedule, args.m, args.runs, args.iterations, args.opt_ms),
        timeout_s=1800,
    )
    report = summarise(results, args.schedule, args.p, args.m, args.opt_ms)
    report.update(runs=args.runs, iterations=args.iterations, environment=environment(),
                  wall_s=round(time.time() - t0, 1))  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    md = to_markdown(report)
    with open(os.path.join(args.out, "post_validation.md"), "w", encoding="utf-8") as fh:
        fh.write(md)
    with open(os.path.join(args.out, "post_validation.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    plot(report, os.path.join(args.out, "post_validation.png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
