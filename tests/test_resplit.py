"""Re-splitting the layers in process (``megatron.pipeline.resplit``): after the move the run continues bit for bit
as a run that started with the new split, and a checkpoint written after it records and resumes the new split."""

from __future__ import annotations

import dataclasses

import pytest
from training_runs import WINDOW, pretrain_rank

from zb_pipeline.testing.harness import run_multiprocess

STEPS = 4
ARGV = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-warmup-iters", "1", "--weight-decay", "0.1",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "11", "--log-interval", "1",
    "--distributed-timeout-seconds", "60", "--eval-iters", "0", "--pipeline-model-parallel-size", "2",
]  # fmt: skip
AUTO = ["--pipeline-layer-split", "auto"]
FULL_BLOCK_1 = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]


def _train(
    rank: int,
    world_size: int,
    argv: list[str],
    split: tuple[int, ...] | None,
    at: int,
    save: bool,
    recompute: tuple[str, ...] | None = None,
    start: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
):
    """``argv``'s run for its iterations, re-split to ``split`` (with ``--recompute-granularity auto``: each stage's
    ``recompute``) before iteration ``at``; saved (``--save``) after iteration ``at + 1`` if ``save``.  ``start``:
    the run starts with these layers and recompute choice per stage instead of the start-up planner's."""
    from datetime import timedelta

    import torch

    from megatron.arguments import parse_run_config
    from megatron.checkpointing import save_checkpoint
    from megatron.parallel.context import ParallelContext
    from megatron.pipeline.resplit import resplit
    from megatron.pipeline.trainer_hooks import context_layout
    from megatron.training_setup import setup
    from megatron.training_step import settle_losses, settle_pending_step, train_step

    torch.set_num_threads(1)
    run = parse_run_config(argv, world_size=world_size)
    if start is not None:  # a fresh run of the chosen configuration
        import dataclasses

        layout = run.pipeline_layout.with_split(start[0], split="auto")
        run = dataclasses.replace(
            run, pipeline_layout=layout, recompute=run.recompute.planned(layout.layer_ranges, start[1])
        )
    ctx = ParallelContext.initialize(
        tp=run.parallel.tp_size, pp=run.parallel.pp_size, timeout=timedelta(seconds=60), **context_layout(run)
    )
    try:
        tr = setup(run, ctx)
        before = tr.run.pipeline_layout.layers_per_stage
        while tr.iteration < run.training.train_iters:
            if split == "planned" and tr.iteration == at:  # the planner's answer for head-heavy per-part costs
                decision = _planned(tr)
                tr = resplit(tr, decision.plan.layers, decision=decision)
            elif split is not None and tr.iteration == at:
                tr = resplit(tr, split, recompute=recompute)
            train_step(tr)
            if save and tr.iteration == at + 1:
                settle_pending_step(tr)
                save_checkpoint(tr)
        settle_pending_step(tr)
        settle_losses(tr)  # the losses' reductions are deferred until read (megatron.deferred_loss)
        recomputed = {  # what each of this rank's stages recomputes: (whole-layer runs, core attention per layer)
            s: (stage.recompute_segments, [layer.self_attention.recompute_core for layer in stage.layers])
            for s, stage in tr.pipeline.stages.items()
        }
        return {
            "losses": list(tr.losses),
            "before": before,
            "after": tr.run.pipeline_layout.layers_per_stage,
            "recompute": tr.run.recompute.stages,
            "recomputed": recomputed,
        }
    finally:
        ctx.shutdown()


def _planned(tr):
    """A ``MeasuredSplit`` from per-part costs whose head weighs three layers (the planner moves layers off it)."""
    from megatron.pipeline.layer_split import measured_layer_split
    from zb_pipeline.schedule.profile import Profile

    one = {"f": 1.0, "b": 1.0, "w": 1.0, "mem_f": 1.0, "mem_b": 0.0}
    parts = {"num_layers": 4, "layer": one, "embedding": {**one, "f": 0.1}, "head": {**one, "f": 3, "b": 3, "w": 3}}
    pair = (1.0, 1.0)
    profile = Profile(
        num_ranks=2, stage_to_rank=(0, 1), f=pair, b=pair, w=pair, bw=(None, None), comm=0.0,
        mem_f=pair, mem_b=(0.0, 0.0), mem_w=(-1.0, -1.0), parts=parts,
    )  # fmt: skip
    run = tr.run
    return measured_layer_split(profile, run.pipeline_layout, num_microbatches=run.num_microbatches)


