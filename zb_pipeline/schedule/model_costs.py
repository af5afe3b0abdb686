"""The stage planner's view of a model, per part and per microbatch: what the search over splits
(``stage_planner``) prices each candidate stage with.

``PartCosts``: one part's F/B/W times and activation memory (a transformer layer, the embedding, the output head with
the loss).  ``RecomputeOption``: what recomputing a layer adds to B, what F then keeps and what B holds while it
recomputes (measured numbers plug in here).  ``StepShare``: each part's share of its rank's work between iterations.
``ModelCosts`` combines them into one virtual stage's ``PartCosts`` (``stage_part``), a candidate's ``StageCosts``
(``stage_costs``, with each stage's recompute transients, ``stage_transient``) and its time between iterations
(``step_time``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zb_pipeline.schedule.costs import StageCosts

NO_RECOMPUTE = "none"


def _check_nonneg(what: str, **values: float) -> None:
    """Raise one line naming the first of ``values`` that is not finite and >= 0."""
    for name, v in values.items():
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{what} {name}={v} must be finite and >= 0")


@dataclass(frozen=True)
class PartCosts:
    """One part of the model for one microbatch: its F, B, W times and the activation memory F keeps (``mem_f``)
    and B adds (``mem_b``; W frees ``mem_f + mem_b``)."""

    f: float
    b: float
    w: float
    mem_f: float = 0.0
    mem_b: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("part cost", f=self.f, b=self.b, w=self.w)
        if not (math.isfinite(self.mem_f) and math.isfinite(self.mem_b)):
            raise ValueError(f"part memory ({self.mem_f}, {self.mem_b}) must be finite")
        if self.mem_f < 0 or self.mem_f + self.mem_b < 0:
            raise ValueError(
                f"part memory mem_f={self.mem_f:g}, mem_b={self.mem_b:g}: F keeps >= 0 and after B at least 0 is held"
            )


@dataclass(frozen=True)
class RecomputeOption:
    """What recomputing one transformer layer does: B re-runs (part of) the forward, ``b_extra`` more time; F then
    keeps ``mem_f`` (the layer's input, ...) and B adds ``mem_b`` (what W needs minus what it freed).  While B
    recomputes the layer it holds ``transient`` above what F kept of it (the rebuilt graph less what the layer's
    backward has freed by then); ``transient_bw`` the same inside a fused BW, whose W work runs as it goes
    (``ModelCosts.stage_transient`` makes a stage's of them).  Whole-layer recompute in runs (Megatron's
    ``--recompute-method``): ``run`` layers recompute as one unit (uniform; F keeps one ``mem_f`` per run and B
    rebuilds the run's other layers beside the first's transient; a stage's last run is shorter where ``run`` does
    not divide its layers, ``run_lengths``); ``block`` > 0 recomputes only a stage's first
    ``block`` layers (the rest keep their activations)."""

    name: str
    b_extra: float
    mem_f: float
    mem_b: float = 0.0
    transient: float = 0.0
    transient_bw: float = 0.0
    run: int = 1
    block: int = 0

    def __post_init__(self) -> None:
        if self.name == NO_RECOMPUTE:
            raise ValueError(f"recompute option name {NO_RECOMPUTE!r} is reserved for no recompute")
        PartCosts(f=0.0, b=self.b_extra, w=0.0, mem_f=self.mem_f, mem_b=self.mem_b)  # same checks
        if not (math.isfinite(self.transient) and math.isfinite(self.transient_bw)):
            raise ValueError(f"recompute option {self.name!r}: transients must be finite")
        if self.run < 1 or self.block < 0:
            raise ValueError(f"recompute option {self.name!r}: run={self.run} must be >= 1 and block={self.block} >= 0")

    def recomputed(self, num_layers: int) -> int:
        """How many of a stage's ``num_layers`` layers recompute (its first ones)."""
        return num_layers if self.block == 0 else min(self.block, num_layers)

    def runs(self, num_layers: int) -> tuple[int, ...]:
        """The recomputed runs of a stage's ``num_layers`` layers, each one's layers (``run_lengths``)."""
        return run_lengths(self.recomputed(num_layers), self.run)

    def apply(self, layer: PartCosts) -> PartCosts:
        return PartCosts(f=layer.f, b=layer.b + self.b_extra, w=layer.w, mem_f=self.mem_f, mem_b=self.mem_b)


def run_lengths(num_layers: int, run: int) -> tuple[int, ...]:
    """The layers of each run (first to last) when ``num_layers`` layers recompute in runs of ``run`` (Megatron's
    uniform method): the last run is shorter when ``run`` does not divide them."""
    return tuple(min(run, num_layers - i) for i in range(0, num_layers, run))


def runs_transient(
    runs: Sequence[int], *, transient: float, rebuilt: float, swap_run: float, swap_layer: float, head: float = 0.0
) -> float:
    """``StageCosts.mem_b_transient`` (``mem_bw_transient``) of a stage whose recomputed layers form ``runs`` (each
    run's layer count, first to last): B runs the head and the layers that keep their activations (``head``: what
    they add), then the runs last to first; while a run of ``n`` layers recomputes it holds ``transient`` (its first
    layer's, above what F kept of it) plus its other layers rebuilt (``rebuilt`` each), and when it is done it has
    added ``swap_run + n * swap_layer`` (in a B: what waits for its W less the one input F kept; in a BW: less that
    input).  The highest of these points (``transient + runs_rest(...)``), at least 0; 0 without runs."""
    if not runs:
        return 0.0
    rest = runs_rest(runs, rebuilt=rebuilt, swap_run=swap_run, swap_layer=swap_layer, head=head)
    return max(0.0, transient + rest)


def runs_rest(runs: Sequence[int], *, rebuilt: float, swap_run: float, swap_layer: float, head: float = 0.0) -> float:
    """What ``runs_transient``'s highest point holds beyond the one recomputing layer's own ``transient`` (the same
    arguments; may be negative): a measured stage transient less this is that layer's (``ModelCosts.transient_rest``).
    """
    done, top = head, -math.inf
    for n in reversed(runs):
        top = max(top, done + (n - 1) * rebuilt)
        done += swap_run + n * swap_layer
    return top


@dataclass(frozen=True)
class StepShare:
    """Each part's share of its rank's work between iterations (the optimizer step over the parameters it holds):
    per embedding, per transformer layer, per head.  Every rank starts that work at the pipeline's end (the
    tied-embedding gradient sum synchronises them), so the iteration waits for the rank with the most
    (``largest_rank``)."""

    embedding: float = 0.0
    layer: float = 0.0
    head: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("step share", embedding=self.embedding, layer=self.layer, head=self.head)

    def largest_rank(self, layers: Sequence[int], stage_to_rank: Sequence[int]) -> float:
        """The largest rank's share under the split ``layers`` (per virtual stage) placed by ``stage_to_rank``."""
        S = len(layers)
        per_rank: dict[int, float] = {}
        for s, n in enumerate(layers):
            own = n * self.layer + (self.embedding if s == 0 else 0.0) + (self.head if s == S - 1 else 0.0)
            per_rank[stage_to_rank[s]] = per_rank.get(stage_to_rank[s], 0.0) + own
        return max(per_rank.values(), default=0.0)


@dataclass(frozen=True)
class ModelCosts:
    """The planner's view of a model: ``num_layers`` identical transformer layers, the embedding, the head+loss."""

    num_layers: int
    layer: PartCosts
    embedding: PartCosts
    head: PartCosts
    comm: float = 0.0  # time added to every cross-rank hand-off
    recompute: tuple[RecomputeOption, ...] = ()  # options each stage may take besides no recompute
    # Time every virtual stage's F, B and W takes beyond its parts (the runtime's work per action); memory unused.
    overhead: PartCosts = PartCosts(f=0.0, b=0.0, w=0.0)
    # time per iteration outside the pipeline's actions (optimizer step, iteration boundary): ``step`` on every
    # split plus the largest rank's ``step_share`` (``step_time``)
    step: float = 0.0
    step_share: StepShare = StepShare()
    # Every stage takes ``recompute[0]`` (an explicit recompute, e.g. Megatron's --recompute-granularity full): the
    # planner chooses the split only, "none" is no candidate.
    fixed_recompute: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        if not (math.isfinite(self.comm) and self.comm >= 0):
            raise ValueError(f"communication cost {self.comm} must be finite and >= 0")
        if not (math.isfinite(self.step) and self.step >= 0):
            raise ValueError(f"time per iteration outside the pipeline {self.step} must be finite and >= 0")
        names = [o.name for o in self.recompute]
        if len(set(names)) != len(names):
            raise ValueError(f"recompute option names repeat: {names}")
        if self.fixed_recompute and len(self.recompute) != 1:
            raise ValueError(f"a fixed recompute needs exactly one recompute option, got {names}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelCosts:
        """From a profile's ``parts`` entry: ``{"num_layers": L, "layer": {f, b, w, mem_f, mem_b}, "embedding": ...,
        "head": ..., "comm": C, "recompute": [{name, b_extra, mem_f, mem_b, transient, transient_bw, run, block},
        ...], "overhead": {f, b, w}, "step": T, "step_share": {embedding, layer, head}, "fixed_recompute": bool}``
        (all but num_layers, layer, embedding and head optional; so are the fields with defaults)."""
        if not isinstance(d, dict):
            raise ValueError("model parts must be a JSON object with num_layers, layer, embedding and head")
        try:
            parts = {k: PartCosts(**d[k]) for k in ("layer", "embedding", "head")}
            rec = tuple(RecomputeOption(**o) for o in d.get("recompute", ()))
            over = PartCosts(**d.get("overhead", {"f": 0.0, "b": 0.0, "w": 0.0}))
            return cls(
                num_layers=int(d["num_layers"]),
                comm=float(d.get("comm", 0.0)),
                recompute=rec,
                overhead=over,
                step=float(d.get("step", 0.0)),
                step_share=StepShare(**d.get("step_share", {})),
                fixed_recompute=bool(d.get("fixed_recompute", False)),
                **parts,
            )
        except KeyError as err:
            raise ValueError(f"model parts lack {err}: give num_layers, layer, embedding and head") from None
        except TypeError as err:
            raise ValueError(f"model parts: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def step_time(self, layers: Sequence[int], stage_to_rank: Sequence[int]) -> float:
        """The time between iterations of the split ``layers`` placed by ``stage_to_rank``: the fixed ``step`` plus
        the largest rank's optimizer share (``StepShare.largest_rank``)."""
        return self.step + self.step_share.largest_rank(layers, stage_to_rank)

    def option_names(self) -> tuple[str, ...]:
        return (NO_RECOMPUTE,) + tuple(o.name for o in self.recompute)

    def stage_part(self, num_layers: int, option: int, *, first: bool, last: bool) -> PartCosts:
        """One virtual stage: ``num_layers`` layers under option ``option`` (0 = none), plus the embedding/head and
        the per-action overhead."""
        k, kept = 0, 0.0  # layers that recompute; what their runs' F keeps beyond one input per run
        layers = [(num_layers, self.layer)]
        if option:
            o = self.recompute[option - 1]
            k = o.recomputed(num_layers)
            layers = [(num_layers - k, self.layer), (k, o.apply(self.layer))]
            kept = (k - len(o.runs(num_layers))) * o.mem_f  # uniform runs: one input per run, not per layer
        parts = [*layers, (1, self.overhead)] + [(1, self.embedding)] * first + [(1, self.head)] * last
        return PartCosts(
            f=sum(n * q.f for n, q in parts),
            b=sum(n * q.b for n, q in parts),
            w=sum(n * q.w for n, q in parts),
            mem_f=sum(n * q.mem_f for n, q in parts) - kept,
            mem_b=sum(n * q.mem_b for n, q in parts) + kept,
        )

    def stage_costs(self, layers: Sequence[int], options: Sequence[int]) -> StageCosts:
        """``StageCosts`` of a candidate: ``layers[s]`` layers and option ``options[s]`` on virtual stage ``s``."""
        S = len(layers)
        parts = [self.stage_part(n, o, first=s == 0, last=s == S - 1) for s, (n, o) in enumerate(zip(layers, options))]
        tiny = 1e-12 * max(1.0, max(q.f + q.b + q.w for q in parts))  # StageCosts needs > 0 (an empty stage)
        return StageCosts(
            f=tuple(max(q.f, tiny) for q in parts),
            b=tuple(max(q.b, tiny) for q in parts),
            w=tuple(max(q.w, tiny) for q in parts),
            comm=self.comm,
            mem_f=tuple(q.mem_f for q in parts),
            mem_b=tuple(q.mem_b for q in parts),
            mem_w=tuple(-(q.mem_f + q.mem_b) for q in parts),
            mem_b_transient=tuple(
                self.stage_transient(n, o, last=s == S - 1) for s, (n, o) in enumerate(zip(layers, options))
            ),
            mem_bw_transient=tuple(
                self.stage_transient(n, o, last=s == S - 1, fused=True) for s, (n, o) in enumerate(zip(layers, options))
            ),
        )

    def stage_transient(self, num_layers: int, option: int, *, last: bool, fused: bool = False) -> float:
        """What a B (``fused``: a BW) of a virtual stage with ``num_layers`` layers under option ``option`` (0 =
        none: nothing) holds above the sum before it while it recomputes (``runs_transient``): in a B each run
        swaps the input F kept for what waits for its layers' W, and the head and the layers that keep their
        activations (block) add their ``mem_b``; in a BW they free all."""
        if option == 0:
            return 0.0
        o = self.recompute[option - 1]
        return runs_transient(
            o.runs(num_layers),
            transient=o.transient_bw if fused else o.transient,
            **self._runs(num_layers, o, last=last, fused=fused),
        )

    def transient_rest(self, num_layers: int, option: int, *, last: bool, fused: bool = False) -> float:
        """``stage_transient`` less the option's own one-layer transient (``runs_rest``; may be negative): what a
        measured stage transient holds besides that layer's."""
        o = self.recompute[option - 1]
        return runs_rest(o.runs(num_layers), **self._runs(num_layers, o, last=last, fused=fused))

    def _runs(self, num_layers: int, o: RecomputeOption, *, last: bool, fused: bool) -> dict[str, float]:
        """``runs_rest``'s memory arguments for a stage of ``num_layers`` layers under ``o``."""
        plain = num_layers - o.recomputed(num_layers)  # block: the layers that keep their activations
        if fused:  # a BW frees what it holds as it goes: a run frees the one input F kept of it
            head = (-self.head.mem_f if last else 0.0) - plain * self.layer.mem_f
            return dict(rebuilt=self.layer.mem_f, swap_run=-o.mem_f, swap_layer=0.0, head=head)
        head = (self.head.mem_b if last else 0.0) + plain * self.layer.mem_b
        held = o.mem_f + o.mem_b  # what a layer's deferred W waits on after B
        return dict(rebuilt=self.layer.mem_f, swap_run=-o.mem_f, swap_layer=held, head=head)
