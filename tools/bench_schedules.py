"""Benchmark the pipeline schedules: bubble rates, zb-auto's search time and the V schedules' time and quality.

The V sections: the V schedules' generation time (compiled passes and Python fallback) and their bubble rates
against the zero-bubble paper's ZB-V table.  The scale section: 1F1B and ZB-H1 at p = 512, m = 2048 (about 3 million
actions) generated, lowered, validated and simulated in a fresh process each, with its CPU and wall time and peak
RSS against the targets (60 s, 4 GB); ``--scale`` runs only that section and prints its table.

Writes ``bench/results/schedules.md`` and ``bench/results/schedules.png`` (``--out`` to change the folder).

Columns are a list of ``Column`` (a name and a function of the setting returning a bubble rate or None); to add one
(e.g. the exact solver's gap), append to ``COLUMNS`` or call ``main(extra_columns=[...])``.
Run: ``.venv/bin/python tools/bench_schedules.py [--out DIR] [--quick] [--scale]``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators import v_shape, v_shape_codes, zb_auto, zb_auto_passes
from zb_pipeline.schedule.ir import v_placement
from zb_pipeline.schedule.lowering import CommBatch
from zb_pipeline.schedule.paper_tables import ZB_V_TABLE
from zb_pipeline.schedule.registry import available, generate, get
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower


@dataclass(frozen=True)
class Setting:
    p: int
    m: int
    f: float
    b: float
    w: float
    comm: float

    @property
    def label(self) -> str:
        return f"p={self.p} m={self.m} F:B:W={self.f:g}:{self.b:g}:{self.w:g} c={self.comm:g}"

    def costs(self, chunks: int = 1) -> StageCosts:
        return StageCosts.build(num_ranks=self.p, chunks=chunks, f=self.f, b=self.b, w=self.w, comm=self.comm)


@dataclass(frozen=True)
class Column:
    name: str
    fn: Callable[[Setting], float | None]  # bubble rate (0..1), or None where it does not apply


def _bubble_of(name: str, *, chunks: int | None = None, limit_units: Callable[[int], float] | None = None):
    def fn(s: Setting) -> float | None:
        c = get(name).default_chunks if chunks is None else chunks
        costs = s.costs(c)
        limit = None if limit_units is None else limit_units(s.p)
        try:
            sched = generate(name, s.p, s.m, chunks=c, costs=costs, mem_limit=limit)
        except ValueError:
            return None
        return simulate(sched, costs).bubble_rate

    return fn


def default_columns() -> list[Column]:
    cols = [
        Column("1f1b", _bubble_of("1f1b")),
        Column("zb-h1", _bubble_of("zb-h1")),
        Column("zb-h2", _bubble_of("zb-h2")),
        Column("zb-auto (limit p)", _bubble_of("zb-auto", limit_units=lambda p: p)),
        Column("zb-auto (limit 2p)", _bubble_of("zb-auto", limit_units=lambda p: 2 * p)),
    ]
    names = available()
    for name in ("zb-v", "v-half", "v-min", "interleaved-zb"):  # registered by the V-shape work
        if name in names:
            cols.append(Column(name, _bubble_of(name)))
    return cols


SETTINGS: tuple[Setting, ...] = tuple(
    Setting(p, m, f, b, w, c)
    for p, m in ((4, 8), (4, 16), (8, 16), (8, 32), (16, 64))
    for f, b, w in ((1, 1, 1), (2, 2, 1), (1, 2, 1))
    for c in (0.0, 0.2)
)


def timing_costs(p: int, kind: str) -> StageCosts:
    """Cost settings of the search-time table: uniform, heavier end stages, and +-10 % per-stage jitter with comm."""
    if kind == "uniform":
        return StageCosts.uniform(p)
    if kind == "per-stage":  # heavier first (embedding) and last (head + loss) stages
        mid = [1.0] * (p - 2)
        return StageCosts.build(num_ranks=p, f=[1.4, *mid, 1.8], b=[1.3, *mid, 2.0], w=[1.2, *mid, 1.5], comm=0.05)
    rng = random.Random(p)  # "jitter": no dominant stage, so the lower bound is not reached and the search runs
    vals = [[rng.uniform(0.9, 1.1) for _ in range(p)] for _ in range(3)]
    return StageCosts.build(num_ranks=p, f=vals[0], b=vals[1], w=vals[2], comm=0.3)


TIMING_KINDS = ("uniform", "per-stage", "jitter c=0.3")


def search_times(shapes: Sequence[tuple[int, int]], repeats: int) -> list[tuple]:
    """zb-auto's search time per shape, cost kind and limit (p, 2p): median wall and CPU seconds of the search
    (passes and scoring) and of the whole call (plus building the Schedule; the first call also creates the
    interned Action objects: "cold"), with the plan's bubble, passes and gap to the lower bound."""
    rows = []
    for p, m in shapes:
        for kind in TIMING_KINDS:
            costs = timing_costs(p, kind.split()[0])
            for limit in (p, 2 * p):
                zb_auto_passes._actions_of.cache_clear()
                c0, t0 = time.process_time(), time.perf_counter()
                res = zb_auto.search(p, m, costs, limit)
                cold_cpu, cold_wall = time.process_time() - c0, time.perf_counter() - t0
                wall, cpu, s_wall, s_cpu = [], [], [], []
                for _ in range(repeats):
                    c0, t0 = time.process_time(), time.perf_counter()
                    res = zb_auto.search(p, m, costs, limit)
                    cpu.append(time.process_time() - c0)
                    wall.append(time.perf_counter() - t0)
                    s_wall.append(res.seconds)
                    s_cpu.append(res.cpu_seconds)
                bubble = simulate(res.schedule, costs).bubble_rate
                gap = res.makespan / res.lower_bound - 1
                med = statistics.median
                rows.append(
                    (f"p={p} m={m} {kind}", limit, med(s_cpu), med(s_wall), med(cpu), med(wall), cold_cpu, cold_wall,
                     bubble, gap, res.passes)
                )  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- V schedules

