"""``--pipeline-layer-split auto``: the analytic cost model through the stage planner into the pipeline layout."""

from __future__ import annotations

import dataclasses

import pytest
from scaled_costs import scaled_costs

from megatron.arguments import apply_layer_split, parse_run_config
from megatron.config.errors import ConfigError
from megatron.model.config import GPTConfig
from megatron.model.cost_model import model_costs
from megatron.training_log import model_flops_per_iteration
from zb_pipeline.schedule.stage_planner import evaluate_split

# make train's model (tools/make_train.py): 4 layers, hidden 128, 4 heads, sequence 128, vocabulary 4096, pp = 2,
# 4 microbatches of 2 per data-parallel replica (global batch 16 over dp = 2).
MAKE_TRAIN = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "2",
    "--lr", "1e-3", "--pipeline-model-parallel-size", "2", "--mock-data", "--vocab-size", "4096",
]  # fmt: skip


def test_auto_split_on_make_train_model_moves_a_layer_off_the_head_stage() -> None:
    even = parse_run_config(MAKE_TRAIN, world_size=4).pipeline_layout
    auto = parse_run_config([*MAKE_TRAIN, "--pipeline-layer-split", "auto"], world_size=4).pipeline_layout
    assert even.layers_per_stage == (2, 2) and even.split == "even"
    # The head (about two layers of FLOPs) sits on the last stage: the planner gives it fewer layers.
    assert auto.split == "auto" and auto.layers_per_stage == (3, 1)
    assert [r for r in auto.layer_ranges] == [range(0, 3), range(3, 4)]
    assert auto.split_plan.iteration < auto.even_iteration
    # The even split's prediction is the same model and plan simulated with (2, 2).
    config = GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=4096, seq_length=128)
    model = model_costs(config, padded_vocab_size=4096, micro_batch_size=2)
    shape = dict(schedule="zb-h1", num_ranks=2, num_microbatches=4)
    assert evaluate_split(model, (2, 2), **shape)[0] == pytest.approx(auto.even_iteration)
    assert evaluate_split(model, (3, 1), **shape)[0] == pytest.approx(auto.split_plan.iteration)


def test_cost_model_is_the_logged_flops_formula() -> None:
    config = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=32, swiglu=True)
    m = model_costs(config, padded_vocab_size=512, micro_batch_size=2)
    layer = m.layer.f + m.layer.b + m.layer.w
    head = m.head.w * 3  # the logits matmul three times (the loss's element-wise work is not in the logged count)
    tokens = 32 * 2
    logged = model_flops_per_iteration(config, padded_vocab_size=512, global_batch_size=2)
    assert (3 * layer + head) * 1e9 / tokens * tokens == pytest.approx(logged)
    assert m.layer.b > m.layer.w and m.head.f > m.head.w  # attention core and the loss: B and F only


def test_explicit_split_wins_and_the_vocabulary_is_waited_for() -> None:
    run = parse_run_config(
        [*MAKE_TRAIN, "--pipeline-layer-split", "auto", "--decoder-last-pipeline-num-layers", "2"], world_size=4
    )
    assert run.pipeline_layout.split == "explicit" and run.pipeline_layout.layers_per_stage == (2, 2)
    # Without the vocabulary (real data, no --vocab-size) the split waits; resolve_vocab plans it.
    auto = parse_run_config([*MAKE_TRAIN, "--pipeline-layer-split", "auto"], world_size=4)
    unknown = dataclasses.replace(
        auto,
        model=dataclasses.replace(auto.model, vocab_size=0),
        pipeline_layout=parse_run_config(MAKE_TRAIN, world_size=4).pipeline_layout,
    )
    assert apply_layer_split(unknown) is unknown
    known = dataclasses.replace(unknown, model=auto.model)
    assert apply_layer_split(known).pipeline_layout.layers_per_stage == (3, 1)


