"""``--enable-optimizer-post-validation`` in the trainer (issue 9): bit-identical to the synchronised optimizer.

Each case trains the same small GPT twice in one process group -- synchronised optimizer, then post-validated --
for 22 iterations with clipping that triggers on some iterations (the clip threshold sits inside the range the
global norm takes) and gradients forced to inf/NaN on chosen pipeline stages at chosen iterations.  After every
step (recorded when its outcome is final) the fp32 main parameters, optimizer state (Adam moments or SGD momentum
buffers), step count, loss scale, learning rate, grad norm and skip flag must be identical, and so must every
iteration's loss.  Dropout is on: iterations whose warm-up forwards ran with weights that validation then changed
are replayed with the iteration's RNG state.
"""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
from training_runs import pretrain_rank

from zb_pipeline.testing.harness import run_multiprocess

ITERS = 22
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--train-iters", str(ITERS),
    "--lr", "1e-2", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--attention-dropout", "0.1",
    "--hidden-dropout", "0.1", "--seed", "11", "--eval-iters", "0", "--log-interval", "1",
    "--distributed-timeout-seconds", "60", "--untie-embeddings-and-output-weights",
]  # fmt: skip
# iteration (0-based) -> (pipeline rank, "inf" | "nan"): forced into a main gradient on every rank of that stage
INJECT = {3: (1, "inf"), 8: (0, "nan"), 9: (1, "nan"), 15: (0, "inf")}


def _record(tr, st) -> dict:
    opt = tr.optimizer
    out = {
        "iteration": st.iteration,
        "lr": st.learning_rate,
        "skipped": st.skipped,
        "norm": st.stats.norm,
        "scale": opt.loss_scale,
        "step": opt.step_count,
        "next_lr": tr.scheduler.current_lr,
    }
    for s in opt.shards:
        state = opt.update_rule.state.get(id(s.main))
        out[s.name] = s.main.detach().float().numpy().copy()
        for key in opt.update_rule.state_keys:  # Adam moments, or SGD momentum buffers
            out[f"{s.name}/{key}"] = None if state is None else state[key].numpy().copy()
    return out


def _train(argv: list[str], world_size: int, inject: dict, iterations: int) -> dict:
    import torch

    from megatron.arguments import parse_run_config
    from megatron.parallel.context import ParallelContext
    from megatron.pipeline.trainer_hooks import context_layout
    from megatron.training_setup import setup
    from megatron.training_step import forward_backward, optimizer_step, settle_pending_step

    run = parse_run_config(argv, world_size=world_size)
    ctx = ParallelContext.initialize(
        tp=run.parallel.tp_size, pp=run.parallel.pp_size, timeout=timedelta(seconds=60), **context_layout(run)
    )
    tr = setup(run, ctx)
    records: list[dict] = []
    tr.step_listeners.append(lambda t, st: records.append(_record(t, st)))
    losses = []
    for it in range(iterations):
        losses.append(forward_backward(tr))
        if it in inject and inject[it][0] == ctx.pp_rank:
            tr.optimizer.shards[0].grad.view(-1)[0] = float(inject[it][1])
        optimizer_step(tr)
        tr.iteration += 1
    settle_pending_step(tr)
    pv = tr.post_validation
    return {
        "losses": losses,
        "records": records,
        "skipped": tr.skipped_iterations,
        "counts": dict(pv.validator.counts) if pv else None,
        "replays": pv.replays if pv else 0,
        "threads": torch.get_num_threads(),
    }


def _rank(rank: int, world_size: int, argv: list[str], inject: dict, iterations: int) -> dict:
    import torch

    torch.set_num_threads(1)
    sync = _train(argv, world_size, inject, iterations)
    pv = _train(argv + ["--enable-optimizer-post-validation"], world_size, inject, iterations)
    return {"sync": sync, "pv": pv}


def _assert_identical(sync: dict, pv: dict, rank: int) -> None:
    assert sync["losses"] == pv["losses"] or all(
        a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(sync["losses"], pv["losses"])
    ), f"rank {rank}: losses differ"
    assert len(sync["records"]) == len(pv["records"]), f"rank {rank}: {len(pv['records'])} settled steps"
    for a, b in zip(sync["records"], pv["records"]):
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, np.ndarray):
                same = y is not None and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
            elif isinstance(x, float) and math.isnan(x):
                same = isinstance(y, float) and math.isnan(y)
            else:
                same = x == y
            assert same, f"rank {rank} step of iteration {a['iteration']}: {k} = {x} (sync) vs {y} (post-validated)"
    assert sync["skipped"] == pv["skipped"]


def _check(argv: list[str], world_size: int, inject: dict = INJECT, iterations: int = ITERS) -> list[dict]:
    results = run_multiprocess(_rank, world_size, args=(argv, inject, iterations), timeout_s=600)
    for r, res in enumerate(results):
        _assert_identical(res["sync"], res["pv"], r)
    return results


def _causes(results: list[dict]) -> dict:
    total: dict = {}
    for res in results:
        for k, v in res["pv"]["counts"].items():
            total[k] = total.get(k, 0) + v
    return total


CLIP = ["--clip-grad", "1.5"]  # the global norm ranges over ~1.0-2.7 here: clipping triggers on some iterations


def test_pp2_fp16_zb_h1_matches_the_synchronised_optimizer() -> None:
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--fp16"]
    argv += ["--initial-loss-scale", "4096", "--pipeline-schedule", "zb-h1"]
    results = _check(argv, 2)
    causes = _causes(results)
    assert causes["rollback_nonfinite"] + causes["held_nonfinite"] > 0, causes
    assert causes["rollback_clip"] + causes["held_clip"] > 0 and causes["validated"] > 0, causes
    assert results[0]["pv"]["replays"] == results[1]["pv"]["replays"] > 0


