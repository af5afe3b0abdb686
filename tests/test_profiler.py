"""The profiler: measured costs -> Profile -> prof.json -> zb-schedule, and switching plans at an iteration boundary.

Deterministic properties only (no timing asserts): the plan the trainer switches to is the plan ``zb-schedule
--profile`` makes from the saved file; switching mid-run gives exactly the losses of a run that used the new plan
from the start; the saved-tensor memory accounting gives exact byte counts for a known stage and its measured peak
equals the simulator's prediction under the profiled deltas.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_models import BATCH, HIDDEN, MLPStage, mlp_input, mlp_target

from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.profiler import ActionProfiler
from zb_pipeline.runtime.replanner import WindowReplanner, regenerate
from zb_pipeline.schedule import cli
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.lowering import lower
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.model_costs import ModelCosts, PartCosts
from zb_pipeline.schedule.plan_file import load_plan, plan_from_dict, plan_to_dict, save_plan
from zb_pipeline.schedule.profile import Profile, fuses_backward, mem_limit_for_microbatches, predict_makespan
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.testing import run_multiprocess

P, M, ITERS, WINDOW = 3, 5, 4, (0, 2)
LR = 0.05
FLOAT_BYTES = 4


def _loss_fn(out: torch.Tensor, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    loss = ((out - mlp_target(mb)) ** 2).mean()
    return loss / M, loss


def _train_rank(rank: int, world_size: int, plan: dict | None, plan_path: str | None) -> dict:
    """ITERS iterations of SGD.  plan=None: start on zb-h1, profile WINDOW, replan zb-auto and switch; else run
    ``plan`` (loaded from ``plan_path``) from the start."""
    torch.set_num_threads(1)
    sched = load_plan(plan_path) if plan_path else generate("zb-h1", world_size, M)
    lowered = lower(sched)
    stages = {s: MLPStage(s) for s in sched.stages_of(rank)}
    specs = [TensorSpec((BATCH, HIDDEN))] * (sched.num_stages - 1)
    p2p = PipelineP2P(pp_rank=rank, boundary_specs=specs, timeout_s=60, check=True)
    ex = PipelineExecutor(lowered, rank, stages, p2p=p2p, input_fn=mlp_input, loss_fn=_loss_fn)
    replanner = None
    if plan_path is None:
        replanner = WindowReplanner(
            ex, start_iter=WINDOW[0], end_iter=WINDOW[1], mem_limit_microbatches=world_size, log=lambda line: None
        )
    losses, executed_plan_after = [], None
    for it in range(ITERS):
        losses.append([float(x) for x in ex.run(it)])
        with torch.no_grad():
            for mod in stages.values():
                for prm in mod.parameters():
                    prm -= LR * prm.grad
                    prm.grad = None
        if replanner is not None and replanner.after_iteration(it) is not None:
            executed_plan_after = [str(st) for st in ex.steps]
    dist.barrier()
    out = {
        "losses": losses,
        "params": {s: [prm.detach().numpy().copy() for prm in mod.parameters()] for s, mod in stages.items()},
    }
    if replanner is not None:
        out["profile"] = replanner.profile.to_dict()
        out["plan"] = plan_to_dict(replanner.replan.schedule)
        out["mem_limit"] = replanner.replan.mem_limit
        out["makespan"] = replanner.replan.result.makespan
        out["steps_after_switch"] = executed_plan_after
        out["window_plan"] = plan_to_dict(sched)
    return out


@pytest.fixture(scope="module")
def switched_run() -> list[dict]:
    return run_multiprocess(_train_rank, P, args=(None, None), timeout_s=120)


def test_profile_memory_is_exact_saved_tensor_bytes(switched_run: list[dict]) -> None:
    prof = Profile.from_dict(switched_run[0]["profile"])
    act = BATCH * HIDDEN * FLOAT_BYTES
    S = prof.num_stages
    # F saves the linear input and the tanh output (the second linear's input, same storage); the last stage also
    # saves (out - target) for the squared error and the divisor M of loss / M (a float64 scalar tensor).  After B
    # the graph is freed and each linear's W work holds its input and its output gradient.
    scalar = 8
    assert prof.mem_f == tuple([2.0 * act] * (S - 1) + [3.0 * act + scalar])
    assert prof.mem_b == tuple([2.0 * act] * (S - 1) + [1.0 * act - scalar])
    assert prof.mem_w == tuple([-4.0 * act] * S)
    assert prof.residual == (0.0,) * S
    assert prof.memory_source == "saved-tensors" and prof.window == WINDOW
    assert all(n == M * (WINDOW[1] - WINDOW[0]) for n in prof.samples)
    assert all(v is not None and v > 0 for v in (*prof.f, *prof.b, *prof.w)) and prof.comm > 0
    # The measured peak of every rank equals the simulator's prediction for the profiled plan under these deltas.
    window_plan = plan_from_dict(switched_run[0]["window_plan"])
    assert prof.peak_bytes == peak_memory(window_plan, prof.to_stage_costs())
    # The runtime's gap between two compute actions was measured (posting transfers takes some time).
    assert 0 < prof.overhead < 1e3


def test_saved_profile_gives_the_plan_the_run_switched_to(switched_run: list[dict], tmp_path, capsys) -> None:
    res = switched_run[0]
    prof = Profile.from_dict(res["profile"])
    path = tmp_path / "prof.json"
    prof.save(path)
    assert Profile.load(path) == prof
    switched = plan_from_dict(res["plan"])
    assert res["mem_limit"] == mem_limit_for_microbatches(prof, P)
    again = regenerate(Profile.load(path), M, mem_limit=res["mem_limit"])
    assert again.schedule == switched and again.result.makespan == res["makespan"]
    export = tmp_path / "plan.json"
    argv = ["simulate", "zb-auto", "-p", str(P), "-m", str(M), "--profile", str(path)]
    assert cli.main([*argv, "--mem-limit", repr(res["mem_limit"]), "--export", str(export), "--json"]) == 0
    assert load_plan(export) == switched
    summary = json.loads(capsys.readouterr().out)
    assert summary["makespan"] == res["makespan"]
    assert cli.main(["compare", "-p", str(P), "-m", str(M), "--profile", str(path), "--json"]) == 0
    assert cli.main(["show", "zb-h2", "-p", str(P), "-m", str(M), "--profile", str(path), "--color", "never"]) == 0
    capsys.readouterr()
    assert cli.main(["simulate", "zb-auto", "-p", "4", "-m", str(M), "--profile", str(path)]) == 2
    assert "measured with p=3" in capsys.readouterr().err
    # Every rank switched its executor to exactly that plan.
    lowered = lower(switched)
    for rank, r in enumerate(switched_run):
        assert r["steps_after_switch"] == [str(st) for st in lowered.ranks[rank]]
        assert r["plan"] == res["plan"]


def test_switching_at_a_boundary_matches_the_new_plan_from_the_start(switched_run: list[dict], tmp_path) -> None:
    path = tmp_path / "switched.json"
    save_plan(plan_from_dict(switched_run[0]["plan"]), path)
    ref = run_multiprocess(_train_rank, P, args=(None, str(path)), timeout_s=120)
    last = P - 1
    assert switched_run[last]["losses"] == ref[last]["losses"]
    assert all(len(x) == M for x in ref[last]["losses"])
    for rank in range(P):
        for s, params in switched_run[rank]["params"].items():
            for a, b in zip(params, ref[rank]["params"][s], strict=True):
                assert np.array_equal(a, b)


def _profile(**over) -> Profile:
    base = dict(
        num_ranks=2,
        stage_to_rank=(0, 1, 1, 0),
        f=(1.0, 2.0, 3.0, 4.0),
        b=(1.5, 2.5, 3.5, 4.5),
        w=(0.5, 1.0, 1.5, 2.0),
        bw=(None,) * 4,
        comm=0.25,
        mem_f=(10.0, 20.0, 30.0, 40.0),
        mem_b=(1.0, 2.0, 3.0, 4.0),
        mem_w=(-11.0, -22.0, -33.0, -44.0),
    )
    base.update(over)
    return Profile(**base)


def test_profile_costs_keep_or_regroup_stages() -> None:
    prof = _profile()
    same = prof.to_stage_costs()
    assert same.f == prof.f and same.b == prof.b and same.w == prof.w and same.comm == 0.25
    assert same.mem_w == prof.mem_w
    # Another layout: each rank's share (rank 0: stages 0 and 3, rank 1: stages 1 and 2), spread over its chunks.
    one = prof.to_stage_costs(chunks=1, stage_to_rank=(0, 1))
    assert one == StageCosts.build(num_ranks=2, f=[5.0, 5.0], b=[6.0, 6.0], w=[2.5, 2.5], comm=0.25,
                                   mem_f=[50.0, 50.0], mem_b=[5.0, 5.0])  # fmt: skip
    assert prof.microbatch_bytes() == 55.0
    assert mem_limit_for_microbatches(prof, 3) == 165.0
    with pytest.raises(ValueError, match="must be > 0"):
        mem_limit_for_microbatches(prof, 0)


def test_profile_without_split_backward_says_what_to_do() -> None:
    prof = _profile(b=(None,) * 4, w=(None,) * 4, bw=(2.0, 3.0, 4.0, 5.0))
    with pytest.raises(ValueError, match="fused BW.*zb-h1"):
        prof.to_stage_costs()
    # ... but a plan that fuses its backward too can be simulated from it: the whole BW counts as B.
    fused = prof.to_stage_costs(fused=True)
    assert fused.f == prof.f and all(fused.bw(s) == pytest.approx(prof.bw[s]) for s in range(4))


def test_a_stage_that_ran_only_fused_bw_is_split_in_the_others_ratio() -> None:
    """A memory-capped plan (zb-auto under a tight limit) may run every backward of one stage fused: that stage's
    BW is shared in the B : W ratio the other stages measured (their median share of B), so a split plan can still
    be made from the window; the window's re-plan of zb-auto goes through."""
    # B's shares of B + W on stages 1-3: 2.5/3.5, 3.5/5, 4.5/6.5 -> median 0.7.
    prof = _profile(b=(None, 2.5, 3.5, 4.5), w=(None, 1.0, 1.5, 2.0), bw=(4.0, None, None, None))
    assert prof.splits_backward
    costs = prof.to_stage_costs()
    assert costs.b[0] == pytest.approx(2.8) and costs.w[0] == pytest.approx(1.2)
    assert costs.b[1:] == prof.b[1:] and costs.w[1:] == prof.w[1:]
    replan = regenerate(prof, 8, name="zb-auto")
    assert not fuses_backward(replan.schedule) and replan.result.makespan > 0
    # Every stage fused (a plan capped to fuse them all): the per-part model's layer gives the ratio, when present.
    parts = ModelCosts(
        num_layers=4, layer=PartCosts(f=1.0, b=1.0, w=0.5), embedding=PartCosts(f=0.1, b=0.1, w=0.05),
        head=PartCosts(f=2.0, b=2.0, w=1.0),
    ).to_dict()  # fmt: skip
    every = _profile(b=(None,) * 4, w=(None,) * 4, bw=(3.0, 4.5, 6.0, 7.5), parts=parts)
    assert not every.splits_backward
    costs = every.to_stage_costs()
    assert costs.b == pytest.approx((2.0, 3.0, 4.0, 5.0)) and costs.w == pytest.approx((1.0, 1.5, 2.0, 2.5))
    replan = regenerate(every, 8, name="zb-auto")
    assert not fuses_backward(replan.schedule) and replan.result.makespan > 0


