"""``zb-schedule``: generate, look at, simulate, compare and validate pipeline schedules.

    zb-schedule list
    zb-schedule show NAME -p 4 -m 8 [--chunks 2] [--png out.png | --svg out.svg] [cost flags]
    zb-schedule show --trace trace.json --png out.png [--iteration N]   (a --pipeline-trace above its plan, and its
                                                                       critical path: compute, gaps, hops)
    zb-schedule simulate NAME -p 4 -m 8 [--chunks V] --cost-f F --cost-b B --cost-w W --cost-comm C [--cost-overlap A]
                         [--mem-f X --mem-b Y --mem-w Z] [--mem-limit L] [--json] [--export plan.json]
    zb-schedule compare -p 4 -m 8 [cost flags] [--png chart.png] [--json]
    zb-schedule validate plan.json [cost flags] [--mem-limit L]
    zb-schedule certify NAME|plan.json -p 4 -m 8 [cost flags] [--mem-limit L] [--time-limit S] [--json]
    zb-schedule plan NAME -m 8 (--profile prof.json | -p 4 --num-layers L --layer F,B,W,MEM ...)  (stage planner:
                                                                       layers and recompute per stage)

Every command that takes cost flags also takes ``--profile prof.json`` (a measured profile, see
``zb_pipeline.runtime.profiler``): its per-stage costs in ms and memory deltas in bytes replace the flags.

Cost and memory flags take one number (a rank's whole share of layers), a comma-separated list with one number
per rank, or one per virtual stage (see ``StageCosts.build``).  Bad input prints one line on stderr and exits
with status 2; a plan that fails ``check_and_lower`` prints its grid (failing step marked) and exits with status 2 too.
A shape or plan file over the size limits, or costs whose sums overflow, is bad input (``limits``), refused before
any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from zb_pipeline.schedule import certify, limits, plan_cli, registry
from zb_pipeline.schedule.bounds import iteration_lower_bound
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind, Schedule
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule
from zb_pipeline.schedule.pictures import ComparisonRow, ansi_timeline, plot_comparison, plot_timeline
from zb_pipeline.schedule.plan_file import load_plan, save_plan
from zb_pipeline.schedule.schedule_error import ScheduleError, render_grid
from zb_pipeline.schedule.simulate import SimResult, simulate
from zb_pipeline.schedule.validate import check_and_lower

PROG = "zb-schedule"
_GRID_MAX_ACTIONS = 4000  # print a failing plan's grid only up to this size (it is one line per rank)


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ------------------------------------------------------------------------------------------- number parsing


def _spec(flag: str, text: str, *, positive: bool) -> float | list[float]:
    """``"2"`` -> 2.0, ``"1,2,3"`` -> [1.0, 2.0, 3.0]; every value finite (and > 0 for costs)."""
    values = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise UsageError(
                f"{flag} {text!r}: {part.strip()!r} is not a number (give one number or a comma-separated list)"
            ) from None
        if not math.isfinite(v):
            raise UsageError(f"{flag} {text!r}: values must be finite")
        if positive and v <= 0:
            raise UsageError(f"{flag} {text!r}: costs must be > 0, got {v:g}")
        values.append(v)
    return values[0] if len(values) == 1 else values


def _add_shape_args(sp: argparse.ArgumentParser, *, shape: bool = True, required: bool = True) -> None:
    if shape:
        sp.add_argument("-p", "--ranks", type=int, required=required, help="pipeline ranks p")
        sp.add_argument("-m", "--microbatches", type=int, required=required, help="microbatches per iteration m")
        sp.add_argument("--chunks", type=int, default=None, help="virtual stages per rank (default: the schedule's)")
    g = sp.add_argument_group("costs (one number per rank's share, a list per rank, or a list per virtual stage)")
    g.add_argument("--cost-f", default="1", metavar="F", help="forward time T_F (default 1)")
    g.add_argument("--cost-b", default="1", metavar="B", help="input-gradient backward time T_B (default 1)")
    g.add_argument("--cost-w", default="1", metavar="W", help="weight-gradient time T_W (default 1)")
    g.add_argument("--cost-comm", default="0", metavar="C", help="time added to every cross-rank hand-off (default 0)")
    g.add_argument(
        "--cost-overlap",
        type=float,
        default=1.0,
        metavar="A",
        help="an overlapped F+BW pair (dualpipev) costs A x (F + BW), at least its longer half; 0 < A <= 1 "
        "(default 1: the sum)",
    )
    g.add_argument("--mem-f", default="1", metavar="X", help="activation memory added by F (default 1)")
    g.add_argument("--mem-b", default=None, metavar="Y", help="memory added by B (default 0)")
    g.add_argument("--mem-w", default=None, metavar="Z", help="memory added by W (default -(mem_f + mem_b))")
    g.add_argument("--mem-limit", type=float, default=None, metavar="L", help="per-rank memory limit (mem units)")
    g.add_argument(
        "--profile",
        default=None,
        metavar="PROF_JSON",
        help="plan from a measured profile (zb_pipeline.runtime.profiler): its per-stage costs (ms) and memory "
        "(bytes; --mem-limit then in bytes) replace the cost and memory flags",
    )


def _build_costs(args: argparse.Namespace, p: int, chunks: int, placement: Sequence[int]) -> StageCosts:
    overlap = getattr(args, "cost_overlap", 1.0)
    if not (math.isfinite(overlap) and 0 < overlap <= 1):
        raise UsageError(f"--cost-overlap {overlap:g} must be in (0, 1]: a pair costs that share of F + BW")
    if overlap != 1.0:
        return dataclasses.replace(_build_costs_from_flags(args, p, chunks, placement), overlap=overlap)
    return _build_costs_from_flags(args, p, chunks, placement)


def _build_costs_from_flags(args: argparse.Namespace, p: int, chunks: int, placement: Sequence[int]) -> StageCosts:
    if getattr(args, "profile", None):
        from zb_pipeline.schedule.profile import load_profile  # reads JSON only; no torch

        profile = load_profile(args.profile)
        if profile.num_ranks != p:
            raise UsageError(f"--profile {args.profile} was measured with p={profile.num_ranks}, not p={p}")
        return profile.to_stage_costs(chunks=chunks, stage_to_rank=placement)
    comm = _spec("--cost-comm", args.cost_comm, positive=False)
    if isinstance(comm, list):
        raise UsageError(f"--cost-comm takes one number, got {args.cost_comm!r}")
    if comm < 0:
        raise UsageError(f"--cost-comm {comm:g} must be >= 0")
    return StageCosts.build(
        num_ranks=p,
        chunks=chunks,
        stage_to_rank=placement,
        f=_spec("--cost-f", args.cost_f, positive=True),
        b=_spec("--cost-b", args.cost_b, positive=True),
        w=_spec("--cost-w", args.cost_w, positive=True),
        comm=comm,
        mem_f=_spec("--mem-f", args.mem_f, positive=False),
        mem_b=None if args.mem_b is None else _spec("--mem-b", args.mem_b, positive=False),
        mem_w=None if args.mem_w is None else _spec("--mem-w", args.mem_w, positive=False),
    )


def _check_shape(args: argparse.Namespace) -> None:
    if args.ranks < 1:
        raise UsageError(f"-p/--ranks {args.ranks} must be >= 1")
    if args.microbatches < 1:
        raise UsageError(f"-m/--microbatches {args.microbatches} must be >= 1")
    if args.chunks is not None and args.chunks < 1:
        raise UsageError(f"--chunks {args.chunks} must be >= 1")
    if args.mem_limit is not None and not math.isfinite(args.mem_limit):
        raise UsageError(f"--mem-limit {args.mem_limit} must be finite")


# ----------------------------------------------------------------------------------------------- the work


def _plan(name: str, args: argparse.Namespace) -> tuple[Schedule, StageCosts, LoweredSchedule]:
    """Generate, validate and lower schedule ``name`` for the shape and costs on the command line."""
    spec = registry.get(name)
    p, m = args.ranks, args.microbatches
    chunks = spec.default_chunks if args.chunks is None else args.chunks
    if spec.chunks is not None and chunks not in spec.chunks:
        raise UsageError(f"schedule {name!r} supports --chunks in {list(spec.chunks)}, got {chunks}")
    registry.check_limits(name, p, m, chunks)  # before anything of size p or m is built
    costs = _build_costs(args, p, chunks, registry.placement_of(name, p, chunks))
    sched = registry.generate(name, p, m, chunks=chunks, costs=costs, mem_limit=args.mem_limit)
    lowered = check_and_lower(sched, costs=costs, mem_limit=args.mem_limit)
    return sched, costs, lowered


def p2p_messages(lowered: LoweredSchedule) -> int:
    """Point-to-point messages per iteration: the sends of the lowered plan."""
    sends = (Kind.SEND_F, Kind.SEND_B)
    return sum(a.kind in sends for r in range(len(lowered.ranks)) for a in lowered.comm_actions(r))


def _use_color(mode: str) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _summary_dict(result: SimResult, costs: StageCosts, lowered: LoweredSchedule) -> dict[str, Any]:
    s = result.schedule
    return {
        "schedule": s.name,
        "num_ranks": s.num_ranks,
        "num_stages": s.num_stages,
        "num_microbatches": s.num_microbatches,
        "chunks": s.chunks,
        "placement": s.placement,
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "peak_memory": list(result.peak_memory),
        "rank_span": list(result.rank_span),
        "rank_compute": list(result.rank_compute),
        "p2p_messages": p2p_messages(lowered),
        "cost_comm": costs.comm,
        "cost_overlap": costs.overlap,
        "end_time": result.end_time,
        "lower_bound": iteration_lower_bound(costs, s.stage_to_rank, s.num_microbatches).time,
    }


def _fmt_list(values: Sequence[float], limit: int = 8) -> str:
    if len(values) <= limit:
        return ",".join(f"{v:g}" for v in values)
    return f"max {max(values):g} (rank {list(values).index(max(values))})"


def _print_summary(result: SimResult, costs: StageCosts, lowered: LoweredSchedule) -> None:
    s = result.schedule
    print(
        f"{s.name}: p={s.num_ranks} m={s.num_microbatches} chunks={s.chunks} ({s.placement})  "
        f"makespan {result.makespan:g}  bubble rate {result.bubble_rate:.2%}  P2P messages {p2p_messages(lowered)}"
    )
    bound = iteration_lower_bound(costs, s.stage_to_rank, s.num_microbatches)
    print(
        f"iteration ends at {result.end_time:g}; no plan of this layout can end before {bound.time:g} "
        f"(rank {bound.rank}, {bound.reason}): {result.end_time / bound.time - 1:+.2%} over that bound"
    )
    print(f"{'rank':>5} {'span':>10} {'compute':>10} {'idle':>8} {'peak mem':>9}")
    for r in range(s.num_ranks):
        span, busy = result.rank_span[r], result.rank_compute[r]
        idle = 1 - busy / span if span > 0 else 0.0
        print(f"{r:>5} {span:>10g} {busy:>10g} {idle:>8.1%} {result.peak_memory[r]:>9g}")


def _write_picture(result: SimResult, args: argparse.Namespace) -> bool:
    wrote = False
    for path in (args.png, args.svg):
        if path:
            plot_timeline(result, path)
            print(f"wrote {path}")
            wrote = True
    return wrote


def cmd_list(args: argparse.Namespace) -> int:
    for name in registry.available():
        spec = registry.get(name)
        chunks = "any" if spec.chunks is None else ",".join(map(str, spec.chunks))
        print(f"{name:<18} chunks={chunks:<6} placement={spec.placement:<5} {spec.description}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _show_trace(args)
    if args.name is None or args.ranks is None or args.microbatches is None:
        raise UsageError("show needs NAME -p P -m M (or --trace trace.json to draw a measured run)")
    _check_shape(args)
    sched, costs, lowered = _plan(args.name, args)
    result = simulate(sched, costs)
    if not _write_picture(result, args):
        if args.grid:
            print(render_grid(sched, color=_use_color(args.color)))
        else:
            width = max(60, shutil.get_terminal_size((160, 24)).columns)
            print(ansi_timeline(result, color=_use_color(args.color), max_width=width))
    return 0


def _show_trace(args: argparse.Namespace) -> int:
    """``show --trace``: one iteration of a ``--pipeline-trace`` above its plan simulated with the measured costs."""
    from zb_pipeline.schedule.critical_path import critical_path
    from zb_pipeline.schedule.trace_timeline import plan_of, plot_trace_vs_plan

    paths = [x for x in (args.png, args.svg) if x]
    if not paths:
        raise UsageError("show --trace draws a picture: add --png out.png or --svg out.svg")
    with open(args.trace, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as err:
            raise UsageError(f"--trace {args.trace} is not JSON: {err}") from None
    schedule = None
    if args.name is not None:  # an explicit plan (old traces hold none): generated for the given shape
        if args.ranks is None or args.microbatches is None:
            raise UsageError("with NAME, --trace also needs -p P -m M (or drop NAME to use the plan in the trace)")
        _check_shape(args)
        schedule = _plan(args.name, args)[0]
    for path in paths:
        measured, planned = plot_trace_vs_plan(doc, path, schedule=schedule, iteration=args.iteration)
        print(f"wrote {path}")
    print(
        f"iteration {measured.iteration}: measured span {measured.span_ms:.2f} ms (bubble rate "
        f"{measured.bubble_rate:.1%}); the plan under the measured costs {planned.makespan:.2f} ms "
        f"(bubble rate {planned.bubble_rate:.1%})"
    )
    plan = schedule if schedule is not None else plan_of(doc)
    print(critical_path(doc, plan, measured.iteration).summary())
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    _check_shape(args)
    sched, costs, lowered = _plan(args.name, args)
    result = simulate(sched, costs)
    if args.export:
        save_plan(sched, args.export)
    if args.json:
        print(json.dumps(_summary_dict(result, costs, lowered)))
    else:
        _print_summary(result, costs, lowered)
        if args.export:
            print(f"wrote {args.export}")
    if args.png or args.svg:
        for path in (args.png, args.svg):
            if path:
                plot_timeline(result, path)
                if not args.json:
                    print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    _check_shape(args)
    # The shape itself first (one line); a schedule with a tighter limit of its own is then listed as skipped.
    limits.check_shape(args.ranks, args.microbatches, args.chunks or 1, what="compare")
    rows: list[ComparisonRow] = []
    skipped: list[tuple[str, str]] = []
    for name in registry.available():
        spec = registry.get(name)
        chunks_arg = args.chunks
        if chunks_arg is not None and spec.chunks is not None and chunks_arg not in spec.chunks:
            chunks_arg = None  # this schedule has a fixed chunk count: use its own
        sub = argparse.Namespace(**{**vars(args), "chunks": chunks_arg})
        try:
            sched, costs, lowered = _plan(name, sub)
            result = simulate(sched, costs)
        except (ValueError, UsageError) as e:
            skipped.append((name, str(e).splitlines()[0] if str(e) else type(e).__name__))
            continue
        rows.append(
            ComparisonRow(
                name, sched.chunks, result.bubble_rate, result.makespan, result.peak_memory, p2p_messages(lowered)
            )
        )
    title = f"p={args.ranks} m={args.microbatches}"
    if not rows:
        raise UsageError(f"no registered schedule can serve {title}: {'; '.join(f'{n}: {w}' for n, w in skipped)}")
    if args.json:
        print(
            json.dumps(
                {
                    "num_ranks": args.ranks,
                    "num_microbatches": args.microbatches,
                    "schedules": [
                        {
                            "schedule": r.name,
                            "chunks": r.chunks,
                            "bubble_rate": r.bubble_rate,
                            "makespan": r.makespan,
                            "peak_memory": list(r.peak_memory),
                            "p2p_messages": r.p2p_messages,
                        }
                        for r in rows
                    ],
                    "skipped": [{"schedule": n, "reason": why} for n, why in skipped],
                }
            )
        )
    else:
        name_w = max([len(r.name) for r in rows] + [len(n) for n, _ in skipped] + [8])
        print(f"compare: {title}  (peak memory per rank in units of --mem-f)")
        print(f"{'schedule':<{name_w}} {'chunks':>6} {'bubble':>8} {'makespan':>10} {'P2P msgs':>9}  peak memory")
        for r in rows:
            print(
                f"{r.name:<{name_w}} {r.chunks:>6} {r.bubble_rate:>8.2%} {r.makespan:>10g} {r.p2p_messages:>9}  "
                f"{_fmt_list(r.peak_memory)}"
            )
        for n, why in skipped:
            print(f"{n:<{name_w}} {'-':>6} cannot serve this shape: {why}")
    if args.png:
        plot_comparison(rows, args.png, title=f"schedules at {title}", skipped=[n for n, _ in skipped])
        if not args.json:
            print(f"wrote {args.png}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    sched = load_plan(args.plan)  # refuses a plan over the size limits before parsing its actions
    costs = _build_costs(args, sched.num_ranks, sched.chunks, sched.stage_to_rank)
    limits.check_costs(costs, sched.num_microbatches)
    try:
        lowered = check_and_lower(sched, costs=costs, mem_limit=args.mem_limit)
    except ScheduleError as e:
        if e.grid and sum(len(r) for r in sched.ranks) <= _GRID_MAX_ACTIONS:
            print(e.grid)
        raise
    result = simulate(sched, costs)
    print(
        f"{args.plan}: valid plan {sched.name!r}: p={sched.num_ranks} S={sched.num_stages} m={sched.num_microbatches} "
        f"({sched.placement}); makespan {result.makespan:g}, bubble rate {result.bubble_rate:.2%}, "
        f"peak memory {_fmt_list(result.peak_memory)}, P2P messages {p2p_messages(lowered)}"
    )
    if args.post_validation:
        _report_post_validation(lowered)
    if args.png or args.svg:
        _write_picture(result, args)
    return 0


def _report_post_validation(lowered: LoweredSchedule) -> None:
    """``validate --post-validation``: add the optimizer post-validation chain, validate it, say where it sits."""
    from zb_pipeline.schedule.post_validation_pass import add_post_validation, validation_cut
    from zb_pipeline.schedule.validate import validate_lowered

    validate_lowered(add_post_validation(lowered))
    cut = validation_cut(lowered)
    p = len(lowered.ranks)
    print("post-validation chain: valid; the fully reduced state reaches each rank before its first backward action")
    for r, steps in enumerate(lowered.ranks):
        forwards = [str(st) for st in steps[: cut[r]] if not isinstance(st, CommBatch) and st.kind is Kind.F]
        ran = f"{len(forwards)} forward(s): {' '.join(forwards) or 'none'}"
        if r == p - 1:
            print(f"  rank {r}: validates in its prologue (it sums the total); passes it back after {ran}")
        else:
            print(f"  rank {r}: validates after {ran} (run meanwhile with the optimistic weights)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Generate, inspect, simulate, compare and validate pipeline schedules.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    sp = sub.add_parser("list", help="the registered schedules")
    sp.set_defaults(fn=cmd_list)

    sp = sub.add_parser("show", help="draw a schedule's timeline, or a measured trace above its plan")
    sp.add_argument("name", nargs="?", help="schedule name (see 'zb-schedule list'); optional with --trace")
    _add_shape_args(sp, required=False)
    sp.add_argument("--trace", help="a --pipeline-trace JSON: draw it above its plan (with --png/--svg)")
    sp.add_argument("--iteration", type=int, default=None, help="with --trace: which iteration (default the last)")
    sp.add_argument("--png", help="write the timeline as PNG")
    sp.add_argument("--svg", help="write the timeline as SVG")
    sp.add_argument("--grid", action="store_true", help="print the rank x position action grid instead")
    sp.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    sp.set_defaults(fn=cmd_show)

    sp = sub.add_parser("simulate", help="simulate a schedule under given costs")
    sp.add_argument("name", help="schedule name (see 'zb-schedule list')")
    _add_shape_args(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--export", metavar="PLAN_JSON", help="write the plan file")
    sp.add_argument("--png", help="also write the timeline as PNG")
    sp.add_argument("--svg", help="also write the timeline as SVG")
    sp.set_defaults(fn=cmd_simulate)

    sp = sub.add_parser("compare", help="every registered schedule side by side")
    _add_shape_args(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--png", help="write a comparison bar chart")
    sp.set_defaults(fn=cmd_compare)

    sp = sub.add_parser("validate", help="check a plan file (structure, dependencies, strict P2P order, memory)")
    sp.add_argument("plan", help="plan file (JSON)")
    _add_shape_args(sp, shape=False)
    sp.add_argument("--png", help="write the simulated timeline as PNG")
    sp.add_argument("--svg", help="write the simulated timeline as SVG")
    sp.add_argument(
        "--post-validation",
        action="store_true",
        help="also add and check the optimizer post-validation chain (--enable-optimizer-post-validation)",
    )
    sp.set_defaults(fn=cmd_validate)
    certify.add_parser(sub, shape_args=_add_shape_args, check=_check_shape, plan=_plan, costs=_build_costs)
    plan_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zb-schedule`` and ``python -m zb_pipeline.schedule``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.fn(args)
    except BrokenPipeError:  # `zb-schedule show ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        print(f"{PROG}: error: cannot access{where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (UsageError, ValueError) as e:
        text = str(e).strip().splitlines()
        msg = text[0] if text else type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
