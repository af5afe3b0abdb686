"""Pipeline-schedule flags -> ``ScheduleConfig``: our own flags and the reference zero-bubble fork's, one mapping.

Flags (``add_schedule_args`` adds them to an argparse parser; ``ScheduleConfig.from_flags`` reads the parsed values
from any mapping or namespace keyed by argparse dest names):

    --pipeline-schedule NAME                  any schedule in ``zb_pipeline.schedule.registry`` (``zb-schedule list``)
    --schedule-file plan.json                 a plan exported by ``zb-schedule simulate --export`` (wins over the name)
    --num-layers-per-virtual-pipeline-stage N  chunks = num_layers / (pp x N)

The reference fork's flags, so its users' scripts run unchanged:

    --enable-zero-bubble                      -> zb-auto
    --zero-bubble-v-schedule                  -> zb-v, and with
    --zero-bubble-v-schedule-mem-setup {zb,half,min}  -> zb-v / v-half / v-min
    --zero-bubble-max-pending-backward N      -> zb-auto's memory limit: N microbatches' activations per rank (in the
                                                 generators' units, mem_f = 1 per rank's share); ignored by V schedules
    --zero-bubble-max-pending-backward auto   -> the limit that fits --zero-bubble-adaptive-memory-limit-percentile
                                                 (default 85) of device memory; resolved by the profiler at run time
                                                 (``mem_limit_auto``), no limit until then
    --zero-bubble-pipeline-timers-start-iter / -end-iter  -> the profiling window: at its end zb-auto, zb-h2, zb-v,
                                                 v-half, v-min and interleaved-zb are re-planned from measured costs;
                                                 with --enable-zero-bubble / --zero-bubble-v-schedule the fork's
                                                 default window, iterations 100 to 110, applies when they are absent
    --enable-exactly-numeric-match            accepted: our runtime is exact by construction (each stage's weight
                                                 gradients accumulate in microbatch order)
    --enable-optimizer-post-validation        the optimizer steps without waiting for the other pipeline stages'
                                                 gradient statistics and rolls back exactly when they prove it wrong
                                                 (``megatron.pipeline.post_validated_step``); pp > 1

An explicit ``--pipeline-schedule`` that contradicts a fork flag is an error (one line naming both).  Without any
flag the schedule is ``zb-h1`` (``interleaved-1f1b`` when --num-layers-per-virtual-pipeline-stage is given): it has
1F1B's peak activation memory (p microbatches on the first rank), the same losses bit for bit (weight gradients still
accumulate in microbatch order), and a bubble of about a third of 1F1B's -- there is no case where 1F1B is the better
default.  Every built-in schedule but dualpipev (m >= 2p) serves m < p (a short iteration simply has a larger bubble);
a shape a plan cannot serve (dualpipev with m < 2p, a plan file for another p or m, a chunk count the schedule does
not support, layers that do not split over the virtual stages, a memory limit below one microbatch) is a
``ConfigError`` at start-up, before any communication.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.config.errors import ConfigError, require
from zb_pipeline.runtime.emulate import parse_stage_scale
from zb_pipeline.runtime.runtime import PlanSource
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.plan_file import load_plan

DEFAULT_SCHEDULE = "zb-h1"
FORK_TIMERS_WINDOW = (100, 110)  # the zero-bubble fork's --zero-bubble-pipeline-timers-start/end-iter defaults
V_MEM_SETUP = {"zb": "zb-v", "half": "v-half", "min": "v-min"}  # the fork's V flag -> our schedule names


@dataclass(frozen=True)
class ScheduleConfig:
    """Which plan the pipeline runs and how the runtime executes it."""

    schedule: str = "zb-h1"
    schedule_file: str | None = None
    num_layers_per_virtual_stage: int | None = None
    mem_limit: float | None = None  # zb-auto: per rank, in microbatches' activations
    mem_limit_auto: bool = False  # --zero-bubble-max-pending-backward auto
    adaptive_memory_percentile: float = 85.0
    timers_start_iter: int | None = None
    timers_end_iter: int | None = None
    exactly_numeric_match: bool = False
    optimizer_post_validation: bool = False
    p2p_check: bool = False  # the P2P checking mode (tests on gloo)
    trace_path: str | None = None  # --pipeline-trace
    emulate_compute: str | None = None  # --emulate-compute F,B,W[,OPT]
    emulate_stage_scale: str | None = None  # --emulate-stage-scale s0,s1,... (one factor per pipeline rank)

    def __post_init__(self) -> None:
        known = registry.available()
        require(self.schedule in known, f"--pipeline-schedule={self.schedule!r} is not one of {', '.join(known)}")
        require(self.mem_limit is None or self.mem_limit > 0, f"memory limit {self.mem_limit} must be > 0")
        require(
            0 < self.adaptive_memory_percentile <= 100,
            f"--zero-bubble-adaptive-memory-limit-percentile={self.adaptive_memory_percentile} must be in (0, 100]",
        )
        require(
            self.emulate_stage_scale is None or self.emulate_compute is not None,
            f"--emulate-stage-scale {self.emulate_stage_scale} scales emulated compute: add --emulate-compute F,B,W",
        )

    def stage_scale(self, pp: int) -> tuple[float, ...]:
        """``--emulate-stage-scale`` as one factor per pipeline rank (all 1 without it); ``ConfigError`` naming the
        fix for a wrong count or value."""
        if self.emulate_stage_scale is None:
            return (1.0,) * pp
        try:
            return parse_stage_scale(self.emulate_stage_scale, pp)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    # -- shape ----------------------------------------------------------------------------------------------
    def chunks(self, *, num_layers: int, pp: int) -> int:
        """Virtual stages per rank for this schedule on ``pp`` ranks (a plan file's own count)."""
        if self.schedule_file is not None:
            return self._load_file().chunks
        spec = registry.get(self.schedule)
        per = self.num_layers_per_virtual_stage
        if spec.placement == "v":  # a V runs a fixed chunk count; the flag, if given, must agree with it
            c = spec.default_chunks
            if per is not None:
                require(
                    num_layers == c * pp * per,
                    f"{self.schedule} runs {c} chunks per rank: --num-layers-per-virtual-pipeline-stage {per} "
                    f"needs --num-layers={c * pp * per}",
                )
            return c
        if per is None:
            return spec.default_chunks
        require(
            num_layers % (pp * per) == 0,
            f"--num-layers={num_layers} must be a multiple of pp x --num-layers-per-virtual-pipeline-stage = "
            f"{pp * per}",
        )
        return num_layers // (pp * per)

    def placement(self) -> str:
        """``"v"`` or ``"loop"``: where the virtual stages live (a plan file says it itself)."""
        if self.schedule_file is not None:
            return self._load_file().placement
        return registry.get(self.schedule).placement

    def _load_file(self):
        try:
            return load_plan(self.schedule_file)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--schedule-file {self.schedule_file}: {str(err).splitlines()[0]}") from None

    # -- the plan ---------------------------------------------------------------------------------------------
    def plan_source(self, *, pp: int, num_layers: int, costs: Any = None) -> PlanSource:
        """Where the runtime takes its plans from: the registry's schedule for this run (any microbatch count), or
        the plan file."""
        if self.schedule_file is not None:
            return PlanSource.of(self._load_file())
        chunks = self.chunks(num_layers=num_layers, pp=pp)
        mem_limit = self.mem_limit if registry.get(self.schedule).takes_mem_limit else None
        return PlanSource(self.schedule, num_ranks=pp, chunks=chunks, costs=costs, mem_limit=mem_limit)

    def build_schedule(
        self, *, pp: int, num_microbatches: int, num_layers: int, costs: Any = None, source: PlanSource | None = None
    ):
        """The ``Schedule`` to run (generated once: the registry caches it); ``ConfigError`` with the fix on bad
        shapes.  ``source``: this config's ``plan_source`` when the caller has it (a plan file is then read once)."""
        if source is None:
            source = self.plan_source(pp=pp, num_layers=num_layers, costs=costs)
        if self.schedule_file is not None:
            plan = source.fixed
            require(
                plan.num_ranks == pp and plan.num_microbatches == num_microbatches,
                f"--schedule-file {self.schedule_file} is for p={plan.num_ranks}, m={plan.num_microbatches}, but the "
                f"run has --pipeline-model-parallel-size={pp} and {num_microbatches} microbatches",
            )
            return plan
        try:
            return source.schedule(num_microbatches)
        except ValueError as err:
            raise ConfigError(f"--pipeline-schedule {self.schedule}: {str(err).splitlines()[0]}") from None

    # -- flags --------------------------------------------------------------------------------------------------
    @classmethod
    def from_flags(cls, values: Mapping[str, Any] | argparse.Namespace) -> ScheduleConfig:
        """Map parsed flag values (argparse dest names; missing ones take their defaults) onto a config."""
        v = vars(values) if isinstance(values, argparse.Namespace) else dict(values)

        def get(name: str, default: Any = None) -> Any:
            value = v.get(name, default)
            return default if value is None else value

        explicit = v.get("pipeline_schedule")
        implied = None
        if get("enable_zero_bubble", False):
            implied, why = "zb-auto", "--enable-zero-bubble"
        if get("zero_bubble_v_schedule", False):
            setup = get("zero_bubble_v_schedule_mem_setup", "zb")
            require(setup in V_MEM_SETUP, f"--zero-bubble-v-schedule-mem-setup={setup!r} must be zb, half or min")
            implied, why = V_MEM_SETUP[setup], f"--zero-bubble-v-schedule (mem setup {setup})"
        if explicit is not None and implied is not None and explicit != implied:
            raise ConfigError(f"--pipeline-schedule {explicit} contradicts {why}, which means {implied}; drop one")
        per = v.get("num_layers_per_virtual_pipeline_stage")
        schedule = explicit or implied or ("interleaved-1f1b" if per is not None else DEFAULT_SCHEDULE)

        pending = v.get("zero_bubble_max_pending_backward")
        mem_limit, auto = None, False
        if pending is not None:
            if str(pending).strip().lower() == "auto":
                auto = True
            else:
                try:
                    mem_limit = float(pending)
                except ValueError:
                    raise ConfigError(
                        f"--zero-bubble-max-pending-backward={pending!r} must be a number of microbatches or 'auto'"
                    ) from None
        start, end = v.get("zero_bubble_pipeline_timers_start_iter"), v.get("zero_bubble_pipeline_timers_end_iter")
        if implied is not None:  # the fork's flags: its default window where the script gives none
            start = FORK_TIMERS_WINDOW[0] if start is None else start
            end = FORK_TIMERS_WINDOW[1] if end is None else end
        return cls(
            schedule=schedule,
            schedule_file=v.get("schedule_file"),
            num_layers_per_virtual_stage=per,
            mem_limit=mem_limit,
            mem_limit_auto=auto,
            adaptive_memory_percentile=float(get("zero_bubble_adaptive_memory_limit_percentile", 85.0)),
            timers_start_iter=start,
            timers_end_iter=end,
            exactly_numeric_match=bool(get("enable_exactly_numeric_match", False)),
            optimizer_post_validation=bool(get("enable_optimizer_post_validation", False)),
            p2p_check=bool(get("pipeline_p2p_check", False)),
            trace_path=v.get("pipeline_trace"),
            emulate_compute=v.get("emulate_compute"),
            emulate_stage_scale=v.get("emulate_stage_scale"),
        )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def schedule_flags() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(flag, argparse keyword arguments): the table a flag parser adds (``add_schedule_args`` does it for argparse).
    The schedule names are the registry's at the time the parser is built."""
    return (
        ("--pipeline-schedule", dict(choices=tuple(registry.available()), default=None, help=_schedule_help())),
    ) + (_OTHER_FLAGS)


def _schedule_help() -> str:
    return f"pipeline schedule (default {DEFAULT_SCHEDULE})"


_OTHER_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--schedule-file", dict(default=None, help="run this plan file (zb-schedule simulate --export)")),
    ("--num-layers-per-virtual-pipeline-stage", dict(type=_positive_int, default=None, help="layers per chunk")),
    ("--enable-zero-bubble", dict(action="store_true", help="zero-bubble fork flag: zb-auto")),
    ("--zero-bubble-v-schedule", dict(action="store_true", help="zero-bubble fork flag: zb-v (see mem setup)")),
    ("--zero-bubble-v-schedule-mem-setup", dict(choices=tuple(V_MEM_SETUP), default="zb", help="zb, half or min")),
    ("--zero-bubble-max-pending-backward", dict(default=None, help="zb-auto memory limit in microbatches, or auto")),
    ("--zero-bubble-adaptive-memory-limit-percentile", dict(type=float, default=85.0, help="with ...=auto")),
    ("--zero-bubble-pipeline-timers-start-iter", dict(type=int, default=None, help="profiling window start")),
    ("--zero-bubble-pipeline-timers-end-iter", dict(type=int, default=None, help="profiling window end")),
    ("--enable-exactly-numeric-match", dict(action="store_true", help="accepted (always exact here)")),
    (
        "--enable-optimizer-post-validation",
        dict(action="store_true", help="step without the cross-stage wait; exact rollback when validation fails"),
    ),
    ("--pipeline-trace", dict(default=None, help="write a Chrome/Perfetto trace of what every rank executed")),
    ("--emulate-compute", dict(default=None, help="F,B,W[,OPT] ms: sleep instead of computing (real P2P)")),
    ("--emulate-stage-scale", dict(default=None, help="s0,s1,...: pipeline rank r's emulated F,B,W times s_r")),
    ("--pipeline-p2p-check", dict(action="store_true", help="check the strict P2P order at run time (gloo tests)")),
)


def schedule_flag_specs() -> list[tuple[str, dict[str, Any]]]:
    """``schedule_flags()`` as keyword arguments of the trainer's flag table (``megatron.flag_table.FlagTable.add``)."""
    out = []
    for flag, kwargs in schedule_flags():
        switch = kwargs.get("action") == "store_true"
        spec: dict[str, Any] = {"help": kwargs["help"], "switch": switch}
        if not switch:
            spec.update(type=kwargs.get("type"), default=kwargs.get("default"), choices=kwargs.get("choices"))
        out.append((flag, spec))
    return out


def add_schedule_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the pipeline-schedule flags (an argument group) to ``parser``."""
    group = parser.add_argument_group("pipeline schedule")
    for flag, kwargs in schedule_flags():
        group.add_argument(flag, **kwargs)
    return parser
