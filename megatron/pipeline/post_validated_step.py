"""``--enable-optimizer-post-validation`` in the trainer: the optimizer steps without the cross-stage wait.

The library side is ``zb_pipeline.optim.post_validation`` (the protocol, the chain, exact rollback) and
``zb_pipeline.schedule.post_validation_pass`` (where the chain sits in the plan); the executor replays an iteration
whose warm-up forwards used weights that validation then changed.  This file is the trainer's glue:

- the running plan gets the ``SEND_PV``/``RECV_PV`` chain (and keeps it when zb-auto switches plans);
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
from zb_pipeline.schedule.post_validation_pass import add_post_validation, has_post_validation
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
        if not has_post_validation(pipe.lowered):
            lowered = add_post_validation(pipe.lowered)
            try:
                validate_lowered(lowered)
            except ScheduleError as err:  # pragma: no cover - the pass is validated over every built-in plan
                raise ConfigError(f"post-validation cannot be added to plan {pipe.schedule.name!r}: {err}") from None
            pipe.lowered = lowered
            pipe.executor.lowered = lowered
            pipe.executor.steps = lowered.ranks[pipe.executor.rank]
        self.ctx = ctx
        self.validator = PostValidator(
            optimizer, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size, on_validated=self._on_validated
        )
        self.validator.install(pipe.executor)
        self.executor = pipe.executor
        self._waiting: deque[tuple[int, float]] = deque()  # (iteration, lr) of steps taken, not yet validated
        self._settled: list[SettledStep] = []

    def step(self, lr: float, iteration: int) -> None:
        """End of ``iteration`` (1-based): take or hold back the step from this rank's statistics alone."""
        self._waiting.append((iteration, lr))
        self.validator.step(lr)

    def _on_validated(self, v: Validation) -> None:
        iteration, lr = self._waiting.popleft()
        stats = GradStats(norm=v.stats.norm, found_nonfinite=v.stats.found_nonfinite)
        self._settled.append(SettledStep(iteration, lr, stats, v.skipped))

    def flush(self) -> None:
        """Validate the pending step now (ordered all-gather over the pipeline): before eval, save, exit."""
        if self.validator.pending is not None:
            self.validator.flush(self.ctx.pp_group)

    def take_settled(self) -> list[SettledStep]:
        out, self._settled = self._settled, []
        return out

    @property
    def replays(self) -> int:
        return self.executor.replays

    def summary(self) -> str:
        """For the log line: validated steps and rollbacks by cause, and replayed iterations."""
        return f"post-validation: {self.validator.log_summary()} | replayed iterations: {self.replays}"
