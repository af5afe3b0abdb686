"""Re-planning from a profile: generate a plan from measured costs and switch the running executor to it.

``regenerate`` plans schedule ``name`` from a ``Profile``'s per-stage costs and predicts it with the simulator
(``Replan``); ``switch_plan`` makes an executor run another plan from its next iteration on; ``adaptive_mem_limit``
is the memory left for activations on the GPU.  ``WindowReplanner`` ties it together for a trainer: profile a
window of iterations (``ActionProfiler``), regenerate at its end, switch the plan at the iteration boundary on every
rank alike and log the predicted bubble rate and memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zb_pipeline import comm
from zb_pipeline.runtime.profiler import ActionProfiler
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.post_validation_pass import add_post_validation, has_post_validation
from zb_pipeline.schedule.profile import Profile, costs_for, fuses_backward, mem_limit_for_microbatches
from zb_pipeline.schedule.simulate import SimResult, simulate
from zb_pipeline.schedule.validate import check_and_lower, validate_lowered

if TYPE_CHECKING:
    from zb_pipeline.runtime.executor import PipelineExecutor
    from zb_pipeline.schedule.lowering import LoweredSchedule

__all__ = [
    "MeasuredLimitError",
    "Replan",
    "ReplanError",
    "WindowReplanner",
    "adaptive_mem_limit",
    "regenerate",
    "switch_plan",
]


class ReplanError(ValueError):
    """The profiling window's measured costs leave no plan of the run's schedule; ``str()`` is one line naming the
    problem and what to change.  Every rank holds the same agreed profile, so every rank raises it."""


class MeasuredLimitError(ReplanError):
    """At the end of the profiling window no plan of the schedule fits the memory limit under the measured
    activations.  ``str()`` is one line naming the limit (``flag``), the window and the generator's answer (which
    names the smallest limit that works).  Every rank holds the same profile and limit, so every rank raises it."""

    def __init__(self, message: str, *, limit: float) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class Replan:
    """A plan generated from a profile, with the simulator's prediction under the profiled costs."""

    schedule: Schedule
    costs: StageCosts
    result: SimResult
    mem_limit: float | None

    def summary(self) -> str:
        mib = ", ".join(f"{v / 2**20:.1f}" for v in self.result.peak_memory)
        limit = "none" if self.mem_limit is None else f"{self.mem_limit / 2**20:.1f} MiB"
        s = self.schedule
        return (
            f"replanned {s.name} (p={s.num_ranks}, m={s.num_microbatches}) from profiled costs: predicted iteration "
            f"{self.result.makespan:.2f} ms, bubble rate {self.result.bubble_rate:.1%}, peak activation memory per "
            f"rank [{mib}] MiB (limit {limit}), T_comm {self.costs.comm:.3f} ms"
        )


def regenerate(
    profile: Profile,
    num_microbatches: int,
    *,
    name: str = "zb-auto",
    chunks: int | None = None,
    mem_limit: float | None = None,
) -> Replan:
    """Generate schedule ``name`` from the profiled per-stage costs; ``mem_limit`` is per rank in bytes.

    A profile of fused ``BW`` only (a 1F1B-like run) plans a schedule that fuses its backward too from the
    measured BW (``Profile.to_stage_costs(fused=True)``); a plan that splits B and W on a stage profiled fused
    needs their ratio: from the stages that ran them apart or the per-part model (``Profile._split``), else a
    ``ValueError`` naming the profile to take."""
    fused = not profile.splits_backward
    c, costs = costs_for(profile, name, chunks=chunks, fused=fused)
    sched = registry.generate(name, profile.num_ranks, num_microbatches, chunks=c, costs=costs, mem_limit=mem_limit)
    if fused and not fuses_backward(sched):  # B and W apart from the per-part model, else its ValueError
        c, costs = costs_for(profile, name, chunks=chunks)
        sched = registry.generate(name, profile.num_ranks, num_microbatches, chunks=c, costs=costs, mem_limit=mem_limit)
    return Replan(sched, costs, simulate(sched, costs), mem_limit)


