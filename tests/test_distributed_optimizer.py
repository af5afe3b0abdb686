"""The distributed optimizer (ZeRO-1) equals the plain one: dp = 2, 5 steps, parameters to a norm-wise relative
error of 1e-6 (fp32; bound fixed before measuring), each rank holding only its shard of the optimizer state (Adam;
SGD with momentum in the slow run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zb_pipeline.testing.harness import run_multiprocess

STEPS = 5
TOL = 1e-6
ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "100", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(STEPS), "--lr", "5e-3", "--lr-warmup-iters", "1", "--weight-decay", "0.1",
    "--clip-grad", "0.5", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--distributed-timeout-seconds", "120",
]  # fmt: skip


def _train_both(rank: int, world_size: int, extra: list[str]) -> dict:
    from datetime import timedelta

    from megatron.arguments import parse_run_config
    from megatron.parallel.context import ParallelContext
    from megatron.training_setup import setup
    from megatron.training_step import train_step

    torch.set_num_threads(1)
    out = {}
    for name, flags in (("plain", []), ("dist", ["--use-distributed-optimizer"])):
        run = parse_run_config([*ARGV, *extra, *flags], world_size=world_size)
        ctx = ParallelContext.initialize(tp=run.parallel.tp_size, pp=1, timeout=timedelta(seconds=120))
        tr = setup(run, ctx)
        norms = [train_step(tr).grad_stats.norm for _ in range(STEPS)]
        owned = sum(s.hi - s.lo for s in tr.optimizer.shards)
        params = {n: p.detach().float().numpy().copy() for n, p in tr.model.named_parameters()}
        out[name] = {
            "params": params,
            "norms": norms,
            "owned": owned,
            "total": sum(p.numel() for p in tr.model.parameters()),
        }
    return out


def _check(results: list[dict], dp: int) -> None:
    for r in results:
        plain, dist_ = r["plain"], r["dist"]
        num = sum(float(np.sum((plain["params"][n] - dist_["params"][n]) ** 2)) for n in plain["params"])
        den = sum(float(np.sum(plain["params"][n] ** 2)) for n in plain["params"])
        assert (num / den) ** 0.5 <= TOL
        np.testing.assert_allclose(dist_["norms"], plain["norms"], rtol=1e-6)
        assert plain["owned"] == plain["total"]
        assert dist_["owned"] <= -(-plain["total"] // dp) + dp, "each rank holds only its shard of the main params"
    assert sum(r["dist"]["owned"] for r in results) >= results[0]["plain"]["total"]


def test_distributed_optimizer_equals_plain_dp2():
    _check(run_multiprocess(_train_both, 2, args=([],), timeout_s=180), dp=2)


@pytest.mark.slow  # the default run has sgd + distributed optimizer in test_checkpointing's bit-exact resume
def test_distributed_optimizer_equals_plain_dp2_sgd():
    _check(run_multiprocess(_train_both, 2, args=(["--optimizer", "sgd"],), timeout_s=180), dp=2)


@pytest.mark.slow
def test_distributed_optimizer_equals_plain_tp2_dp2_untied():
    results = run_multiprocess(
        _train_both,
        4,
        args=(["--tensor-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],),
        timeout_s=300,
    )
    _check(results, dp=2)