def _run(argv: list[str], world: int, split=None, at: int = 0, save: bool = False, recompute=None, start=None):
    results = run_multiprocess(_train, world, args=(argv, split, at, save, recompute, start), timeout_s=240)
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"]
    return {**results[0], "recomputed": {s: v for r in results for s, v in r["recomputed"].items()}}


@pytest.mark.parametrize(
    "flags",
    [
        ["--pipeline-schedule", "zb-h1"],
        pytest.param(["--enable-zero-bubble"], marks=pytest.mark.slow),
        pytest.param(["--pipeline-schedule", "zb-h1", "--enable-optimizer-post-validation"], marks=pytest.mark.slow),
        pytest.param(
            ["--pipeline-schedule", "zb-h1", "--bf16", "--untie-embeddings-and-output-weights"], marks=pytest.mark.slow
        ),
        # an explicit block recompute: each stage's first layer recomputes, before and after the move
        pytest.param(["--pipeline-schedule", "zb-h1", *FULL_BLOCK_1], marks=pytest.mark.slow),
    ],
)
def test_resplit_continues_bit_for_bit_and_resumes(tmp_path, flags: list[str]) -> None:
    """Start auto-split ([2, 2] for this small head), move a layer to the last rank after two steps: the losses are
    those of a run that started with [1, 3] (explicit flags), to the bit.  The checkpoint written after the move
    records [1, 3]; ``pretrain --load`` with the auto split (which alone would choose [2, 2]) resumes with it, bit
    for bit."""
    argv = [*ARGV, *flags]
    ckpt = str(tmp_path / "ckpt")
    moved = _run([*argv, *AUTO, "--save", ckpt], 2, split=(1, 3), at=2, save=True)
    assert moved["before"] == (2, 2) and moved["after"] == (1, 3)
    started = _run([*argv, "--decoder-first-pipeline-num-layers", "1"], 2)
    assert started["after"] == (1, 3)
    assert moved["losses"] == started["losses"], (moved, started)
    resumed = run_multiprocess(pretrain_rank, 2, args=([*argv, *AUTO, "--load", ckpt],), timeout_s=240)[0]
    assert resumed["losses"] == moved["losses"][3:]
    assert "layers per stage: [1, 3] (auto)" in resumed["log"]


