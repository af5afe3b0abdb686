"""``PipelineRuntime``: the one entry point that runs a pipeline plan on one rank.

Built once per run, called once per iteration with that iteration's microbatches::

    runtime = PipelineRuntime(
        {stage: module, ...},                        # this rank's virtual stages
        rank=pp_rank,
        plans=PlanSource("zb-h1", num_ranks=pp),     # plans come from the schedule registry (cached)
        comm=PipelineP2P(...),                       # None when the plan has no transfer (pp = 1)
        input_fn=lambda batch: batch["tokens"],      # stage 0's input, from microbatch k's batch
        loss_fn=lambda out, batch: loss,             # last stage: loss to backpropagate (or (loss, reported))
    )
    losses = runtime.run(microbatches)               # this rank's per-microbatch losses (last stage's rank)
    losses = runtime.forward_only(microbatches)      # evaluation: a forward-only plan over the same stages

The runtime owns the plan for its whole life: it asks its ``PlanSource`` for the plan of each microbatch count it
is called with (generated once per shape, costs and memory limit, validated and lowered once, then cached), loads
another plan when the count changes or a re-planner switches plans (``switch_plan``), and swaps stage modules
between iterations (``replace_stages``).  It issues no collective of its own: only the plan's transfers.

Everything else attaches through declared extension points (``zb_pipeline.runtime.hooks``): ``hooks`` (named hook
lists), ``after_iteration`` (called after each ``run`` with the iteration index), ``set_handler`` /
``wrap_handler`` (action kinds and their handlers), and ``attach(extension)``, which calls ``extension.attach(self)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.hooks import ExecutorHooks, Handler, HandlerWrap
from zb_pipeline.runtime.p2p import PipelineP2P
from zb_pipeline.runtime.weight_grad_store import WeightGradStore
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, F, Kind, Schedule
from zb_pipeline.schedule.lowering import LoweredSchedule, lower
from zb_pipeline.schedule.validate import check_and_lower

BatchInputFn = Callable[[Any], torch.Tensor]
BatchLossFn = Callable[[torch.Tensor, Any], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
BatchForwardFn = Callable[[torch.nn.Module, torch.Tensor, int, Any], torch.Tensor]


@dataclass(frozen=True)
class PlanSource:
    """Where a runtime's plans come from: a registered schedule (``name``) for any microbatch count, or one fixed
    plan (a plan file) for its own count.  ``costs``/``mem_limit`` are the generator's inputs (``None``: the
    registry's defaults); ``replanned`` gives the same source with measured costs."""

    name: str | None = None
    num_ranks: int = 1
    chunks: int | None = None
    costs: StageCosts | None = None
    mem_limit: float | None = None
    fixed: Schedule | None = None

    def __post_init__(self) -> None:
        if (self.name is None) == (self.fixed is None):
            raise ValueError("a PlanSource takes a registered schedule name or a fixed plan, exactly one")
        if self.fixed is not None and self.fixed.num_ranks != self.num_ranks:
            object.__setattr__(self, "num_ranks", self.fixed.num_ranks)

    @classmethod
    def of(cls, schedule: Schedule) -> PlanSource:
        """A source that serves exactly ``schedule``."""
        return cls(fixed=schedule, num_ranks=schedule.num_ranks)

    def schedule(self, num_microbatches: int) -> Schedule:
        """The plan for ``num_microbatches`` (``ValueError`` naming the constraint a shape violates)."""
        if self.fixed is not None:
            if num_microbatches != self.fixed.num_microbatches:
                raise ValueError(
                    f"plan {self.fixed.name!r} is for m={self.fixed.num_microbatches}, got {num_microbatches} "
                    "microbatches"
                )
            return self.fixed
        return registry.generate(
            self.name, self.num_ranks, num_microbatches, chunks=self.chunks, costs=self.costs, mem_limit=self.mem_limit
        )

    def replanned(self, *, costs: StageCosts, mem_limit: float | None) -> PlanSource:
        """The same schedule planned from other costs and memory limit (a fixed plan cannot be re-planned)."""
        if self.fixed is not None:
            raise ValueError(f"plan {self.fixed.name!r} is fixed (a plan file): it cannot be re-planned")
        return dataclasses.replace(self, costs=costs, mem_limit=mem_limit)


