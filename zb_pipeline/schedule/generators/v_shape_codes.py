"""Plans of the V generators as integer codes, and the compiled passes behind them (with the Python reference).

A plan here is one list of codes per rank, ``(stage * m + microbatch) * 3 + kind`` with kind 0 = F, 1 = B, 2 = W,
so that candidates can be made and timed without building ``Action`` objects; only the chosen plan becomes a
``Schedule`` (its actions are interned, so plans share them).

Speed: ``zb_pipeline.schedule._v_shape_cpp`` (built from ``csrc/v_shape_passes.cpp``) runs the alternating pass,
the block's order, floor and squeeze, and the simulator's makespan; without it the Python reference in
``v_shape_alternate`` / ``v_shape_block`` / ``simulate`` runs, with identical plans and numbers (tested in
``tests/test_v_fast.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.zb_auto_passes import extension_backend
from zb_pipeline.schedule.ir import Action, Kind, Schedule, v_placement
from zb_pipeline.schedule.simulate import simulate

try:  # the compiled passes; the Python reference is the fallback
    from zb_pipeline.schedule import _v_shape_cpp as cpp
except ImportError:  # pragma: no cover - depends on the build
    cpp = None

Codes = list[list[int]]
_KINDS = (Kind.F, Kind.B, Kind.W)
_KIND_CODE = {Kind.F: 0, Kind.B: 1, Kind.W: 2}


def resolve_backend(name: str | None) -> str:
    """``"cpp"`` when the extension is built (or asked for), else ``"python"``."""
    return extension_backend(name, cpp, "_v_shape_cpp")


def cost_args(costs: StageCosts) -> tuple:
    """The per-stage arrays the compiled passes take: f, b, w, comm, mem_f, mem_b, mem_w."""
    return (costs.f, costs.b, costs.w, costs.comm, costs.mem_f, costs.mem_b, costs.mem_w)


def to_codes(ranks: Sequence[Sequence[Action]], m: int) -> Codes:
    return [[(a.stage * m + a.microbatch) * 3 + _KIND_CODE[a.kind] for a in acts] for acts in ranks]


def _action(stage: int, kind: Kind, mb: int) -> Action:
    """``Action(stage, kind, mb)`` without re-running its checks (the codes are in range by construction)."""
    a = object.__new__(Action)
    for name, value in (("stage", stage), ("kind", kind), ("microbatch", mb), ("peer", None)):
        object.__setattr__(a, name, value)
    return a


@functools.lru_cache(maxsize=4)
def _table(num_stages: int, m: int) -> tuple[Action, ...]:
    """Code -> interned Action for ``num_stages`` stages and ``m`` microbatches."""
    return tuple(_action(s, kind, k) for s in range(num_stages) for k in range(m) for kind in _KINDS)


def actions_of(p: int, m: int, plan: Sequence[int]) -> tuple[Action, ...]:
    """One rank's plan of codes as its (interned) actions."""
    return tuple(map(_table(2 * p, m).__getitem__, plan))


def to_schedule(name: str, p: int, m: int, codes: Codes) -> Schedule:
    table = _table(2 * p, m)
    return Schedule(name, p, 2 * p, m, v_placement(p, 2), [tuple(map(table.__getitem__, c)) for c in codes])


def makespan(p: int, m: int, costs: StageCosts, codes: Codes, backend: str) -> float:
    """The simulator's makespan of a plan given as codes."""
    if backend == "cpp":
        return cpp.makespan(p, m, costs.f, costs.b, costs.w, costs.comm, codes)
    return simulate(to_schedule("v", p, m, codes), costs).makespan