def adaptive_mem_limit(percentile: float = 85.0, device: Any = None) -> float | None:
    """``--zero-bubble-max-pending-backward auto``: bytes left for activations within ``percentile`` % of the GPU
    (total * percentile / 100 minus what is allocated now, between iterations: parameters, gradients, optimizer).
    ``None`` on CPU (no device limit to fit)."""
    if not 0 < percentile <= 100:
        raise ValueError(f"--zero-bubble-adaptive-memory-limit-percentile {percentile} must be in (0, 100]")
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0.0, total * percentile / 100.0 - torch.cuda.memory_allocated(device))


def switch_plan(executor: PipelineExecutor, schedule: Schedule) -> LoweredSchedule:
    """Make ``executor`` run ``schedule`` from its next iteration on (call between iterations).

    The new plan must keep every rank's stages and the microbatch count (stage modules, P2P boundaries and the
    trainer's data stay as they are); it is validated and lowered here, so a bad plan fails before any transfer.
    """
    old = executor.lowered.schedule
    if schedule.num_microbatches != old.num_microbatches:
        raise ValueError(
            f"cannot switch from {old.name!r} to {schedule.name!r}: the new plan must keep p={old.num_ranks}, "
            f"m={old.num_microbatches} and the placement {list(old.stage_to_rank)}"
        )
    lowered = check_and_lower(schedule)
    if has_post_validation(executor.lowered):  # keep the optimizer post-validation chain of the running plan
        lowered = add_post_validation(lowered)
        validate_lowered(lowered)
    executor.load_plan(lowered)  # checks p and the placement
    return lowered


