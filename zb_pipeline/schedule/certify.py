"""``zb-schedule certify``: how far is a plan from the best any plan can do, on the user's own costs?

The exact solver (``milp.solve_exact``, HiGHS) is warm-started from the plan and asked for the iteration time -- the
end of the last action with every rank starting at 0 (``SimResult.end_time``), the quantity
``bounds.iteration_lower_bound`` bounds -- under the same per-rank memory limit (the plan's own peak unless one is
given).  It answers with the best plan it found and a lower bound it proved: no plan (any order, split or fused
backwards) under that limit ends an iteration sooner.  The reported bound is the larger of the solver's and
``iteration_lower_bound``; the gap is the plan's time over that bound, an upper bound on how much the plan could
still gain (0 = proven optimal).

With one chunk per rank and loop placement, zb-auto's plan under the same limit is a second warm start (the better
of the two is handed to the solver): a lower incumbent narrows the time windows and so raises the bound sooner.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zb_pipeline.schedule import limits
from zb_pipeline.schedule.bounds import iteration_lower_bound
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.plan_file import load_plan
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

DEFAULT_TIME_LIMIT = 60.0


@dataclass(frozen=True)
class Certificate:
    """A plan's iteration time next to the best plan found and a proven lower bound, under one memory limit."""

    plan: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    placement: str
    mem_limit: float
    mem_limit_given: bool  # False: the plan's own peak
    plan_makespan: float  # the plan's iteration time (SimResult.end_time)
    best_makespan: float  # the best iteration time known: the solver's, the plan's or a warm start's
    lower_bound: float  # max(the solver's proven bound, iteration_lower_bound)
    analytic_bound: float  # iteration_lower_bound (no memory limit)
    status: str  # "optimal", or HiGHS's status (e.g. "Time limit reached")
    searched: bool  # False: the time windows' bound met the warm start, no search ran
    seconds: float
    time_limit: float
    best_schedule: Schedule | None = None

    @property
    def optimal(self) -> bool:
        """The best plan found is proven optimal (HiGHS: within its relative tolerance of 1e-6)."""
        return self.status == "optimal" or self.best_makespan <= self.lower_bound * (1 + 1e-9)

    @property
    def gap(self) -> float:
        """(plan - lower bound) / lower bound: at most this share of the plan's time can still be saved."""
        return max(0.0, (self.plan_makespan - self.lower_bound) / self.lower_bound) if self.lower_bound > 0 else 0.0

    @property
    def best_gap(self) -> float:
        """The same for the best plan found."""
        return max(0.0, (self.best_makespan - self.lower_bound) / self.lower_bound) if self.lower_bound > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.plan,
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "chunks": self.chunks,
            "placement": self.placement,
            "mem_limit": self.mem_limit,
            "plan_makespan": self.plan_makespan,
            "best_makespan": self.best_makespan,
            "lower_bound": self.lower_bound,
            "iteration_lower_bound": self.analytic_bound,
            "gap": self.gap,
            "best_gap": self.best_gap,
            "optimal": self.optimal,
            "status": self.status,
            "searched": self.searched,
            "seconds": self.seconds,
            "time_limit": self.time_limit,
        }

    def report(self) -> str:
        limit = f"{self.mem_limit:g}" + ("" if self.mem_limit_given else " (the plan's peak)")
        if self.gap <= 1e-6:
            verdict = "the plan is optimal"
        else:
            verdict = f"the plan is {'' if self.optimal else 'at most '}{self.gap:.2%} over the optimum"
        how = "HiGHS branch and bound" if self.searched else "the time windows' bound meets a warm start: no search"
        return "\n".join(
            [
                f"certify {self.plan}: p={self.num_ranks} m={self.num_microbatches} chunks={self.chunks} "
                f"({self.placement}), memory limit {limit}; makespan = iteration time (every rank starts at 0)",
                f"  plan makespan   {self.plan_makespan:g}",
                f"  best found      {self.best_makespan:g}",
                f"  lower bound     {self.lower_bound:g}  (iteration_lower_bound {self.analytic_bound:g})",
                f"  gap             {self.gap:.2%}  ({verdict})",
                f"  solver          {self.status}, {how}, {self.seconds:.1f} s of {self.time_limit:g} s",
            ]
        )


