"""The stage planner against brute force on the simulator: every split and recompute choice of small models."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.stage_planner import (
    ModelCosts,
    PartCosts,
    PlannerError,
    RecomputeOption,
    StepShare,
    evaluate_split,
    plan_stages,
    smallest_mem_limit,
)

# A layer: F 1, B 1, W 0.8; F keeps 4 units.  Full recompute re-runs F in B and keeps only the layer input (1 unit),
# B then holds what W needs (2 units).  The head costs about two layers, the embedding almost nothing.
LAYER = PartCosts(f=1.0, b=1.0, w=0.8, mem_f=4.0)
EMBEDDING = PartCosts(f=0.05, b=0.01, w=0.05, mem_f=0.5)
HEAD = PartCosts(f=2.1, b=2.0, w=1.9, mem_f=6.0)
FULL = RecomputeOption("full", b_extra=1.0, mem_f=1.0, mem_b=2.0)
SELECTIVE = RecomputeOption("selective", b_extra=0.3, mem_f=3.0)


def model(num_layers: int, *, recompute: tuple[RecomputeOption, ...] = (), comm: float = 0.0) -> ModelCosts:
    return ModelCosts(
        num_layers=num_layers, layer=LAYER, embedding=EMBEDDING, head=HEAD, comm=comm, recompute=recompute
    )


def compositions(total: int, parts: int):
    for cut in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cut, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def brute_force(mc: ModelCosts, name: str, p: int, m: int, chunks: int, mem_limit: float | None):
    """Every candidate: (end time, peak, layers, options) of those the generator serves within the limit."""
    S = p * chunks
    out = []
    for layers in compositions(mc.num_layers, S):
        for opts in itertools.product(range(len(mc.recompute) + 1), repeat=S):
            costs = mc.stage_costs(layers, opts)
            try:
                plan = registry.generate(name, p, m, chunks=chunks, costs=costs, mem_limit=mem_limit)
            except ValueError:
                continue
            peak = max(peak_memory(plan, costs))
            if mem_limit is not None and peak > mem_limit:
                continue
            out.append((simulate(plan, costs).end_time, peak, layers, opts))
    return out


CASES = [
    ("1f1b", 2, 4, 1, 6, ()),
    ("zb-h1", 3, 6, 1, 7, ()),
    ("zb-h1", 2, 4, 1, 5, (FULL,)),
    ("zb-h2", 2, 4, 1, 6, (FULL,)),
    ("zb-v", 2, 4, 2, 6, ()),
    ("interleaved-1f1b", 2, 4, 2, 6, ()),
    ("zb-auto", 2, 4, 1, 5, (FULL,)),
]


@pytest.mark.parametrize("name,p,m,chunks,num_layers,rec", CASES)
def test_split_is_optimal_against_brute_force(name, p, m, chunks, num_layers, rec) -> None:
    mc = model(num_layers, recompute=rec, comm=0.05)
    got = plan_stages(mc, schedule=name, num_ranks=p, num_microbatches=m, chunks=chunks)
    best = min(c[0] for c in brute_force(mc, name, p, m, chunks, None))
    assert got.exact
    assert got.iteration == pytest.approx(best, rel=1e-12)
    assert sum(got.layers) == num_layers and len(got.layers) == p * chunks and min(got.layers) >= 1
    # The answer is what it says: its own costs simulate to its iteration.
    assert simulate(got.schedule, got.costs).end_time == pytest.approx(got.iteration, rel=1e-12)
    assert got.costs == mc.stage_costs(got.layers, [mc.option_names().index(r) for r in got.recompute])


def test_head_heavy_model_moves_layers_off_the_last_stage() -> None:
    got = plan_stages(model(4), schedule="zb-h1", num_ranks=2, num_microbatches=4)
    even = model(4).stage_costs((2, 2), (0, 0))
    assert got.layers == (3, 1)
    assert got.iteration < simulate(registry.generate("zb-h1", 2, 4), even).end_time


def test_recompute_choice_between_zb_h1_and_zb_h2_peaks() -> None:
    """A limit between ZB-H1's and ZB-H2's peaks: ZB-H2 without recompute does not fit; the planner's choice is the
    candidate with the shortest simulated iteration that does, and it recomputes somewhere."""
    p, m, L = 2, 6, 6
    mc = model(L, recompute=(FULL, SELECTIVE))
    even = mc.stage_costs((3, 3), (0, 0))
    h1 = max(peak_memory(registry.generate("zb-h1", p, m, costs=even), even))
    h2 = max(peak_memory(registry.generate("zb-h2", p, m, costs=even), even))
    limit = (h1 + h2) / 2
    assert h1 < limit < h2
    got = plan_stages(mc, schedule="zb-h2", num_ranks=p, num_microbatches=m, mem_limit=limit)
    fits = brute_force(mc, "zb-h2", p, m, 1, limit)
    best = min(fits)
    assert got.iteration == pytest.approx(best[0], rel=1e-12)
    assert max(got.peak_memory) <= limit
    assert any(r != "none" for r in got.recompute)
    # No recompute anywhere does not fit, whatever the split.
    assert not [c for c in fits if not any(c[3])]
    unlimited = plan_stages(mc, schedule="zb-h2", num_ranks=p, num_microbatches=m)
    assert unlimited.iteration <= got.iteration and max(unlimited.peak_memory) > limit


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_infeasible_limit_names_the_smallest_that_works(name) -> None:
    p, m, L = 2, 4, 5
    mc = model(L, recompute=(FULL,))
    smallest = min(c[1] for c in brute_force(mc, name, p, m, 1, None))
    assert smallest_mem_limit(mc, schedule=name, num_ranks=p, num_microbatches=m) == pytest.approx(smallest, rel=0.005)
    with pytest.raises(PlannerError, match=r"the smallest limit that works is ([0-9.e+]+)") as err:
        plan_stages(mc, schedule=name, num_ranks=p, num_microbatches=m, mem_limit=smallest * 0.99)
    named = float(str(err.value).rsplit(" ", 1)[1])
    assert named == pytest.approx(smallest, rel=0.005)
    assert max(plan_stages(mc, schedule=name, num_ranks=p, num_microbatches=m, mem_limit=named).peak_memory) <= named


def test_evaluation_cap_says_the_answer_is_not_proven() -> None:
    mc = model(12, recompute=(FULL,))
    got = plan_stages(mc, schedule="1f1b", num_ranks=4, num_microbatches=8, max_evaluations=1)
    assert got.evaluations == 1 and not got.exact and math.isfinite(got.iteration)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="at least 1 layer"):
        plan_stages(model(3), schedule="zb-h1", num_ranks=4, num_microbatches=4)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        PartCosts(f=-1.0, b=1.0, w=1.0)
    with pytest.raises(ValueError, match="reserved"):
        RecomputeOption("none", b_extra=1.0, mem_f=1.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        plan_stages(model(4), schedule="nope", num_ranks=2, num_microbatches=4)


def test_uniform_runs_with_a_shorter_last_run() -> None:
    """Full recompute in uniform runs of 2 on a stage of 3 layers: runs of 2 and 1.  F keeps one input per run; B
    recomputes the short last run first, then the run of two, which rebuilds its second layer beside its first's
    transient on top of what the short run left waiting for W (one layer's, less the input F kept of it); a BW frees
    the short run's input instead.  The run of two is not counted twice."""
    run2 = RecomputeOption("uniform-2", b_extra=1.0, mem_f=1.0, mem_b=2.0, transient=5.0, transient_bw=4.0, run=2)
    mc = ModelCosts(num_layers=4, layer=LAYER, embedding=EMBEDDING, head=HEAD, recompute=(run2,), fixed_recompute=True)
    costs = mc.stage_costs((3, 1), (1, 1))
    assert costs.mem_f[0] == 2 * 1.0 + EMBEDDING.mem_f  # two runs, one input each
    # B: the short run (5.0), then the run of two: (1 + 2) - 1 waiting after the first + 5.0 + one layer rebuilt (4.0)
    assert costs.mem_b_transient[0] == pytest.approx(2.0 + 5.0 + 4.0)
    # BW: the short run (4.0), then the run of two: -1 (its input freed) + 4.0 + 4.0
    assert costs.mem_bw_transient[0] == pytest.approx(-1.0 + 4.0 + 4.0)
    # the last stage's one layer is a run of one: the head's B adds its mem_b first, a BW frees what the head kept
    assert costs.mem_b_transient[1] == pytest.approx(HEAD.mem_b + 5.0)
    assert costs.mem_bw_transient[1] == pytest.approx(max(0.0, -HEAD.mem_f + 4.0))


def test_block_recomputes_a_stages_first_layers() -> None:
    """Full recompute of a stage's first 2 layers (block): on a stage of 3 the first two take the option (B adds
    its ``b_extra``, F keeps its ``mem_f``) and the third keeps its activations; on a stage of 1 that one layer
    recomputes.  B runs the plain layer's backward first (it adds its ``mem_b``), then the two recomputed layers last
    to first; ``transient_rest`` is the stage's transient less the one layer's own."""
    block2 = RecomputeOption("block-2", b_extra=0.7, mem_f=1.0, mem_b=2.0, transient=5.0, transient_bw=4.0, block=2)
    mc = ModelCosts(
        num_layers=4, layer=LAYER, embedding=EMBEDDING, head=HEAD, recompute=(block2,), fixed_recompute=True
    )
    costs = mc.stage_costs((3, 1), (1, 1))
    assert costs.b[0] == pytest.approx(3 * LAYER.b + 2 * 0.7 + EMBEDDING.b)
    assert costs.b[1] == pytest.approx(LAYER.b + 0.7 + HEAD.b)
    assert costs.f[0] == pytest.approx(3 * LAYER.f + EMBEDDING.f)
    assert costs.mem_f[0] == pytest.approx(2 * 1.0 + LAYER.mem_f + EMBEDDING.mem_f)
    assert costs.mem_f[1] == pytest.approx(1.0 + HEAD.mem_f)
    # what waits for W after B is the layers' whatever recomputes: each layer's mem_f + mem_b
    held = 2 * 3.0 + LAYER.mem_f + LAYER.mem_b + EMBEDDING.mem_f + EMBEDDING.mem_b
    assert costs.mem_f[0] + costs.mem_b[0] == pytest.approx(held)
    # B: the plain layer (LAYER.mem_b = 0), then layer 1 (5.0), then layer 0 on top of layer 1's swap (3 - 1)
    assert costs.mem_b_transient[0] == pytest.approx(LAYER.mem_b + 2.0 + 5.0)
    # BW: the plain layer frees what F kept of it, then the recomputed layers each free their input
    assert costs.mem_bw_transient[0] == pytest.approx(max(0.0, -LAYER.mem_f + 4.0))
    for n, last in ((3, False), (1, True), (2, False)):
        for fused, own in ((False, 5.0), (True, 4.0)):
            whole = mc.stage_transient(n, 1, last=last, fused=fused)
            assert whole == pytest.approx(max(0.0, own + mc.transient_rest(n, 1, last=last, fused=fused)))
    # the planner's search takes the block as it is: brute force over every split agrees
    shape = dict(schedule="zb-h1", num_ranks=2, num_microbatches=4)
    best = min(compositions(4, 2), key=lambda layers: evaluate_split(mc, layers, **shape)[0])
    assert plan_stages(mc, **shape).iteration == pytest.approx(evaluate_split(mc, best, **shape)[0])


def test_step_follows_the_rank_with_the_most_optimizer_work() -> None:
    """Every rank starts its optimizer step at the pipeline's end, each over the parameters it holds: a candidate's
    time between iterations is the fixed part plus the largest rank's share (here per layer 1, the embedding 0.5, the
    head 3), and the planner minimises the simulated iteration with it (brute force over every split)."""
    share = StepShare(embedding=0.5, layer=1.0, head=3.0)
    mc = ModelCosts(num_layers=4, layer=LAYER, embedding=EMBEDDING, head=HEAD, step=2.0, step_share=share)
    assert mc.step_time((3, 1), (0, 1)) == 2.0 + max(0.5 + 3.0, 1.0 + 3.0)
    assert mc.step_time((2, 2), (0, 1)) == 2.0 + max(0.5 + 2.0, 2.0 + 3.0)
    assert mc.step_time((1, 1, 1, 1), (0, 1, 1, 0)) == 2.0 + max(0.5 + 1 + 1 + 3.0, 2.0)  # V: both ends on rank 0
    shape = dict(schedule="zb-h1", num_ranks=2, num_microbatches=4)
    plan = registry.generate("zb-h1", 2, 4)
    for layers in compositions(4, 2):
        end = simulate(plan, mc.stage_costs(layers, (0, 0))).end_time
        assert evaluate_split(mc, layers, **shape)[0] == pytest.approx(end + mc.step_time(layers, (0, 1)))
    best = min(compositions(4, 2), key=lambda layers: evaluate_split(mc, layers, **shape)[0])
    got = plan_stages(mc, **shape)
    assert got.layers == best and got.iteration == pytest.approx(evaluate_split(mc, best, **shape)[0])
    # an embedding whose optimizer work outweighs its time moves layers off its rank (without the shares: even)
    light_head = PartCosts(f=0.1, b=0.1, w=0.1)
    plain = ModelCosts(num_layers=6, layer=LAYER, embedding=EMBEDDING, head=light_head)
    heavy = dataclasses.replace(plain, step_share=StepShare(embedding=100.0, layer=20.0))
    assert plan_stages(plain, **shape).layers == (3, 3) and plan_stages(heavy, **shape).layers[0] < 3
    with pytest.raises(ValueError, match="step share head"):
        StepShare(head=-1.0)
