"""Profiling for zb-auto: measure what every F, B and W really costs on the running pipeline.

In a window of iterations ``[start_iter, end_iter)`` an ``ActionProfiler`` attached to a rank's executor records

- the time of every compute action per virtual stage (its input wait excluded: the clock starts once
  ``fetch_input`` / ``fetch_output_grad`` has returned), with ``time.perf_counter`` on CPU and CUDA events on GPU,
  and on CPU the runtime's own gap between two compute actions and the time between iterations (from an
  iteration's last compute action to the next one's first call: the optimizer step, the loss reductions, the next
  batch -- what an iteration holds besides the plan);
- the activation memory each action adds or frees and the rank's peak (``zb_pipeline.runtime.activation_memory``).
  That accounting runs after each action, outside its time; it holds each microbatch's graph root and W work
  until its W, and what it then lets go is dropped inside the W's time, where it dies without a profiler.  Under
  recomputation it also counts, inside a B, the graph each recompute rebuilds (the store's ``on_recompute``): that
  time is left out of the B's (``accounting_s``, which the per-part timer leaves out of its parts too).

It attaches through the executor's extension points only: ``wrap_handler`` around each compute kind, the
``input_ready``, ``saved_for_backward`` and ``iteration_start`` hooks, and the weight-gradient store's
``on_submit``; ``detach`` takes them all out again at the window's end (``WindowReplanner``: after its gathers).
``gather`` (collective over the pipeline group, ``zb_pipeline.runtime.profile_gather``) turns every
rank's samples into one ``Profile`` (``zb_pipeline.schedule.profile``: converts to ``StageCosts``, saves to
``prof.json``, which ``zb-schedule simulate/show/compare --profile`` reads); ``zb_pipeline.runtime.replanner``
plans from it and switches the running plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zb_pipeline.runtime import profile_gather
from zb_pipeline.runtime.activation_memory import ActivationMemory, resolve_memory_source
from zb_pipeline.runtime.profile_gather import COMPUTE_KINDS
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.profile import STATISTICS, Profile

if TYPE_CHECKING:
    from zb_pipeline.runtime.executor import PipelineExecutor

__all__ = ["ActionProfiler", "clock_mark"]


def clock_mark(cuda: bool) -> Any:
    """A point in time for interval timing: a recorded CUDA event on the current stream (read with
    ``start.elapsed_time(end)`` once synchronised), else ``time.perf_counter()`` seconds."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