@dataclass
class WindowReplanner:
    """Profile ``[start_iter, end_iter)``, then regenerate and switch the plan at the iteration boundary.

    Call ``after_iteration(iteration)`` after every ``executor.run``; at ``end_iter - 1`` it gathers the profile
    (collective over ``group``), regenerates ``name`` with the memory limit (bytes, or ``"auto"`` for
    ``percentile`` % of the GPU, and/or ``mem_limit_microbatches`` microbatches: the smaller), switches the executor
    and logs one line.  It returns the ``Replan`` then (the trainer updates its own copies of the plan), ``None``
    otherwise.  Every rank of the job calls it: the profile of global rank ``broadcast_src`` (one collective over
    the default group) and the smallest memory limit are used everywhere, so all tensor- and data-parallel replicas
    switch to one plan.
    """

    executor: PipelineExecutor
    start_iter: int
    end_iter: int
    name: str = "zb-auto"
    mem_limit: float | str | None = None
    mem_limit_microbatches: float | None = None
    percentile: float = 85.0
    group: Any = None
    save_path: str | None = None
    log: Callable[[str], None] = print
    broadcast_src: int | None = 0  # global rank whose profile every rank adopts (None: keep the group's own)
    limit_flag: str = "the memory limit"  # how the user gave the limit (named by ``MeasuredLimitError``)
    stage_layers: tuple[int, ...] = ()  # layers per virtual stage, recorded in the profile (the stage planner's input)
    # Collective on every rank after the gather: the profile's ``parts`` entry (per-part costs measured by the
    # model's own timer, e.g. megatron.pipeline.part_timer), or None; it travels with the agreed profile.
    parts: Callable[[Profile], dict[str, Any] | None] | None = None
    # Called on every rank with the agreed profile, after the plan switch (e.g. the stage planner's re-decision);
    # what it returns is kept in ``agreed``.
    on_agreed: Callable[[Profile], Any] | None = None
    agreed: Any = field(default=None, init=False)
    profiler: ActionProfiler | None = field(default=None, init=False)
    profile: Profile | None = field(default=None, init=False)
    replan: Replan | None = field(default=None, init=False)
    runtime: Any = field(default=None, init=False)  # set by ``attach``

    def __post_init__(self) -> None:
        if self.end_iter <= self.start_iter:
            raise ValueError(
                f"--zero-bubble-pipeline-timers-start-iter {self.start_iter} must be below -end-iter {self.end_iter}"
            )
        self.profiler = ActionProfiler(self.executor, start_iter=self.start_iter, end_iter=self.end_iter)

    def resolve_mem_limit(self, profile: Profile) -> float | None:
        """The plan's limit in bytes per rank: ``mem_limit`` (bytes, or the device's share for ``"auto"``) and
        ``mem_limit_microbatches`` converted with the measured per-microbatch bytes, the smaller of those given."""
        if self.mem_limit == "auto":
            limit = adaptive_mem_limit(self.percentile, self.profiler.device if self.profiler else None)
        else:
            limit = None if self.mem_limit is None else float(self.mem_limit)
        if self.mem_limit_microbatches is None:
            return limit
        pending = mem_limit_for_microbatches(profile, self.mem_limit_microbatches)
        return pending if limit is None else min(limit, pending)

    def attach(self, runtime: Any) -> None:
        """Run inside ``runtime`` (a ``PipelineRuntime`` over this replanner's executor): called after each of its
        iterations, the switch goes through ``runtime.switch_plan`` so the runtime keeps owning its plans."""
        if runtime.executor is not self.executor:
            raise ValueError("attach the WindowReplanner to the runtime whose executor it profiles")
        self.runtime = runtime
        runtime.after_iteration.append(self.after_iteration)

    def after_iteration(self, iteration: int) -> Replan | None:
        if iteration != self.end_iter - 1 or self.replan is not None:
            return None
        profile = self.profiler.gather(group=self.group)
        if self.stage_layers:
            profile = dataclasses.replace(profile, stage_layers=tuple(self.stage_layers))
        if self.parts is not None:
            profile = dataclasses.replace(profile, parts=self.parts(profile))
        self.profiler.detach()  # the window is over: its wrappers and hooks come out, its samples stay
        profile, limit = self._agree(profile, self.resolve_mem_limit(profile))
        self.profile = profile
        current = self.executor.lowered.schedule  # keep its chunks (interleaved-zb may run 2..8)
        try:
            replan = regenerate(
                profile, current.num_microbatches, name=self.name, chunks=current.chunks, mem_limit=limit
            )
        except ValueError as err:
            first = str(err).splitlines()[0]
            if limit is None:
                raise ReplanError(
                    f"the re-plan of {self.name} at the end of the profiling window (iterations {self.start_iter}-"
                    f"{self.end_iter - 1}) failed: {first}"
                ) from None
            raise MeasuredLimitError(
                f"{self.limit_flag} ({limit:.0f} bytes per rank): the activations measured in the profiling window "
                f"(iterations {self.start_iter}-{self.end_iter - 1}) leave no {self.name} plan within it: {first}",
                limit=limit,
            ) from None
        if self.runtime is not None:
            self.runtime.switch_plan(self.runtime.plans.replanned(costs=replan.costs, mem_limit=limit))
        else:
            switch_plan(self.executor, replan.schedule)
        self.replan = replan
        rank0 = self.executor.rank == 0
        if self.save_path and rank0:
            profile.save(self.save_path)
        if rank0:
            self.log(replan.summary())
        if self.on_agreed is not None:
            self.agreed = self.on_agreed(profile)
        return replan

    def _agree(self, profile: Profile, limit: float | None) -> tuple[Profile, float | None]:
        """Every rank of the job must switch to the same plan (tensor- and data-parallel peers run their
        collectives in plan order): take global rank ``broadcast_src``'s profile and the smallest memory limit
        (reduced on the default group's device)."""
        if self.broadcast_src is None or not comm.is_initialized():
            return profile, limit
        box: list[Any] = [profile.to_dict()]
        comm.broadcast_object_list(box, src=self.broadcast_src)
        if limit is not None or self.mem_limit == "auto":
            (least,) = comm.all_reduce_values([math.inf if limit is None else limit], op="min")
            limit = None if math.isinf(least) else float(least)
        return Profile.from_dict(box[0]), limit
