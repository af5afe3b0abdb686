"""The store of deferred weight-gradient work: the seam between a zero-bubble schedule's B and W actions.

A runtime instance owns one ``WeightGradStore`` (there is no class-level or module-level store, so two runtimes, or
two tests, never see each other's work).  The executor runs the B action of ``(chunk, microbatch)`` as::

    with store.defer(chunk, microbatch):
        torch.autograd.backward(outputs, grad_outputs)   # layers compute grad-input only, enqueue their W work

and later the W action as ``store.run(chunk, microbatch)``, which pops that key's closures and runs them in the
order they were enqueued (the backward order, last layer first).  Each closure computes one layer's weight
gradients and accumulates them into ``param.main_grad`` (fp32, in place) when the parameter has one, otherwise into
``param.grad``.

Layers find the store through an attribute: any module with a ``weight_grad_store`` attribute is a deferrable layer,
and ``bind_weight_grad_store(model, store)`` points all of them at one store.  A layer with no store bound, or a
backward run outside ``store.defer(...)``, computes everything immediately: plain autograd behaviour.

Backward may run on autograd's device thread (CUDA), so the active key is a plain attribute, not thread-local state:
it is set by the thread that calls backward and read by the engine while that thread waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

WeightGradKey = tuple[int, int]  # (chunk, microbatch)
WeightGradWork = Callable[[], None]


class WeightGradStore:
    """Deferred weight-gradient closures keyed by ``(chunk, microbatch)``; one instance per runtime."""

    def __init__(self) -> None:
        self._queues: dict[WeightGradKey, list[WeightGradWork]] = {}
        self._active: WeightGradKey | None = None
        # Called with each work item queued under a key (before it is queued): the profiler's memory accounting.
        self.on_submit: list[Callable[[WeightGradWork], None]] = []
        # True while a generic split's B runs: a recompute segment (``zb_pipeline.runtime.recompute``) then defers
        # its plain autograd parameters to W as the split does, instead of computing them in B.
        self.split_autograd_params = False
        # Called with a recomputed segment's outputs once B has rebuilt its graph, before backpropagating through it
        # (``zb_pipeline.runtime.recompute``): the profiler measures the transient there.
        self.on_recompute: list[Callable[[tuple[torch.Tensor, ...]], None]] = []

    # -- B side -------------------------------------------------------------------------------------------------
    @contextmanager
    def defer(self, chunk: int, microbatch: int) -> Iterator[WeightGradStore]:
        """Within this block, deferrable layers' backward enqueues weight-gradient work under the given key."""
        if self._active is not None:
            raise RuntimeError(
                f"WeightGradStore.defer({chunk}, {microbatch}) entered while ({self._active[0]}, "
                f"{self._active[1]}) is still active; B actions must not nest"
            )
        self._active = (chunk, microbatch)
        try:
            yield self
        finally:
            self._active = None

    @property
    def deferring(self) -> bool:
        """True while inside ``defer``: backward should compute grad-input only."""
        return self._active is not None

    @property
    def active_key(self) -> WeightGradKey | None:
        return self._active

    def submit(self, work: WeightGradWork) -> None:
        """Enqueue ``work`` under the active key, or run it now when nothing is being deferred."""
        key = self._active
        if key is None:
            work()
            return
        for hook in self.on_submit:
            hook(work)
        queue = self._queues.get(key)
        if queue is None:
            self._queues[key] = [work]
        else:
            queue.append(work)

    # -- W side -------------------------------------------------------------------------------------------------
    def run(self, chunk: int, microbatch: int) -> int:
        """Run (and forget) the weight-gradient work of ``(chunk, microbatch)``; returns how many closures ran.

        A key with nothing enqueued is not an error: a stage without deferrable layers has an empty W.
        """
        if self._active is not None:
            raise RuntimeError(f"WeightGradStore.run({chunk}, {microbatch}) called inside defer{self._active}")
        work = self._queues.pop((chunk, microbatch), None)
        if not work:
            return 0
        with torch.no_grad():
            for fn in work:
                fn()
        return len(work)

    def run_all(self) -> int:
        """Run every pending key in insertion order (a flush, e.g. for a plain non-pipelined step)."""
        done = 0
        for key in list(self._queues):
            done += self.run(*key)
        return done

    def pending(self) -> dict[WeightGradKey, int]:
        """Keys that still hold work, with the number of closures each."""
        return {key: len(work) for key, work in self._queues.items() if work}

    def assert_empty(self) -> None:
        """Raise if any deferred work is left (the runtime checks this at the end of every iteration)."""
        left = self.pending()
        if left:
            keys = ", ".join(f"chunk {c} microbatch {m}: {n}" for (c, m), n in sorted(left.items()))
            raise RuntimeError(f"deferred weight-gradient work left over ({keys}); every B needs its W")

    def clear(self) -> None:
        """Drop all pending work (after an error, before retrying an iteration)."""
        self._queues.clear()
        self._active = None

    def __repr__(self) -> str:
        return f"WeightGradStore(active={self._active}, pending={self.pending()})"


def bind_weight_grad_store(module: torch.nn.Module, store: WeightGradStore | None) -> int:
    """Point every deferrable layer in ``module`` (those with a ``weight_grad_store`` attribute) at ``store``.

    Returns the number of layers bound.  ``store=None`` unbinds them (plain immediate backward).
    """
    bound = 0
    for sub in module.modules():
        if hasattr(sub, "weight_grad_store"):
            sub.weight_grad_store = store
            bound += 1
    return bound