def test_pp2_sgd_momentum_buffers_roll_back_exactly() -> None:
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    argv += ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--pipeline-schedule", "zb-h1"]
    results = _check(argv, 2, inject={3: (1, "inf"), 8: (0, "nan")}, iterations=12)
    assert _causes(results)["rollback_nonfinite"] + _causes(results)["held_nonfinite"] > 0


def test_pp2_dp2_bf16_distributed_optimizer_matches() -> None:
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--bf16"]
    argv += ["--use-distributed-optimizer", "--pipeline-schedule", "1f1b"]
    results = _check(argv, 4, iterations=14)
    assert _causes(results)["rollback_clip"] + _causes(results)["held_clip"] > 0


def test_pp2_tp2_fp32_zb_v_matches() -> None:
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    argv += ["--global-batch-size", "4", "--pipeline-schedule", "zb-v"]
    results = _check(argv, 4, inject={3: (1, "inf"), 9: (0, "nan")}, iterations=12)
    assert sum(_causes(results).values()) == 4 * 12  # every rank validated every step


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,pp,precision",
    [
        ("1f1b", 4, "--fp16"),
        ("zb-h2", 2, "--bf16"),
        ("zb-auto", 4, "--fp16"),
        ("gpipe", 2, "--fp16"),
        ("interleaved-1f1b", 2, "--bf16"),
        ("interleaved-zb", 2, "--fp16"),
        ("v-half", 2, "--fp16"),
        ("v-min", 2, "--bf16"),
        ("zb-v", 4, "--fp16"),
    ],
)
def test_every_schedule_matches_slow(schedule: str, pp: int, precision: str) -> None:
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(2 * pp)]
    argv += [precision, "--pipeline-schedule", schedule]
    if precision == "--fp16":
        argv += ["--initial-loss-scale", "4096"]
    if schedule.startswith("interleaved"):
        argv += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if schedule in ("zb-v", "v-half", "v-min") and pp == 4:
        argv += ["--num-layers", "8"]  # two chunks per rank: 8 virtual stages
    if schedule == "1f1b":
        argv.remove("--untie-embeddings-and-output-weights")  # tied: the copies on ranks 0 and p-1 roll back alike
    inject = {3: (pp - 1, "inf"), 8: (0, "nan"), 15: (pp // 2, "inf")}
    results = _check(argv, pp, inject=inject)
    assert sum(_causes(results).values()) == pp * ITERS


def test_pretrain_with_the_flag_matches_and_resumes_bit_exact(tmp_path) -> None:
    """The whole run (evaluation and checkpoints flush the pending step): the same losses, validation losses and
    log line counters as the synchronised run; a run resumed from its iteration-4 checkpoint continues bit-exactly."""
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--fp16"]
    argv += ["--initial-loss-scale", "4096", "--train-iters", "8", "--eval-interval", "4", "--eval-iters", "1"]
    argv += ["--save-interval", "4"]
    pv_flag = ["--enable-optimizer-post-validation"]
    sync = run_multiprocess(pretrain_rank, 2, args=(argv + ["--save", str(tmp_path / "s")],), timeout_s=300)
    pv = run_multiprocess(pretrain_rank, 2, args=(argv + pv_flag + ["--save", str(tmp_path / "p")],), timeout_s=300)
    assert sync[0]["losses"] == pv[0]["losses"] and sync[0]["valid"] == pv[0]["valid"]
    assert "optimizer post-validation: on" in pv[0]["log"]
    assert "post-validation: validated steps:" in pv[0]["log"]
    skipped = [line.split("number of skipped iterations:")[1].split("|")[0] for line in sync[0]["log"].splitlines()
               if "number of skipped" in line]  # fmt: skip
    assert skipped, sync[0]["log"]
    ckpt = str(tmp_path / "r")
    first = run_multiprocess(pretrain_rank, 2, args=(argv + pv_flag + ["--save", ckpt, "--exit-interval", "4"],))
    resume = argv + pv_flag + ["--load", ckpt, "--save", ckpt]
    second = run_multiprocess(pretrain_rank, 2, args=(resume,), timeout_s=300)
    assert first[0]["losses"] + second[0]["losses"] == pv[0]["losses"]


@pytest.mark.slow
def test_zb_auto_replanned_mid_run_keeps_the_chain(tmp_path) -> None:
    """zb-auto switches to a plan regenerated from the profiling window (iterations 2..4); the new plan gets the
    post-validation chain too, and losses still match the synchronised run (every plan is bit-exact)."""
    argv = BASE + CLIP + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--bf16"]
    argv += ["--pipeline-schedule", "zb-auto", "--train-iters", "8", "--zero-bubble-pipeline-timers-start-iter", "2"]
    argv += ["--zero-bubble-pipeline-timers-end-iter", "4"]
    sync = run_multiprocess(pretrain_rank, 2, args=(argv,), timeout_s=300)
    pv = run_multiprocess(pretrain_rank, 2, args=(argv + ["--enable-optimizer-post-validation"],), timeout_s=300)
    assert sync[0]["losses"] == pv[0]["losses"]
    assert "replanned zb-auto" in pv[0]["log"] and "post-validation: validated steps:" in pv[0]["log"]


def test_clipping_every_step_validates_in_the_prologue_instead_of_replaying() -> None:
    """With a clip threshold far below the norm every step is held back and clipped at validation.  After the first
    such validation the next iterations validate before their first forward, so only the first one replays;
    results still match the synchronised optimizer bit for bit."""
    argv = BASE + ["--clip-grad", "0.05", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    results = _check(argv, 2, inject={}, iterations=8)
    for res in results:
        assert res["pv"]["counts"]["held_clip"] == 8
        assert res["pv"]["replays"] == 1
