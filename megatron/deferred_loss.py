"""The global-batch mean loss of an iteration, reduced without a wait at the iteration boundary.

An iteration's loss is the float64 sum of this rank's microbatch losses (non-zero only where the last pipeline stage
lives), summed over the pipeline group, then over the data-parallel group, divided by the number of microbatches.
Waiting for those sums at the end of every iteration would make every rank wait for the slowest before its optimizer
step -- the wait optimizer post-validation removes.  So ``PendingLoss`` only *starts* them:

- the pipeline-group sum starts as an asynchronous all-reduce when the plan ends (``GPTPipeline.forward_backward``);
- the data-parallel sum starts when the value is asked for (``resolve_losses``: at a log line, before an evaluation or
  a checkpoint, at the end of the run -- the same iterations on every rank, so the collectives pair up), after the
  pipeline sum completed (waited with the run's timeout; by then it finished long ago);
- ``value()`` waits for it and reads the number back (one host read per logged iteration).

The reductions and their order are exactly the blocking ones' (one scalar all-reduce over each group, pipeline first),
so the logged losses are the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

from megatron.parallel.context import ParallelContext
from zb_pipeline import comm


class PendingLoss:
    """The mean loss of one iteration whose reductions are started, not yet waited for (module docstring)."""

    def __init__(
        self,
        total: torch.Tensor,
        count: int,
        *,
        dp_group: Any = None,
        dp_size: int = 1,
        timeout: timedelta | None = None,
        pp_work: Any = None,
        pp_group: Any = None,
    ) -> None:
        self._total, self._count = total, count
        self._dp_group, self._dp_size, self._timeout = dp_group, dp_size, timeout
        self._pp_work, self._pp_group = pp_work, pp_group
        self._dp_work: Any = None
        self._dp_started = False
        self._value: float | None = None

    @classmethod
    def of_context(cls, total: torch.Tensor, count: int, ctx: ParallelContext, *, pp_work: Any = None) -> PendingLoss:
        """The mean of ``total`` over ``count`` microbatches of every data-parallel rank of ``ctx``; ``pp_work``: the
        started pipeline-group sum of ``total`` (``GPTPipeline.start_forward_backward``)."""
        return cls(
            total,
            count,
            dp_group=ctx.dp_group,
            dp_size=ctx.dp_size,
            timeout=ctx.timeout,
            pp_work=pp_work,
            pp_group=ctx.pp_group,
        )

    @property
    def resolved(self) -> bool:
        return self._value is not None

    def start_dp(self) -> None:
        """Start the data-parallel sum (after the pipeline sum has completed)."""
        if self._dp_started or self._value is not None:
            return
        if self._pp_work is not None:
            comm.wait(self._pp_work, group=self._pp_group, timeout=self._timeout)
            self._pp_work = None
        if self._dp_group is not None:
            self._dp_work = comm.all_reduce(self._total, group=self._dp_group, async_op=True)
        self._dp_started = True

    def value(self) -> float:
        """The global-batch mean loss (waits for the reductions the first time; then cached)."""
        if self._value is None:
            self.start_dp()
            if self._dp_work is not None:
                comm.wait(self._dp_work, group=self._dp_group, timeout=self._timeout)
                self._dp_work = None
            self._value = float(self._total) / (self._count * self._dp_size)
        return self._value


def resolve_losses(pending: Iterable[PendingLoss]) -> list[float]:
    """Every loss of ``pending`` as a number: all data-parallel sums are started first, then waited for, so a log
    window of losses costs one round of waits.  Call it at the same iterations on every rank."""
    items = list(pending)
    for p in items:
        p.start_dp()
    return [p.value() for p in items]