@pytest.mark.parametrize(
    "flags,world",
    [
        (["--pipeline-schedule", "zb-h1"], 2),
        pytest.param(["--pipeline-schedule", "zb-h1", "--tensor-model-parallel-size", "2"], 4, marks=pytest.mark.slow),
        pytest.param(["--enable-zero-bubble", "--use-distributed-optimizer", "--global-batch-size", "8"], 4,
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_recompute_choice_changes_in_process_and_resumes(tmp_path, flags: list[str], world: int) -> None:
    """--recompute-granularity auto: the run starts with the planner's [2, 2] and no recompute; before iteration 2
    a layer moves and the stages take another recompute choice (full on the first, selective on the second), in
    process.  The stages then recompute as chosen, the losses are those of a run that started with [1, 3] and that
    choice, to the bit, and the checkpoint written after the change records both: a resume takes them back and
    continues bit for bit (make test-slow: tp = 2; zb-auto with the distributed optimizer over dp = 2)."""
    argv = [*ARGV, *flags, *AUTO, "--recompute-granularity", "auto"]
    ckpt = str(tmp_path / "ckpt")
    chosen = ("full", "selective")
    moved = _run([*argv, "--save", ckpt], world, split=(1, 3), at=2, save=True, recompute=chosen)
    assert moved["before"] == (2, 2) and moved["after"] == (1, 3)
    assert moved["recompute"] == ((0, 1, "full"), (1, 4, "selective"))
    assert moved["recomputed"] == {0: (((0, 1),), [False]), 1: ((), [True, True, True])}
    started = _run(argv, world, start=((1, 3), chosen))
    assert started["recomputed"] == moved["recomputed"]
    assert moved["losses"] == started["losses"], (moved, started)
    resumed = run_multiprocess(pretrain_rank, world, args=([*argv, "--load", ckpt],), timeout_s=240)[0]
    assert resumed["losses"] == moved["losses"][3:]
    assert "layers per stage: [1, 3] (auto)" in resumed["log"]
    assert "activation recomputation: auto per stage: full, selective" in resumed["log"]


@pytest.mark.slow
def test_planned_resplit_of_a_cost_dependent_schedule() -> None:
    """zb-auto moved by the planner's decision (whose simulated plan for the new split the runtime then runs): the
    losses of a run started with that split, whose plan came from the default costs (relative 1e-4, fixed before
    measuring: another plan may order the weight-gradient accumulation differently)."""
    argv = [*ARGV, "--enable-zero-bubble"]
    moved = _run([*argv, *AUTO], 2, split="planned", at=2)
    assert moved["before"] == (2, 2) and moved["after"] == (3, 1)
    started = _run([*argv, "--decoder-first-pipeline-num-layers", "3"], 2)
    assert started["after"] == (3, 1)
    assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(moved["losses"], started["losses"], strict=True))


@pytest.mark.slow
def test_resplit_with_tensor_parallelism() -> None:
    """pp = 2 x tp = 2: each tensor-parallel shard moves to its new owner of the same tp rank."""
    argv = [*ARGV, "--pipeline-schedule", "zb-h1", "--tensor-model-parallel-size", "2"]
    moved = _run([*argv, *AUTO], 4, split=(1, 3), at=2)
    assert moved["after"] == (1, 3)
    started = _run([*argv, "--decoder-first-pipeline-num-layers", "1"], 4)
    assert moved["losses"] == started["losses"], (moved, started)


@pytest.mark.slow
def test_resplit_with_the_distributed_optimizer_over_dp2() -> None:
    """pp = 2 x dp = 2 with --use-distributed-optimizer: the optimizer shards are re-sharded for the new split's
    buckets and the run continues bit for bit."""
    argv = [*ARGV, "--pipeline-schedule", "zb-h1", "--use-distributed-optimizer", "--global-batch-size", "8"]
    moved = _run([*argv, *AUTO], 4, split=(3, 1), at=2)
    assert moved["before"] == (2, 2) and moved["after"] == (3, 1)
    started = _run([*argv, "--decoder-first-pipeline-num-layers", "3"], 4)
    assert moved["losses"] == started["losses"], (moved, started)


def test_profiling_window_measures_parts_and_keeps_the_losses(tmp_path) -> None:
    """The trainer's own path: the window times the parts (the saved profile has a ``parts`` entry the planner
    reads), every rank plans the split from the agreed profile and, if it differs, moves the layers; either way the
    losses are those of the run without a window, to the bit."""
    from megatron.pipeline.layer_split import PREDICTION
    from zb_pipeline.schedule.profile import Profile
    from zb_pipeline.schedule.stage_planner import ModelCosts, evaluate_split, plan_stages

    argv = [*ARGV, "--pipeline-schedule", "zb-h1", *AUTO, "--train-iters", "5"]
    save = str(tmp_path / "ckpt")
    log = _with_and_without_window(argv, "--save", save)
    assert "layer split from measured per-part costs" in log
    profile = Profile.load(f"{save}/zb_profile.json")
    parts = profile.model_costs()
    assert parts.num_layers == 4 and min(parts.layer.f, parts.layer.b, parts.head.f, parts.embedding.f) > 0
    # the saved (agreed) profile plans offline what every rank decided in process
    offline = plan_stages(parts, schedule="zb-h1", num_ranks=2, num_microbatches=4)
    assert f"layer split from measured per-part costs: {list(offline.layers)}" in log
    # the logged prediction: whole iterations in ms under the window's means, the time between iterations (window
    # 1-2: one sample) included: on the window's split the measured one, the fixed part plus the largest rank's
    # share of the optimizer work, which each rank measured (iteration 1's step) and shared by parameters
    assert profile.boundary > 0 and parts.step_time((2, 2), (0, 1)) == pytest.approx(profile.boundary)
    assert min(parts.step_share.layer, parts.step_share.embedding, parts.step_share.head) > 0
    means = ModelCosts.from_dict(profile.parts["predict"])
    assert means.step_time((2, 2), (0, 1)) > 0 and means.layer.f > 0
    (found,) = PREDICTION.findall(log)
    shape = dict(schedule="zb-h1", num_ranks=2, num_microbatches=4)
    predicted = evaluate_split(means, offline.layers, **shape)[0]
    assert float(found[1]) == pytest.approx(predicted, abs=0.01) and predicted > means.step
    assert float(found[2]) == pytest.approx(evaluate_split(means, (2, 2), **shape)[0], abs=0.01)
    if "re-split after iteration 3" in log:
        assert "layers per stage [2, 2] -> " in log


def test_part_timer_takes_out_every_hook_at_the_windows_end() -> None:
    """The window's ``PartTimer`` times a one-stage GPT's parts through module hooks, an iteration hook and handler
    wrappers; ``detach`` (the trainer's, at the window's end) puts the modules' hook dicts, the runtime's handler
    table and its iteration hooks back to what they were, and the samples stay for the gather."""
    import torch
    from model_configs import pipeline_config

    from megatron.model.gpt import build_gpt_stages
    from megatron.pipeline.part_timer import PartTimer
    from zb_pipeline.runtime.runtime import PipelineRuntime, PlanSource

    torch.manual_seed(0)
    cfg = pipeline_config(2, tied=False)
    (stage,) = build_gpt_stages(cfg, 1, seed=77)
    runtime = PipelineRuntime(
        {0: stage}, rank=0, plans=PlanSource("zb-h1"), num_microbatches=2, comm=None, input_fn=lambda t: t[:, :-1],
        loss_fn=lambda out, t: (out.mean() / 2, out.mean()), forward_fn=lambda m, x, s, t: m(x, labels=t[:, 1:]),
    )  # fmt: skip
    batches = [torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1)) for _ in range(2)]

    def installed() -> tuple:
        hooks = {n: (list(m._forward_pre_hooks), list(m._forward_hooks)) for n, m in stage.named_modules()}
        return hooks, dict(runtime.executor.handlers), list(runtime.hooks.iteration_start)

    before = installed()
    timer = PartTimer(runtime, start_iter=0, end_iter=2)
    assert installed() != before
    for it in range(2):
        runtime.run(batches, iteration=it)
    timer.detach()
    assert installed() == before
    summary = timer.local_summary()
    assert all(summary[part][kind] for part in ("embedding", "layer", "head") for kind in ("f", "b")), summary
    runtime.run(batches, iteration=2)
    assert timer.local_summary() == summary


