"""A profile: what every F, B and W of a pipeline cost, per virtual stage, as measured in a profiling window.

``zb_pipeline.runtime.profiler.ActionProfiler`` measures it on the running pipeline; this module holds the result
(pure Python, no torch), so ``zb-schedule --profile prof.json`` and the planners can read it anywhere.

Besides the per-stage medians (what ``simulate`` and the generators read), a CPU profile carries the runtime's
``overhead``: the median time from the end of one compute action to the start of the next on a rank (posting the
transfers in between, bookkeeping), which every compute action pays once.  ``predict_makespan`` adds it; files
without the field (older profiles, GPU profiles, where the host work overlaps the device) read as 0.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind, Schedule
from zb_pipeline.schedule.memory import microbatch_bytes, pending_bytes
from zb_pipeline.schedule.model_costs import ModelCosts, PartCosts
from zb_pipeline.schedule.registry import placement_of
from zb_pipeline.schedule.simulate import simulate

PROFILE_VERSION = 1
# How a profile summarises each stage's samples: the median (the typical cost, to plan with) or the mean (to
# predict an iteration's span, a sum of actions and gaps).
STATISTICS = ("median", "mean")
_MIN_COST_MS = 1e-6  # StageCosts needs costs > 0; an action too fast to time still costs something


@dataclass(frozen=True)
class Profile:
    """Per-virtual-stage medians (or means, see ``statistic``) of one profiling window (times in ms, memory in
    bytes).

    ``b``/``w`` are ``None`` for stages that only ran fused ``BW`` (then ``bw`` holds its time); ``mem_b`` and
    ``mem_w`` follow the cost model (``mem_f + mem_b + mem_w == 0``; ``residual`` is what W left resident, which the
    model folds into ``mem_w``).
    """

    num_ranks: int
    stage_to_rank: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float | None, ...]
    w: tuple[float | None, ...]
    bw: tuple[float | None, ...]
    comm: float
    mem_f: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    residual: tuple[float, ...] = ()
    peak_bytes: tuple[float, ...] = ()  # measured per rank (max over the window's iterations)
    samples: tuple[int, ...] = ()  # F samples per stage
    schedule: str = ""
    num_microbatches: int = 0
    window: tuple[int, int] = (0, 0)
    memory_source: str = "none"  # "cuda" | "saved-tensors" | "none"
    device: str = "cpu"
    overhead: float = 0.0  # ms of runtime work between two compute actions of a rank (its gap; 0 = not measured)
    # ms per iteration outside its compute actions (optimizer step, loss reductions, the next batch): the shortest
    # rank's time from an iteration's last action to the next one's first (CPU; 0 = not measured)
    boundary: float = 0.0
    statistic: str = "median"  # how times and gaps were summarised (STATISTICS): "median" to plan, "mean" to predict
    mem_b_transient: tuple[float, ...] = ()  # held inside a B above the sum before it (recomputation); () = none
    mem_bw_transient: tuple[float, ...] = ()  # the same inside a fused BW; () = mem_b_transient
    stage_layers: tuple[int, ...] = ()  # transformer layers per virtual stage when profiled (() = not recorded)
    parts: dict[str, Any] | None = None  # per-part costs for the stage planner (model_costs.ModelCosts.from_dict)

    @property
    def num_stages(self) -> int:
        return len(self.f)

    @property
    def splits_backward(self) -> bool:
        """Whether some stage ran B and W apart (a stage that ran fused ``BW`` only is then split in their ratio,
        ``_split``)."""
        return any(b is not None and w is not None for b, w in zip(self.b, self.w))

    @cached_property
    def _b_share(self) -> float | None:
        """B's share of B + W: the median over the stages that ran them apart; when none did, the per-part model's
        layer (``parts``, where the window shared each part's BW in the analytic ratio); ``None``: neither known.
        Computed once per profile (``_split`` asks for it per fused stage)."""
        shares = [b / (b + w) for b, w in zip(self.b, self.w) if b is not None and w is not None and b + w > 0]
        if shares:
            return statistics.median(shares)
        if self.parts is not None:
            layer = self.model_costs().layer
            return layer.b / (layer.b + layer.w) if layer.b + layer.w > 0 else None
        return None

    # -- costs ------------------------------------------------------------------------------------------------
    def _split(self, s: int, *, fused: bool = False) -> tuple[float, float]:
        """(B, W) of stage ``s``; ``fused=True`` lets a stage that only ran ``BW`` count its whole backward as B (W
        about 0) -- right for simulating a plan that fuses it too.  Else such a stage's BW is shared in the B : W
        ratio ``_b_share`` (a memory-capped plan may run every backward of a stage, or of every stage, fused)."""
        b, w, bw = self.b[s], self.w[s], self.bw[s]
        if b is not None and w is not None:
            return b, w
        if bw is not None and fused:
            return bw, _MIN_COST_MS
        if bw is not None and (share := self._b_share) is not None:
            return max(bw * share, _MIN_COST_MS), max(bw * (1.0 - share), _MIN_COST_MS)
        raise ValueError(
            f"profile of {self.schedule!r} has no separate B and W times for stage {s} (it ran fused BW); "
            "profile a split-backward schedule such as zb-h1"
        )

    def to_stage_costs(
        self,
        *,
        chunks: int | None = None,
        stage_to_rank: Sequence[int] | None = None,
        fused: bool = False,
        overhead: bool = False,
    ) -> StageCosts:
        """``StageCosts`` for a plan with ``chunks`` per rank and placement ``stage_to_rank`` (default: as profiled).

        The same placement keeps every virtual stage's own costs; another one gives each rank its profiled share
        (the sum over its stages) spread evenly over its new chunks.  ``fused=True`` accepts stages profiled with
        fused ``BW`` only (see ``_split``); ``overhead=True`` adds the runtime's per-action overhead to F, B and W
        (to F and B only with ``fused``, so a fused BW pays it once).
        """
        target = tuple(self.stage_to_rank if stage_to_rank is None else stage_to_rank)
        p = self.num_ranks
        c = chunks if chunks is not None else len(target) // p
        if len(target) != p * c:
            raise ValueError(f"stage_to_rank has {len(target)} entries, expected p * chunks = {p} * {c}")
        costs = self._stage_costs(target, c, fused)
        if not (overhead and self.overhead > 0):
            return costs
        o = self.overhead  # once per compute action, whatever the placement

        def plus(values: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(v + o for v in values)

        return replace(costs, f=plus(costs.f), b=plus(costs.b), w=costs.w if fused else plus(costs.w))

    def _stage_costs(self, target: tuple[int, ...], c: int, fused: bool) -> StageCosts:
        p = self.num_ranks
        bs, ws = zip(*(self._split(s, fused=fused) for s in range(self.num_stages)), strict=True)
        mf = tuple(float(v) for v in self.mem_f)
        mb = tuple(float(v) for v in self.mem_b)
        mt = tuple(float(v) for v in self.mem_b_transient) or (0.0,) * self.num_stages
        mtw = tuple(float(v) for v in self.mem_bw_transient) or mt
        fs = tuple(max(v, _MIN_COST_MS) for v in self.f)
        bs = tuple(max(v, _MIN_COST_MS) for v in bs)
        ws = tuple(max(v, _MIN_COST_MS) for v in ws)
        if target == tuple(self.stage_to_rank):
            mw = tuple(-(x + y) for x, y in zip(mf, mb))
            return StageCosts(
                f=fs, b=bs, w=ws, comm=self.comm, mem_f=mf, mem_b=mb, mem_w=mw, mem_b_transient=mt, mem_bw_transient=mtw
            )

        def share(values: Sequence[float]) -> list[float]:
            out = [0.0] * p
            for s, v in enumerate(values):
                out[self.stage_to_rank[s]] += v
            return out

        return StageCosts.build(
            num_ranks=p,
            chunks=c,
            stage_to_rank=target,
            f=[max(v, _MIN_COST_MS) for v in share(fs)],
            b=[max(v, _MIN_COST_MS) for v in share(bs)],
            w=[max(v, _MIN_COST_MS) for v in share(ws)],
            comm=self.comm,
            mem_f=share(mf),
            mem_b=share(mb),
            mem_b_transient=share(mt),  # spread over the new chunks like the deltas
            mem_bw_transient=share(mtw),
        )

    def model_costs(self) -> ModelCosts:
        """The stage planner's per-part costs: the ``parts`` entry, or else derived from the stage medians and
        ``stage_layers``: a layer is what the stages without embedding and head cost per layer, the embedding and
        the head are what the first and the last stage cost beyond their layers (needs >= 3 virtual stages)."""
        if self.parts is not None:
            return ModelCosts.from_dict(self.parts)
        S = self.num_stages
        n = self.stage_layers
        if len(n) != S or S < 3 or sum(n[1:-1]) == 0:
            raise ValueError(
                "profile has no per-part costs: add a 'parts' entry (num_layers, layer, embedding, head), or profile "
                "with >= 3 virtual stages and record 'stage_layers'"
            )
        per = [(self.f[s], *self._split(s), self.mem_f[s], self.mem_b[s]) for s in range(S)]
        mid = range(1, S - 1)
        layer = [sum(per[s][k] for s in mid) / sum(n[s] for s in mid) for k in range(5)]

        def beyond(s: int) -> PartCosts:
            v = [max(0.0, per[s][k] - n[s] * layer[k]) for k in range(4)]
            mem_b = max(-v[3], per[s][4] - n[s] * layer[4])  # F keeps >= 0, and >= 0 is held after B
            return PartCosts(f=v[0], b=v[1], w=v[2], mem_f=v[3], mem_b=mem_b)

        kept = max(0.0, layer[3])
        lay = PartCosts(f=layer[0], b=layer[1], w=layer[2], mem_f=kept, mem_b=max(-kept, layer[4]))
        o = self.overhead
        return ModelCosts(
            num_layers=sum(n),
            layer=lay,
            embedding=beyond(0),
            head=beyond(S - 1),
            comm=self.comm,
            overhead=PartCosts(f=o, b=o, w=o),
            step=self.boundary,
        )

    def microbatch_bytes(self) -> float:
        """The most any rank holds for one microbatch (``memory.microbatch_bytes``)."""
        return microbatch_bytes(self.mem_f, self.mem_b, self.stage_to_rank)

    # -- files ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        d["units"] = {"time": "ms", "memory": "bytes"}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if not isinstance(d, dict) or "f" not in d or "stage_to_rank" not in d:
            raise ValueError("not a profile file: expected a JSON object with 'f', 'b', 'w', 'stage_to_rank', ...")
        if d.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')} is not supported (expected {PROFILE_VERSION})")
        kw: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name not in d:
                continue
            v = d[name]
            kw[name] = tuple(v) if isinstance(v, list) else v
        try:
            prof = cls(**kw)
        except TypeError as err:
            raise ValueError(f"profile file is missing a field: {err}") from None
        n = len(prof.stage_to_rank)
        for name in ("f", "b", "w", "bw", "mem_f", "mem_b", "mem_w"):
            if len(getattr(prof, name)) != n:
                raise ValueError(f"profile field {name!r} has {len(getattr(prof, name))} entries, expected {n}")
        if prof.statistic not in STATISTICS:
            raise ValueError(f"profile statistic {prof.statistic!r} must be one of {STATISTICS}")
        if not (math.isfinite(prof.overhead) and prof.overhead >= 0):
            raise ValueError(f"profile overhead {prof.overhead} must be finite and >= 0 (ms per compute action)")
        if not (math.isfinite(prof.boundary) and prof.boundary >= 0):
            raise ValueError(f"profile boundary {prof.boundary} must be finite and >= 0 (ms per iteration)")
        return prof

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"profile {os.fspath(path)!r} is not valid JSON: {err}") from None
        return cls.from_dict(d)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    return Profile.load(path)


def costs_for(profile: Profile, name: str, *, chunks: int | None = None, fused: bool = False) -> tuple[int, StageCosts]:
    """(chunks, StageCosts) of schedule ``name`` under ``profile`` (``fused``: see ``Profile.to_stage_costs``)."""
    spec = registry.get(name)
    c = spec.default_chunks if chunks is None else chunks
    target = placement_of(name, profile.num_ranks, c)
    return c, profile.to_stage_costs(chunks=c, stage_to_rank=target, fused=fused)


def predict_makespan(profile: Profile, schedule: Schedule, *, overhead: bool = True) -> float:
    """The iteration span ``schedule`` should take under ``profile``'s costs (ms): ``simulate`` under the per-stage
    medians, plus the runtime's per-action overhead when ``overhead`` (default) and the profile measured it.  A
    plan that fuses every backward may be predicted from a profile of fused ``BW`` times."""
    c = schedule.num_stages // schedule.num_ranks
    costs = profile.to_stage_costs(
        chunks=c, stage_to_rank=tuple(schedule.stage_to_rank), fused=fuses_backward(schedule), overhead=overhead
    )
    return simulate(schedule, costs).makespan


def fuses_backward(schedule: Schedule) -> bool:
    """Whether every backward of ``schedule`` is a fused ``BW`` (no separate B or W)."""
    return not any(a.kind in (Kind.B, Kind.W) for acts in schedule.ranks for a in acts)


def mem_limit_for_microbatches(profile: Profile, n: float) -> float:
    """``--zero-bubble-max-pending-backward N`` in bytes under ``profile``'s measured memory (with the run's
    recomputation in force): ``memory.pending_bytes``."""
    return pending_bytes(n, profile.mem_f, profile.mem_b, profile.mem_b_transient, stage_to_rank=profile.stage_to_rank)


def profile_is_finite(profile: Profile) -> bool:
    """True when every measured time is a finite number (a sanity check for tools)."""
    vals = [v for v in (*profile.f, *profile.b, *profile.w) if v is not None]
    return all(math.isfinite(v) for v in vals)


def split_cost_ratio(split: Profile, fused: Profile) -> tuple[float | None, ...]:
    """Per virtual stage, (B + W) as ``split`` measured it (a split-backward schedule's run) over BW as ``fused``
    measured it (a fused schedule's run, e.g. 1F1B) on the same stages: what splitting the backward costs inside
    the pipeline (1.0: nothing).  ``None`` for a stage either profile lacks; ``ValueError`` if the stages differ."""
    if split.num_stages != fused.num_stages:
        raise ValueError(
            f"profiles of {split.schedule!r} ({split.num_stages} stages) and {fused.schedule!r} "
            f"({fused.num_stages} stages) are of different layouts"
        )
    out = []
    for b, w, bw in zip(split.b, split.w, fused.bw):
        out.append(None if b is None or w is None or not bw else (b + w) / bw)
    return tuple(out)