def test_auto_split_serves_layers_that_do_not_divide() -> None:
    argv = [*MAKE_TRAIN, "--pipeline-layer-split", "auto"]
    argv[argv.index("--num-layers") + 1] = "5"
    layout = parse_run_config(argv, world_size=4).pipeline_layout
    assert sum(layout.layers_per_stage) == 5 and layout.layers_per_stage[0] > layout.layers_per_stage[1]
    assert layout.even_iteration is None


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--pipeline-model-parallel-size", "1"], "needs --pipeline-model-parallel-size > 1"),
        (["--num-layers", "1"], "at least 1 layer"),
        (["--pipeline-schedule", "interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage", "1"], "drop --num"),
    ],
)
def test_bad_auto_split_is_a_config_error(extra, message) -> None:
    argv = [*MAKE_TRAIN, "--pipeline-layer-split", "auto"]
    for i in range(0, len(extra), 2):
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i : i + 2]
    with pytest.raises(ConfigError, match=message):
        parse_run_config(argv, world_size=4)


def test_checkpoint_of_another_split_is_refused_with_the_flags_to_pass(tmp_path) -> None:
    from types import SimpleNamespace

    from megatron.checkpointing import _check_compatible, layout_of

    def trainer(argv: list[str]) -> SimpleNamespace:
        run = parse_run_config(argv, world_size=2)
        ctx = SimpleNamespace(tp_size=1, pp_size=2, dp_size=1, world_size=2)
        return SimpleNamespace(run=run, ctx=ctx)

    even, auto = trainer(MAKE_TRAIN), trainer([*MAKE_TRAIN, "--pipeline-layer-split", "auto"])
    common = {"layout": layout_of(auto), "model_args": dataclasses.asdict(auto.run.model)}
    assert common["layout"]["layers_per_stage"] == [3, 1]
    _check_compatible(auto, common, tmp_path)  # the same split resumes
    with pytest.raises(ConfigError, match=r"written with \[3, 1\] .* splits them \[2, 2\]; pass the same"):
        _check_compatible(even, common, tmp_path)


@pytest.mark.slow
def test_auto_split_trains_the_even_splits_losses_and_resumes_bit_exact(tmp_path) -> None:
    """pp = 2, zb-h1, a head of about 2.6 layers: the auto split [3, 1] gives the even split's losses bit for bit (the
    split only moves layers between ranks), and 3 steps saved + 3 resumed equal 6 in one launch."""
    from test_pipeline_training import BASE, _pipeline

    from megatron import checkpoint_files as cf

    argv = [*BASE, "--train-iters", "6", "--global-batch-size", "8", "--eval-iters", "0"]
    argv[argv.index("--vocab-size") + 1] = "1000"
    argv += ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
    auto = [*argv, "--pipeline-layer-split", "auto"]
    assert parse_run_config(auto, world_size=2).pipeline_layout.layers_per_stage == (3, 1)
    full = _pipeline(auto, 2)[0]["losses"]
    assert _pipeline(argv, 2)[0]["losses"] == full
    ckpt = str(tmp_path / "auto")
    first = _pipeline([*auto, "--save", ckpt, "--exit-interval", "3"], 2)[0]["losses"]
    assert cf.read_tracker(ckpt) == 3
    second = _pipeline([*auto, "--load", ckpt], 2)[0]["losses"]
    assert first + second == full


