"""``--recompute-granularity auto``: the stage planner chooses none, selective or full recompute per stage from the
analytic cost model (``megatron.model.cost_model.recompute_options``) within ``--pipeline-memory-limit-gb``, and
``apply_recompute`` applies each stage's choice.  Checked on the simulator against brute force."""

from __future__ import annotations

import itertools

import pytest
from scaled_costs import scaled_costs

from megatron.arguments import parse_run_config
from megatron.config.errors import ConfigError
from megatron.model.cost_model import model_costs, recompute_options
from megatron.pipeline.layer_split import GIB
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.stage_planner import smallest_mem_limit

P, M, L = 2, 4, 6
# Layers hold most of the activation memory here (sequence 256, vocabulary 1024): recompute can pay off.
ARGV = [
    "--num-layers", str(L), "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "2",
    "--lr", "1e-3", "--pipeline-model-parallel-size", str(P), "--mock-data", "--vocab-size", "1024",
    "--pipeline-layer-split", "auto", "--pipeline-schedule", "zb-auto",
]  # fmt: skip
WORLD = 4  # dp = 2: 4 microbatches of 2 per replica


def _costs():
    run = parse_run_config(ARGV, world_size=WORLD)
    return model_costs(
        run.model,
        padded_vocab_size=run.padded_vocab_size,
        micro_batch_size=2,
        bytes_per_element=4,
        recompute=recompute_options(run.model, micro_batch_size=2, bytes_per_element=4),
    )


def _brute_force(mc, limit: float) -> list[tuple[float, tuple[int, ...], tuple[str, ...], float]]:
    """Every (split, recompute choice) whose zb-auto plan under ``limit`` fits it: (iteration, layers, choice, peak)."""
    names = mc.option_names()
    out = []
    for k in range(1, L):
        for opts in itertools.product(range(len(names)), repeat=P):
            costs = mc.stage_costs((k, L - k), opts)
            try:
                plan = registry.generate("zb-auto", P, M, costs=costs, mem_limit=limit)
            except ValueError:
                continue
            peak = max(peak_memory(plan, costs))
            if peak <= limit:
                out.append((simulate(plan, costs).end_time, (k, L - k), tuple(names[o] for o in opts), peak))
    return out


def test_cost_model_recompute_options() -> None:
    """Full keeps the layer input and re-runs the layer's forward; selective re-runs the core attention; after B
    a pending W holds the same whatever the choice."""
    mc = _costs()
    sel, full = mc.recompute
    h, tokens = 128, 256 * 2
    assert (sel.name, full.name) == ("selective", "full")
    assert full.mem_f == h * 4 * tokens and full.b_extra == pytest.approx(mc.layer.f)
    assert 0 < sel.b_extra < full.b_extra and full.mem_f < sel.mem_f < mc.layer.mem_f
    for o in (sel, full):
        assert o.mem_f + o.mem_b == pytest.approx(mc.layer.mem_f + mc.layer.mem_b)