V_NAMES = ("zb-v", "v-half", "v-min")
# The zero-bubble paper's ZB-V table (zb_pipeline.schedule.paper_tables; tests/test_v_targets.py asserts the targets).
PAPER_TABLE = ZB_V_TABLE


def paper_costs(p: int, f: float, b: float, w: float, c: float) -> StageCosts:
    """The table's costs as ``zb-schedule simulate NAME --chunks 2 --cost-f 2F ... --mem-f 1 --mem-b -0.6
    --mem-w -0.4`` reads them (W keeps 40% of F's activation until it runs)."""
    return StageCosts.build(
        num_ranks=p, chunks=2, stage_to_rank=v_placement(p, 2), f=2 * f, b=2 * b, w=2 * w, comm=c, mem_f=1,
        mem_b=-0.6, mem_w=-0.4,
    )  # fmt: skip


def paper_table_lines(rows: Sequence[int] | None = None) -> list[str]:
    """The paper's columns beside ours (``rows``: those of ``PAPER_TABLE``, default all), each of our schedules at
    its cap, with the targets of the issue."""
    lines = [
        "| model | p | m | paper 1F1B | paper ZB-H1 | paper ZB-V | our zb-v | our v-half (target) | "
        "our v-min (target) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (model, p, m, f, b, w, c, one_f_one_b, zb_h1, zb_v) in enumerate(PAPER_TABLE):
        if rows is not None and i not in rows:
            continue
        costs = paper_costs(p, f, b, w, c)
        got = {n: simulate(generate(n, p, m, chunks=2, costs=costs), costs).bubble_rate for n in V_NAMES}
        half, low = (one_f_one_b + zb_h1) / 2, one_f_one_b + 0.12
        lines.append(
            f"| {model} | {p} | {m} | {one_f_one_b:.4f} | {zb_h1:.4f} | {zb_v:.4f} | {got['zb-v']:.5f} | "
            f"{got['v-half']:.4f} ({half:.4f}) | {got['v-min']:.4f} ({low:.4f}) |"
        )
    return lines


def v_generation_times(shapes: Sequence[tuple[int, int]], repeats: int, python_up_to: int = 32) -> list[tuple]:
    """CPU and wall seconds of one V generation (median of ``repeats``; the registry's cache bypassed), with the
    compiled passes and, up to ``python_up_to`` ranks, the Python fallback (one run), and the plan's bubble."""
    rows = []
    for p, m in shapes:
        for kind, costs in (("uniform", StageCosts.uniform(2 * p)), ("table", paper_costs(p, 9447, 9644, 7193, 887))):
            for name in V_NAMES:
                for backend in ("cpp", "python"):
                    if backend == "cpp" and v_shape_codes.cpp is None or backend == "python" and p > python_up_to:
                        continue
                    cpu, wall = [], []
                    for _ in range(repeats if backend == "cpp" else 1):
                        c0, t0 = time.process_time(), time.perf_counter()
                        sched = v_shape.plan_v(name, p, m, chunks=2, costs=costs, mem_limit=None, backend=backend)
                        cpu.append(time.process_time() - c0)
                        wall.append(time.perf_counter() - t0)
                    bubble = simulate(sched, costs).bubble_rate
                    rows.append((f"p={p} m={m} {kind}", name, backend, statistics.median(cpu),
                                 statistics.median(wall), bubble))  # fmt: skip
    return rows


SCALE_SHAPE = (512, 2048)  # p, m: about 3 million actions (issue 24's bounded-cost target)
SCALE_SCHEDULES = ("1f1b", "zb-h1")
SCALE_TARGET_S, SCALE_TARGET_GB = 60.0, 4.0


def scale_child(name: str, p: int, m: int) -> dict:
    """One end-to-end run in this process (``--scale-child``): generate, lower + validate, simulate; CPU and wall
    seconds of each phase and the process's peak RSS."""
    out: dict = {"schedule": name, "p": p, "m": m}
    t0, c0 = time.perf_counter(), time.process_time()
    sched = generate(name, p, m)
    costs = StageCosts.build(num_ranks=p, chunks=sched.chunks, stage_to_rank=sched.stage_to_rank)
    t1, c1 = time.perf_counter(), time.process_time()
    lowered = check_and_lower(sched, costs=costs)
    t2, c2 = time.perf_counter(), time.process_time()
    result = simulate(sched, costs)
    t3, c3 = time.perf_counter(), time.process_time()
    out["actions"] = sum(len(acts) for acts in sched.ranks)
    out["messages"] = sum(len(st) for steps in lowered.ranks for st in steps if isinstance(st, CommBatch)) // 2
    out["bubble"] = result.bubble_rate
    out["cpu"] = {"generate": c1 - c0, "lower_validate": c2 - c1, "simulate": c3 - c2, "total": c3 - c0}
    out["wall"] = {"generate": t1 - t0, "lower_validate": t2 - t1, "simulate": t3 - t2, "total": t3 - t0}
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    return out


def scale_times(names: Sequence[str] = SCALE_SCHEDULES, shape: tuple[int, int] = SCALE_SHAPE) -> list[dict]:
    """``scale_child`` of each schedule in a fresh interpreter (so each peak RSS is its own); the wall time is the
    whole process, start-up and imports included."""
    rows = []
    for name in names:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--scale-child", name, str(shape[0]), str(shape[1])],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["process_wall"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def scale_lines(rows: Sequence[dict]) -> list[str]:
    lines = [
        "| schedule | p | m | actions | messages | generate CPU (s) | lower + validate CPU (s) | simulate CPU (s) | "
        "total CPU (s) | process wall (s) | peak RSS (GB) | within target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["cpu"]
        ok = r["cpu"]["total"] <= SCALE_TARGET_S and r["peak_rss_gb"] <= SCALE_TARGET_GB
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['actions']} | {r['messages']} | {c['generate']:.1f} | "
            f"{c['lower_validate']:.1f} | {c['simulate']:.1f} | {c['total']:.1f} | {r['process_wall']:.1f} | "
            f"{r['peak_rss_gb']:.2f} | {'yes' if ok else 'NO'} |"
        )
    return lines


