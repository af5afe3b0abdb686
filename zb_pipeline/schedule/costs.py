"""Per-virtual-stage compute costs and activation-memory deltas, as the simulator and the generators read them.

Costs are given the way users think of them (see ``StageCosts.build``):
- one number, or a list with one number per rank: the cost of a rank's *whole share* of layers for one
  microbatch; with several chunks per rank each chunk costs its ``1/chunks`` part;
- a list with one number per virtual stage: each chunk gets its own cost.

Memory follows the same rule.  The model: F adds ``mem_f``, B adds ``mem_b``, W adds ``mem_w`` and
``mem_f + mem_b + mem_w == 0`` (a fused BW adds ``mem_b + mem_w``).  ``mem_b_transient`` (default 0) is what a B
holds *while it runs* above the sum before it: the activations activation recomputation rebuilds for one segment
(``zb_pipeline.runtime.recompute``), freed again before the B ends, plus the W work it has queued by then;
``mem_bw_transient`` (default: ``mem_b_transient``) the same for a fused BW, which queues nothing.  The default
``mem_b = 0, mem_w = -mem_f`` counts a microbatch as resident from its F until its W, the conservative reading used
for the schedules' bounds.

``overlap`` prices an overlapped pair (``ir.PairAction``, DualPipe's F&B: a forward and a full backward run together
on one rank): it costs ``max(overlap * (f + b + w), f, b + w)`` of its halves' stages -- never less than its longer
half.  The default 1 is the sum of the parts (what the runtime's back-to-back execution does); a small factor means
perfect overlap (the pair takes as long as its longer half).  It must lie in (0, 1]; plans without pairs ignore it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Number = float | int
CostSpec = Number | Sequence[Number]


@dataclass(frozen=True)
class StageCosts:
    """Costs and memory deltas per virtual stage (index = virtual stage)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    mem_f: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    overlap: float = 1.0  # an F+BW pair costs overlap * (f + b + w), at least its longer half (module docstring)
    mem_b_transient: tuple[float, ...] = ()  # held inside a B above the sum before it (recompute); () = zeros
    mem_bw_transient: tuple[float, ...] = ()  # the same inside a fused BW; () = mem_b_transient

    def __post_init__(self) -> None:
        n = len(self.f)
        if not self.mem_b_transient:
            object.__setattr__(self, "mem_b_transient", (0.0,) * n)
        if not self.mem_bw_transient:
            object.__setattr__(self, "mem_bw_transient", self.mem_b_transient)
        for name in ("mem_b_transient", "mem_bw_transient"):
            t = getattr(self, name)
            if len(t) != n or any(not (math.isfinite(v) and v >= 0) for v in t):
                raise ValueError(f"{name} {t} must be {n} finite values >= 0")
        for name in ("b", "w", "mem_f", "mem_b", "mem_w"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StageCosts.{name} has {len(getattr(self, name))} entries, expected {n}")
        for name in ("f", "b", "w"):
            for s, v in enumerate(getattr(self, name)):
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"cost {name.upper()} of stage {s} is {v}: costs must be finite and > 0")
        if not (math.isfinite(self.comm) and self.comm >= 0):
            raise ValueError(f"communication cost {self.comm} must be finite and >= 0")
        if not (math.isfinite(self.overlap) and 0 < self.overlap <= 1):
            raise ValueError(f"overlap factor {self.overlap} must be in (0, 1] (an F+BW pair costs overlap x (F + BW))")
        for s in range(n):
            total = self.mem_f[s] + self.mem_b[s] + self.mem_w[s]
            if abs(total) > 1e-9 * max(1.0, abs(self.mem_f[s])):
                raise ValueError(
                    f"memory deltas of stage {s} must sum to 0 (mem_f + mem_b + mem_w), got "
                    f"{self.mem_f[s]} + {self.mem_b[s]} + {self.mem_w[s]} = {total}"
                )

    @property
    def num_stages(self) -> int:
        return len(self.f)

    def bw(self, stage: int) -> float:
        """Cost of a fused full backward."""
        return self.b[stage] + self.w[stage]

    def pair(self, f_stage: int, b_stage: int) -> float:
        """Cost of an overlapped pair: the forward of ``f_stage`` with the full backward of ``b_stage`` (module
        docstring)."""
        f, bw = self.f[f_stage], self.b[b_stage] + self.w[b_stage]
        return f + bw if self.overlap == 1.0 else max(self.overlap * (f + bw), f, bw)

    @classmethod
    def build(
        cls,
        *,
        num_ranks: int,
        chunks: int = 1,
        stage_to_rank: Sequence[int] | None = None,
        f: CostSpec = 1.0,
        b: CostSpec = 1.0,
        w: CostSpec = 1.0,
        comm: Number = 0.0,
        mem_f: CostSpec = 1.0,
        mem_b: CostSpec | None = None,
        mem_w: CostSpec | None = None,
        overlap: Number = 1.0,
        mem_b_transient: CostSpec = 0.0,
        mem_bw_transient: CostSpec | None = None,
    ) -> StageCosts:
        """Expand user-style specs to per-virtual-stage tuples.

        ``stage_to_rank`` (default: loop placement) says which rank's share a per-rank value applies to.
        ``mem_b`` defaults to 0 and ``mem_w`` to ``-(mem_f + mem_b)``.
        """
        if num_ranks < 1:
            raise ValueError(f"number of ranks p={num_ranks} must be >= 1")
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1")
        num_stages = num_ranks * chunks
        if stage_to_rank is None:
            stage_to_rank = [s % num_ranks for s in range(num_stages)]
        if len(stage_to_rank) != num_stages:
            raise ValueError(f"stage_to_rank has {len(stage_to_rank)} entries, expected {num_stages}")

        def expand(name: str, spec: CostSpec) -> tuple[float, ...]:
            if isinstance(spec, (int, float)):
                values = [float(spec)] * num_ranks
            else:
                values = [float(v) for v in spec]
                if len(values) == num_stages:  # one per virtual stage: taken as given
                    return tuple(values)
                if len(values) == 1:
                    values = values * num_ranks
                elif len(values) != num_ranks:
                    per_stage = f" or one per virtual stage ({num_stages})" if chunks > 1 else ""
                    raise ValueError(
                        f"--{name.replace('_', '-')} has {len(values)} values: give one number, one per rank "
                        f"({num_ranks}){per_stage}"
                    )
            # A rank's whole share: each of its chunks costs 1/chunks of it.
            return tuple(values[stage_to_rank[s]] / chunks for s in range(num_stages))

        fs, bs, ws = expand("cost_f", f), expand("cost_b", b), expand("cost_w", w)
        mf = expand("mem_f", mem_f)
        mb = expand("mem_b", 0.0 if mem_b is None else mem_b)
        if mem_w is None:
            mw = tuple(-(x + y) for x, y in zip(mf, mb, strict=True))
        else:
            mw = expand("mem_w", mem_w)
        mt = expand("mem_b_transient", mem_b_transient)
        mtw = mt if mem_bw_transient is None else expand("mem_bw_transient", mem_bw_transient)
        return cls(
            f=fs,
            b=bs,
            w=ws,
            comm=float(comm),
            mem_f=mf,
            mem_b=mb,
            mem_w=mw,
            overlap=float(overlap),
            mem_b_transient=mt,
            mem_bw_transient=mtw,
        )

    @classmethod
    def uniform(
        cls, num_stages: int, *, f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0
    ) -> StageCosts:
        """The same cost on every virtual stage, default memory model (mem_f = 1 per stage)."""
        n = num_stages
        return cls(
            f=(float(f),) * n,
            b=(float(b),) * n,
            w=(float(w),) * n,
            comm=float(comm),
            mem_f=(1.0,) * n,
            mem_b=(0.0,) * n,
            mem_w=(-1.0,) * n,
        )
