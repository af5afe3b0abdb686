"""zb-auto's family of list-scheduler variants: the anchors (ZB-H1, ZB-H2) and the knobs the search tries.

ZB-H1 is the static variant warm = p - r, lag = r; ZB-H2 is the dynamic one with warm = 2(p-r) - 1, B first, no
lag and theta_w = 0.  These two *anchors* run first and uncut, so the search's own result is never worse than ZB-H1
or ZB-H2 within its limit, for any costs, T_comm > 0 included.

The rest of the family: warm-up budgets (none, the number of forwards that fit before the first gradient returns
computed from the real per-stage costs, rounded both ways, 1F1B's ``p - r`` and ZB-H2's ``2(p - r) - 1``),
``ahead``, ``lag``, W thresholds ``theta_w`` in {-inf, 0, 1/2, 1, inf}, ``f_fits`` and ``guard``, and the static
orders.  The variants that were most often best on a measured grid (``FIRST``) come first.
"""

from __future__ import annotations

import math

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.zb_auto_passes import INF, Policy


def fill_counts(m: int, costs: StageCosts, *, round_up: bool) -> tuple[int, ...]:
    """Per rank: how many forwards fit between its first F and the return of the first gradient.

    With every rank working as early as it can on microbatch 0, rank r starts at sum_{q<r}(T_F[q] + c) and the
    gradient of microbatch 0 reaches it at sum_q T_F[q] + (p-1) c + sum_{q>r}(T_B[q] + c).  ZB-H2's warm-up
    ``2(p - r) - 1`` is this count with F = B and c = 0.
    """
    p = costs.num_stages
    c = costs.comm
    total_f = sum(costs.f) + (p - 1) * c
    out = []
    start = 0.0
    for r in range(p):
        back = sum(costs.b[q] + c for q in range(r + 1, p))
        x = (total_f - start + back) / costs.f[r]
        n = math.ceil(x - 1e-9) if round_up else math.floor(x + 1e-9)
        out.append(max(1, min(m, n)))
        start += costs.f[r] + c
    return tuple(out)


def variant(
    warm: tuple[int, ...],
    ahead: tuple[int, ...],
    lag: tuple[int, ...],
    theta_w: float,
    f_fits: bool,
    guard: bool,
    label: str,
    static: bool = False,
) -> Policy:
    """A ``Policy``; a static one in canonical form (the fields it ignores zeroed, so duplicates are found)."""
    if static:
        ahead, theta_w, f_fits, guard = (0,) * len(warm), 0.0, False, False
        # No rank may want more forwards in flight than the rank before it can send: else it waits for an F
        # that comes only after its own B (a deadlock).
        warm = tuple(min(warm[: r + 1]) for r in range(len(warm)))
    return Policy(warm, ahead, lag, theta_w, f_fits, guard, label, static)


def anchors(p: int, m: int) -> list[Policy]:
    """The handcrafted orders as members of the family: ZB-H1 (static, warm p - r, W lagging r behind B) and
    ZB-H2 (dynamic, warm 2(p - r) - 1, B first, F within the limit, W where it ends before the next arrival).

    They run first and uncut, so the search's own result is never worse than these orders within its limit."""
    h1 = variant(
        tuple(max(1, min(m, p - r)) for r in range(p)), (0,) * p, tuple(range(p)), 0.0, False, False,
        "static warm=1f1b lag=rank", static=True,
    )  # fmt: skip
    h2 = variant(
        tuple(max(1, min(m, 2 * (p - r) - 1)) for r in range(p)), (0,) * p, (m,) * p, 0.0, False, False,
        "warm=h2 ahead=0 lag=none theta_w=0.0 f_fits=False guard=False",
    )  # fmt: skip
    return [h1, h2]


def policies(p: int, m: int, costs: StageCosts) -> list[Policy]:
    """The family of variants the search runs, in order: the anchors, then the rest (no two alike)."""
    warms: list[tuple[str, tuple[int, ...]]] = [("free", (m,) * p)]
    for label, wm in (
        ("fill-", fill_counts(m, costs, round_up=False)),
        ("fill+", fill_counts(m, costs, round_up=True)),
        ("1f1b", tuple(max(1, min(m, p - r)) for r in range(p))),
        ("h2", tuple(max(1, min(m, 2 * (p - r) - 1)) for r in range(p))),
    ):
        if all(wm != w_ for _, w_ in warms):
            warms.append((label, wm))
    lags = (("none", (m,) * p), ("rank", tuple(range(p))))
    out = []
    for label, wm in warms:
        for ahead_label, ahead in (("0", (0,) * p), ("warm", wm)):
            for lag_label, lag in lags:
                for theta_w in (-INF, 0.0, 0.5, 1.0, INF):
                    for f_fits in (False, True):
                        for guard in (False, True) if math.isfinite(theta_w) else (theta_w < 0,):
                            name = (
                                f"warm={label} ahead={ahead_label} lag={lag_label} theta_w={theta_w} "
                                f"f_fits={f_fits} guard={guard}"
                            )
                            out.append(variant(wm, ahead, lag, theta_w, f_fits, guard, name))
        if label != "free":  # a static order needs a finite number of forwards in flight
            for lag_label, lag in (*lags, ("0", (0,) * p), ("rank/2", tuple(r // 2 for r in range(p)))):
                out.append(variant(wm, (0,) * p, lag, 0.0, False, False, f"static warm={label} lag={lag_label}", True))
    # Most useful first (measured: how often a variant alone is best over a grid of shapes and cost ratios), so
    # that the cut of later passes bites early.
    rank = {label: i for i, label in enumerate(FIRST)}
    out.sort(key=lambda pol: rank.get(pol.label, len(rank)))
    family, seen = [], set()
    for pol in anchors(p, m) + out:
        key = (pol.warm, pol.ahead, pol.lag, pol.theta_w, pol.f_fits, pol.guard, pol.static)
        if key not in seen:
            seen.add(key)
            family.append(pol)
    return family


# The variants that always run (after the anchors), most often best first.
FIRST = (
    "warm=fill- ahead=warm lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=1f1b ahead=warm lag=rank theta_w=0.0 f_fits=False guard=False",
    "warm=fill- ahead=warm lag=rank theta_w=0.0 f_fits=False guard=False",
    "warm=free ahead=0 lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=1f1b ahead=warm lag=none theta_w=0.5 f_fits=False guard=False",
    "warm=fill- ahead=warm lag=none theta_w=0.5 f_fits=False guard=False",
    "warm=fill+ ahead=warm lag=none theta_w=0.5 f_fits=False guard=False",
    "warm=1f1b ahead=warm lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=free ahead=0 lag=none theta_w=0.0 f_fits=False guard=True",
    "warm=fill- ahead=0 lag=rank theta_w=0.5 f_fits=True guard=False",
    "warm=1f1b ahead=warm lag=rank theta_w=0.5 f_fits=True guard=False",
    "warm=fill- ahead=0 lag=none theta_w=1.0 f_fits=False guard=False",
    "warm=fill+ ahead=warm lag=rank theta_w=0.0 f_fits=False guard=False",
    "warm=fill+ ahead=0 lag=rank theta_w=0.0 f_fits=False guard=False",
)
