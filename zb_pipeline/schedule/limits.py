"""The size limits of the schedule tools, in one place, and the checks that enforce them before any work.

Generating, lowering, validating and simulating a plan cost O(actions + messages) in time and memory, so what a
request costs is known from its shape alone: ``p`` ranks, ``m`` microbatches, ``chunks`` virtual stages per rank,
and at most ``3 x p x chunks x m`` compute actions (an F, a B and a W per virtual stage and microbatch).  A shape
beyond these limits is refused up front with one line naming the limit and what to do, instead of running until
the machine runs out of memory:

- ``MAX_RANKS`` pipeline ranks and ``MAX_MICROBATCHES`` microbatches per iteration;
- ``MAX_ACTIONS`` compute actions (``3 x p x chunks x m``) -- room for p = 512, m = 2048 1F1B or ZB-H1 (3.1 million
  actions: 34.6 s CPU and 1.74 GB peak RSS to generate, lower, validate and simulate ZB-H1, measured on a shared
  2-core host; ``tools/bench_schedules.py --scale``, bench/results/NOTES.md);
- a schedule whose generator costs more per action (a search) states a smaller ``max_actions`` in its registry
  entry (``registry.GeneratorSpec.max_actions``), which takes the place of ``MAX_ACTIONS`` for it
  (``registry.check_limits`` applies it; ``registry.generate`` calls that before generating);
- ``MAX_EXACT_ACTIONS`` compute actions for the exact solver (``zb-schedule certify``), whose model grows with the
  square of a rank's actions;
- a plan file is read only up to ``MAX_PLAN_FILE_BYTES``, and its header (ranks, stages, microbatches, the number
  of actions) is checked before any action is parsed;
- costs whose sums are not finite (``1e308`` summed over a plan overflows to ``inf``) are refused: an iteration's
  total work ``m x sum(F + B + W)`` plus a communication cost per hand-off, and its total memory traffic
  ``m x sum(|mem_f| + |mem_b| + |mem_w|)``, must be finite numbers.

Every refusal is a ``LimitError`` (a ``ValueError``): the CLI prints it as ``zb-schedule: error: ...`` and exits 2;
the trainer reports it as a one-line ``ConfigError``.
"""

from __future__ import annotations

import math

from zb_pipeline.schedule.costs import StageCosts

MAX_RANKS = 4096
MAX_MICROBATCHES = 65536
MAX_ACTIONS = 4_000_000
MAX_EXACT_ACTIONS = 5_000
ACTIONS_PER_STAGE_AND_MICROBATCH = 3  # F, B and W (a fused BW counts as its B and its W)
# A plan file's canonical text takes about 8 bytes per action; the bound leaves room for hand-written layouts.
MAX_PLAN_FILE_BYTES = 32 * MAX_ACTIONS


class LimitError(ValueError):
    """A request beyond the schedule tools' limits (one line: which limit, and what to do)."""


def action_count(num_ranks: int, num_microbatches: int, chunks: int) -> int:
    """The compute actions a plan of this shape holds at most: ``3 x p x chunks x m``."""
    return ACTIONS_PER_STAGE_AND_MICROBATCH * num_ranks * chunks * num_microbatches


def check_shape(
    num_ranks: int, num_microbatches: int, chunks: int = 1, *, max_actions: int | None = None, what: str = "a plan"
) -> None:
    """``LimitError`` unless ``p``, ``m`` and the action count are within the limits (``max_actions``: a tighter
    per-schedule limit, ``None`` for ``MAX_ACTIONS``); ``what`` names the request in the message."""
    p, m = num_ranks, num_microbatches
    if p > MAX_RANKS:
        raise LimitError(f"{what} with p={p} ranks is over the limit of {MAX_RANKS} pipeline ranks; use fewer ranks")
    if m > MAX_MICROBATCHES:
        raise LimitError(
            f"{what} with m={m} microbatches is over the limit of {MAX_MICROBATCHES} microbatches per iteration; "
            f"use m <= {MAX_MICROBATCHES} (more, smaller iterations)"
        )
    limit = MAX_ACTIONS if max_actions is None else min(max_actions, MAX_ACTIONS)
    n = action_count(p, m, chunks)
    if n > limit:
        most = limit // (ACTIONS_PER_STAGE_AND_MICROBATCH * p * chunks)
        fix = f"use m <= {most} at p={p} (or fewer ranks or chunks)" if most >= 1 else "use fewer ranks or chunks"
        raise LimitError(
            f"{what} with p={p}, m={m}, chunks={chunks} has up to 3 x p x chunks x m = {n} actions, over the limit of "
            f"{limit}; {fix}"
        )


def check_plan_size(num_ranks: int, num_stages: int, num_microbatches: int, num_actions: int, *, what: str) -> None:
    """The limits for a plan someone wrote (a plan file): its header and its actual number of actions."""
    if num_ranks > MAX_RANKS:
        raise LimitError(
            f"{what} has {num_ranks} ranks, over the limit of {MAX_RANKS} pipeline ranks; plans with up to "
            f"{MAX_RANKS} ranks can be checked"
        )
    chunks = max(1, num_stages // max(1, num_ranks))
    check_shape(num_ranks, num_microbatches, chunks, what=what)
    if num_actions > MAX_ACTIONS:
        raise LimitError(f"{what} holds {num_actions} actions, over the limit of {MAX_ACTIONS}; split the plan")


def check_costs(costs: StageCosts, num_microbatches: int) -> None:
    """``LimitError`` unless an iteration's sums of costs and memory deltas are finite (module docstring)."""
    m, n = num_microbatches, costs.num_stages
    # Plain sums (math.fsum raises on overflow): a sum that overflows is inf, and so is a product that does.
    work = m * sum(costs.f) + m * sum(costs.b) + m * sum(costs.w)
    # At most two hand-offs per virtual stage and microbatch (a forward out, a gradient back).
    work += costs.comm * 2 * n * m
    if not math.isfinite(work):
        raise LimitError(
            f"the costs are too large: one iteration's work, m x sum(F + B + W) over {n} stages plus the "
            f"communication, is not a finite number (overflow); give costs in a larger unit (e.g. ms, not ns)"
        )
    traffic = m * (sum(map(abs, costs.mem_f)) + sum(map(abs, costs.mem_b)) + sum(map(abs, costs.mem_w)))
    if not math.isfinite(traffic):
        raise LimitError(
            f"the memory deltas are too large: m x sum(|mem_f| + |mem_b| + |mem_w|) over {n} stages is not a finite "
            "number (overflow); give memory in a larger unit (e.g. MB, not bytes)"
        )