def _with_and_without_window(argv: list[str], *window_only: str) -> str:
    """``argv`` trained on 2 ranks with the profiling window (and ``window_only``) and without: the losses agree to
    the bit; returns the window run's log (every rank's)."""
    got = run_multiprocess(pretrain_rank, 2, args=([*argv, *WINDOW, *window_only],), timeout_s=240)
    ref = run_multiprocess(pretrain_rank, 2, args=(argv,), timeout_s=240)[0]
    assert got[0]["losses"] == ref["losses"]
    return "".join(r["log"] for r in got)


def _analytic(num_layers: int):
    """The analytic model both calibration tests share: its proportions are what the measured stages scale."""
    from zb_pipeline.schedule.stage_planner import ModelCosts, PartCosts

    return ModelCosts(
        num_layers=num_layers,
        layer=PartCosts(f=1.0, b=2.0, w=1.0, mem_f=10.0),
        embedding=PartCosts(f=0.1, b=0.0, w=0.5, mem_f=1.0),
        head=PartCosts(f=2.0, b=2.0, w=2.0, mem_f=30.0),
    )


def test_parts_combine_measured_times_with_the_stage_profile() -> None:
    """F and B of each part are the medians of every rank's samples; a stage's measured W and memory are shared among
    its parts in the analytic model's proportions; what a stage's action holds beyond its parts goes to the
    embedding (first stage) and the head (last stage), so the parts add up to every measured stage again."""
    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.schedule.profile import Profile
    from zb_pipeline.schedule.stage_planner import ModelCosts

    analytic = _analytic(num_layers=4)
    profile = Profile(
        num_ranks=2, stage_to_rank=(0, 1), f=(9.0, 9.0), b=(9.0, 9.0), w=(5.0, 8.0), bw=(None, None), comm=0.25,
        mem_f=(42.0, 100.0), mem_b=(0.0, 0.0), mem_w=(-42.0, -100.0), stage_layers=(2, 2), boundary=7.5,
    )  # fmt: skip
    summaries = [
        {"embedding": {"f": [0.3, 0.2, 9.0]}, "layer": {"f": [2.0, 2.1, 50.0], "b": [3.0, 3.0]}},
        {"layer": {"f": [2.2], "b": [3.5, 4.0]}, "head": {"f": [4.0, 4.4, 4.2], "b": [5.0]}},
    ]
    parts = combine_parts(summaries, profile, analytic)
    assert parts["layer"]["f"] == pytest.approx(2.15) and parts["layer"]["b"] == 3.25  # medians of the pooled samples
    # stage 0's F 9 holds 0.3 + 2 x 2.15 timed by the hooks, B 9 holds 0 + 2 x 3.25: the rest is the embedding's
    assert parts["embedding"]["f"] == pytest.approx(4.7) and parts["embedding"]["b"] == pytest.approx(2.5)
    assert parts["head"]["f"] == pytest.approx(4.7) and parts["head"]["b"] == pytest.approx(2.5)
    # stage 0 measured W 5 over analytic 0.5 + 2 * 1 = 2.5: x2; stage 1: 8 over 2 * 1 + 2 = 4: x2
    assert parts["embedding"]["w"] == pytest.approx(1.0) and parts["layer"]["w"] == 2.0
    assert parts["head"]["w"] == pytest.approx(4.0)
    # memory: stage 0 42 over 21: x2; stage 1 100 over 50: x2
    assert parts["embedding"]["mem_f"] == 2.0 and parts["layer"]["mem_f"] == 20.0 and parts["head"]["mem_f"] == 60.0
    assert parts["comm"] == 0.25 and parts["num_layers"] == 4 and parts["step"] == 7.5
    assert parts["overhead"] == {"f": 0.0, "b": 0.0, "w": 0.0}  # no stage without embedding and head: none seen
    means = combine_parts(summaries, profile, analytic, statistic="mean")  # what the logged prediction reads
    assert means["layer"]["f"] == pytest.approx((2.0 + 2.1 + 50.0 + 2.2) / 4) and means["layer"]["b"] == 3.375
    assert _through_json(parts, profile)
    costs = ModelCosts.from_dict(parts).stage_costs((2, 2), (0, 0))
    assert costs.f == pytest.approx(profile.f) and costs.b == pytest.approx(profile.b)
    assert costs.w == pytest.approx(profile.w)


