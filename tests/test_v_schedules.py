"""zb-v, v-half and v-min: valid under the strict validator, within their exact memory caps, planned from real costs.

Memory is counted in half-units: with ``StageCosts.uniform(2p)`` each chunk's F adds 1, so a rank's whole share
M_r is 2 and ``cap_units(name, p)`` is directly the bound on every rank's peak.
"""

from __future__ import annotations

import pytest
from vshape_plan_checks import check_plan

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.v_shape import cap_units, plan_variants, rank_caps
from zb_pipeline.schedule.ir import v_placement
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.registry import generate, get
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

NAMES = ("zb-v", "v-half", "v-min")


def costs_for(kind: str, p: int) -> StageCosts:
    """Cost settings: uniform F=B=W; F=B=2W; heterogeneous per virtual stage with T_comm and uneven memory."""
    S = 2 * p
    if kind == "uniform":
        return StageCosts.uniform(S)
    if kind == "w-half":
        return StageCosts.uniform(S, f=1.0, b=1.0, w=0.5)
    if kind == "hetero":
        # first and last virtual stages carry the embedding and the output head; rank 0 holds both in V placement
        f = [1.0 + 0.1 * (s % 3) for s in range(S)]
        f[0] += 0.7
        f[-1] += 1.5
        b = [2.0 * x for x in f]
        w = [0.6 * x for x in f]
        mem_f = [1.0 + 0.25 * (s % 2) for s in range(S)]
        return StageCosts(
            f=tuple(f),
            b=tuple(b),
            w=tuple(w),
            comm=0.3,
            mem_f=tuple(mem_f),
            mem_b=(0.0,) * S,
            mem_w=tuple(-x for x in mem_f),
        )
    raise AssertionError(kind)


def check(name: str, p: int, m: int, costs: StageCosts) -> None:
    sched = generate(name, p, m, chunks=2, costs=costs)
    assert sched.placement == ("loop" if p == 1 else "v") and sched.stage_to_rank == v_placement(p, 2)
    caps = rank_caps(name, p, costs, None)
    check_and_lower(sched, costs=costs, mem_limit=max(caps))  # strict P2P model, lowering with local V hand-offs
    peaks = peak_memory(sched, costs)
    for r in range(p):
        assert peaks[r] <= caps[r] + 1e-9, f"{name} p={p} m={m}: rank {r} peak {peaks[r]} > cap {caps[r]}"
    # Independent: completeness, dependencies.  Hand-offs may be consumed out of their sender's order: lowering
    # posts every receive when its data is produced (so in the sender's order), and check_and_lower() above has already
    # run the strict one-order-per-pair model on the lowered plan.
    check_plan(sched, costs, check_channels=False)


def _subset() -> list[tuple[str, int, int, str]]:
    cases = []
    for p in (1, 2, 3, 4, 5, 7):
        for m in sorted({1, 2, p - 1, p, p + 1, 2 * p + 1, 3 * p} - {0}):
            for name in NAMES:
                kind = ("uniform", "w-half", "hetero")[(p + m) % 3]
                cases.append((name, p, m, kind))
    return cases


@pytest.mark.parametrize("name,p,m,kind", _subset())
def test_generators_valid_within_caps(name: str, p: int, m: int, kind: str) -> None:
    check(name, p, m, costs_for(kind, p))


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 17))
@pytest.mark.parametrize("name", NAMES)
def test_full_grid(name: str, p: int) -> None:
    # Every m in 1..64 for p <= 6; beyond that a stratified third of them (every m below p + 2 included).
    for m in range(1, 65):
        if p > 6 and m > p + 2 and m % 3 != p % 3:
            continue
        check(name, p, m, costs_for(("uniform", "w-half", "hetero")[m % 3], p))


def test_registry_entries() -> None:
    for name in NAMES:
        spec = get(name)
        assert spec.chunks == (2,) and spec.placement == "v"


def test_cap_units_table() -> None:
    """The papers' caps: zb-v p, v-half floor((p + 2) / 2), v-min floor((p + 4) / 3) whole shares (here in halves)."""
    assert [cap_units("zb-v", p) for p in (1, 2, 3, 4, 8, 16, 24, 32)] == [2, 4, 6, 8, 16, 32, 48, 64]
    assert [cap_units("v-half", p) for p in (1, 2, 3, 4, 8, 16, 24, 32)] == [2, 4, 4, 6, 10, 18, 26, 34]
    assert [cap_units("v-min", p) for p in (1, 2, 3, 4, 8, 16, 24, 32)] == [2, 4, 4, 4, 8, 12, 18, 24]


def test_registry_states_the_caps() -> None:
    """The registry's stated bound (whole shares) is the cap, for the trainer, the CLI and the benchmarks."""
    for p in (1, 2, 3, 4, 8, 16, 24, 32):
        for name in NAMES:
            assert get(name).stated_memory_bound(p, 4 * p) == cap_units(name, p) / 2, (name, p)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8])
def test_peak_within_cap(p: int) -> None:
    """Uniform costs, m = 3p: every rank's peak is within its cap, and zb-v's warm-up fills its cap exactly."""
    costs = StageCosts.uniform(2 * p)
    for name in NAMES:
        sched = generate(name, p, 3 * p, chunks=2, costs=costs)
        peak = max(peak_memory(sched, costs))
        assert peak <= cap_units(name, p), (name, peak)
        if name == "zb-v":
            assert peak == cap_units(name, p)


