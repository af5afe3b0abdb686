"""``PipelineLayout``: what a pipelined run's shape resolves to, computed once while the flags are parsed.

The plan source the runtime draws plans from, the plan for the run's microbatch count (generated once; the
registry caches it), and each virtual stage's transformer layers.  ``RunConfig.pipeline_layout`` carries it, so the
parallel context (chunks, placement), the stage builder and the runtime read one answer instead of re-deriving it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.config.parallel import split_layers
from megatron.pipeline.schedule_flags import ScheduleConfig
from zb_pipeline.runtime.runtime import PlanSource
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.stage_planner import StagePlan


@dataclass(frozen=True)
class PipelineLayout:
    plans: PlanSource
    schedule: Schedule  # the plan for the run's microbatch count
    layer_ranges: tuple[range, ...]  # virtual stage -> its transformer layers
    split: str = "even"  # how the layers were split: "even", "explicit" (--decoder-first/last-...) or "auto"
    split_plan: StagePlan | None = None  # "auto": the stage planner's answer (its predicted iteration)
    even_iteration: float | None = None  # "auto": the even split's simulated iteration under the same model

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.layer_ranges)

    def with_split(
        self, sizes: Sequence[int], *, split: str, plan: StagePlan | None = None, even: float | None = None
    ) -> PipelineLayout:
        """The same plan with ``sizes`` layers per virtual stage (the stage planner's)."""
        return dataclasses.replace(
            self, layer_ranges=ranges_of(sizes), split=split, split_plan=plan, even_iteration=even
        )

    @property
    def chunks(self) -> int:
        return self.schedule.chunks

    @property
    def placement(self) -> str:
        return self.schedule.placement

    def context_layout(self) -> dict[str, object]:
        """``chunks``/``placement`` keyword arguments of ``ParallelContext.initialize``."""
        return {"chunks": self.chunks, "placement": self.placement}


def pipeline_layout(
    config: ScheduleConfig,
    *,
    pp: int,
    num_microbatches: int,
    num_layers: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    allow_padding: bool = False,
) -> PipelineLayout:
    """Generate the plan and split the layers over its virtual stages; ``ConfigError`` if the shape does not fit
    (called while parsing the flags, so a bad shape exits 2 before any rank starts communicating)."""
    config.stage_scale(pp)  # a wrong --emulate-stage-scale exits 2 here too
    plans = config.plan_source(pp=pp, num_layers=num_layers)
    schedule = config.build_schedule(pp=pp, num_microbatches=num_microbatches, num_layers=num_layers, source=plans)
    sizes = split_layers(
        num_layers, schedule.num_stages, first=first_stage_layers, last=last_stage_layers, allow_padding=allow_padding
    )
    split = "even" if first_stage_layers is None and last_stage_layers is None else "explicit"
    return PipelineLayout(plans, schedule, ranges_of(sizes), split=split)


def ranges_of(sizes: Sequence[int]) -> tuple[range, ...]:
    """Contiguous layer ranges of stages holding ``sizes`` layers, first to last."""
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)