def test_overhead_is_paid_once_per_compute_action() -> None:
    o = 0.125
    prof = _profile(overhead=o)
    plain, paid = prof.to_stage_costs(), prof.to_stage_costs(overhead=True)
    assert paid.f == tuple(v + o for v in plain.f) and paid.b == tuple(v + o for v in plain.b)
    assert paid.w == tuple(v + o for v in plain.w)
    sched = generate("zb-v", 2, 4)
    assert tuple(sched.stage_to_rank) == prof.stage_to_rank
    assert predict_makespan(prof, sched) == simulate(sched, paid).makespan
    assert predict_makespan(prof, sched, overhead=False) == simulate(sched, plain).makespan
    # A fused schedule from a fused profile: a BW is one action, it pays the overhead once.
    fused_prof = _profile(b=(None,) * 4, w=(None,) * 4, bw=(2.0, 3.0, 4.0, 5.0), overhead=o)
    loop = generate("interleaved-1f1b", 2, 4)
    costs = fused_prof.to_stage_costs(stage_to_rank=tuple(loop.stage_to_rank), fused=True, overhead=True)
    # each rank's share (stages 0 + 3 and 1 + 2: 7 ms) over its two chunks, then the overhead once per action
    assert all(costs.bw(s) == pytest.approx(3.5 + o) for s in range(4))
    assert predict_makespan(fused_prof, loop) == simulate(loop, costs).makespan
    # Profiles written before the field existed read as overhead 0; a negative one is refused.
    d = prof.to_dict()
    del d["overhead"]
    assert Profile.from_dict(d).overhead == 0.0
    d["overhead"] = -1.0
    with pytest.raises(ValueError, match="overhead -1.0 must be finite and >= 0"):
        Profile.from_dict(d)


