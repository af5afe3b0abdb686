"""Activation recomputation: Megatron's ``--recompute-*`` flags and ``--distribute-saved-activations``.

* ``granularity``: ``None`` (off), ``"selective"`` (the core attention of every layer: from the fused QKV projection
  to the attention output, i.e. rotary, scores, softmax, dropout and the weighted sum; ``--recompute-activations``
  is its shorthand) or ``"full"`` (whole transformer layers, chosen by ``method``).
* ``method`` (full only): ``"uniform"`` splits each stage's layers into runs of ``num_layers`` and recomputes every
  run (F keeps one input per run); ``"block"`` recomputes the first ``num_layers`` layers of each stage, one by one,
  and keeps the rest's activations.  As in Megatron, "stage" means a virtual pipeline stage.
* ``"auto"`` (our extension, with ``--pipeline-layer-split auto``): the stage planner chooses none, selective or full
  (uniform, 1 layer) per virtual stage within ``--pipeline-memory-limit-gb``; ``stages`` holds its answer, one
  ``(first layer, stop layer, choice)`` per virtual stage (``megatron.pipeline.layer_split``).
* ``distribute_saved_activations`` (full, tp > 1, not with sequence parallelism): each tensor-parallel rank keeps only
  its ``1/tp`` slice of a recomputed run's input and all-gathers it at B.

Validation that needs only the flags lives here; ``megatron.arguments._recompute_config`` checks ``num_layers``
against the stages' layer counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.config.errors import require

RECOMPUTE_GRANULARITIES = ("full", "selective", "auto")
AUTO_CHOICES = ("none", "selective", "full")  # what auto chooses among, per virtual stage
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    distribute_saved_activations: bool = False
    stages: tuple[tuple[int, int, str], ...] = ()  # auto: (start, stop, choice) per virtual stage, once planned

    def __post_init__(self) -> None:
        g, m, n = self.granularity, self.method, self.num_layers
        require(
            g is None or g in RECOMPUTE_GRANULARITIES, f"--recompute-granularity={g!r} must be full, selective or auto"
        )
        require(m is None or m in RECOMPUTE_METHODS, f"--recompute-method={m!r} must be uniform or block")
        if g == "full":
            require(
                m is not None and n is not None,
                "--recompute-granularity full needs --recompute-method {uniform,block} and --recompute-num-layers N",
            )
        else:
            require(
                m is None and n is None,
                f"--recompute-method/--recompute-num-layers apply to --recompute-granularity full, not {g or 'none'}; "
                "drop them or use full granularity",
            )
        require(
            not self.stages or (g == "auto" and all(c in AUTO_CHOICES for _, _, c in self.stages)),
            f"per-stage recompute choices {self.stages} need --recompute-granularity auto and one of {AUTO_CHOICES}",
        )
        require(n is None or n >= 1, f"--recompute-num-layers={n} must be >= 1")
        require(
            not self.distribute_saved_activations or g == "full",
            "--distribute-saved-activations needs --recompute-granularity full",
        )

    @property
    def enabled(self) -> bool:
        return self.granularity is not None

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    @property
    def auto(self) -> bool:
        return self.granularity == "auto"

    def for_stage(self, layer_range: range) -> RecomputeConfig:
        """The concrete recompute of the virtual stage holding ``layer_range``: itself unless auto, else the
        planner's choice for that stage (``ValueError`` if the plan has no stage of those layers)."""
        if not self.auto:
            return self
        for start, stop, choice in self.stages:
            if (start, stop) == (layer_range.start, layer_range.stop):
                if choice == "full":
                    return RecomputeConfig(granularity="full", method="uniform", num_layers=1)
                return RecomputeConfig(granularity=None if choice == "none" else choice)
        raise ValueError(
            f"--recompute-granularity auto has no choice for layers [{layer_range.start}, {layer_range.stop}) "
            f"(planned stages: {[(a, b) for a, b, _ in self.stages]})"
        )

    def planned(self, layer_ranges: Sequence[range], choices: Sequence[str]) -> RecomputeConfig:
        """``--recompute-granularity auto`` with the planner's ``choices``, one per virtual stage of ``layer_ranges``
        (the one place ``stages`` is written: at start-up, at a re-decision in the profiling window, at a resume)."""
        return dataclasses.replace(
            self, stages=tuple((r.start, r.stop, str(c)) for r, c in zip(layer_ranges, choices, strict=True))
        )

    def choices(self, layer_ranges: Sequence[range]) -> tuple[str, ...]:
        """The auto choice of each virtual stage of ``layer_ranges`` (``ValueError`` if one was not planned)."""
        out = []
        for r in layer_ranges:
            mine = self.for_stage(r)
            out.append("full" if mine.full else "selective" if mine.selective else "none")
        return tuple(out)

    def summary(self) -> dict[str, str]:
        """The start-up summary's line (none when recomputation is off)."""
        if not self.enabled:
            return {}
        if self.auto:
            what = "auto per stage: " + (", ".join(c for _, _, c in self.stages) or "not planned yet")
        elif self.selective:
            what = "selective (core attention)"
        else:
            what = f"full, {self.method}, {self.num_layers} layer(s)"
            what += ", saved inputs distributed over tp" if self.distribute_saved_activations else ""
        return {"activation recomputation": what + "; B recomputes, W never does"}

    def segments(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """The runs ``(start, stop)`` of a stage's ``num_layers`` local layers that are recomputed as one unit."""
        if not self.full:
            return ()
        n = self.num_layers
        if self.method == "uniform":
            return tuple((i, min(i + n, num_layers)) for i in range(0, num_layers, n))
        return tuple((i, i + 1) for i in range(min(n, num_layers)))

    def check(self, *, tp: int, sequence_parallel: bool, stage_layers: tuple[int, ...], transformer_impl: str) -> None:
        """What needs the run's shape: tp, sequence parallelism, each (virtual) stage's layer count."""
        if self.distribute_saved_activations:
            require(tp > 1, "--distribute-saved-activations needs --tensor-model-parallel-size > 1")
            require(
                not sequence_parallel,
                "--distribute-saved-activations does not combine with --sequence-parallel (the saved input is "
                "already split over tp); drop one of them",
            )
        if self.enabled:
            require(
                transformer_impl == "local",
                "activation recomputation needs --transformer-impl local (Transformer Engine layers keep their own "
                "weight-gradient state)",
            )
        if self.full:
            fewest = min(stage_layers, default=0)
            require(
                self.num_layers <= fewest,
                f"--recompute-num-layers={self.num_layers} is more than the {fewest} layers of a pipeline stage; "
                f"use at most {fewest}",
            )

    @classmethod
    def from_flags(cls, v: Mapping[str, Any]) -> RecomputeConfig:
        """From the parsed flag values; ``--recompute-activations`` is selective granularity."""
        granularity = v.get("recompute_granularity")
        if v.get("recompute_activations"):
            require(
                granularity in (None, "selective"),
                f"--recompute-activations (selective) contradicts --recompute-granularity {granularity}; "
                "give one of them",
            )
            granularity = "selective"
        return cls(
            granularity=granularity,
            method=v.get("recompute_method"),
            num_layers=v.get("recompute_num_layers"),
            distribute_saved_activations=bool(v.get("distribute_saved_activations", False)),
        )