@pytest.mark.parametrize("where", ["between ZB-H1 and ZB-H2", "below ZB-H1"])
def test_auto_choice_is_the_fastest_candidate_within_the_limit(where) -> None:
    mc = _costs()
    even = mc.stage_costs((L // 2, L // 2), (0, 0))
    h1 = max(peak_memory(registry.generate("zb-h1", P, M, costs=even), even))
    h2 = max(peak_memory(registry.generate("zb-h2", P, M, costs=even), even))
    if where.startswith("between"):
        limit = (h1 + h2) / 2
    else:  # between the smallest limit anything fits and ZB-H1's peak
        floor = smallest_mem_limit(mc, schedule="zb-auto", num_ranks=P, num_microbatches=M)
        limit = (floor + h1) / 2
        assert floor < limit < h1
    argv = [*ARGV, "--recompute-granularity", "auto", "--pipeline-memory-limit-gb", str(limit / GIB)]
    run = parse_run_config(argv, world_size=WORLD)
    plan = run.pipeline_layout.split_plan
    fits = _brute_force(mc, limit)
    best = min(fits)
    assert plan.iteration == pytest.approx(best[0], rel=1e-9)
    assert max(plan.peak_memory) <= limit * (1 + 1e-9)
    # the choice reaches the run's recompute config, one entry per stage with its layers
    ranges = run.pipeline_layout.layer_ranges
    assert run.recompute.stages == tuple((r.start, r.stop, c) for r, c in zip(ranges, plan.recompute, strict=True))
    if not where.startswith("between"):  # here recomputing the first stage is the faster way to fit
        assert any(c != "none" for c in plan.recompute), plan.recompute
        assert min(f for f in fits if f[2] == ("none", "none"))[0] > plan.iteration


def test_apply_recompute_takes_each_stages_choice() -> None:
    from megatron.config.recompute import RecomputeConfig
    from megatron.model.gpt import build_gpt_stages
    from megatron.model.recompute import apply_recompute

    run = parse_run_config(ARGV, world_size=WORLD)
    choice = ((0, 2, "full"), (2, 4, "selective"), (4, 6, "none"))
    config = RecomputeConfig(granularity="auto", stages=choice)
    stages = build_gpt_stages(run.model, 3, ranges=[range(a, b) for a, b, _ in choice])
    for stage in stages:
        apply_recompute(stage, config)
    assert [s.recompute_segments for s in stages] == [((0, 1), (1, 2)), (), ()]
    cores = [[layer.self_attention.recompute_core for layer in s.layers] for s in stages]
    assert cores == [[False, False], [True, True], [False, False]]
    with pytest.raises(ValueError, match="no choice for layers"):
        apply_recompute(build_gpt_stages(run.model, 2)[0], config)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--pipeline-layer-split", "even"], "needs --pipeline-layer-split auto"),
        (["--recompute-method", "uniform", "--recompute-num-layers", "1"], "apply to --recompute-granularity full"),
        (["--pipeline-memory-limit-gb", "1e-6"], r"the smallest limit that works is [0-9.e-]+ GiB"),
    ],
)
def test_bad_auto_recompute_is_a_config_error(extra, message) -> None:
    argv = [*ARGV, "--recompute-granularity", "auto", *extra]
    if "--pipeline-layer-split" in extra:
        i = argv.index("--pipeline-layer-split")
        del argv[i : i + 2]
    with pytest.raises(ConfigError, match=message):
        parse_run_config(argv, world_size=WORLD)


def test_named_smallest_limit_works() -> None:
    argv = [*ARGV, "--recompute-granularity", "auto", "--pipeline-memory-limit-gb", "1e-6"]
    with pytest.raises(ConfigError) as err:
        parse_run_config(argv, world_size=WORLD)
    named = str(err.value).split("the smallest limit that works is ")[1].split(" GiB")[0]
    run = parse_run_config([*argv[:-1], named], world_size=WORLD)
    assert max(run.pipeline_layout.split_plan.peak_memory) <= float(named) * GIB


# -- the profiling window's re-decision (megatron.pipeline.part_costs, layer_split.measured_layer_split) -----------
def _window_profile(true, layers: tuple[int, ...], choice: tuple[str, ...]):
    """The stage profile and part samples of a window that ran ``layers`` with ``choice`` under ``true`` costs: each
    stage's F, B, W and memory under its own choice; the part timer's samples (no layer B from a stage that
    recomputes, nor its embedding's or head's; no layer F from a full-recompute stage)."""
    from zb_pipeline.schedule.profile import Profile

    names = true.option_names()
    stage = true.stage_costs(layers, [names.index(c) for c in choice])
    summaries = []
    for s, c in enumerate(choice):
        mine = {}
        timed_b = c == "none"  # the part timer leaves out the B of a stage that recomputes
        if s == 0:
            mine["embedding"] = {"f": [true.embedding.f], **({"b": [true.embedding.b]} if timed_b else {})}
        if s == len(layers) - 1:
            mine["head"] = {"f": [true.head.f], **({"b": [true.head.b]} if timed_b else {})}
        mine["layer"] = {}
        if c != "full":
            mine["layer"]["f"] = [true.layer.f] * layers[s]
        if c == "none":
            mine["layer"]["b"] = [true.layer.b] * layers[s]
        summaries.append(mine)
    profile = Profile(
        num_ranks=len(layers), stage_to_rank=tuple(range(len(layers))), f=stage.f, b=stage.b, w=stage.w,
        bw=(None,) * len(layers), comm=0.0, mem_f=stage.mem_f, mem_b=stage.mem_b, mem_w=stage.mem_w,
        stage_layers=layers,
    )  # fmt: skip
    return summaries, profile