def test_parts_share_each_ranks_optimizer_work_by_parameters() -> None:
    """Each rank's measured optimizer work (its own, per window iteration) is shared among the parts it holds by
    their parameter counts, a part's share the median over the ranks holding it; the fixed part is the measured
    time between iterations less the largest rank's share on the window's split, so that split gives it back and
    another split moves it with the rank that holds the most (given costs)."""
    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.schedule.profile import Profile
    from zb_pipeline.schedule.stage_planner import ModelCosts

    profile = Profile(
        num_ranks=2, stage_to_rank=(0, 1), f=(9.0, 9.0), b=(9.0, 9.0), w=(5.0, 8.0), bw=(None, None), comm=0.25,
        mem_f=(42.0, 100.0), mem_b=(0.0, 0.0), mem_w=(-42.0, -100.0), stage_layers=(2, 2), boundary=7.5,
    )  # fmt: skip
    times = {"f": [1.0], "b": [1.0]}
    summaries = [
        {"embedding": times, "layer": times, "step": {"ms": [3.0, 3.2, 2.9], "embedding": 100, "layer": 50,
                                                      "head": 0, "layers": 2}},
        {"layer": times, "head": times, "step": {"ms": [4.0], "embedding": 0, "layer": 50, "head": 150,
                                                 "layers": 2}},
    ]  # fmt: skip
    parts = combine_parts(summaries, profile, _analytic(num_layers=4))
    # rank 0: 3.0 ms over 200 parameters (embedding 100, two layers of 50); rank 1: 4.0 over 250 (two layers, head 150)
    share = parts["step_share"]
    assert share["embedding"] == pytest.approx(1.5) and share["head"] == pytest.approx(2.4)
    assert share["layer"] == pytest.approx((0.75 + 0.8) / 2)
    window = max(1.5 + 2 * share["layer"], 2 * share["layer"] + 2.4)  # the head's rank, 3.95
    assert parts["step"] == pytest.approx(7.5 - window)
    costs = ModelCosts.from_dict(parts)
    assert costs.step_time((2, 2), (0, 1)) == pytest.approx(7.5)  # the measured split gives the measured step
    assert costs.step_time((3, 1), (0, 1)) == pytest.approx(7.5 - window + 1.5 + 3 * share["layer"])
    assert _through_json(parts, profile)
    without = [{k: v for k, v in one.items() if k != "step"} for one in summaries]  # not measured (a GPU)
    flat = combine_parts(without, profile, _analytic(num_layers=4))
    assert flat["step"] == 7.5 and "step_share" not in flat