def test_zb_auto_runs_the_planned_plan_within_the_byte_limit() -> None:
    """Under ``--pipeline-memory-limit-gb`` zb-auto's own plan is generated with the limit in bytes (the analytic
    costs' units), not only with ``--zero-bubble-max-pending-backward``'s count: its simulated peak stays within
    the limit, it is the plan the stage planner simulated, and a count converts by the same costs (the smaller)."""
    from zb_pipeline.schedule.memory import microbatch_bytes, peak_memory, schedule_mem_limit

    flags = [*MAKE_TRAIN, "--pipeline-schedule", "zb-auto", "--pipeline-layer-split", "auto"]
    free = parse_run_config(flags, world_size=4).pipeline_layout
    free_peak = max(peak_memory(free.split_plan.schedule, free.split_plan.costs))
    limit_gb = 0.85 * free_peak / 2**30  # below what zb-auto takes unlimited with this split
    layout = parse_run_config([*flags, "--pipeline-memory-limit-gb", f"{limit_gb}"], world_size=4).pipeline_layout
    plans, plan = layout.plans, layout.split_plan
    assert plans.mem_limit == pytest.approx(limit_gb * 2**30) and plans.costs == plan.costs
    assert layout.schedule == plan.schedule  # the runtime runs what the planner simulated
    assert max(peak_memory(layout.schedule, plans.costs)) <= limit_gb * 2**30 < free_peak
    # --zero-bubble-max-pending-backward 1: one microbatch of the heaviest rank, in the same bytes
    one = parse_run_config([*flags, "--pipeline-memory-limit-gb", f"{limit_gb}", "--zero-bubble-max-pending-backward",
                            "1"], world_size=4).pipeline_layout  # fmt: skip
    place = one.schedule.stage_to_rank
    expected = microbatch_bytes(one.plans.costs.mem_f, one.plans.costs.mem_b, place)
    assert one.plans.mem_limit == pytest.approx(min(expected, limit_gb * 2**30))
    assert max(peak_memory(one.schedule, one.plans.costs)) <= one.plans.mem_limit
    assert schedule_mem_limit(plans.costs, place) is None


def test_window_replan_takes_the_byte_limit_and_the_count_the_smaller() -> None:
    """The profiling window's zb-auto re-plan: the byte limit and the count converted with the measured bytes."""
    from types import SimpleNamespace

    from zb_pipeline.runtime.replanner import WindowReplanner
    from zb_pipeline.schedule.profile import Profile, mem_limit_for_microbatches

    profile = Profile(
        num_ranks=2, stage_to_rank=(0, 1), f=(1.0, 1.0), b=(1.0, 1.0), w=(1.0, 1.0), bw=(None, None), comm=0.0,
        mem_f=(100.0, 60.0), mem_b=(0.0, 0.0), mem_w=(-100.0, -60.0), mem_b_transient=(7.0, 0.0),
    )  # fmt: skip
    assert mem_limit_for_microbatches(profile, 3) == 307.0  # 3 x the heaviest rank's 100 + B's transient
    replanner = WindowReplanner.__new__(WindowReplanner)  # only its limit arithmetic
    replanner.profiler = SimpleNamespace(device="cpu")
    for mem_limit, count, expected in ((250.0, 3, 250.0), (400.0, 3, 307.0), (250.0, None, 250.0), (None, 2, 207.0)):
        replanner.mem_limit, replanner.mem_limit_microbatches, replanner.percentile = mem_limit, count, 85.0
        assert replanner.resolve_mem_limit(profile) == expected


def test_v_schedule_plans_under_the_byte_limit() -> None:
    """zb-v under ``--pipeline-memory-limit-gb``: its runtime plan is generated with its cap lowered to the limit in
    bytes (the planner's analytic costs) and peaks within it; a fixed schedule keeps its plan source."""
    from megatron.pipeline.layer_split import plans_within_bytes
    from zb_pipeline.schedule.memory import peak_memory

    flags = [*MAKE_TRAIN, "--num-layers", "8", "--pipeline-schedule", "zb-v", "--pipeline-layer-split", "auto"]
    free = parse_run_config(flags, world_size=4).pipeline_layout
    limit_gb = 1.05 * max(free.split_plan.peak_memory) / 2**30
    layout = parse_run_config([*flags, "--pipeline-memory-limit-gb", f"{limit_gb}"], world_size=4).pipeline_layout
    assert layout.plans.mem_limit == pytest.approx(limit_gb * 2**30) and layout.plans.costs == layout.split_plan.costs
    assert max(peak_memory(layout.schedule, layout.plans.costs)) <= limit_gb * 2**30
    assert plans_within_bytes("zb-auto") and plans_within_bytes("v-min") and not plans_within_bytes("zb-h1")


FULL = ["--recompute-granularity", "full", "--recompute-method"]
EXPLICIT_RECOMPUTE = {
    "selective": ["--recompute-activations"],
    "full": [*FULL, "uniform", "--recompute-num-layers", "1"],
    "full-uniform-2": [*FULL, "uniform", "--recompute-num-layers", "2"],
    "full-block-1": [*FULL, "block", "--recompute-num-layers", "1"],
}


