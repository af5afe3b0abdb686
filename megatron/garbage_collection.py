"""Manual garbage collection (``--manual-gc``): Python's cyclic collector at iteration boundaries only.

CPython runs its cyclic collector whenever enough container objects have been allocated since the last run: at an
arbitrary moment, on each rank on its own.  A collection of the oldest generation walks every tracked object of the
process (torch, the model, the data pipeline: tens to hundreds of milliseconds); landing inside a pipeline
iteration it stalls one rank, and every rank that waits for that rank's sends stalls with it.

With ``--manual-gc`` the trainer

- collects once and freezes what setup left (``gc.freeze``: those objects are never scanned again);
- turns the automatic collector off;
- after every iteration collects the young generations (what the iteration allocated and still holds: cheap), on
  every rank at the same point of the loop;
- every ``--manual-gc-interval`` iterations (0: never) collects everything;
- before and after each evaluation collects everything, unless ``--no-manual-gc-eval``.

Nothing is left uncollected for long: cyclic garbage of an iteration is found at its end (young collection) or,
once it has survived two young collections, at the next full one.  ``stop`` restores the automatic collector.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

YOUNG = 1  # gc.collect(1): generations 0 and 1


@dataclass
class ManualGC:
    """The collection policy of one rank's training loop (see the module docstring)."""

    interval: int = 0
    around_eval: bool = True
    collections: int = 0  # collections this policy ran
    seconds: float = 0.0  # time they took
    _was_enabled: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"--manual-gc-interval={self.interval} must be >= 0 (0: no periodic full collection)")

    def start(self) -> None:
        """Collect, freeze the survivors, and switch the automatic collector off."""
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._collect(2)
        gc.freeze()

    def after_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` (1-based count of finished iterations) has ended on this rank."""
        full = self.interval > 0 and iteration % self.interval == 0
        self._collect(2 if full else YOUNG)

    def around_evaluation(self) -> None:
        """Call right before and right after an evaluation."""
        if self.around_eval:
            self._collect(2)

    def stop(self) -> None:
        """Give the objects back to the automatic collector and restore its state."""
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()

    def _collect(self, generation: int) -> None:
        t0 = time.perf_counter()
        gc.collect(generation)
        self.seconds += time.perf_counter() - t0
        self.collections += 1
