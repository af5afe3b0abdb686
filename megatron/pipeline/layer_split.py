"""``--pipeline-layer-split auto``: each virtual stage's transformer layers from the stage planner at start-up.

The planner (``zb_pipeline.schedule.stage_planner``) takes the analytic cost model (``megatron.model.cost_model``:
FLOPs of a layer, the embedding, the head with the loss) and the run's plan shape, and returns the split with the
shortest simulated iteration; ``PipelineLayout`` then carries its layer ranges, so the stage builder, the parallel
context and the checkpoint all read one answer.  Explicit ``--decoder-first/last-pipeline-num-layers`` win (the
split stays ``"explicit"``).  The vocabulary must be known (the head's cost is vocabulary-wide): with real data and
no ``--vocab-size`` the split is planned once the tokenizer is built (``training_setup.resolve_vocab``), before any
stage is built (``megatron.arguments.apply_layer_split``).  ``recompute``: the options each stage may take
(``--recompute-granularity auto``: ``cost_model.recompute_options``); ``mem_limit``: each rank's activation bytes
(``--pipeline-memory-limit-gb``) the plan must fit.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from megatron.config.errors import ConfigError, require
from megatron.config.parallel import ParallelConfig
from megatron.config.recompute import RecomputeConfig
from megatron.model.config import GPTConfig
from megatron.model.cost_model import explicit_recompute_option, model_costs, recompute_options
from megatron.pipeline.layout import PipelineLayout
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.memory import schedule_mem_limit
from zb_pipeline.schedule.profile import Profile
from zb_pipeline.schedule.stage_planner import (
    NO_RECOMPUTE,
    ModelCosts,
    PlannerError,
    RecomputeOption,
    StagePlan,
    evaluate_split,
    even_split,
    plan_stages,
)


def auto_layer_split(
    layout: PipelineLayout,
    model: GPTConfig,
    *,
    schedule: str,
    schedule_file: str | None,
    padded_vocab_size: int,
    micro_batch_size: int,
    num_microbatches: int,
    bytes_per_element: int,
    recompute: RecomputeConfig,
    mem_limit: float | None = None,
    on_cuda: bool = False,
) -> PipelineLayout:
    """``layout`` with the stage planner's split under the analytic cost model (``ConfigError`` if none serves);
    ``recompute``: the run's recompute (``planner_costs``: the options a stage may take, or the one every stage
    takes); ``mem_limit``: bytes per rank; ``on_cuda``: the stages run on a GPU (the analytic activation bytes
    follow its kernels)."""
    if schedule_file is not None:
        raise ConfigError(
            "--pipeline-layer-split auto plans for a registered --pipeline-schedule, not a --schedule-file; drop one"
        )
    costs = planner_costs(
        model,
        recompute,
        padded_vocab_size=padded_vocab_size,
        micro_batch_size=micro_batch_size,
        bytes_per_element=bytes_per_element,
        on_cuda=on_cuda,
    )
    shape = dict(
        schedule=schedule, num_ranks=layout.schedule.num_ranks, num_microbatches=num_microbatches, chunks=layout.chunks
    )
    try:
        plan: StagePlan = plan_stages(costs, **shape, mem_limit=mem_limit)
    except PlannerError as err:
        if err.smallest is None:
            raise ConfigError(f"--pipeline-layer-split auto: {str(err).splitlines()[0]}") from None
        chooses = bool(costs.recompute) and not costs.fixed_recompute  # auto: each stage's recompute is planned
        what = "layer split or recompute choice" if chooses else "layer split"
        hint = "" if chooses else "; or let stages recompute: --recompute-granularity auto"
        raise ConfigError(
            f"--pipeline-memory-limit-gb {mem_limit / GIB:g}: no {what} fits it with {schedule} by the analytic "
            f"model; the smallest limit that works is {_ceil_gib(err.smallest)} GiB{hint}"
        ) from None
    except ValueError as err:
        raise ConfigError(f"--pipeline-layer-split auto: {str(err).splitlines()[0]}") from None
    even = even_split(costs.num_layers, layout.schedule.num_stages)
    even_time = None if even is None else evaluate_split(costs, even, **shape)[0]
    return _runs_plan(layout.with_split(plan.layers, split="auto", plan=plan, even=even_time), plan, mem_limit)


def planner_recompute(
    model: GPTConfig, recompute: RecomputeConfig, *, micro_batch_size: int, bytes_per_element: int, on_cuda: bool
) -> tuple[RecomputeOption, ...]:
    """The recompute options the stage planner plans with: ``--recompute-granularity auto``'s choices, an explicit
    recompute's one option (every stage takes it: ``ModelCosts.fixed_recompute``), or none."""
    shape = dict(micro_batch_size=micro_batch_size, bytes_per_element=bytes_per_element, on_cuda=on_cuda)
    if recompute.auto:
        return recompute_options(model, **shape)
    if not recompute.enabled:
        return ()
    option = explicit_recompute_option(
        model, granularity=recompute.granularity, method=recompute.method, num_layers=recompute.num_layers, **shape
    )
    return (option,)