def test_parts_calibration_finds_the_per_action_overhead() -> None:
    """With a stage that holds neither the embedding nor the head, what its actions hold beyond its layers is the
    overhead every action pays (plus the runtime's gap between actions); the parts still add up to every stage."""
    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.schedule.profile import Profile
    from zb_pipeline.schedule.stage_planner import ModelCosts

    analytic = _analytic(num_layers=6)
    profile = Profile(
        num_ranks=3, stage_to_rank=(0, 1, 2), f=(5.0, 4.5, 7.0), b=(7.0, 7.0, 9.0), w=(2.5, 2.0, 4.0),
        bw=(None,) * 3, comm=0.0, mem_f=(21.0, 20.0, 50.0), mem_b=(0.0,) * 3, mem_w=(-21.0, -20.0, -50.0),
        stage_layers=(2, 2, 2), overhead=0.1,
    )  # fmt: skip
    summaries = [
        {"embedding": {"f": [0.5]}, "layer": {"f": [2.0, 2.0], "b": [3.0, 3.0]}},
        {"layer": {"f": [2.0, 2.0], "b": [3.0, 3.0]}},
        {"layer": {"f": [2.0], "b": [3.0]}, "head": {"f": [2.0], "b": [2.0]}},
    ]
    parts = combine_parts(summaries, profile, analytic)
    over = parts["overhead"]  # the middle stage: F 4.5 - 2 x 2, B 7 - 2 x 3, W 2 - 2 x 1; plus the gap 0.1
    assert over["f"] == pytest.approx(0.6) and over["b"] == pytest.approx(1.1) and over["w"] == pytest.approx(0.1)
    assert parts["embedding"]["f"] == pytest.approx(0.5 + (5.0 - 0.5 - 4.0) - 0.5)
    costs = ModelCosts.from_dict(parts).stage_costs((2, 2, 2), (0, 0, 0))
    gap = 0.1  # the runtime's gap is paid between actions: the stages' own times plus it
    assert costs.f == pytest.approx(tuple(v + gap for v in profile.f))
    assert costs.b == pytest.approx(tuple(v + gap for v in profile.b))
    assert costs.w == pytest.approx(tuple(v + gap for v in profile.w))


def _through_json(parts: dict, profile) -> bool:
    """The entry is what ``Profile.model_costs`` reads, through the profile file's JSON."""
    import dataclasses
    import json

    from zb_pipeline.schedule.profile import Profile
    from zb_pipeline.schedule.stage_planner import ModelCosts

    mc = ModelCosts.from_dict(parts)
    assert ModelCosts.from_dict(json.loads(json.dumps(mc.to_dict()))) == mc  # every field survives its own dict
    again = Profile.from_dict(json.loads(json.dumps(dataclasses.replace(profile, parts=parts).to_dict())))
    assert again.model_costs() == mc  # and the profile file's
    return again.model_costs().head.w == 4.0


