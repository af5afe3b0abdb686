"""Re-splitting the layers in process (``megatron.pipeline.resplit``): after the move the run continues bit for bit
as a run that started with the new split, and a checkpoint written after it records and resumes the new split."""

from __future__ import annotations

import pytest

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


def _train(rank: int, world_size: int, argv: list[str], split: tuple[int, ...] | None, at: int, save: bool):
    """``argv``'s run for its iterations, re-split to ``split`` before iteration ``at``; saved (``--save``) after
    iteration ``at + 1`` if ``save``."""
    from datetime import timedelta

    import torch

    from megatron.arguments import parse_run_config
    from megatron.checkpointing import save_checkpoint
    from megatron.parallel.context import ParallelContext
    from megatron.pipeline.resplit import resplit
    from megatron.pipeline.trainer_hooks import context_layout
    from megatron.training_setup import setup
    from megatron.training_step import settle_pending_step, train_step

    torch.set_num_threads(1)
    run = parse_run_config(argv, world_size=world_size)
    ctx = ParallelContext.initialize(
        tp=run.parallel.tp_size, pp=run.parallel.pp_size, timeout=timedelta(seconds=60), **context_layout(run)
    )
    try:
        tr = setup(run, ctx)
        before = tr.run.pipeline_layout.layers_per_stage
        while tr.iteration < run.training.train_iters:
            if split is not None and tr.iteration == at:
                tr = resplit(tr, split)
            train_step(tr)
            if save and tr.iteration == at + 1:
                settle_pending_step(tr)
                save_checkpoint(tr)
        settle_pending_step(tr)
        return {"losses": list(tr.losses), "before": before, "after": tr.run.pipeline_layout.layers_per_stage}
    finally:
        ctx.shutdown()


def _run(argv: list[str], world: int, split=None, at: int = 0, save: bool = False) -> dict:
    results = run_multiprocess(_train, world, args=(argv, split, at, save), timeout_s=240)
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"]
    return results[0]


@pytest.mark.parametrize(
    "flags",
    [
        ["--pipeline-schedule", "zb-h1"],
        pytest.param(["--enable-zero-bubble"], marks=pytest.mark.slow),
        pytest.param(
            ["--pipeline-schedule", "zb-h1", "--bf16", "--untie-embeddings-and-output-weights"], marks=pytest.mark.slow
        ),
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
    resumed = run_multiprocess(_pretrain, 2, args=([*argv, *AUTO, "--load", ckpt],), timeout_s=240)[0]
    assert resumed["losses"] == moved["losses"][3:]
    assert "layers per stage: [1, 3] (auto)" in resumed["log"]


def _pretrain(rank: int, world_size: int, argv: list[str]) -> dict:
    import io

    import torch

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    stream = io.StringIO()
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=stream)
    return {"losses": list(summary.losses), "log": stream.getvalue()}
