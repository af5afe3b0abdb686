"""The global batch size of every iteration: constant, or ramped up (``--rampup-batch-size START INCR SAMPLES``).

Megatron's ramp-up: while fewer than ``SAMPLES`` samples have been consumed, the global batch size is
``START + INCR * floor(consumed / (SAMPLES / ((G - START) / INCR)))``; after that it is ``--global-batch-size`` G.
Each size must be a multiple of micro-batch x data-parallel size, so an iteration runs ``size / (b x dp)``
microbatches -- with pp > 1 the pipeline runtime takes the plan for each microbatch count from the schedule
registry's cache.

Everything here is a pure function of the iteration index, so a resumed run (``--load``) continues exactly.  With
``--train-samples`` the number of iterations follows Megatron's ``update_train_iters``: the ramp's iterations, then
whole global batches of the remaining samples.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from megatron.config.errors import require


@dataclass(frozen=True)
class BatchSizeSchedule:
    """Global batch size per iteration: ``ramp[i]`` for the first ``len(ramp)`` iterations, then ``final``."""

    final: int
    per_microbatch: int  # micro-batch size x data-parallel size
    ramp: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", (0, *itertools.accumulate(self.ramp)))

    def global_batch_size(self, iteration: int) -> int:
        """The global batch size of the iteration after ``iteration`` completed ones (0-based index)."""
        return self.ramp[iteration] if iteration < len(self.ramp) else self.final

    def num_microbatches(self, iteration: int) -> int:
        """Microbatches each data-parallel rank runs in iteration ``iteration`` (0-based)."""
        return self.global_batch_size(iteration) // self.per_microbatch

    def consumed_before(self, iteration: int) -> int:
        """Training samples consumed by the first ``iteration`` iterations."""
        starts: tuple[int, ...] = self._starts  # type: ignore[attr-defined]
        if iteration < len(starts):
            return starts[iteration]
        return starts[-1] + (iteration - len(self.ramp)) * self.final

    def iteration_of_sample(self, consumed: int) -> int:
        """The number of whole iterations that ``consumed`` samples make (inverse of ``consumed_before``)."""
        starts: tuple[int, ...] = self._starts  # type: ignore[attr-defined]
        if consumed <= starts[-1]:
            return bisect.bisect_right(starts, consumed) - 1
        return len(self.ramp) + (consumed - starts[-1]) // self.final

    def microbatch_counts(self) -> tuple[int, ...]:
        """Every microbatch count the run uses (ramp first, final last)."""
        seen = dict.fromkeys(g // self.per_microbatch for g in (*self.ramp, self.final))
        return tuple(seen)


def ramp_up_sizes(start: int, increment: int, ramp_samples: int, *, final: int, per_microbatch: int) -> tuple[int, ...]:
    """The global batch sizes of the ramp-up iterations (Megatron's ``RampupBatchsizeNumMicroBatches`` stepped
    while at most ``ramp_samples`` samples are consumed); ``ConfigError`` on bad values."""
    flag = f"--rampup-batch-size {start} {increment} {ramp_samples}"
    require(start >= 1 and increment >= 1 and ramp_samples >= 0, f"{flag}: all three values must be positive")
    require(start <= final, f"{flag}: the start size must be <= --global-batch-size={final}")
    diff = final - start
    require(
        diff % increment == 0, f"{flag}: --global-batch-size={final} minus {start} must be a multiple of {increment}"
    )
    sizes: list[int] = []
    if diff == 0:
        return ()
    per_increment = ramp_samples / (diff // increment)
    consumed = 0
    while consumed <= ramp_samples:
        size = final if per_increment == 0 else min(final, start + int(consumed / per_increment) * increment)
        require(
            size % per_microbatch == 0,
            f"{flag}: the ramp's global batch size {size} is not a multiple of micro-batch x data-parallel size "
            f"{per_microbatch}; pick START and INCR as multiples of {per_microbatch}",
        )
        sizes.append(size)
        consumed += size
    return tuple(sizes)


def iterations_for_samples(schedule: BatchSizeSchedule, train_samples: int) -> int:
    """Megatron's ``update_train_iters``: the ramp's iterations, then whole global batches of what is left."""
    i = 0
    while i < len(schedule.ramp) and schedule.consumed_before(i) <= train_samples:
        i += 1
    left = train_samples - schedule.consumed_before(i)
    return i + (left // schedule.final if left > 0 else 0)