def _explicit_model(run):
    """The start-up planner's model of ``run``'s explicit recompute (every stage takes its option)."""
    from megatron.model.cost_model import explicit_recompute_option

    rc = run.recompute
    option = explicit_recompute_option(
        run.model, granularity=rc.granularity, method=rc.method, num_layers=rc.num_layers,
        micro_batch_size=2, bytes_per_element=4,
    )  # fmt: skip
    model = model_costs(run.model, padded_vocab_size=4096, micro_batch_size=2, recompute=(option,))
    return dataclasses.replace(model, fixed_recompute=True)


@pytest.mark.parametrize("name", list(EXPLICIT_RECOMPUTE))
def test_explicit_recompute_is_planned_in_force(name: str) -> None:
    """An explicit --recompute-granularity (not auto): the start-up planner plans the split with it on every stage
    -- B replays the forward, F keeps what the recompute leaves, B holds the recompute's transient -- so its plan is
    the explicit model's (``explicit_recompute_option``, ``fixed_recompute``) and a memory limit that only the
    recompute meets is served (it was refused, planned as if nothing recomputed)."""
    auto = [*MAKE_TRAIN, "--pipeline-layer-split", "auto"]
    flags = EXPLICIT_RECOMPUTE[name]
    run = parse_run_config([*auto, *flags], world_size=4)
    plan = run.pipeline_layout.split_plan
    plain = parse_run_config(auto, world_size=4).pipeline_layout.split_plan
    assert plan.recompute == (name, name)
    assert plan.iteration > plain.iteration and max(plan.peak_memory) < max(plain.peak_memory)
    model = _explicit_model(run)
    shape = dict(schedule="zb-h1", num_ranks=2, num_microbatches=4)
    iteration, peak = evaluate_split(model, plan.layers, **shape)
    assert iteration == pytest.approx(plan.iteration) and peak == pytest.approx(plan.peak_memory)
    # a limit just above the recompute's peak and below what any split without recompute needs
    limit = ["--pipeline-memory-limit-gb", f"{max(plan.peak_memory) * 1.01 / 2**30:.6f}"]
    with pytest.raises(ConfigError, match="no layer split fits it with zb-h1 by the analytic model"):
        parse_run_config([*auto, *limit], world_size=4)
    served = parse_run_config([*auto, *flags, *limit], world_size=4).pipeline_layout.split_plan
    assert served.recompute == plan.recompute


def test_window_replans_an_explicit_recompute_in_force() -> None:
    """The window's part model under an explicit recompute carries it as fixed (``fixed_recompute`` in the profile's
    ``parts``): the measured split is planned with it on every stage and is no recompute change; per-part costs
    that are the start-up model's give back the start-up split and iteration."""
    from megatron.pipeline.layer_split import measured_layer_split
    from zb_pipeline.schedule.profile import Profile

    argv = [*MAKE_TRAIN, "--pipeline-layer-split", "auto", *EXPLICIT_RECOMPUTE["selective"]]
    run = parse_run_config(argv, world_size=4)
    layout = run.pipeline_layout
    start = layout.split_plan
    pair, parts = (1.0, 1.0), _explicit_model(run).to_dict()
    profile = Profile(
        num_ranks=2, stage_to_rank=(0, 1), f=pair, b=pair, w=pair, bw=(None, None), comm=0.0, mem_f=pair,
        mem_b=(0.0, 0.0), mem_w=(-1.0, -1.0), stage_layers=layout.layers_per_stage, parts=parts,
    )  # fmt: skip
    decision = measured_layer_split(profile, layout, num_microbatches=run.num_microbatches)
    assert decision.plan.layers == start.layers and decision.plan.recompute == ("selective", "selective")
    assert decision.plan.iteration == pytest.approx(start.iteration) and not decision.changes
    assert decision.current_iteration == pytest.approx(start.iteration)