def test_fused_bw_window_replans_and_resplits_from_the_measured_bw() -> None:
    """1F1B runs only fused BW: the window's re-plan simulates its plan under the measured BW (it has no split B
    and W to ask for), and each part's B and W are its timed BW shared in the analytic B : W ratio, so the stage
    planner re-decides the split from what the window measured (a head whose BW weighs four layers' moves one)."""
    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.runtime.replanner import regenerate
    from zb_pipeline.schedule.profile import Profile, predict_makespan
    from zb_pipeline.schedule.stage_planner import ModelCosts, plan_stages

    profile = Profile(
        num_ranks=2, stage_to_rank=(0, 1), f=(9.0, 9.0), b=(None, None), w=(None, None), bw=(14.0, 16.0),
        comm=0.25, mem_f=(42.0, 100.0), mem_b=(0.0, 0.0), mem_w=(-42.0, -100.0), stage_layers=(2, 2),
        schedule="1f1b", num_microbatches=4,
    )  # fmt: skip
    replan = regenerate(profile, 4, name="1f1b")
    assert [replan.costs.bw(s) for s in range(2)] == pytest.approx(profile.bw)
    assert replan.result.makespan == pytest.approx(predict_makespan(profile, replan.schedule, overhead=False))
    with pytest.raises(ValueError, match="fused BW.*zb-h1"):  # a split plan needs the split times
        regenerate(profile, 4, name="zb-h1")

    def parts_for(head_bw: float, stage_bw: tuple[float, float] = (14.0, 16.0)) -> dict:
        summaries = [
            {"embedding": {"f": [0.3], "bw": [0.6]}, "layer": {"f": [2.0, 2.0], "bw": [3.0, 3.0]}},
            {"layer": {"f": [2.0, 2.0], "bw": [3.0, 3.0]}, "head": {"f": [2.0], "bw": [head_bw]}},
        ]
        measured = dataclasses.replace(profile, bw=stage_bw)
        return combine_parts(summaries, measured, _analytic(num_layers=4))

    parts = parts_for(3.0)
    # analytic B : W of a layer 2 : 1, of the embedding 0 : 0.5, of the head 2 : 2; the stages' BW beyond their
    # timed parts (14 - 0.6 - 2 x 3, 16 - 2 x 3 - 3) goes to the embedding and the head in the same ratio
    assert (parts["layer"]["b"], parts["layer"]["w"]) == pytest.approx((2.0, 1.0))
    assert (parts["embedding"]["b"], parts["embedding"]["w"]) == pytest.approx((0.0, 0.6 + 7.4))
    assert (parts["head"]["b"], parts["head"]["w"]) == pytest.approx((1.5 + 3.5, 1.5 + 3.5))
    shape = dict(schedule="1f1b", num_ranks=2, num_microbatches=4)
    assert plan_stages(ModelCosts.from_dict(parts), **shape).layers == (2, 2)
    # the window measured a last stage whose BW weighs far more than the first's: a layer moves off it
    assert plan_stages(ModelCosts.from_dict(parts_for(12.0, (8.0, 24.0))), **shape).layers == (3, 1)


def test_fused_bw_calibration_pays_the_overhead_once() -> None:
    """A fused-BW window (1F1B) is calibrated like a split one: what a stage's BW holds beyond its parts' B + W is
    the per-action overhead (the stages without embedding and head) and the embedding's and head's rest, so the
    parts add up to every measured BW, and the runtime's gap between actions is paid once per BW, not on its B and
    its W both."""
    from megatron.pipeline.part_costs import combine_parts
    from zb_pipeline.schedule.profile import Profile
    from zb_pipeline.schedule.stage_planner import ModelCosts

    gap = 0.1
    profile = Profile(
        num_ranks=3, stage_to_rank=(0, 1, 2), f=(5.0, 4.5, 7.0), b=(None,) * 3, w=(None,) * 3, bw=(9.0, 8.0, 13.0),
        comm=0.0, mem_f=(21.0, 20.0, 50.0), mem_b=(0.0,) * 3, mem_w=(-21.0, -20.0, -50.0), stage_layers=(2, 2, 2),
        overhead=gap,
    )  # fmt: skip
    summaries = [
        {"embedding": {"f": [0.5], "bw": [0.5]}, "layer": {"f": [2.0, 2.0], "bw": [3.0, 3.0]}},
        {"layer": {"f": [2.0, 2.0], "bw": [3.0, 3.0]}},
        {"layer": {"f": [2.0], "bw": [3.0]}, "head": {"f": [2.0], "bw": [4.0]}},
    ]
    parts = combine_parts(summaries, profile, _analytic(num_layers=6))
    # the middle stage's BW 8 holds 2 x 3 of layers: 2 per BW beyond them, paid once, plus the gap
    assert parts["overhead"]["b"] + parts["overhead"]["w"] == pytest.approx(2.0 + gap)
    costs = ModelCosts.from_dict(parts).stage_costs((2, 2, 2), (0, 0, 0))
    assert [costs.bw(s) for s in range(3)] == pytest.approx([v + gap for v in profile.bw])
    assert costs.f == pytest.approx(tuple(v + gap for v in profile.f))


