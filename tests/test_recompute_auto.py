"""``--recompute-granularity auto``: the stage planner chooses none, selective or full recompute per stage from the
analytic cost model (``megatron.model.cost_model.recompute_options``) within ``--pipeline-memory-limit-gb``, and
``apply_recompute`` applies each stage's choice.  Checked on the simulator against brute force."""

from __future__ import annotations

import itertools

import pytest

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