def _explicit_window(true, layers: tuple[int, ...]):
    """The stage profile and the part timer's samples of a window that ran ``layers`` under ``true``'s explicit
    recompute: each stage's F, B, W, memory and B transient; every layer's F, the B of a layer that recomputed (a
    run's shared evenly among its layers) tagged ``rb``, of one that kept its activations (block: a stage's later
    layers) ``b``, and the embedding's and the head's."""
    from zb_pipeline.schedule.profile import Profile

    (option,) = true.recompute
    S = len(layers)
    stage = true.stage_costs(layers, (1,) * S)
    summaries = []
    for s, n in enumerate(layers):
        k = option.recomputed(n)
        mine = {"layer": {"f": [true.layer.f] * n, "rb": [true.layer.b + option.b_extra] * k}}
        if n > k:
            mine["layer"]["b"] = [true.layer.b] * (n - k)
        if s == 0:
            mine["embedding"] = {"f": [true.embedding.f], "b": [true.embedding.b]}
        if s == S - 1:
            mine["head"] = {"f": [true.head.f], "b": [true.head.b]}
        summaries.append(mine)
    profile = Profile(
        num_ranks=S, stage_to_rank=tuple(range(S)), f=stage.f, b=stage.b, w=stage.w, bw=(None,) * S, comm=0.0,
        mem_f=stage.mem_f, mem_b=stage.mem_b, mem_w=stage.mem_w, stage_layers=layers,
        mem_b_transient=stage.mem_b_transient,
    )  # fmt: skip
    return summaries, profile


WINDOWS = [("full-block-2", (3, 1)), ("full-block-2", (2, 2)), ("full-uniform-2", (3, 1)), ("full", (2, 2))]


@pytest.mark.parametrize("name,window", WINDOWS)
def test_window_derives_an_explicit_full_recompute(name: str, window: tuple[int, ...]) -> None:
    """The window's part model under an explicit full recompute of any method (``part_costs._fixed_recompute``):
    the layer without recompute from the layers that kept their activations (block) or, where every layer
    recomputed, the recomputing B less the option's analytic share of the measured forward; the option's extra B
    the difference, its memory calibrated with its runs or block.  When the measured costs are the analytic ones
    scaled, the derived parts and option are exactly those costs, so every split's stages -- B with the block's or
    the runs' recompute, F's memory and B's transient -- are the true ones, the window's split included."""
    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.schedule.stage_planner import ModelCosts

    flags = {
        "full": [*FULL, "uniform", "--recompute-num-layers", "1"],
        "full-uniform-2": [*FULL, "uniform", "--recompute-num-layers", "2"],
        "full-block-2": [*FULL, "block", "--recompute-num-layers", "2"],
    }[name]
    analytic = _explicit_model(parse_run_config([*MAKE_TRAIN, "--pipeline-layer-split", "auto", *flags], world_size=4))
    true = scaled_costs(analytic)
    summaries, profile = _explicit_window(true, window)
    got = ModelCosts.from_dict(combine_parts(summaries, profile, analytic, recompute=(name,) * len(window)))
    for part in ("layer", "embedding", "head"):
        want, have = dataclasses.asdict(getattr(true, part)), dataclasses.asdict(getattr(got, part))
        assert have == pytest.approx(want, rel=1e-9, abs=1e-9), part
    (have,), (want,) = got.recompute, true.recompute
    assert (have.name, have.run, have.block) == (want.name, want.run, want.block) and got.fixed_recompute
    numbers = ("b_extra", "mem_f", "mem_b", "transient", "transient_bw")
    assert [getattr(have, k) for k in numbers] == pytest.approx([getattr(want, k) for k in numbers], rel=1e-9)
    for layers in [(1, 3), (2, 2), (3, 1)]:
        g, t = got.stage_costs(layers, (1, 1)), true.stage_costs(layers, (1, 1))
        for field in ("f", "b", "w", "mem_f", "mem_b", "mem_b_transient", "mem_bw_transient"):
            assert getattr(g, field) == pytest.approx(getattr(t, field), rel=1e-9), (layers, field)