@pytest.mark.slow
def test_fused_bw_schedule_with_auto_split_and_window_trains() -> None:
    """pretrain with 1F1B, the auto split, a memory limit and a profiling window: the window re-plans and re-decides
    the split from the measured BW (it once ended in a traceback asking for split B and W times), and the losses are
    those of the run without a window, to the bit."""
    argv = [*ARGV, "--pipeline-schedule", "1f1b", *AUTO, "--pipeline-memory-limit-gb", "0.001", "--train-iters", "5"]
    log = _with_and_without_window(argv)
    assert "replanned 1f1b (p=2, m=4) from profiled costs" in log
    assert "layer split from measured per-part costs" in log


@pytest.mark.parametrize(
    "method,n",
    [
        ("uniform", 1),
        ("block", 2),
        ("uniform", 2),
        pytest.param("block", 1, marks=pytest.mark.slow),
    ],
)
def test_window_under_explicit_full_recompute(tmp_path, method: str, n: int) -> None:
    """--recompute-granularity full with --recompute-method ``method`` --recompute-num-layers ``n`` on every stage:
    the window times each layer's F (without autograd where it recomputes) and the B of each recomputed run (its
    recompute and backward) apart from a layer that kept its activations (block: a stage's later layers), and
    re-decides the split from them, the option fixed in the profile's parts with its run or block.  The parts add up
    to every measured stage under the recompute it ran, and the losses are those of the run without a window."""
    from zb_pipeline.schedule.profile import Profile

    full = ["--recompute-granularity", "full", "--recompute-method", method, "--recompute-num-layers", str(n)]
    # six layers: whatever the split, a stage holds more than two (block 2 leaves one of them plain)
    argv = [*ARGV, "--num-layers", "6", "--pipeline-schedule", "zb-h1", *AUTO, *full, "--train-iters", "5"]
    save = str(tmp_path / "ckpt")
    log = _with_and_without_window(argv, "--save", save)
    profile = Profile.load(f"{save}/zb_profile.json")
    assert "layer split from measured per-part costs" in log and "layer split kept" not in log
    parts = profile.model_costs()
    (option,) = parts.recompute
    assert parts.fixed_recompute and option.name == ("full" if (method, n) == ("uniform", 1) else f"full-{method}-{n}")
    assert (option.run, option.block) == ((1, n) if method == "block" else (n, 0))
    assert option.b_extra > 0 and min(parts.layer.f, parts.layer.b) > 0
    # block: the layers that kept their activations were timed apart, so what the option adds to B is measured
    # (where every layer recomputes it is the measured forward: the analytic full recompute re-runs the forward)
    assert (option.b_extra != pytest.approx(parts.layer.f, rel=1e-9)) == (method == "block")
    # every measured stage's F, B and activation memory are its parts' under the recompute it ran, plus the
    # runtime's gap between actions -- unless the remainder it leaves the embedding (first stage) or the head (last)
    # is below 0, which that part's time is clipped at
    S, gap = profile.num_stages, profile.overhead
    stage = parts.stage_costs(profile.stage_layers, (1,) * S)
    assert stage.mem_f == pytest.approx(profile.mem_f, rel=1e-9)
    for kind in ("f", "b"):
        for s, (have, want) in enumerate(zip(getattr(stage, kind), getattr(profile, kind))):
            clipped = any(getattr(p, kind) <= 1e-6 for p in [parts.embedding] * (s == 0) + [parts.head] * (s == S - 1))
            assert have == pytest.approx(want + gap, rel=1e-9) or (clipped and have > want + gap), (kind, s, parts)