def test_zb_v_at_most_p_whole_units_default_memory_model() -> None:
    """With the default memory model (mem_f = 1 for a rank's whole share, 1/2 per chunk) ZB-V's peak is <= p."""
    for p in (2, 3, 4):
        sched = generate("zb-v", p, 4 * p)
        check_and_lower(sched, mem_limit=p)
        costs = StageCosts.build(num_ranks=p, chunks=2, stage_to_rank=v_placement(p, 2))
        assert max(peak_memory(sched, costs)) == p


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_bubble_bound(p: int) -> None:
    """F = B = W (per chunk 1), T_comm = 0: zb-v ends at the iteration lower bound, 6m + p - 1, and no rank idles
    inside its span (makespan 6m); the grid up to p = 32 is in tests/test_v_targets.py."""
    costs = StageCosts.uniform(2 * p)
    for m in (2 * p, 3 * p + 1):
        res = simulate(generate("zb-v", p, m, costs=costs), costs)
        assert (res.end_time, res.makespan) == (6 * m + p - 1, 6 * m), (p, m)


def _rates(name: str, p: int, m: int, w: float) -> tuple[float, float, float]:
    """(bubble rate of ``name``, of 1F1B at the same whole-share costs, makespan - m(F+B+W) in chunk-F units)."""
    costs = StageCosts.uniform(2 * p, f=1.0, b=1.0, w=w)
    res = simulate(generate(name, p, m, costs=costs), costs)
    flat = StageCosts.uniform(p, f=2.0, b=2.0, w=2.0 * w)
    ref = simulate(generate("1f1b", p, m, costs=flat), flat)
    return res.bubble_rate, ref.bubble_rate, res.makespan - 2 * m * (2.0 + w)


# Bounds at uniform per-chunk costs, T_comm = 0 (the table with communication: tests/test_v_targets.py):
# - v-half: never a larger bubble rate than 1F1B, at F = B = W and at F = B = 2W (measured over p = 2..16,
#   m in {2p, 4p}: at least 1.3 points below);
# - v-min: at most 1F1B's + 12 points (measured: below 1F1B at F = B = W; at most 9.8 points over at F = B = 2W,
#   p = 6, m = 24).  The earlier version missed 1F1B + 15 at p = 3, 6, ..., 15, m = 4p, F = B = 2W under its tighter
#   cap; under the paper's cap floor((p + 4) / 3) those are 9-10 points over.
V_HALF_SLACK = {1.0: 0.0, 0.5: 0.0}
V_MIN_SLACK = 0.12


def _check_rate_bound(name: str, p: int, m: int, w: float) -> None:
    rate, ref, _ = _rates(name, p, m, w)
    slack = V_HALF_SLACK[w] if name == "v-half" else V_MIN_SLACK
    assert rate <= ref + slack + 1e-9, (name, p, m, w, rate, ref)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_v_half_v_min_bubble_against_1f1b(p: int) -> None:
    for m in (2 * p, 4 * p):
        for w in (1.0, 0.5):
            for name in ("v-half", "v-min"):
                _check_rate_bound(name, p, m, w)


def _grid() -> list:
    out = []
    for p in (3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16):
        for m in (2 * p, 4 * p):
            for w in (1.0, 0.5):
                for name in ("v-half", "v-min"):
                    out.append(pytest.param(name, p, m, w))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "p", "m", "w"), _grid())
def test_v_half_v_min_bubble_against_1f1b_grid(name: str, p: int, m: int, w: float) -> None:
    _check_rate_bound(name, p, m, w)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(2, 17))
def test_zb_v_bubble_bound_grid(p: int) -> None:
    """zb-v, m in {2p, 4p}: makespan - m(F+B+W) is 0 at F = B = W and at most p - 1.5 chunk-F units at F = B = 2W
    (measured exactly p - 1.5 for p >= 3; the earlier version's bound was 1.5p)."""
    for w, slack in ((1.0, 0.0), (0.5, p - 1.5)):
        for m in (2 * p, 4 * p):
            _, _, excess = _rates("zb-v", p, m, w)
            assert excess <= max(0.0, slack) + 1e-9, (p, m, w, excess)


def test_planned_from_real_costs() -> None:
    """Variants are compared under the given heterogeneous costs: the chosen plan's simulated makespan is the
    smallest of them, and planning from flattened (median-like) costs gives a different plan."""
    p, m = 4, 12
    true = costs_for("hetero", p)
    flat = StageCosts.uniform(2 * p, f=1.2, b=2.4, w=0.7, comm=0.3)
    for name in NAMES:
        caps = rank_caps(name, p, true, None)
        chosen = generate(name, p, m, costs=true)
        spans = [span for span, _ in plan_variants(name, p, m, true, caps)]
        assert simulate(chosen, true).makespan == pytest.approx(min(spans), abs=1e-9), name
        assert len(spans) >= 4
    assert generate("zb-v", p, m, costs=true).ranks != generate("zb-v", p, m, costs=flat).ranks


def test_mem_limit_lowers_cap_and_rejects_too_small() -> None:
    p, m = 4, 16
    costs = StageCosts.uniform(2 * p)
    sched = generate("zb-v", p, m, costs=costs, mem_limit=5)
    assert max(peak_memory(sched, costs)) <= 5
    check_and_lower(sched, costs=costs, mem_limit=5)
    with pytest.raises(ValueError, match="smallest limit that works is 2"):
        generate("v-min", p, m, costs=costs, mem_limit=1.5)


def test_bad_shapes_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="chunks"):
        generate("zb-v", 4, 8, chunks=3)
    with pytest.raises(ValueError, match="m=0"):
        generate("v-half", 4, 0)