@pytest.mark.parametrize("choice", [("full", "none"), ("none", "selective"), ("selective", "none"), ("none", "none")])
def test_window_measures_every_option_whatever_the_stages_ran(choice) -> None:
    """The window's model (``part_costs`` docstring): a recompute option's extra B is its share of the measured layer
    forward and what F keeps is its analytic bytes times the layer's calibration factor, with each stage calibrated
    under the choice it ran.  When the measured costs are the analytic ones scaled (times by KT, bytes by KM), the
    parts and options derived from a window that ran ``choice`` are exactly those costs."""
    import dataclasses

    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.schedule.stage_planner import ModelCosts

    mc = _costs()
    true = scaled_costs(mc)
    summaries, profile = _window_profile(true, (3, 3), choice)
    got = ModelCosts.from_dict(combine_parts(summaries, profile, mc, recompute=choice))
    for name in ("layer", "embedding", "head"):
        want, have = dataclasses.asdict(getattr(true, name)), dataclasses.asdict(getattr(got, name))
        assert have == pytest.approx(want, rel=1e-9, abs=1e-9), name
    assert len(got.recompute) == len(true.recompute)
    for want, have in zip(true.recompute, got.recompute, strict=True):
        assert have.name == want.name
        assert (have.b_extra, have.mem_f, have.mem_b) == pytest.approx((want.b_extra, want.mem_f, want.mem_b), rel=1e-9)
    # and the derived costs give back every measured stage under the choice it ran
    names = got.option_names()
    again = got.stage_costs((3, 3), [names.index(c) for c in choice])
    assert again.f == pytest.approx(profile.f) and again.b == pytest.approx(profile.b)
    assert again.mem_f == pytest.approx(profile.mem_f)


def _window_limit(true, where: str) -> float:
    even = true.stage_costs((L // 2, L // 2), (0, 0))
    h1 = max(peak_memory(registry.generate("zb-h1", P, M, costs=even), even))
    h2 = max(peak_memory(registry.generate("zb-h2", P, M, costs=even), even))
    if where.startswith("between"):
        return (h1 + h2) / 2
    floor = smallest_mem_limit(true, schedule="zb-auto", num_ranks=P, num_microbatches=M)
    assert floor < h1
    return (floor + h1) / 2


@pytest.mark.parametrize("where", ["between ZB-H1 and ZB-H2", "below ZB-H1"])
def test_window_decision_is_the_fastest_candidate_within_the_limit(where) -> None:
    """At the window's end the split and each stage's recompute are chosen jointly from the window's measurements
    (the start-up run recomputed the first stage fully): the decision is the (split, choice) with the shortest
    simulated iteration among those within the limit, by brute force over every candidate."""
    import dataclasses

    from megatron.pipeline.layer_split import measured_layer_split
    from megatron.pipeline.part_costs import combine_parts

    mc = _costs()
    true = scaled_costs(mc)
    start = ("full", "none")
    summaries, profile = _window_profile(true, (3, 3), start)
    profile = dataclasses.replace(profile, parts=combine_parts(summaries, profile, mc, recompute=start))
    limit = _window_limit(true, where)
    run = parse_run_config([*ARGV, "--recompute-granularity", "auto"], world_size=WORLD)
    layout = run.pipeline_layout.with_split((3, 3), split="auto")
    decision = measured_layer_split(profile, layout, num_microbatches=M, mem_limit=limit, recompute=start)
    fits = _brute_force(true, limit)
    best = min(fits)
    assert decision.plan.iteration == pytest.approx(best[0], rel=1e-9)
    assert max(decision.plan.peak_memory) <= limit * (1 + 1e-9)
    assert (tuple(decision.plan.layers), tuple(decision.plan.recompute)) in [
        (f[1], f[2]) for f in fits if f[0] <= best[0] * (1 + 1e-9)
    ]
    assert decision.current_recompute == start
    assert decision.changes == (tuple(decision.plan.layers) != (3, 3) or tuple(decision.plan.recompute) != start)
    chosen = ", ".join(decision.plan.recompute)
    assert f"; --recompute-granularity auto: recompute per stage {chosen} (was full, none)" in decision.summary()
    # not auto (the recompute in force is not decided): the line names no recompute choice
    kept = measured_layer_split(profile, layout, num_microbatches=M, mem_limit=limit)
    assert kept.current_recompute is None and "recompute per stage" not in kept.summary(), kept.summary()
    if where.startswith("below"):  # here the fastest way to fit recomputes some stages, not all
        assert "none" in decision.plan.recompute and set(decision.plan.recompute) != {"none"}, decision.plan