def planner_costs(
    model: GPTConfig,
    recompute: RecomputeConfig,
    *,
    padded_vocab_size: int,
    micro_batch_size: int,
    bytes_per_element: int,
    on_cuda: bool,
) -> ModelCosts:
    """The analytic model the stage planner plans with: ``planner_recompute``'s options, and an explicit recompute
    (not auto) fixed on every stage (``ModelCosts.fixed_recompute``)."""
    options = planner_recompute(
        model, recompute, micro_batch_size=micro_batch_size, bytes_per_element=bytes_per_element, on_cuda=on_cuda
    )
    costs = model_costs(
        model,
        padded_vocab_size=padded_vocab_size,
        micro_batch_size=micro_batch_size,
        bytes_per_element=bytes_per_element,
        recompute=options,
        on_cuda=on_cuda,
    )
    return dataclasses.replace(costs, fixed_recompute=bool(options) and not recompute.auto)


def plans_within_bytes(schedule: str) -> bool:
    """Whether the runtime generates ``schedule``'s plan under ``--pipeline-memory-limit-gb`` in bytes: the
    memory-capped schedules whose plan depends on the costs -- zb-auto (its memory limit) and the V schedules (their
    cap, a ratio to 1F1B, lowered to the limit where it is above).  The others fix their plan; the stage planner
    checks their peak against the limit."""
    spec = registry.get(schedule)
    return spec.uses_costs and (spec.takes_mem_limit or spec.placement == "v")


def _runs_plan(layout: PipelineLayout, plan: StagePlan, mem_limit: float | None) -> PipelineLayout:
    """Under a byte limit, a schedule that plans within it (``plans_within_bytes``) runs from the start the plan
    for the planner's analytic costs with the limit in bytes (zb-auto: with ``--zero-bubble-max-pending-backward``'s
    count converted by the same costs, the smaller) -- for zb-auto the plan the planner simulated."""
    name = layout.schedule.name
    if mem_limit is None or not plans_within_bytes(name) or layout.plans.fixed is not None:
        return layout
    count = layout.plans.mem_limit if registry.get(name).takes_mem_limit else None
    limit = schedule_mem_limit(plan.costs, layout.schedule.stage_to_rank, limit_bytes=mem_limit, microbatches=count)
    plans = layout.plans.replanned(costs=plan.costs, mem_limit=limit)
    return dataclasses.replace(layout, plans=plans, schedule=plans.schedule(layout.schedule.num_microbatches))


GIB = 2**30


def _ceil_gib(nbytes: float) -> str:
    """``nbytes`` in GiB, rounded up at 6 significant digits (so the value named works as a limit)."""
    gib = nbytes / GIB
    digits = 5 - math.floor(math.log10(gib)) if gib > 0 else 0
    return f"{math.ceil(gib * 10**digits) / 10**digits:g}"


def measured_limit_error(
    mem_limit: float, need: float, *, window: tuple[int, int], finding: str, hint: str = ""
) -> ConfigError:
    """The one line when the memory measured in the profiling window (iterations ``window``) proves
    ``--pipeline-memory-limit-gb`` impossible: ``finding`` says what does not fit, ``need`` (bytes per rank) is the
    smallest limit with which the run would have gone on."""
    return ConfigError(
        f"--pipeline-memory-limit-gb {mem_limit / GIB:g}: by the activation memory measured in the profiling window "
        f"(iterations {window[0]}-{window[1]}), {finding}; the smallest limit that works is {_ceil_gib(need)} GiB: "
        f"raise --pipeline-memory-limit-gb{hint}"
    )


def memory_limit_bytes(parallel: ParallelConfig) -> float | None:
    """``--pipeline-memory-limit-gb`` in bytes per rank (None: no limit)."""
    return None if parallel.memory_limit_gb is None else parallel.memory_limit_gb * GIB


def wants_auto_split(layout: PipelineLayout | None, parallel: ParallelConfig, virtual_stage_layers: int | None) -> bool:
    """Whether ``--pipeline-layer-split auto`` still has to plan ``layout`` (pp > 1, no explicit split, not planned
    yet); ``ConfigError`` when it cannot (``--num-layers-per-virtual-pipeline-stage`` fixes the layers already)."""
    if layout is None or parallel.layer_split != "auto" or layout.split != "even":
        return False
    require(
        virtual_stage_layers is None,
        "--pipeline-layer-split auto chooses each virtual stage's layers: drop --num-layers-per-virtual-pipeline-stage "
        "(the schedule's default chunks apply) or the auto split",
    )
    return True