class ActionProfiler:
    """Records one rank's F/B/W/BW times and activation memory in ``[start_iter, end_iter)``.

    ``memory``: ``"auto"`` (CUDA statistics when the stages live on a GPU, saved-tensor bytes otherwise),
    ``"cuda"``, ``"saved-tensors"`` or ``"none"``.  ``end_iter=None`` profiles every iteration from ``start_iter``.
    """

    def __init__(
        self,
        executor: PipelineExecutor,
        *,
        start_iter: int = 0,
        end_iter: int | None = None,
        memory: str = "auto",
    ) -> None:
        if end_iter is not None and end_iter <= start_iter:
            raise ValueError(f"profiling window [{start_iter}, {end_iter}) is empty: end must be > start")
        params = [p for mod in executor.stages.values() for p in mod.parameters()]
        self.cuda = any(p.is_cuda for p in params)
        self.memory = resolve_memory_source(memory, on_cuda=self.cuda)
        self.ex = executor
        self.start_iter, self.end_iter = start_iter, end_iter
        self.device = str(params[0].device) if params else "cpu"
        self.activation = ActivationMemory(
            self.memory, device=self.device, param_ptrs={p.untyped_storage().data_ptr() for p in params}
        )
        self.active = False
        self.times: dict[tuple[Kind, int], list[float]] = {}
        self._events: list[tuple[Kind, int, Any, Any]] = []  # CUDA: (kind, stage, start event, end event)
        self._start: Any = None
        self._in_action = False
        # CPU only (on a GPU the host work between actions overlaps the device's): the runtime's gap between actions
        self.gaps: list[float] = []  # ms from one action's end to the next handler call, profiler's own time out
        self._prev_end: float | None = None
        self._own_time = 0.0
        # CPU: seconds of this profiler's own accounting inside actions so far (at each recompute), not theirs
        self.accounting_s = 0.0
        self.boundaries: list[float] = []  # CPU: ms from an iteration's last compute action to the next one's first
        self._iteration_end: float | None = None  # the last action's end of the previous (profiled) iteration
        self._wraps: list[Any] = []  # the handler wrappers' ``HandlerWrap``s (``detach``)
        self._submitted: Callable[[Callable[[], None]], None] | None = None  # its ``on_submit`` hook
        self._install()

    # the activation-memory samples (see ``ActivationMemory``)
    @property
    def mem(self) -> dict[tuple[Kind, int], list[float]]:
        return self.activation.mem

    @property
    def residual(self) -> dict[int, list[float]]:
        return self.activation.residual

    @property
    def transient(self) -> dict[tuple[Kind, int], list[float]]:
        return self.activation.transient

    @property
    def peaks(self) -> list[float]:
        return self.activation.peaks

    # -- wiring -----------------------------------------------------------------------------------------------
    def _install(self) -> None:
        ex = self.ex
        for kind in COMPUTE_KINDS:
            if kind in ex.handlers:
                self._wraps.append(ex.wrap_handler(kind, lambda inner, kind=kind: self._wrap(kind, inner)))
        ex.hooks.input_ready.append(self._input_ready)
        if self.activation.saved_tensors:
            ex.hooks.saved_for_backward.append(self._capture_root)
        store = ex.store

        def submitted(work: Callable[[], None]) -> None:
            # Only work from this executor's own profiled actions: the store may be shared with other executors
            # (a benchmark running several plans over the same stages), which would otherwise be held here forever.
            if self.active and self._in_action and self.activation.saved_tensors and store.active_key is not None:
                self.activation.hold_work(store.active_key, work)

        self._submitted = submitted
        store.on_submit.append(submitted)
        if self.activation.saved_tensors:
            store.on_recompute.append(self._recomputed)
        ex.hooks.iteration_start.append(self._begin_iteration)

    def detach(self) -> None:
        """Take out every handler wrapper and hook this profiler installed (at its window's end, between
        iterations); the samples stay, so ``local_summary`` and ``gather`` still read them."""
        for wrap in self._wraps:
            wrap.remove()
        self._wraps.clear()
        ex, store = self.ex, self.ex.store
        for hooks, hook in (
            (ex.hooks.input_ready, self._input_ready),
            (ex.hooks.saved_for_backward, self._capture_root),
            (store.on_submit, self._submitted),
            (store.on_recompute, self._recomputed),
            (ex.hooks.iteration_start, self._begin_iteration),
        ):
            if hook in hooks:
                hooks.remove(hook)
        self.activation.close_iteration()  # what its iteration hook would have done next
        self.active = False

    def _recomputed(self, outputs: tuple[torch.Tensor, ...]) -> None:
        if self.active and self._in_action:
            began = time.perf_counter()
            self.activation.recomputed(outputs)  # walks the microbatch's graph: the profiler's time, not the B's
            self.accounting_s += time.perf_counter() - began

    def _begin_iteration(self, ex: PipelineExecutor) -> None:
        self.activation.close_iteration()
        it = ex.iteration
        was_active = self.active
        self.active = it >= self.start_iter and (self.end_iter is None or it < self.end_iter)
        self._iteration_end = self._prev_end if was_active and self.active else None
        self._prev_end = None
        if self.active:
            self.activation.begin_iteration()

    def _capture_root(self, a: Any, inp: Any, root: Any) -> None:
        if self.active:
            self.activation.hold_root((a.stage, a.microbatch), root)

    # -- timing -----------------------------------------------------------------------------------------------
    def _now(self) -> Any:
        return clock_mark(self.cuda)

    def _input_ready(self, a: Any) -> None:
        if self._in_action:
            self._start = self._now()  # the action's own work starts once its input is here

    def _wrap(self, kind: Kind, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def handler(ex: Any, a: Any) -> Any:
            if not self.active:
                return inner(ex, a)
            called = time.perf_counter()
            if self._prev_end is not None and not self.cuda:
                self.gaps.append(max(0.0, called - self._prev_end - self._own_time) * 1e3)
            elif self._iteration_end is not None and not self.cuda:  # the first action after a profiled iteration
                self.boundaries.append(max(0.0, called - self._iteration_end - self._own_time) * 1e3)
                self._iteration_end = None
            before = self.activation.before_action(kind, (a.stage, a.microbatch))
            self._in_action = True
            accounted = self.accounting_s
            self._start = self._now()
            try:
                out = inner(ex, a)
                end = self._now()
            finally:
                self._in_action = False
            released = self.activation.after_action(kind, (a.stage, a.microbatch), before)
            if self.cuda:
                self._events.append((kind, a.stage, self._start, end))
            else:
                # What the accounting held of the microbatch (its graph, its W work) dies here, not inside the W as
                # it does without the profiler: that release is the action's time, the accounting is not.
                freeing = time.perf_counter()
                released.clear()
                freed = time.perf_counter() - freeing
                inside = self.accounting_s - accounted  # the recompute accounting inside the action
                self.times.setdefault((kind, a.stage), []).append((end - self._start + freed - inside) * 1e3)
                self._prev_end = end
                self._own_time = time.perf_counter() - end  # the accounting and the release: not the gap's
            return out

        return handler

    def _resolve_events(self) -> None:
        if not self._events:
            return
        torch.cuda.synchronize(self.device)
        for kind, stage, start, end in self._events:
            self.times.setdefault((kind, stage), []).append(float(start.elapsed_time(end)))
        self._events.clear()

    # -- results ----------------------------------------------------------------------------------------------
    def local_summary(self, statistic: str = "median") -> dict[str, Any]:
        """Per-stage summaries of this rank's samples (JSON-able; what ``gather`` exchanges): times and the gap
        between compute actions by ``statistic`` (see ``gather``), memory deltas by their median."""
        if statistic not in STATISTICS:  # before the open iteration is closed
            raise ValueError(f"{statistic=} must be one of {STATISTICS}")
        self.activation.close_iteration()
        self._resolve_events()
        return profile_gather.local_summary(
            self.ex.stages,
            times=self.times,
            mem=self.mem,
            residual=self.residual,
            transient=self.transient,
            gaps=self.gaps,
            boundaries=self.boundaries,
            peaks=self.peaks,
            statistic=statistic,
        )

    def gather(
        self, *, group: Any = None, comm_ms: float | None = None, latency_repeats: int = 20, statistic: str = "median"
    ) -> Profile:
        """Every rank's summaries and the P2P latency, combined into one ``Profile`` (collective on ``group``).

        ``statistic="median"`` (the default) gives the typical cost of each action, what a planner should plan
        with, robust to a stray slow sample; ``"mean"`` is the one for predicting an iteration (see
        ``profile_gather.gather``).
        """
        return profile_gather.gather(
            self.ex,
            self.local_summary(statistic),
            window=(self.start_iter, self.end_iter),
            memory_source=self.memory,
            device=self.device,
            group=group,
            comm_ms=comm_ms,
            latency_repeats=latency_repeats,
            statistic=statistic,
        )