def forward_only_plan(schedule: Schedule) -> Schedule:
    """The same stages and placement, F actions only: each rank runs its forwards in (microbatch, stage) order,
    which is a topological order of the forward dependencies, so the plan cannot deadlock."""
    m = schedule.num_microbatches
    ranks = [tuple(F(s, mb) for mb in range(m) for s in schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    return Schedule(
        name=f"{schedule.name}/forward-only",
        num_ranks=schedule.num_ranks,
        num_stages=schedule.num_stages,
        num_microbatches=m,
        stage_to_rank=schedule.stage_to_rank,
        ranks=tuple(ranks),
    )


def _forward_only(ex: PipelineExecutor, a: Action) -> None:
    s, mb = a.stage, a.microbatch
    out = ex.forward_fn(ex.stages[s], ex.fetch_input(a), s, mb)
    if s == ex.num_stages - 1:
        got = ex.loss_fn(out, mb)
        ex.losses[mb] = (got[1] if isinstance(got, tuple) else got).detach()
    else:
        ex.deliver_output(a, out)


class PipelineRuntime:
    """Runs one rank's part of a pipeline plan, one iteration per call (see the module docstring)."""

    def __init__(
        self,
        stages: Mapping[int, torch.nn.Module],
        *,
        rank: int,
        plans: PlanSource,
        num_microbatches: int,
        comm: PipelineP2P | None,
        loss_fn: BatchLossFn,
        input_fn: BatchInputFn | None = None,
        forward_fn: BatchForwardFn | None = None,
        split: str = "auto",
        tracer: Any = None,
        store: WeightGradStore | None = None,
    ) -> None:
        self.plans, self.rank = plans, rank
        self._input_fn = input_fn or (lambda batch: batch)
        self._loss_fn = loss_fn
        self._forward_fn = forward_fn
        self._batches: Sequence[Any] = ()
        self._lowered: dict[int, tuple[Schedule, LoweredSchedule]] = {}  # id(schedule) -> its lowered plan
        self.after_iteration: list[Callable[[int], None]] = []
        self.executor = PipelineExecutor(
            self._lower(plans.schedule(num_microbatches)),
            rank,
            stages,
            p2p=comm,
            store=store if store is not None else WeightGradStore(),
            input_fn=self._input,
            loss_fn=self._loss,
            forward_fn=self._forward,
            split=split,
            tracer=tracer,
        )
        self._forward_executor: PipelineExecutor | None = None

    # -- what it runs ---------------------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        """The plan the next iteration runs (for the current microbatch count)."""
        return self.executor.lowered.schedule

    @property
    def lowered(self) -> LoweredSchedule:
        return self.executor.lowered

    @property
    def stages(self) -> dict[int, torch.nn.Module]:
        return self.executor.stages

    @property
    def hooks(self) -> ExecutorHooks:
        return self.executor.hooks

    @property
    def store(self) -> WeightGradStore:
        return self.executor.store

    def _lower(self, schedule: Schedule) -> LoweredSchedule:
        """Validate and lower ``schedule`` once (cached per plan object; the registry caches the plans)."""
        hit = self._lowered.get(id(schedule))
        if hit is not None and hit[0] is schedule:
            return hit[1]
        lowered = check_and_lower(schedule)
        self._lowered[id(schedule)] = (schedule, lowered)
        return lowered

    # -- one iteration -------------------------------------------------------------------------------------------
    def run(self, microbatches: Sequence[Any], *, iteration: int | None = None) -> list[torch.Tensor]:
        """Run one iteration over ``microbatches`` (element k: what ``input_fn``/``loss_fn``/``forward_fn`` read
        for microbatch k; ranks that hold neither the first nor the last stage may pass placeholders).  Returns the
        per-microbatch losses on the rank holding the last stage, ``[]`` elsewhere."""
        self._use_count(len(microbatches))
        self._batches = microbatches
        try:
            losses = self.executor.run(iteration)
        finally:
            self._batches = ()
        done = self.executor.iteration - 1
        for hook in self.after_iteration:
            hook(done)
        return losses

    @torch.no_grad()
    def forward_only(self, microbatches: Sequence[Any]) -> list[torch.Tensor]:
        """Forward passes only (evaluation): every rank's F actions in microbatch order, lowered like any plan (so
        P2P keeps the strict order and its timeouts), on a second executor sharing the stages and the store."""
        m = len(microbatches)
        ex = self._forward_executor
        if ex is None:
            ex = self._forward_executor = self._build_forward_executor(self.plans.schedule(m))
        elif ex.num_microbatches != m:
            ex.load_plan(lower(forward_only_plan(self.plans.schedule(m))))
        self._batches = microbatches
        try:
            return ex.run()
        finally:
            self._batches = ()

    def _build_forward_executor(self, schedule: Schedule) -> PipelineExecutor:
        train = self.executor.p2p
        p2p = None
        if train is not None:  # its own P2P state: the training plan's transfers are not interleaved with these
            p2p = PipelineP2P(
                pp_rank=train.pp_rank,
                boundary_specs=train.specs,
                group=train.group,
                pp_ranks=train.pp_ranks,
                device=train.device,
                timeout_s=train.timeout_s,
                check=train.check,
            )
        ex = PipelineExecutor(
            lower(forward_only_plan(schedule)),
            self.rank,
            self.executor.stages,
            p2p=p2p,
            store=self.executor.store,  # binding the stages to another store would divert training's W work
            input_fn=self._input,
            loss_fn=self._loss,
            forward_fn=self._forward,
        )
        ex.set_handler(Kind.F, _forward_only)
        return ex

    def _input(self, mb: int) -> torch.Tensor:
        return self._input_fn(self._batches[mb])

    def _loss(self, out: torch.Tensor, mb: int) -> Any:
        return self._loss_fn(out, self._batches[mb])

    def _forward(self, module: torch.nn.Module, x: torch.Tensor, stage: int, mb: int) -> torch.Tensor:
        if self._forward_fn is None:
            return module(x)
        return self._forward_fn(module, x, stage, self._batches[mb])

    # -- changing what runs, between iterations ----------------------------------------------------------------
    def _use_count(self, num_microbatches: int) -> None:
        if num_microbatches < 1:
            raise ValueError(f"got {num_microbatches} microbatches: an iteration needs at least one")
        if num_microbatches != self.executor.num_microbatches:
            self.executor.load_plan(self._lower(self.plans.schedule(num_microbatches)))

    def switch_plan(self, plans: PlanSource) -> LoweredSchedule:
        """Take plans from ``plans`` from the next iteration on (e.g. re-planned from profiled costs); the plan for
        the current microbatch count is loaded now, so a bad plan fails before any transfer."""
        lowered = self._lower(plans.schedule(self.executor.num_microbatches))
        self.plans = plans
        self.executor.load_plan(lowered)
        return lowered

    def replace_stages(self, stages: Mapping[int, torch.nn.Module]) -> None:
        """Run other modules for this rank's stages from the next iteration on."""
        self.executor.replace_stages(stages)
        if self._forward_executor is not None:
            self._forward_executor.replace_stages(self.executor.stages)

    # -- extension interface ---------------------------------------------------------------------------------------
    def set_handler(self, kind: Kind, handler: Handler) -> None:
        """Run ``handler(executor, action)`` for training actions of ``kind`` (new, or replacing a built-in one)."""
        self.executor.set_handler(kind, handler)

    def wrap_handler(self, kind: Kind, wrapper: Callable[[Handler], Handler]) -> HandlerWrap:
        """Wrap the training handler of ``kind``; ``remove()`` on the result unwraps it (``PipelineExecutor``)."""
        return self.executor.wrap_handler(kind, wrapper)

    def use_steps(self, steps: tuple) -> None:
        """Run a variant of this rank's part of the loaded plan from the next iteration on (post-validation)."""
        self.executor.use_steps(steps)

    def attach(self, extension: Any) -> Any:
        """``extension.attach(self)``; returns the extension."""
        extension.attach(self)
        return extension