def main(argv: Sequence[str] | None = None, extra_columns: Sequence[Column] = ()) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="fewer settings and one timing run")
    ap.add_argument("--scale", action="store_true", help="only the scale section (p=512, m=2048): print its table")
    ap.add_argument("--scale-child", nargs=3, metavar=("NAME", "P", "M"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scale_child:
        name, p, m = args.scale_child
        print(json.dumps(scale_child(name, int(p), int(m))))
        return
    if args.scale:
        print("\n".join(scale_lines(scale_times())))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = default_columns() + list(extra_columns)
    settings = SETTINGS[::6] if args.quick else SETTINGS

    table = [[col.fn(s) for col in columns] for s in settings]
    lines = ["# Schedule benchmark", "", "Bubble rate (simulated; 1 - busiest rank's compute / makespan).", ""]
    lines.append("| setting | " + " | ".join(c.name for c in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for s, row in zip(settings, table):
        cells = ["n/a" if v is None else f"{100 * v:.2f}%" for v in row]
        lines.append(f"| {s.label} | " + " | ".join(cells) + " |")

    shapes = ((32, 256), (64, 512))
    times = search_times(shapes, 1 if args.quick else 5)
    lines += [
        "",
        f"## zb-auto search time (backend: {'C++' if zb_auto_passes._cpp else 'Python'})",
        "",
        "Reference fork's greedy: 0.42 s (p=32, m=256) and 2.0 s (p=64, m=512), uniform costs, same 2-core machine; "
        "target at most half, with per-stage costs. The machine is shared, so CPU time (`time.process_time`) is "
        "the fair measure; wall time is shown too. Medians of repeated calls; 'cold' is the first call, which also "
        "creates the interned Action objects. Gap: to zb-auto's analytic lower bound (0.00%: proven optimal).",
        "",
        "| shape, costs | limit | search CPU (s) | search wall (s) | call CPU (s) | call wall (s) | cold CPU (s) | "
        "cold wall (s) | bubble | gap to bound | passes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, limit, s_cpu, s_wall, cpu, wall, c_cpu, c_wall, bub, gap, n in times:
        lines.append(
            f"| {label} | {limit} | {s_cpu:.3f} | {s_wall:.3f} | {cpu:.3f} | {wall:.3f} | {c_cpu:.3f} | {c_wall:.3f} "
            f"| {100 * max(0.0, bub):.2f}% | {100 * max(0.0, gap):.2f}% | {n} |"
        )
    lines += [
        "",
        "## V schedules: generation time",
        "",
        "One call of the generator (zb-v, v-half, v-min at their caps) with the compiled passes (`_v_shape_cpp`, "
        "median of repeated calls) and with the Python fallback (one call; up to p = 32). Targets (C++): at most 1 s "
        "at p=32, m=256 and at most 5 s at p=64, m=512. 'table' costs: the zero-bubble paper's 28.3B row (F, B, W "
        "per chunk 9447, 9644, 7193 us, T_comm 887 us, W keeping 40% of F's activation).",
        "",
        "| shape, costs | schedule | backend | CPU (s) | wall (s) | bubble |",
        "|---|---|---|---|---|---|",
    ]
    v_shapes, python_up_to = (shapes[:1], 0) if args.quick else (shapes, 32)
    scale_shape = (64, 256) if args.quick else SCALE_SHAPE
    for label, name, backend, cpu, wall, bubble in v_generation_times(v_shapes, 1 if args.quick else 3, python_up_to):
        lines.append(f"| {label} | {name} | {backend} | {cpu:.2f} | {wall:.2f} | {100 * bubble:.2f}% |")
    lines += [
        "",
        "## V schedules against the zero-bubble paper's table",
        "",
        "The paper's ZB-V table (per-chunk costs, T_comm = c), bubble rates; ours simulated at each schedule's cap "
        "(zb-v p, v-half floor((p+2)/2), v-min floor((p+4)/3) microbatches of a rank's activation). Targets: zb-v at "
        "or below the paper's ZB-V; v-half at most halfway between ZB-H1 and 1F1B; v-min at most 1F1B + 12 points. "
        "Our zb-v has five decimals: the paper's columns are rounded to four.",
        "",
        *paper_table_lines((0, 3, 8) if args.quick else None),
        "",
        "## Scale: bounded cost",
        "",
        f"Generate + lower + validate + simulate at p={scale_shape[0]}, m={scale_shape[1]}, each schedule in a "
        f"fresh process; targets at p={SCALE_SHAPE[0]}, m={SCALE_SHAPE[1]} (about 3 million actions; `--quick` "
        f"measures a smaller shape): at most {SCALE_TARGET_S:g} s and {SCALE_TARGET_GB:g} GB. CPU time is the fair "
        "measure on a shared machine. Beyond the size limits (`zb_pipeline/schedule/limits.py`) the tools refuse a "
        "request in one line instead.",
        "",
        *scale_lines(scale_times(shape=scale_shape)),
    ]
    (out / "schedules.md").write_text("\n".join(lines) + "\n")
    _chart(out / "schedules.png", settings, columns, table)
    print(f"wrote {out / 'schedules.md'} and {out / 'schedules.png'}")


def _chart(path: Path, settings: Sequence[Setting], columns: Sequence[Column], table) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(settings)), 5))
    width = 0.8 / len(columns)
    for i, col in enumerate(columns):
        xs = [k + i * width for k in range(len(settings))]
        ys = [100 * (row[i] or 0.0) for row in table]
        ax.bar(xs, ys, width, label=col.name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(settings))])
    ax.set_xticklabels([s.label.replace(" F:B:W", "\n").replace(" c=", "\nc=") for s in settings], fontsize=6)
    ax.set_ylabel("bubble rate (%)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
