"""``zb-schedule plan``: the stage planner offline -- layers and recompute choice per stage from a profile or flags.

    zb-schedule plan NAME -m M --profile prof.json [--chunks C] [--mem-limit BYTES] [--json]
    zb-schedule plan NAME -m M -p P --num-layers L --layer F,B,W[,MEM_F[,MEM_B]] --embedding ... --head ...
                     [--cost-comm C] [--recompute NAME=B_EXTRA,MEM_F[,MEM_B] ...] [--mem-limit X] [--json]

A profile's per-part costs come from its ``parts`` entry, or are derived from its stage medians and ``stage_layers``
(``Profile.model_costs``); ``--recompute`` options add to (or, with a profile, to its own) candidates.  Prints the
split, the recompute choice, the predicted (simulated) iteration and peak, and the even split's for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.stage_planner import (
    ModelCosts,
    PartCosts,
    RecomputeOption,
    StagePlan,
    evaluate_split,
    even_split,
    plan_stages,
)


def _numbers(flag: str, text: str, lo: int, hi: int) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give {lo} to {hi} comma-separated numbers") from None
    if not lo <= len(values) <= hi or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{flag} {text!r}: give {lo} to {hi} comma-separated finite numbers")
    return values


def _part(flag: str, text: str) -> PartCosts:
    v = _numbers(flag, text, 3, 5)
    try:
        return PartCosts(*v)
    except ValueError as err:
        raise ValueError(f"{flag} {text!r}: {err}") from None


def _option(text: str) -> RecomputeOption:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--recompute {text!r}: write NAME=B_EXTRA,MEM_F[,MEM_B] (e.g. full=1.0,2e6)")
    v = _numbers("--recompute", rest, 2, 3)
    try:
        return RecomputeOption(name, *v)
    except ValueError as err:
        raise ValueError(f"--recompute {text!r}: {err}") from None


def model_from_args(args: argparse.Namespace) -> tuple[int, ModelCosts]:
    """(p, ModelCosts) from ``--profile`` or the part flags."""
    extra = tuple(_option(t) for t in args.recompute or ())
    if args.profile:
        from zb_pipeline.schedule.profile import load_profile

        profile = load_profile(args.profile)
        if args.ranks is not None and args.ranks != profile.num_ranks:
            raise ValueError(f"--profile {args.profile} was measured with p={profile.num_ranks}, not p={args.ranks}")
        model = profile.model_costs()
        return profile.num_ranks, dataclasses.replace(model, recompute=model.recompute + extra)
    given = (("-p", args.ranks), ("--num-layers", args.num_layers), ("--layer", args.layer))
    missing = [flag for flag, value in given if value is None]
    if missing:
        raise ValueError(f"plan needs --profile prof.json, or {', '.join(missing)} (and --embedding, --head)")
    model = ModelCosts(
        num_layers=args.num_layers,
        layer=_part("--layer", args.layer),
        embedding=_part("--embedding", args.embedding),
        head=_part("--head", args.head),
        comm=float(args.cost_comm),
        recompute=extra,
    )
    return args.ranks, model


def _report(plan: StagePlan, even: tuple[tuple[int, ...], float, tuple[float, ...]] | None, args, p: int) -> dict:
    d: dict[str, Any] = {
        "schedule": plan.schedule_name,
        "num_ranks": p,
        "num_microbatches": args.microbatches,
        "chunks": plan.schedule.chunks,
        "layers": list(plan.layers),
        "recompute": list(plan.recompute),
        "iteration": plan.iteration,
        "peak_memory": list(plan.peak_memory),
        "mem_limit": args.mem_limit,
        "evaluations": plan.evaluations,
        "exact": plan.exact,
    }
    if even is not None:
        d["even"] = {"layers": list(even[0]), "iteration": even[1], "peak_memory": list(even[2])}
    return d


def run(args: argparse.Namespace) -> int:
    if args.microbatches < 1:
        raise ValueError(f"-m/--microbatches {args.microbatches} must be >= 1")
    if args.mem_limit is not None and not (math.isfinite(args.mem_limit) and args.mem_limit > 0):
        raise ValueError(f"--mem-limit {args.mem_limit:g} must be a positive number (per rank, memory units)")
    p, model = model_from_args(args)
    spec = registry.get(args.name)
    chunks = spec.default_chunks if args.chunks is None else args.chunks
    plan = plan_stages(
        model, schedule=args.name, num_ranks=p, num_microbatches=args.microbatches, chunks=chunks,
        mem_limit=args.mem_limit, max_evaluations=args.max_evaluations,
    )  # fmt: skip
    even = None
    layers = even_split(model.num_layers, p * chunks)
    if layers is not None:
        t, peak = evaluate_split(model, layers, schedule=args.name, num_ranks=p, num_microbatches=args.microbatches)
        even = (layers, t, peak)
    if args.json:
        print(json.dumps(_report(plan, even, args, p)))
        return 0
    print(f"{args.name}: p={p} m={args.microbatches} chunks={chunks}, {model.num_layers} layers")
    print(f"layers per stage: {list(plan.layers)}")
    print(f"recompute:        {', '.join(plan.recompute)}")
    peak = ", ".join(f"{v:g}" for v in plan.peak_memory)
    limit = "" if args.mem_limit is None else f" (limit {args.mem_limit:g})"
    print(f"predicted iteration {plan.iteration:g}, peak memory per rank {peak}{limit}")
    if even is not None:
        change = plan.iteration / even[1] - 1
        over = "" if args.mem_limit is None or max(even[2]) <= args.mem_limit else " -- over the limit"
        print(
            f"even split {list(even[0])}: iteration {even[1]:g} ({change:+.1%} with the planned split), peak "
            f"{', '.join(f'{v:g}' for v in even[2])}{over}"
        )
    proof = "optimal" if plan.exact else "best found (stopped at --max-evaluations; not proven optimal)"
    print(f"search: {plan.evaluations} candidate(s) simulated, {proof}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """``zb-schedule plan``, registered by ``cli.build_parser``."""
    sp = sub.add_parser("plan", help="layers (and recompute) per stage for the shortest iteration (stage planner)")
    sp.add_argument("name", help="schedule name (see 'zb-schedule list')")
    sp.add_argument("-m", "--microbatches", type=int, required=True, help="microbatches per iteration m")
    sp.add_argument("-p", "--ranks", type=int, default=None, help="pipeline ranks p (a profile gives its own)")
    sp.add_argument("--chunks", type=int, default=None, help="virtual stages per rank (default: the schedule's)")
    sp.add_argument("--profile", default=None, metavar="PROF_JSON", help="per-part costs from a profile")
    sp.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    sp.add_argument("--layer", default=None, metavar="F,B,W[,MEM_F[,MEM_B]]", help="one layer, one microbatch")
    sp.add_argument("--embedding", default="0,0,0", metavar="F,B,W[,MEM_F[,MEM_B]]", help="the embedding")
    sp.add_argument("--head", default="0,0,0", metavar="F,B,W[,MEM_F[,MEM_B]]", help="output head and loss")
    sp.add_argument("--cost-comm", type=float, default=0.0, metavar="C", help="time per cross-rank hand-off")
    sp.add_argument(
        "--recompute",
        action="append",
        metavar="NAME=B_EXTRA,MEM_F[,MEM_B]",
        help="a recompute option a stage may take: B costs B_EXTRA more per layer, F keeps MEM_F (repeatable)",
    )
    sp.add_argument("--mem-limit", type=float, default=None, metavar="X", help="per-rank activation memory limit")
    sp.add_argument("--max-evaluations", type=int, default=None, metavar="N", help="cap on simulated candidates")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(fn=run)
    return sp