def certify(
    schedule: Schedule,
    costs: StageCosts,
    *,
    mem_limit: float | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT,
) -> Certificate:
    """Run the exact solver on ``costs``, warm-started from ``schedule``; ``mem_limit`` defaults to the plan's peak.

    Raises ``ValueError`` for input the solver cannot answer: an invalid plan (``ScheduleError``), a plan over
    ``mem_limit``, a time limit <= 0, an overlap factor below 1 (the exact model has no overlapped pairs)."""
    from zb_pipeline.schedule.milp import solve_exact, split_fused

    if not (math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"--time-limit {time_limit:g} must be a positive number of seconds")
    _check_exact_size(schedule.num_ranks, schedule.num_microbatches, schedule.chunks)
    limits.check_costs(costs, schedule.num_microbatches)
    if getattr(costs, "overlap", 1.0) != 1.0:
        raise ValueError("certify models no overlapped pairs: use --cost-overlap 1 (pairs cost F + BW)")
    t0 = time.perf_counter()
    p, m, s2r = schedule.num_ranks, schedule.num_microbatches, schedule.stage_to_rank
    check_and_lower(schedule, costs=costs)  # a plan missing work would look faster than the optimum
    sim = simulate(schedule, costs)
    peak = max(sim.peak_memory)
    limit = peak if mem_limit is None else float(mem_limit)
    if peak > limit + 1e-9:
        raise ValueError(f"plan {schedule.name!r} peaks at {peak:g} memory units, over --mem-limit {limit:g}")
    warm, warm_time = split_fused(schedule), sim.end_time
    for other in _other_warm_starts(schedule, costs, limit):
        other_time = simulate(other, costs).end_time
        if other_time < warm_time:
            warm, warm_time = other, other_time
    res = solve_exact(
        p,
        m,
        chunks=schedule.chunks,
        placement=s2r,
        costs=costs,
        mem_limit=limit,
        time_limit=max(0.1, time_limit - (time.perf_counter() - t0)),
        warm_start=warm,
        name=f"exact({schedule.name})",
        objective="end",
    )
    analytic = iteration_lower_bound(costs, s2r, m).time
    best_schedule = res.schedule if res.schedule is not None and res.makespan <= warm_time else warm
    best = min(res.makespan, warm_time, sim.end_time)
    lower = min(max(res.lower_bound, analytic), best)
    return Certificate(
        plan=schedule.name,
        num_ranks=p,
        num_microbatches=m,
        chunks=schedule.chunks,
        placement=schedule.placement,
        mem_limit=limit,
        mem_limit_given=mem_limit is not None,
        plan_makespan=sim.end_time,
        best_makespan=best,
        lower_bound=lower,
        analytic_bound=analytic,
        status="optimal" if res.optimal else res.status,
        searched=res.searched,
        seconds=time.perf_counter() - t0,
        time_limit=time_limit,
        best_schedule=best_schedule,
    )


def _check_exact_size(num_ranks: int, num_microbatches: int, chunks: int) -> None:
    """The exact solver's size limit (``limits.MAX_EXACT_ACTIONS``: its model grows with the square of a rank's
    actions)."""
    limits.check_shape(
        num_ranks, num_microbatches, chunks, max_actions=limits.MAX_EXACT_ACTIONS, what="certify (the exact solver)"
    )


def _other_warm_starts(schedule: Schedule, costs: StageCosts, limit: float) -> list[Schedule]:
    """zb-auto under the same limit, where it applies (one chunk per rank, loop placement)."""
    if schedule.chunks != 1 or schedule.placement != "loop":
        return []
    from zb_pipeline.schedule import registry

    try:
        plan = registry.generate("zb-auto", schedule.num_ranks, schedule.num_microbatches, costs=costs, mem_limit=limit)
    except ValueError:
        return []
    return [plan] if max(simulate(plan, costs).peak_memory) <= limit + 1e-9 else []


# ------------------------------------------------------------------------------------------------ the CLI


def add_parser(
    sub: Any,  # the subparsers of ``cli.build_parser``
    *,
    shape_args: Callable[[argparse.ArgumentParser], None],
    check: Callable[[argparse.Namespace], None],
    plan: Callable[[str, argparse.Namespace], tuple],
    costs: Callable[[argparse.Namespace, int, int, tuple[int, ...]], StageCosts],
) -> argparse.ArgumentParser:
    """``zb-schedule certify``, registered by ``cli.build_parser``, which hands over its helpers: ``shape_args`` adds
    -p/-m/--chunks and the cost flags, ``check`` checks them, ``plan(name, args)`` generates and validates a named
    schedule (-> schedule, costs, ...), ``costs(args, p, chunks, stage_to_rank)`` reads the cost flags."""
    sp = sub.add_parser("certify", help="prove how far a plan is from the optimum on your costs (exact solver)")
    sp.add_argument("target", metavar="NAME|PLAN_JSON", help="schedule name (see 'zb-schedule list') or plan file")
    shape_args(sp)
    sp.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT,
        metavar="S",
        help=f"seconds for the solver, building the model included (default {DEFAULT_TIME_LIMIT:g})",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args: argparse.Namespace) -> int:
        check(args)
        _check_exact_size(args.ranks, args.microbatches, args.chunks or 1)  # before a plan is generated or read
        if not (math.isfinite(args.time_limit) and args.time_limit > 0):
            raise ValueError(f"--time-limit {args.time_limit:g} must be a positive number of seconds")
        if args.target.endswith(".json") or os.path.isfile(args.target):
            schedule = load_plan(args.target)
            shape, asked = (schedule.num_ranks, schedule.num_microbatches), (args.ranks, args.microbatches)
            if shape != asked:
                raise ValueError(
                    f"{args.target} is a plan for p={shape[0]} m={shape[1]}, not p={asked[0]} m={asked[1]}"
                )
            if args.chunks is not None and args.chunks != schedule.chunks:
                raise ValueError(f"{args.target} has {schedule.chunks} chunks per rank, not --chunks {args.chunks}")
            stage_costs = costs(args, schedule.num_ranks, schedule.chunks, schedule.stage_to_rank)
        else:
            schedule, stage_costs = plan(args.target, args)[:2]
        cert = certify(schedule, stage_costs, mem_limit=args.mem_limit, time_limit=args.time_limit)
        print(json.dumps(cert.to_dict()) if args.json else cert.report())
        return 0

    sp.set_defaults(fn=run)
    return sp
