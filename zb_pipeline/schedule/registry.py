"""The named registry of schedule generators: the one source of schedule facts.

A generator is a pure function ``fn(p, m, *, chunks, costs, mem_limit) -> Schedule`` over integers and costs.
Its registry entry says everything else about it -- the chunk counts it allows, its placement, whether its plan
depends on the costs, the peak activation memory it states, whether it takes a memory limit, and the help text
-- and the trainer's flags, the CLI, the simulator, the profiler and the benchmarks ask the registry.  Adding a
schedule is one generator module plus its ``@register`` line (listed in ``_BUILTIN_MODULES`` for a built-in one).

``generate`` is the one entry point; a plan is generated once per (name, shape, costs, memory limit) and cached
(plans are immutable, so the cache is invisible except in time).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from zb_pipeline.schedule import limits
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Schedule, loop_placement, v_placement

GeneratorFn = Callable[..., Schedule]

BUILTIN_PACKAGE = "zb_pipeline.schedule.generators"
# Modules under zb_pipeline/schedule/generators/ that register built-in schedules.
_BUILTIN_MODULES: tuple[str, ...] = ("classic", "zero_bubble", "zb_auto", "v_shape", "interleaved_zb", "dualpipe_v")


@dataclass(frozen=True)
class GeneratorSpec:
    name: str
    fn: GeneratorFn
    chunks: tuple[int, ...] | None  # supported chunk counts; None = any >= 1
    default_chunks: int
    placement: str  # "loop" or "v"
    description: str  # one line: the CLI's and the trainer's help text
    uses_costs: bool = False  # the plan depends on the stage costs (re-planned from profiled costs by the trainer)
    # Peak activation memory the schedule states, per rank, in microbatches of the rank's own share: fn(p, m).
    memory_bound: Callable[[int, int], float] | None = None
    takes_mem_limit: bool = True  # a memory limit shapes or checks the plan (False: the schedule fixes its own)
    # The most compute actions (3 x p x chunks x m) this generator is asked to plan: a search costs more per action
    # than a fixed pattern, so it states a smaller limit here (None: limits.MAX_ACTIONS).
    max_actions: int | None = None

    def stated_memory_bound(self, num_ranks: int, num_microbatches: int) -> float | None:
        """The peak activation memory this schedule states (``None``: none stated)."""
        return None if self.memory_bound is None else float(self.memory_bound(num_ranks, num_microbatches))


_REGISTRY: dict[str, GeneratorSpec] = {}
_loaded = False


def register(
    name: str,
    *,
    chunks: tuple[int, ...] | None = (1,),
    default_chunks: int | None = None,
    placement: str = "loop",
    description: str = "",
    uses_costs: bool = False,
    memory_bound: Callable[[int, int], float] | None = None,
    takes_mem_limit: bool = True,
    max_actions: int | None = None,
) -> Callable[[GeneratorFn], GeneratorFn]:
    """Decorator: add a generator under ``name`` (the fields of ``GeneratorSpec``).  ``uses_costs``: its plan
    depends on the ``costs`` it is given (not only the memory limit), so a profiling window re-plans it from measured
    costs; ``memory_bound(p, m)``: the peak activation memory it states, in microbatches of a rank's share;
    ``max_actions``: its own, smaller limit on ``3 x p x chunks x m`` (``limits``)."""

    def deco(fn: GeneratorFn) -> GeneratorFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"schedule {name!r} is registered twice")
        dc = default_chunks if default_chunks is not None else (chunks[0] if chunks else 1)
        doc = description or (fn.__doc__ or "").strip()
        if placement not in ("loop", "v"):
            raise ValueError(f"schedule {name!r}: placement {placement!r} must be 'loop' or 'v'")
        spec = GeneratorSpec(
            name, fn, chunks, dc, placement, doc, uses_costs, memory_bound, takes_mem_limit, max_actions
        )
        _REGISTRY[name] = spec
        return fn

    return deco


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN_MODULES:
        importlib.import_module(f"{BUILTIN_PACKAGE}.{mod}")


def placement_of(name: str, num_ranks: int, chunks: int) -> tuple[int, ...]:
    """The stage-to-rank map schedule ``name`` uses with ``chunks`` per rank (its V or loop placement)."""
    return v_placement(num_ranks, chunks) if get(name).placement == "v" else loop_placement(num_ranks, chunks)


def available() -> list[str]:
    """Names of every registered schedule, in registration order."""
    _load_builtins()
    return list(_REGISTRY)


def get(name: str) -> GeneratorSpec:
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def check_limits(name: str, num_ranks: int, num_microbatches: int, chunks: int | None = None) -> None:
    """``limits.LimitError`` unless schedule ``name`` may be planned for this shape: ``limits.MAX_RANKS``,
    ``limits.MAX_MICROBATCHES`` and its action limit (its ``max_actions``, else ``limits.MAX_ACTIONS``).  Cheap: run
    it before building anything of size p or m."""
    spec = get(name)
    c = spec.default_chunks if chunks is None else chunks
    limits.check_shape(num_ranks, num_microbatches, c, max_actions=spec.max_actions, what=f"schedule {name!r}")


def generate(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    chunks: int | None = None,
    costs: StageCosts | None = None,
    mem_limit: float | None = None,
) -> Schedule:
    """Generate schedule ``name`` for ``p`` ranks and ``m`` microbatches.

    ``costs`` defaults to F = B = W = 1 for a rank's whole share of layers (each chunk 1/chunks), T_comm = 0 and the
    default memory model (mem_f = 1 per rank's share); ``mem_limit`` is in the units of the memory deltas (per rank).
    Raises ``ValueError`` naming the constraint a shape violates (``limits.LimitError`` for a shape over the size
    limits, checked first, or costs whose sums overflow).
    """
    spec = get(name)
    if num_ranks < 1:
        raise ValueError(f"number of ranks p={num_ranks} must be >= 1")
    if num_microbatches < 1:
        raise ValueError(f"number of microbatches m={num_microbatches} must be >= 1")
    c = spec.default_chunks if chunks is None else chunks
    if spec.chunks is not None and c not in spec.chunks:
        raise ValueError(f"schedule {name!r} supports chunks in {list(spec.chunks)}, got chunks={c}")
    if c < 1:
        raise ValueError(f"chunks={c} must be >= 1")
    check_limits(name, num_ranks, num_microbatches, c)
    if costs is None:
        # F = B = W = 1 and mem_f = 1 for a rank's whole share (each of its chunks 1/c), as the CLI reads them.
        costs = StageCosts.build(num_ranks=num_ranks, chunks=c, stage_to_rank=placement_of(name, num_ranks, c))
    if costs.num_stages != num_ranks * c:
        raise ValueError(
            f"costs are given for {costs.num_stages} virtual stages, but {name!r} with p={num_ranks} and "
            f"chunks={c} has {num_ranks * c}"
        )
    limits.check_costs(costs, num_microbatches)
    key = (name, spec.fn, num_ranks, num_microbatches, c, costs, mem_limit)
    plan = _PLANS.get(key)
    if plan is None:
        plan = spec.fn(num_ranks, num_microbatches, chunks=c, costs=costs, mem_limit=mem_limit)
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def cached_plans() -> int:
    """How many generated plans the cache holds (tests: a plan is generated once per shape, costs and limit)."""
    return len(_PLANS)


_PLAN_CACHE_SIZE = 256
_PLANS: OrderedDict[tuple, Schedule] = OrderedDict()
