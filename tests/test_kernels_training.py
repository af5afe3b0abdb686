"""Training through ``pretrain_gpt.py``'s ``pretrain`` with ``--kernels triton`` (Triton's interpreter on CPU) gives
the ``--kernels torch`` losses.

fp32, 3 iterations, a tiny model, every Triton kernel on (the W kernel, LayerNorm or RMSNorm, bias-GeLU or bias-SwiGLU,
and ``--cross-entropy-loss-fusion``).  Tolerance, fixed before measuring: each iteration's loss within a relative
1e-4 of the torch run's (the kernels round differently from torch's ops in the last bits of fp32, and AdamW carries
those differences into the next iterations' weights).  pp = 2 (zb-h1: the kernels inside the pipeline's B and W)
with LayerNorm and bias-GeLU; pp = 1 with RMSNorm and bias-SwiGLU.  About 5 s each.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from megatron.kernels.triton_runtime import interpreter_problem
from zb_pipeline.testing.harness import run_multiprocess

# Never import triton here: the ranks import this module, and Triton must see TRITON_INTERPRET before its first import.
pytestmark = [
    pytest.mark.skipif(interpreter_problem() is not None, reason=f"no Triton interpreter: {interpreter_problem()}"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter on CPU tensors (no CUDA)"),
]

LOSS_RTOL = 1e-4
STEPS = 3
BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-warmup-iters", "1", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--seed", "7", "--eval-iters", "0", "--log-interval", "1",
    "--distributed-timeout-seconds", "120", "--cross-entropy-loss-fusion",
]  # fmt: skip
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"]


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    import torch

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    log = io.StringIO()
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=log)
    kernels = [line for line in log.getvalue().splitlines() if line.startswith("kernels:")]
    return {"losses": list(summary.losses), "kernels": kernels}


def _losses_agree(argv: list[str], world_size: int) -> None:
    torch_run = run_multiprocess(_train, world_size, args=([*argv, "--kernels", "torch"],), timeout_s=300)[0]
    triton_run = run_multiprocess(_train, world_size, args=([*argv, "--kernels", "triton"],), timeout_s=300)[0]
    assert torch_run["kernels"] == ["kernels: torch (--kernels torch)"]
    (line,) = triton_run["kernels"]
    assert (
        line.startswith("kernels: triton, Triton interpreter on CPU (--kernels triton): W kernel") and "cross" in line
    )
    a, b = triton_run["losses"], torch_run["losses"]
    assert len(a) == len(b) == STEPS
    assert all(math.isfinite(x) and abs(x - y) <= LOSS_RTOL * abs(y) for x, y in zip(a, b)), (a, b)


def test_triton_kernels_train_like_torch_pp1_rmsnorm_swiglu() -> None:
    _losses_agree([*BASE, *LLAMA], 1)


def test_triton_kernels_train_like_torch_pp2_zb_h1() -> None:
    _losses_agree([*BASE, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"], 2)
