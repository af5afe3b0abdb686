"""Schedules re-planned from profiled costs inside the trainer (--zero-bubble-pipeline-timers-start/end-iter).

The profiling window times every F, B and W per stage; at its end every rank regenerates the run's schedule (zb-auto;
also zb-v, whose order depends on the costs) from those costs and switches plans at the iteration boundary.
Switching plans changes only the order of work, so the losses stay those of pp = 1 (relative 1e-4, fixed before
measuring: the order of the weight-gradient accumulation may change), the switch is logged, and the saved profile
gives the same plan offline through ``zb-schedule --profile``.
"""

from __future__ import annotations

import math
import os

import pytest
from training_runs import WINDOW, pretrain_rank

from zb_pipeline.testing.harness import run_multiprocess

STEPS = 5
ARGV = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-warmup-iters", "1", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--seed", "11", "--log-interval", "1", "--distributed-timeout-seconds", "60",
    "--untie-embeddings-and-output-weights", "--eval-iters", "0",
]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "name", "chunks"),
    [
        (["--enable-zero-bubble"], "zb-auto", 1),
        (["--zero-bubble-v-schedule"], "zb-v", 2),
        # a chunk count other than the schedule's default: the re-plan keeps the running plan's chunks
        (
            ["--pipeline-schedule", "interleaved-zb", "--num-layers-per-virtual-pipeline-stage", "1"],
            "interleaved-zb",
            3,
        ),
    ],
)
def test_replans_from_profile_and_keeps_losses(tmp_path, flags: list[str], name: str, chunks: int) -> None:
    from zb_pipeline.runtime.replanner import regenerate
    from zb_pipeline.schedule.plan_file import load_plan
    from zb_pipeline.schedule.profile import Profile

    model = ["--num-layers", "6"] if chunks == 3 else []
    reference = run_multiprocess(pretrain_rank, 1, args=([*ARGV, *model],), timeout_s=240)[0]["losses"]
    save = str(tmp_path / "ckpt")
    argv = [*ARGV, *model, "--pipeline-model-parallel-size", "2", *flags, *WINDOW, "--save", save]
    results = run_multiprocess(pretrain_rank, 2, args=(argv,), timeout_s=240)
    losses = results[0]["losses"]
    assert len(losses) == len(reference) == STEPS
    assert all(math.isfinite(x) and abs(x - y) <= 1e-4 * abs(y) for x, y in zip(losses, reference)), (
        losses,
        reference,
    )
    log = "".join(r["log"] for r in results)
    assert f"replanned {name}" in log
    # The saved profile plans offline exactly what the trainer switched to.
    prof_path = os.path.join(save, "zb_profile.json")
    profile = Profile.load(prof_path)
    again = regenerate(profile, 4, name=name, chunks=chunks).schedule
    assert again.chunks == chunks
    from zb_pipeline.schedule.cli import main as zb_schedule

    out = tmp_path / "plan.json"
    cmd = [
        "simulate",
        name,
        "-p",
        "2",
        "-m",
        "4",
        "--chunks",
        str(chunks),
        "--profile",
        prof_path,
        "--export",
        str(out),
    ]
    assert zb_schedule(cmd) == 0
    assert load_plan(out).ranks == again.ranks
