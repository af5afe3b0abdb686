"""``--enable-optimizer-post-validation`` in the trainer: the optimizer steps without the cross-stage wait.

The library side is ``zb_pipeline.optim.post_validation`` (the protocol, the chain, exact rollback) and
``zb_pipeline.schedule.post_validation_pass`` (where the chain sits in the plan); the executor replays an iteration
whose warm-up forwards used weights that validation then changed.  This file is the trainer's glue:

- the running plan gets the ``SEND_PV``/``RECV_PV`` chain (and keeps it when the runtime loads another plan), at the
  consistent cut before each rank's first backward -- or, for an iteration after a validation that changed weights
  (clipping or skipping tends to persist), in the prologue, so a run that clips every step does not replay its
  warm-up forwards every iteration;
- ``step(lr, iteration)`` replaces ``MainParamOptimizer.step`` at the end of an iteration: it takes the step from
  this rank's own statistics (``MainParamOptimizer`` is the ``PostValidatableOptimizer``) and returns at once;
- the step's outcome (global grad norm, skipped or not) is known once it is validated -- inside the next
  iteration's plan, or by ``flush()`` (an ordered all-gather over the pipeline) before an evaluation, a checkpoint
  and at the end of the run.  ``take_settled()`` hands the trainer each settled step once, in order, so the LR
  schedule advances, the skip counters and the log line follow exactly what the synchronised optimizer did.

Gradients are zeroed at validation, not before ``forward_backward`` (the rollback of a clipped step needs them), so
the trainer resets only the data-parallel reducer's bucket state per iteration
(``DataParallelReducer.start_iteration``).
With one pipeline stage there is nothing to remove: the trainer keeps the synchronised step and says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from megatron.config.errors import ConfigError
from megatron.optimizer.grad_norm import GradStats
from megatron.optimizer.main_params import MainParamOptimizer
from megatron.parallel.context import ParallelContext
from megatron.pipeline.forward_backward import GPTPipeline
from zb_pipeline.optim.post_validation import PostValidator, Validation
from zb_pipeline.schedule.lowering import LoweredSchedule
from zb_pipeline.schedule.post_validation_pass import (
    add_post_validation,
    has_post_validation,
    strip_post_validation,
)
from zb_pipeline.schedule.validate import ScheduleError, validate_lowered


@dataclass(frozen=True)
class SettledStep:
    """An optimizer step whose outcome is final (synchronised: at once; post-validated: once validated)."""

    iteration: int  # 1-based iteration whose gradients the step applied
    learning_rate: float
    stats: GradStats
    skipped: bool


class PostValidatedStep:
    """One rank's post-validated optimizer step inside the trainer (module docstring)."""

    def __init__(self, pipe: GPTPipeline, optimizer: MainParamOptimizer, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.runtime = pipe.runtime
        self.prologue_iterations = 0  # iterations that validated before their first forward (no overlap, no replay)
        self.validator = PostValidator(
            optimizer, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size, on_validated=self._on_validated, device=ctx.device
        )
        self.runtime.attach(self.validator)
        self.runtime.hooks.iteration_start.append(self._count_placement)
        self.runtime.hooks.plan_changed.append(self._plan_changed)  # zb-auto re-planned, or another m
        self._waiting: deque[tuple[int, float]] = deque()  # (iteration, lr) of steps taken, not yet validated
        self._settled: list[SettledStep] = []
        self._next_at = "cut"
        self._plan_changed(self.runtime.lowered)

    def _plan_changed(self, lowered: LoweredSchedule) -> None:
        """This rank's steps with the chain at the cut and in the prologue, for the runtime's new plan."""
        plain = strip_post_validation(lowered) if has_post_validation(lowered) else lowered
        variants = {}
        for at in ("cut", "prologue"):
            chained = add_post_validation(plain, at=at)
            try:
                validate_lowered(chained)
            except ScheduleError as err:  # pragma: no cover - validated over every built-in plan
                raise ConfigError(f"post-validation cannot be added to plan {plain.schedule.name!r}: {err}") from None
            variants[at] = chained.ranks[self.runtime.rank]
        self._variants = variants
        self.runtime.use_steps(variants[self._next_at])

    def _choose_placement(self) -> None:
        """Where the next iteration validates: at the cut (overlapping the warm-up forwards), or in the prologue when
        the last validation changed weights -- clipping or skipping tends to persist over iterations, and replaying
        the warm-up forwards every iteration would cost more than waiting for the chain.  The last validation is
        the same on every rank, so every rank picks the same variant."""
        last = self.validator.last
        self._next_at = "prologue" if last is not None and last.replay else "cut"
        self.runtime.use_steps(self._variants[self._next_at])

    def step(self, lr: float, iteration: int) -> None:
        """End of ``iteration`` (1-based): take or hold back the step from this rank's statistics alone."""
        self._waiting.append((iteration, lr))
        self.validator.step(lr)
        self._choose_placement()

    def _count_placement(self, executor: object) -> None:
        self.prologue_iterations += self._next_at == "prologue"

    def _on_validated(self, v: Validation) -> None:
        iteration, lr = self._waiting.popleft()
        self._settled.append(SettledStep(iteration, lr, v.stats, v.skipped))

    def flush(self) -> None:
        """Validate the pending step now (ordered all-gather over the pipeline): before eval, save, exit."""
        if self.validator.pending is not None:
            self.validator.flush(self.ctx.pp_group)
            self._choose_placement()

    def take_settled(self) -> list[SettledStep]:
        out, self._settled = self._settled, []
        return out

    @property
    def replays(self) -> int:
        return self.runtime.executor.replays

    def summary(self) -> str:
        """For the log line: validated steps and rollbacks by cause, and replayed iterations."""
        return (
            f"post-validation: {self.validator.log_summary()} | replayed iterations: {self.replays} | validated "
            f"before the first forward: {self.prologue_iterations}"
        )
