"""The declared extension points of the pipeline runtime: named hook lists with documented call points.

Extensions (the tracer, the profiler and re-planner, emulated compute, optimizer post-validation, a trainer's
gradient-reduction glue) attach here instead of patching the executor.  Every list is empty by default, and the
executor checks a list before looping over it, so an unused hook costs one truthiness test on the hot path.

Call points (``ex`` is the ``PipelineExecutor``, ``a`` an ``Action``):

==================  =========================================  ======================================================
hook                called                                     with
==================  =========================================  ======================================================
iteration_start     before an iteration's first action         ``(ex)``
iteration_end       after its last action, before the P2P      ``(ex)``; may raise to fail the iteration
                    finish and the executor's clean-up check
input_ready         once F's input or B's output gradient is   ``(a)``
                    available (received or handed over)
saved_for_backward  when F keeps what its B needs              ``(a, input_leaf_or_None, autograd_root)``
after_post[kind]    for each op of that kind in a               ``(ex, a)``
                    communication batch, right after posting
stage_grads_final   after a stage's last W (or BW) of the       ``(stage)``: its weight gradients are final
                    iteration
plan_changed        after the runtime loaded another plan       ``(lowered)``
==================  =========================================  ======================================================

Action handlers are the other extension point: ``set_handler(kind, fn)`` registers a handler for a new kind or
replaces one (emulated compute), ``wrap_handler(kind, wrapper)`` wraps the current one (the profiler) and returns a
``HandlerWrap`` whose ``remove()`` takes the wrapper out again (a profiling window's end).  Both live on
``PipelineExecutor`` and ``PipelineRuntime``.  ``WeightGradStore.on_submit`` sees each deferred weight-gradient
work item as it is queued, and ``WeightGradStore.on_recompute`` each segment B has just rebuilt (activation
recomputation, ``zb_pipeline.runtime.recompute``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from zb_pipeline.schedule.ir import Kind

Handler = Callable[[Any, Any], Any]  # fn(executor, action): a compute handler returns None, a send its tensor
IterationHook = Callable[[Any], None]
ActionHook = Callable[[Any], None]


@dataclass
class ExecutorHooks:
    """The hook lists of one executor (see the module docstring for when each is called)."""

    iteration_start: list[IterationHook] = field(default_factory=list)
    iteration_end: list[IterationHook] = field(default_factory=list)
    input_ready: list[ActionHook] = field(default_factory=list)
    saved_for_backward: list[Callable[[Any, Any, Any], None]] = field(default_factory=list)
    after_post: dict[Kind, list[Callable[[Any, Any], None]]] = field(default_factory=dict)
    stage_grads_final: list[Callable[[int], None]] = field(default_factory=list)
    plan_changed: list[Callable[[Any], None]] = field(default_factory=list)

    def add_after_post(self, kind: Kind, fn: Callable[[Any, Any], None]) -> None:
        self.after_post.setdefault(kind, []).append(fn)


@dataclass(eq=False)
class HandlerWrap:
    """One ``wrap_handler`` call: ``remove()`` takes its wrapper out of the kind's handler again (the wrappers added
    after it are applied anew over what remains, so a wrapper must only build its handler; a no-op once the handler
    was replaced by ``set_handler``, its wrappers with it, or once removed)."""

    wrapper: Callable[[Handler], Handler]
    _remove: Callable[[HandlerWrap], None]

    def remove(self) -> None:
        self._remove(self)


class Extension(Protocol):
    """Something that attaches to a runtime (or a bare executor) through its hooks and handler methods."""

    def attach(self, target: Any) -> None: ...
