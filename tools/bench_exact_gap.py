"""Gap of the schedule generators to the exact MILP optimum, on shapes the solver can handle (p <= 4, m <= 8).

Writes ``bench/results/exact_gap.md``: for each setting, the solver's proven lower bound and best plan, and the
makespan and gap of zb-auto's own search result and of the handcrafted schedules.

    python tools/bench_exact_gap.py --out bench/results [--time-limit 20] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from pathlib import Path

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.milp import highs_available, solve_exact
from zb_pipeline.schedule.simulate import simulate

# (F, B, W) ratios.
RATIOS = {"F=B=W": (1.0, 1.0, 1.0), "F=B=2W": (2.0, 2.0, 1.0)}


def run(out: Path, *, time_limit: float, quick: bool) -> Path:
    shapes = [(2, 4), (3, 6), (4, 8)] if quick else [(2, 2), (2, 4), (2, 6), (3, 3), (3, 6), (4, 4), (4, 8)]
    comms = [0.0] if quick else [0.0, 0.5]
    rows = []
    for (p, m), (ratio_name, (f, b, w)), comm in itertools.product(shapes, RATIOS.items(), comms):
        costs = StageCosts.build(num_ranks=p, f=f * p, b=b * p, w=w * p, comm=comm)
        for limit_name, limit in (("p", float(p)), ("2p-1", float(2 * p - 1))):
            plans = {}
            for name in ("zb-auto", "zb-h1", "zb-h2"):
                try:
                    sched = registry.generate(name, p, m, costs=costs, mem_limit=limit)
                except ValueError:
                    continue
                sim = simulate(sched, costs)
                if max(sim.peak_memory) <= limit + 1e-9:
                    plans[name] = (sched, sim.makespan)
            warm = min(plans.values(), key=lambda x: x[1])[0] if plans else None
            t0 = time.perf_counter()
            exact = solve_exact(p, m, costs=costs, mem_limit=limit, time_limit=time_limit, warm_start=warm)
            seconds = time.perf_counter() - t0
            rows.append((p, m, ratio_name, comm, limit_name, exact, seconds, {k: v[1] for k, v in plans.items()}))
            print(f"p={p} m={m} {ratio_name} comm={comm} limit={limit_name}: LB={exact.lower_bound:.3f} "
                  f"best={exact.makespan:.3f} ({exact.status}, {seconds:.1f}s) "
                  + " ".join(f"{k}={v[1]:.3f}" for k, v in plans.items()), flush=True)

    out.mkdir(parents=True, exist_ok=True)
    path = out / "exact_gap.md"
    lines = [
        "# Gap to the exact optimum (MILP, HiGHS)",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; solver time limit {time_limit:g} s per "
        "setting, warm-started with the best heuristic plan. Costs are one rank's whole share of layers for one "
        "microbatch (`zb-schedule simulate` units); memory limit in units of a rank's F activation (mem_f).",
        "Gap = (makespan - proven lower bound) / lower bound: an upper bound on the true gap (0.0% = optimal).",
        "",
        "| p | m | costs | T_comm | mem limit | lower bound | exact best | solver | zb-auto | gap | zb-h1 | zb-h2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for p, m, ratio, comm, limit_name, exact, seconds, plans in rows:
        def cell(name: str) -> str:
            return f"{plans[name]:.2f}" if name in plans else "-"

        gap = exact.gap_of(plans["zb-auto"]) if "zb-auto" in plans else float("nan")
        if gap == gap:
            worst = max(worst, gap)
        status = "optimal" if exact.optimal else f"{exact.status} ({seconds:.0f}s)"
        lines.append(
            f"| {p} | {m} | {ratio} | {comm:g} | {limit_name} | {exact.lower_bound:.2f} | {exact.makespan:.2f} | "
            f"{status} | {cell('zb-auto')} | {gap:.1%} | {cell('zb-h1')} | {cell('zb-h2')} |"
        )
    lines += ["", f"Largest zb-auto gap in this table: {worst:.1%}.", ""]
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--quick", action="store_true", help="a smaller table")
    args = ap.parse_args(argv)
    if not highs_available():
        print("highspy is not installed: pip install 'zb-megatron[milp]'", file=sys.stderr)
        return 2
    print(f"wrote {run(args.out, time_limit=args.time_limit, quick=args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