def measured_layer_split(
    profile: Profile,
    layout: PipelineLayout,
    *,
    num_microbatches: int,
    mem_limit: float | None = None,
    recompute: tuple[str, ...] | None = None,
) -> MeasuredSplit:
    """The stage planner's split -- and, when ``profile``'s parts carry recompute options (``--recompute-granularity
    auto``), each stage's recompute choice -- under ``profile``'s per-part costs (its ``parts`` entry), for the
    run's schedule and shape within ``mem_limit`` (bytes per rank, the window's), beside the current split's
    simulated iteration under the same costs.  ``recompute``: the current choice per virtual stage (None: none).
    Deterministic in ``profile``: every rank that holds the agreed profile gets the same answer.  ``ValueError``
    when no candidate fits the limit."""
    costs = profile.model_costs()
    sched = layout.schedule
    shape = dict(
        schedule=sched.name, num_ranks=sched.num_ranks, num_microbatches=num_microbatches, chunks=layout.chunks
    )
    plan = plan_stages(costs, mem_limit=mem_limit, **shape)

    def simulated(model: ModelCosts, layers: tuple[int, ...], choice: tuple[str, ...] | None) -> float | None:
        """A candidate's iteration (zb-auto planned within the limit, as the planner did); None: it cannot."""
        try:
            return evaluate_split(model, layers, recompute=choice, mem_limit=mem_limit, **shape)[0]
        except ValueError:
            return None

    current = simulated(costs, layout.layers_per_stage, recompute)
    # the prediction: the window's means (a sum of actions and gaps), where present; the medians plan
    means = profile.parts.get("predict") if isinstance(profile.parts, dict) else None
    predict = costs if means is None else ModelCosts.from_dict(means)
    even = even_split(costs.num_layers, sched.num_stages)
    even_time = None if even is None else simulated(predict, even, None)
    return MeasuredSplit(
        plan=plan,
        current=layout.layers_per_stage,
        current_iteration=math.inf if current is None else current,
        mem_limit=mem_limit,
        predicted=simulated(predict, plan.layers, plan.recompute),
        even=even,
        even_iteration=even_time,
        step=predict.step_time(plan.layers, sched.stage_to_rank),
        current_recompute=None if recompute is None else tuple(recompute),
        fixed_recompute=costs.fixed_recompute,
    )


@dataclass(frozen=True)
class MeasuredSplit:
    """The split (and recompute choice) re-decided from measured costs at the end of the profiling window, with the
    predicted iteration (simulated under the measured costs plus the measured time per iteration outside the
    pipeline's actions) of the chosen, the current and the even split."""

    plan: StagePlan
    current: tuple[int, ...]
    current_iteration: float
    mem_limit: float | None = None  # bytes per rank the plan was chosen within (the window's memory limit)
    predicted: float | None = None  # the chosen split's predicted iteration (ms; None: plan.iteration)
    even: tuple[int, ...] | None = None  # the even split (None: the layers do not divide evenly)
    even_iteration: float | None = None  # its predicted iteration (ms)
    step: float = 0.0  # ms of the chosen split's predicted iteration outside the pipeline's actions
    # --recompute-granularity auto: the recompute choice per virtual stage in force (None: not auto, not decided)
    current_recompute: tuple[str, ...] | None = None
    fixed_recompute: bool = False  # an explicit recompute, in force on every stage before and after

    @property
    def moves_layers(self) -> bool:
        return tuple(self.plan.layers) != tuple(self.current)

    @property
    def recompute_changes(self) -> bool:
        if self.fixed_recompute:
            return False
        current = self.current_recompute or (NO_RECOMPUTE,) * len(self.current)
        return tuple(self.plan.recompute) != tuple(current)

    @property
    def changes(self) -> bool:
        return self.moves_layers or self.recompute_changes

    def summary(self) -> str:
        """The one log line of the decision (``PREDICTION`` parses it back)."""
        predicted = self.plan.iteration if self.predicted is None else self.predicted
        text = f"layer split from measured per-part costs: {list(self.plan.layers)} (predicted iteration "
        text += f"{predicted:.2f} ms, "
        if math.isfinite(self.current_iteration) and self.current_iteration > 0:
            text += f"{self.plan.iteration / self.current_iteration - 1:+.1%} against the current {list(self.current)}"
        else:
            text += f"the current {list(self.current)} does not fit the memory limit"
        if self.even_iteration is not None:
            ratio = predicted / self.even_iteration
            text += f"; even split {list(self.even)}: {self.even_iteration:.2f} ms, chosen / even {ratio:.3f}"
        text += f"; {self.step:.2f} ms per iteration outside the pipeline's actions)"
        if self.current_recompute is not None:  # decided with the split
            chosen, was = ", ".join(self.plan.recompute), ", ".join(self.current_recompute)
            text += f"; --recompute-granularity auto: recompute per stage {chosen} (was {was})"
        if self.moves_layers:
            text += "; moving the layers at this iteration boundary"
        elif self.recompute_changes:
            text += "; changing the recompute at this iteration boundary"
        return text


# The decision's log line: chosen split, its predicted ms, and (when the layers divide evenly) the even split's ms.
PREDICTION = re.compile(
    r"layer split from measured per-part costs: \[([\d, ]+)\] \(predicted iteration ([0-9.]+) ms"
    r"(?:.*?even split \[[\d, ]+\]: ([0-9.]+) ms)?"
)
