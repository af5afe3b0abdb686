"""Per-part costs measured inside the pipeline stages: the embedding, each transformer layer, the head with the loss.

With two virtual stages the stage profile cannot tell a layer's cost from the embedding's or the head's (each stage
holds layers and one of them); the stage planner (``--pipeline-layer-split auto``) needs them apart.  ``PartTimer``
times them inside the profiling window through declared hooks only:

- F: ``torch.nn.Module`` forward pre/post hooks on the embedding, each ``TransformerLayer`` and the stage itself (the
  head with the loss is the time from the last layer's end to the stage's end);
- B: tensor gradient hooks, registered at F, on each part's boundary tensors (the loss, each layer's output and
  input); inside one B action their firing times bound each part's backward (the embedding's is the rest of the B
  action after its output's gradient), the B handler wrapped through the runtime's ``wrap_handler``; in a fused
  BW (1F1B) the same hooks bound each part's B and W together;
- the optimizer: this rank's own work per window iteration (``step_ms``), with the parameters it holds per part
  (``parameter_counts``).

The clock leaves out the profiler's own accounting inside actions (``accounting``: its ``accounting_s``, the graph
it walks at each recompute on the CPU), as the stage profile does.

Under ``--recompute-granularity auto`` stages that recompute are left out of the part times they would distort: a
full-recompute stage's layer F (its layers run without autograd) and the B of every stage that recomputes anything
(its B holds the recompute).  Under an explicit recompute (``ModelCosts.fixed_recompute``, every stage alike) the
parts are timed with it in force: a recomputed layer's F inside the F action without autograd; the B of a recomputed
run (its recompute and backward) between the gradient marks of its input and of the next layer's input (the head's
input after the last), shared evenly among its layers (a uniform run's inner boundaries carry no gradient), and
tagged apart from a layer that kept its activations (``"rb"``/``"rbw"`` beside ``"b"``/``"bw"``: block recomputes
only a stage's first layers), so ``combine_parts`` tells the layer without recompute from what the option adds.

``gather`` is collective over the pipeline group: it combines every rank's samples with the stage profile into the
profile's ``parts`` entry (``megatron.pipeline.part_costs.combine_parts``: W, memory, overhead, the optimizer's
share and the recompute options; ``zb_pipeline.schedule.stage_planner.ModelCosts.from_dict``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron.pipeline.part_costs import combine_parts
from zb_pipeline import comm
from zb_pipeline.runtime.profiler import clock_mark
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.model_costs import ModelCosts
from zb_pipeline.schedule.profile import Profile

__all__ = ["PartTimer", "parameter_counts", "recomputes"]


class PartTimer:
    """Times the parts of this rank's ``GPTStage`` s in iterations ``[start_iter, end_iter)`` of ``runtime``.
    ``layers_without_recompute``: leave out the B of every stage that recomputes anything (the window measures a
    layer without recompute and the options apart, ``--recompute-granularity auto``); else every stage's B is timed
    with the recompute in force, a recomputing layer's tagged apart.  ``step_ms``: this rank's own optimizer work in
    the iteration just stepped (ms, None: not measured), read as each window iteration after the first begins.
    ``accounting``: seconds the profiler has spent so far on its own accounting inside actions (CPU), left out."""

    def __init__(
        self,
        runtime: Any,
        *,
        start_iter: int,
        end_iter: int,
        layers_without_recompute: bool = False,
        step_ms: Callable[[], float | None] | None = None,
        accounting: Callable[[], float] | None = None,
    ) -> None:
        self.runtime, self.start_iter, self.end_iter = runtime, start_iter, end_iter
        self.accounting = accounting
        self.layers_without_recompute = layers_without_recompute
        self.step_ms = step_ms
        self.step_samples: list[float] = []  # this rank's optimizer work per window iteration (ms)
        self.stages: dict[int, Any] = dict(runtime.stages)
        self.params = parameter_counts(self.stages.values())  # what this rank's optimizer steps, per part
        self.cuda = any(p.is_cuda for m in self.stages.values() for p in m.parameters())
        self.active = False
        self.samples: dict[tuple[str, str], list[float]] = {}  # (part, kind: f, b, rb, ..) -> ms per microbatch
        self._pending: list[tuple[str, str, Any, Any, int]] = []  # CUDA: (part, kind, start, end event, layers)
        self._in_b = False
        self._in_f = False  # inside an F action (a recomputed run's layers time their F there without autograd)
        self._marks: dict[tuple[str, int], Any] | None = None  # inside a B action: boundary -> gradient time
        self._layer_start: Any = None
        self._last_layer_end: Any = None
        self._emb_start: Any = None
        self._handles: list[Any] = []  # module hooks' and handler wrappers' removable handles (``detach``)
        # stage -> its module and the units its B times (``_units``), where B is timed (built at window open)
        self._timed_b: dict[int, tuple[Any, list[tuple[int, int, bool]]]] | None = None
        self._owner = {  # id(module) -> its stage: F is timed unless the stage recomputes whole layers
            id(m): stage
            for stage in self.stages.values()
            for m in (stage, stage.embedding, *stage.layers)
            if m is not None
        }
        self._install()

    # -- wiring -----------------------------------------------------------------------------------------------
    def _install(self) -> None:
        self.runtime.hooks.iteration_start.append(self._begin_iteration)
        self._handles.append(self.runtime.wrap_handler(Kind.F, self._wrap_f))
        self._handles.append(self.runtime.wrap_handler(Kind.B, self._wrap_b("b")))
        # a fused backward: each part's B and W together
        self._handles.append(self.runtime.wrap_handler(Kind.BW, self._wrap_b("bw")))
        for module in self.stages.values():
            if module.embedding is not None:
                self._handles.append(module.embedding.register_forward_pre_hook(self._emb_pre))
                self._handles.append(module.embedding.register_forward_hook(self._emb_post))
            for i, layer in enumerate(module.layers):
                self._handles.append(layer.register_forward_pre_hook(self._layer_pre(i)))
                self._handles.append(layer.register_forward_hook(self._layer_post(i, len(module.layers))))
            if module.post_process:
                self._handles.append(module.register_forward_hook(self._stage_post))
                if module.recompute_segments and module.final_layernorm is not None:  # the last run's output
                    self._handles.append(module.final_layernorm.register_forward_pre_hook(self._head_pre(module)))
            elif module.recompute_segments:  # the stage's output is its last run's
                self._handles.append(module.register_forward_hook(self._run_out(module)))

    def detach(self) -> None:
        """Take out every hook and handler wrapper this timer installed (at the window's end; the samples stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        starts = self.runtime.hooks.iteration_start
        if self._begin_iteration in starts:
            starts.remove(self._begin_iteration)
        self.active = False

    def _begin_iteration(self, ex: Any) -> None:
        if self.active and self.step_ms is not None and ex.iteration < self.end_iter:  # the last one's step
            ms = self.step_ms()
            if ms is not None:
                self.step_samples.append(float(ms))
        self.active = self.start_iter <= ex.iteration < self.end_iter
        if self.active and self._timed_b is None:  # the recompute in force in the window, looked up once
            self._timed_b = {s: (m, _units(m)) for s, m in self.stages.items() if self._times_b(m)}

    def _times_b(self, module: Any) -> bool:
        """Whether ``module``'s B is timed: not, with ``layers_without_recompute``, a stage that recomputes anything
        (its B holds the recompute)."""
        return not (self.layers_without_recompute and recomputes(module))

    def _in_forward(self) -> bool:
        """Inside an F action of the window (not B's recompute)."""
        return self.active and not self._in_b  # outside the window: one attribute read

    def _timing_forward(self, module: Any) -> bool:
        """Whether ``module``'s forward is timed as a part: with autograd on, and for a layer its stage not
        recomputing whole layers (their F runs without autograd; the head is timed from the last one's end)."""
        if not self._in_forward():
            return False
        stage = self._owner.get(id(module))
        layer = stage is not None and module is not stage and module is not stage.embedding
        if layer and stage.recompute_segments:  # its recomputed runs' F runs without autograd, inside the F action
            return self._in_f and not self.layers_without_recompute
        return torch.is_grad_enabled()

    # -- clock ------------------------------------------------------------------------------------------------
    def _now(self) -> Any:
        if self.cuda or self.accounting is None:
            return clock_mark(self.cuda)
        return clock_mark(False) - self.accounting()  # the profiler's accounting so far is no part's time

    def _record(self, part: str, kind: str, start: Any, end: Any, layers: int = 1) -> None:
        """One sample of ``part``'s ``kind`` from ``start`` to ``end``; ``layers`` > 1: a run of that many layers,
        one sample per layer of its time shared evenly."""
        if self.cuda:
            self._pending.append((part, kind, start, end, layers))
        else:
            self.samples.setdefault((part, kind), []).extend([(end - start) * 1e3 / layers] * layers)

    def _mark(self, key: tuple[str, int]) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            if self._marks is not None:
                self._marks.setdefault(key, self._now())

        return hook

    # -- F ----------------------------------------------------------------------------------------------------
    def _emb_pre(self, module: Any, args: Any) -> None:
        if self._timing_forward(module):
            self._emb_start = self._now()

    def _emb_post(self, module: Any, args: Any, out: torch.Tensor) -> None:
        if self._timing_forward(module) and self._emb_start is not None:
            self._record("embedding", "f", self._emb_start, self._now())
            self._emb_start = None

    def _layer_pre(self, i: int) -> Callable[[Any, Any], None]:
        def hook(module: Any, args: Any) -> None:
            if not self._in_forward():
                return
            x = args[0]
            if self._timing_forward(module) and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(self._mark(("in", i)))
            self._layer_start = self._now()

        return hook

    def _layer_post(self, i: int, n: int) -> Callable[[Any, Any, Any], None]:
        def hook(module: Any, args: Any, out: Any) -> None:
            if not self._in_forward() or self._layer_start is None:
                return
            end = self._now()
            if self._timing_forward(module):
                self._record("layer", "f", self._layer_start, end)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(self._mark(("out", i)))
            self._layer_start = None
            if i == n - 1:  # the head starts here (also after a recomputed run of layers)
                self._last_layer_end = end

        return hook

    def _stage_post(self, module: Any, args: Any, out: Any) -> None:
        if not self._timing_forward(module) or self._last_layer_end is None:
            return
        self._record("head", "f", self._last_layer_end, self._now())
        self._last_layer_end = None
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._mark(("loss", 0)))

    def _wrap_f(self, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def handler(ex: Any, a: Any) -> Any:
            self._in_f = True
            try:
                return inner(ex, a)
            finally:
                self._in_f = False

        return handler

    def _head_pre(self, stage: Any) -> Callable[[Any, Any], None]:
        """The head's input is the last layer's output; a recomputed run's output gets its gradient mark here."""

        def hook(module: Any, args: Any) -> None:
            x = args[0]
            if self._in_f and self._timing_forward(stage.layers[-1]) and isinstance(x, torch.Tensor):
                if x.requires_grad:
                    x.register_hook(self._mark(("out", len(stage.layers) - 1)))

        return hook

    def _run_out(self, stage: Any) -> Callable[[Any, Any, Any], None]:
        """A stage without the head: its output (its last run's, when that recomputes) gets the last layer's
        output gradient mark."""

        def hook(module: Any, args: Any, out: Any) -> None:
            if self._in_f and self._timing_forward(stage.layers[-1]) and isinstance(out, torch.Tensor):
                if out.requires_grad:
                    out.register_hook(self._mark(("out", len(stage.layers) - 1)))

        return hook

    # -- B ----------------------------------------------------------------------------------------------------
    def _wrap_b(self, kind: str) -> Callable[[Callable[[Any, Any], Any]], Callable[[Any, Any], Any]]:
        """The wrapper of the B (``kind`` "b") or the fused BW ("bw") handler: times each part's backward."""
        return lambda inner: self._timed_backward(inner, kind)

    def _timed_backward(self, inner: Callable[[Any, Any], Any], kind: str) -> Callable[[Any, Any], Any]:
        def handler(ex: Any, a: Any) -> Any:
            timed = self._timed_b.get(a.stage) if self.active else None
            if timed is None:
                return inner(ex, a)
            self._in_b, self._marks = True, {}
            try:
                out = inner(ex, a)
                end = self._now()
                marks = self._marks
            finally:
                self._in_b, self._marks = False, None
            self._b_parts(*timed, marks, end, kind)
            return out

        return handler

    def _b_parts(
        self, module: Any, units: list[tuple[int, int, bool]], marks: dict[tuple[str, int], Any], end: Any, kind: str
    ) -> None:
        n = len(module.layers)
        for i in range(n - 1):  # a recomputed run's output is the next one's input (its own has no gradient)
            if ("out", i) not in marks and ("in", i + 1) in marks:
                marks[("out", i)] = marks[("in", i + 1)]
        if module.post_process and ("loss", 0) in marks and ("out", n - 1) in marks:
            self._record("head", kind, marks[("loss", 0)], marks[("out", n - 1)])
        for start, stop, recomputed in units:  # a recomputed run's: its recompute and backward
            last = stop - 1
            if ("out", last) in marks and ("in", start) in marks:
                tag = "r" + kind if recomputed else kind
                self._record("layer", tag, marks[("out", last)], marks[("in", start)], layers=stop - start)
        if module.embedding is not None and ("in", 0) in marks:
            self._record("embedding", kind, marks[("in", 0)], end)

    # -- results ----------------------------------------------------------------------------------------------
    def local_summary(self) -> dict[str, dict[str, Any]]:
        """This rank's F and B samples (ms per microbatch; a layer's: each layer's) per part it holds, and under
        ``"step"`` its optimizer work per iteration (``"ms"``) with the parameters it holds per part (JSON-able)."""
        if self._pending:
            torch.cuda.synchronize()
            for part, kind, start, end, layers in self._pending:
                self.samples.setdefault((part, kind), []).extend([float(start.elapsed_time(end)) / layers] * layers)
            self._pending.clear()
        out: dict[str, dict[str, Any]] = {}
        for (part, kind), values in self.samples.items():
            out.setdefault(part, {})[kind] = list(values)
        out["step"] = {"ms": list(self.step_samples), **self.params}
        return out

    def gather(
        self,
        profile: Profile,
        analytic: ModelCosts,
        *,
        group: Any = None,
        predict: Profile | None = None,
        recompute: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The profile's ``parts`` entry (collective over ``group``, the pipeline group): each part's measured F
        and B, W and memory from ``profile``'s stages shared in ``analytic``'s proportions.  ``predict``: the same
        window's profile of means; its parts (every sample's mean, ``"predict"`` in the entry) predict an
        iteration, a sum of actions and gaps, where the medians plan (``profile_gather.gather``).  ``recompute``:
        each virtual stage's choice in the window (``combine_parts``)."""
        local = self.local_summary()
        if comm.is_initialized():
            every: list[Any] = [None] * comm.world_size(group)
            comm.all_gather_object(every, local, group=group)
        else:
            every = [local]
        out = combine_parts(every, profile, analytic, recompute=recompute)
        if predict is not None:
            out["predict"] = combine_parts(every, predict, analytic, statistic="mean", recompute=recompute)
        return out


def _units(stage: Any) -> list[tuple[int, int, bool]]:
    """``stage``'s layers as the units its B times, first to last: ``(start, stop, recomputed)``, each recomputed
    run one unit (its inner boundaries carry no gradient), every other layer its own; ``recomputed`` also where the
    layer's core attention is (selective)."""
    runs = {start: stop for start, stop in stage.recompute_segments}
    units, i = [], 0
    while i < len(stage.layers):
        stop = runs.get(i, i + 1)
        units.append((i, stop, i in runs or _recomputes_core(stage.layers[i])))
        i = stop
    return units


def recomputes(stage: Any) -> bool:
    """Whether a ``GPTStage`` recomputes anything at B (whole layers, or its layers' core attention)."""
    if stage.recompute_segments:
        return True
    return any(_recomputes_core(layer) for layer in stage.layers)


def _recomputes_core(layer: Any) -> bool:
    """Whether a ``TransformerLayer`` recomputes its core attention at B (selective recompute)."""
    return bool(getattr(getattr(layer, "self_attention", None), "recompute_core", False))


def parameter_counts(stages: Any) -> dict[str, int]:
    """The parameters a rank's ``GPTStage`` s hold, per part: ``embedding``, ``layer`` (each), ``head`` (the
    stage's beyond its embedding and layers: the final norm and the output layer or the tied embedding's copy),
    and ``layers`` (how many), each parameter counted once."""
    seen: set[int] = set()

    def count(params: Any) -> int:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    stages = list(stages)
    embedding = sum(count(m.embedding.parameters()) for m in stages if m.embedding is not None)
    layers = [layer for m in stages for layer in m.layers]
    in_layers = sum(count(layer.parameters()) for layer in layers)
    head = sum(count(m.parameters()) for m in stages)  # what is left: the head's
    return {"embedding": embedding, "layer": in_layers // max(len(layers), 1), "head": head, "layers": len(layers)}