def test_profile_file_errors(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.load(bad)
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a profile"):
        Profile.from_dict(json.loads(bad.read_text()))
    d = _profile().to_dict()
    d["f"] = [1.0]
    with pytest.raises(ValueError, match="'f' has 1 entries"):
        Profile.from_dict(d)


def test_single_process_profiler_window_and_switch_errors() -> None:
    torch.set_num_threads(1)
    sched = generate("zb-h1", 1, 3)
    ex = PipelineExecutor(lower(sched), 0, {0: MLPStage(0)}, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn)
    prof = ActionProfiler(ex, start_iter=1, end_iter=2)
    ex.run(0)
    assert not prof.times  # outside the window
    ex.run(1)
    ex.run(2)
    assert len(prof.times[(sched.ranks[0][0].kind, 0)]) == 3
    got = prof.gather()
    assert got.samples == (3,) and got.comm == 0.0
    # Medians to plan with, means to predict a span (a sum): each summarises the same recorded samples.
    f_times = prof.times[(sched.ranks[0][0].kind, 0)]
    assert got.statistic == "median" and got.f == (float(np.median(f_times)),)
    mean = prof.gather(statistic="mean")
    assert mean.statistic == "mean" and mean.f[0] == pytest.approx(float(np.mean(f_times)), rel=1e-12)
    assert mean.overhead == pytest.approx(float(np.mean(prof.gaps)), rel=1e-12)
    assert Profile.from_dict(mean.to_dict()) == mean
    with pytest.raises(ValueError, match="statistic"):
        prof.gather(statistic="mode")
    assert got.peak_bytes == peak_memory(sched, got.to_stage_costs()) == (4.0 * BATCH * HIDDEN * FLOAT_BYTES,)
    with pytest.raises(ValueError, match="empty"):
        ActionProfiler(ex, start_iter=2, end_iter=2)
    # Another executor over the same stages and weight-gradient store (as a benchmark runs several plans): a
    # profiler whose window ended with its executor's last run stays marked active, yet holds none of the other's work.
    first = PipelineExecutor(lower(sched), 0, {0: MLPStage(0)}, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn)
    done = ActionProfiler(first, start_iter=0, end_iter=1)
    first.run(0)
    other = PipelineExecutor(
        lower(sched), 0, first.stages, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn, store=first.store
    )
    for it in range(3):
        other.run(it)
    assert done.active and not any(done.activation.held_work.values())
    from zb_pipeline.runtime.replanner import switch_plan

    with pytest.raises(ValueError, match="must keep p=1, m=3"):
        switch_plan(ex, generate("zb-h1", 1, 4))


def test_the_window_replanner_takes_out_every_profiler_hook_at_the_windows_end() -> None:
    """The replanner's ``ActionProfiler`` wraps the compute handlers and hooks the executor and its weight-gradient
    store; at the window's end (the replan) it puts the handler table and every hook list back to what they were,
    and its samples stay: a later gather gives the profile the replan used, after iterations it did not see."""
    torch.set_num_threads(1)
    ex = PipelineExecutor(
        lower(generate("zb-h1", 1, 3)), 0, {0: MLPStage(0)}, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn
    )
    hooks, store = ex.hooks, ex.store

    def installed() -> tuple:
        lists = (hooks.iteration_start, hooks.input_ready, hooks.saved_for_backward, store.on_submit)
        return dict(ex.handlers), [list(h) for h in (*lists, store.on_recompute)]

    before = installed()
    replanner = WindowReplanner(ex, start_iter=0, end_iter=2, log=lambda line: None)
    assert installed() != before
    for it in range(2):
        ex.run(it)
        replanner.after_iteration(it)
    assert replanner.replan is not None and installed() == before
    ex.run(2)  # on the replanned plan, which a gather names
    assert dataclasses.replace(replanner.profiler.gather(), schedule="zb-h1") == replanner.profile


def test_replan_without_a_memory_limit_fails_in_one_line_and_the_trainer_exits_2(monkeypatch, capsys) -> None:
    """A re-plan that the window's measured costs cannot serve, with no memory limit to blame: the replanner raises
    ``ReplanError`` (not the limit's ``MeasuredLimitError``), one line naming the schedule, the window and the
    generator's reason; the trainer turns it into a ``ConfigError`` without a traceback, and ``pretrain_gpt.main``
    prints that line and exits 2 (here a window of fused BW asked for a split-backward plan)."""
    import pretrain_gpt
    from megatron import training
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError
    from zb_pipeline.runtime.replanner import MeasuredLimitError, ReplanError

    torch.set_num_threads(1)
    ex = PipelineExecutor(
        lower(generate("1f1b", 1, 3)), 0, {0: MLPStage(0)}, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn
    )
    replanner = WindowReplanner(ex, start_iter=0, end_iter=2, name="zb-h1", log=lambda line: None)
    ex.run(0)
    assert replanner.after_iteration(0) is None
    ex.run(1)
    with pytest.raises(ReplanError) as got:
        replanner.after_iteration(1)
    err = got.value
    assert not isinstance(err, MeasuredLimitError) and "\n" not in str(err)
    assert str(err).startswith("the re-plan of zb-h1 at the end of the profiling window (iterations 0-1) failed: ")
    assert "fused BW" in str(err) and "zb-h1" in str(err).split("failed: ")[1]

    def replan_fails(*args, **kwargs):
        raise err

    monkeypatch.setattr(training, "_pretrain", replan_fails)  # the trainer's loop, which would run the replanner
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "100", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as translated:
        training.pretrain(parse_run_config(argv, world_size=1))
    assert str(translated.value) == str(err) and translated.value.__suppress_context__
    capsys.readouterr()
    assert pretrain_gpt.main(argv) == 2
    assert capsys.readouterr().err == f"pretrain_gpt.py: error: {err}\n"


# ------------------------------------------------------------------------------------ the benchmark entry points
def test_bench_pipeline_cli_offers_what_make_bench_passes(capsys) -> None:
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_pipeline", os.path.join(root, "tools", "bench_pipeline.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as done:
        mod.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out and "--quick" in out
    assert mod.main(["--parts", "nonsense"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert mod.main(["--emulated-iterations", "1"]) == 2
    assert "warm-up" in capsys.readouterr().err
    assert mod.main(["--launches", "0"]) == 2
    assert mod.main(["--launches", "2", "--one-launch"]) == 2
    assert "--launches" in capsys.readouterr().err


def test_bench_ratio_over_launches_carries_their_spread() -> None:
    import importlib.util
    import os

    import numpy as np

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "bench_pipeline_analysis", os.path.join(root, "tools", "bench_pipeline_analysis.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = np.random.default_rng(1)

    def launch(ratio: float) -> tuple[list[float], list[float]]:  # 20 runs, 1% noise, base 1.0 s
        base = 1.0 + 0.01 * rng.standard_normal(20)
        return list(base / ratio * (1.0 + 0.01 * rng.standard_normal(20))), list(base)

    one = launch(1.10)
    assert mod.bootstrap_launches([one]) == mod.bootstrap_ratio(*one)
    _, lo1, hi1 = mod.bootstrap_ratio(*one)
    launches = [launch(r) for r in (1.04, 1.06, 1.08, 1.10, 1.12)]
    point, lo, hi = mod.bootstrap_launches(launches)
    ratios = sorted(float(np.median(b) / np.median(t)) for t, b in launches)
    assert point == ratios[2]  # the median launch
    assert lo < 1.07 and hi > 1.09  # the launches' spread, not one launch's noise
    assert hi - lo > 2 * (hi1 - lo1)


def test_bench_speedup_ceiling_from_profiles() -> None:
    """p = 2, m = 8, F = B = 2W: every schedule is capped at 1F1B's 22.5 over the bound 21 (15/14); 1F1B paying
    more per action in its own runs raises the own-cost ceiling, and ZB-H2's plan sits at the bound."""
    import importlib.util
    import os

    from zb_pipeline.schedule import registry
    from zb_pipeline.schedule.plan_file import plan_to_dict

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "bench_pipeline_analysis", os.path.join(root, "tools", "bench_pipeline_analysis.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def profile(*, fused: bool, overhead: float = 0.0, f: float = 1.0) -> Profile:
        split = (None, None) if fused else (1.0, 1.0)
        return Profile(num_ranks=2, stage_to_rank=(0, 1), f=(f, f), b=split, w=(None, None) if fused else (0.5, 0.5),
                       bw=(1.5, 1.5) if fused else (None, None), comm=0.0, mem_f=(1.0, 1.0), mem_b=(0.0, 0.0),
                       mem_w=(-1.0, -1.0), overhead=overhead)  # fmt: skip

    m = 8
    launch = profile(fused=False)
    plan = registry.generate("zb-h2", 2, m, costs=launch.to_stage_costs())
    rows = [
        {"schedule": "1f1b", "own_profile": profile(fused=True, f=1.1).to_dict()},
        {"schedule": "zb-h2", "own_profile": launch.to_dict()},
    ]
    cap = mod.speedup_ceiling(launch, rows, {"zb-h2": plan_to_dict(plan)}, m)
    assert cap["launch"]["bound_ms"] == pytest.approx(21.0)
    assert cap["launch"]["one_f_one_b_ms"] == pytest.approx(22.5)
    assert cap["launch"]["ceiling"] == pytest.approx(15 / 14) == pytest.approx(cap["theory"])
    assert cap["own"]["from"] == "zb-h2"
    assert cap["own"]["one_f_one_b_ms"] == pytest.approx(9 * 2.6)  # 1F1B's own F of 1.1 on the critical path
    assert cap["own"]["ceiling"] == pytest.approx(9 * 2.6 / 21.0)
    assert cap["split_end_ms"] == {"zb-h2": pytest.approx(21.0)}


@pytest.mark.slow
def test_example_benchmark_script_runs_under_torchrun(tmp_path) -> None:
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the script runs the interpreter running this test (not whatever python3 is first on PATH)
    env = dict(os.environ, QUICK="1", NPROC="2", RUNS="1", OUT=str(tmp_path), MASTER_PORT="29617")
    env["PYTHON"] = sys.executable
    script = os.path.join(root, "examples", "benchmark_zb_vs_1f1b.sh")
    res = subprocess.run([script, "--microbatches", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "pipeline_torchrun.json").read_text())
    rows = report["real"]["by_m"]["2"]["rows"]
    assert {r["schedule"] for r in rows} >= {"1f1b", "zb-h1", "zb-h2", "zb-auto"}
    # Measured peaks equal the simulator's prediction from the profiled deltas for the profiled layout's schedules.
    zb_h1 = next(r for r in rows if r["schedule"] == "zb-h1")
    assert zb_h1["peak_bytes"] == zb_h1["predicted_peak_bytes"]


def _latency_rank(rank: int, world_size: int) -> tuple[float, float]:
    from zb_pipeline.runtime.profile_gather import measure_p2p_latency

    torch.set_num_threads(1)
    hot = measure_p2p_latency(pp_rank=rank, pp_ranks=[0, 1, 2], repeats=4, warmup=1)
    idle = measure_p2p_latency(pp_rank=rank, pp_ranks=[0, 1, 2], repeats=4, warmup=1, idle_s=0.002)
    return hot, idle


def test_p2p_latency_is_agreed_by_every_rank_in_both_modes() -> None:
    """Back-to-back and idle-receiver one-way latency: finite, non-negative (the held time is subtracted, not
    counted), and the same number on every rank (it is gathered)."""
    results = run_multiprocess(_latency_rank, 3, timeout_s=120)
    assert len({r for r in results}) == 1
    hot, idle = results[0]
    assert 0.0 <= hot < 1e3 and -0.5 < idle < 1e3  # idle: round trip minus the exactly-timed holds


def test_what_the_accounting_held_dies_inside_the_timed_w(monkeypatch) -> None:
    """Without the profiler a microbatch's W work (and the operands it holds) dies inside its W.  The saved-tensor
    accounting holds it until after the W; the profiler lets it go inside the W's time (its own accounting stays
    out of every action and of the gaps), or a window would measure a W cheaper than the W that runs after it.
    A fake clock that jumps 1000 s when a work closure dies shows where each release was timed."""
    import time
    import weakref

    from zb_pipeline.schedule.ir import Kind

    torch.set_num_threads(1)
    sched = generate("zb-h1", 1, 3)
    ex = PipelineExecutor(lower(sched), 0, {0: MLPStage(0)}, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn)
    prof = ActionProfiler(ex, start_iter=0, end_iter=1, memory="saved-tensors")
    skew, real = [0.0], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skew[0])

    def jump() -> None:
        skew[0] += 1000.0

    ex.store.on_submit.append(lambda work: weakref.finalize(work, jump))
    ex.run(0)
    assert skew[0] > 0  # the closures died during the iteration
    w = prof.times[(Kind.W, 0)]
    assert len(w) == 3 and all(t >= 1e6 for t in w)  # ms: each W paid the release of its own work
    assert all(t < 1e6 for (kind, _), ts in prof.times.items() if kind is not Kind.W for t in ts)
    assert all(g < 1e6 for g in prof.gaps)


def test_recompute_accounting_is_the_profilers_time_not_the_bs(monkeypatch) -> None:
    """On the CPU the saved-tensor accounting counts, inside a B, the graph each recompute rebuilds (walking the
    microbatch's graph: under a block recompute the other layers' whole graphs).  That is the profiler's time: it is
    left out of the B's measured time and counted in ``accounting_s`` (which the per-part timer leaves out too).  A
    fake clock that jumps 1000 s inside each recompute's accounting shows where it was timed."""
    import time

    from zb_pipeline.runtime.activation_memory import ActivationMemory
    from zb_pipeline.runtime.recompute import Recompute
    from zb_pipeline.schedule.ir import Kind

    torch.set_num_threads(1)
    sched = generate("zb-h1", 1, 3)
    stage = torch.nn.Sequential(MLPStage(0), Recompute(MLPStage(1)))  # a plain layer, then a recomputed one
    ex = PipelineExecutor(lower(sched), 0, {0: stage}, p2p=None, input_fn=mlp_input, loss_fn=_loss_fn)
    prof = ActionProfiler(ex, start_iter=0, end_iter=1, memory="saved-tensors")
    skew, real, counted = [0.0], time.perf_counter, ActivationMemory.recomputed
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skew[0])

    def slow_accounting(self, outputs) -> None:
        counted(self, outputs)
        skew[0] += 1000.0

    monkeypatch.setattr(ActivationMemory, "recomputed", slow_accounting)
    ex.run(0)
    assert skew[0] == 3 * 1000.0  # one recompute per microbatch's B, each accounted
    assert prof.accounting_s >= 3 * 1000.0
    b = prof.times[(Kind.B, 0)]
    assert len(b) == 3 and all(0 < t < 1e6 for t in b)  # ms: no B paid the accounting
