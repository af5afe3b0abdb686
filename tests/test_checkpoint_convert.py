"""tools/checkpoint_convert.py: a tp = 2 checkpoint converted to tp = 1, and a dp = 2 distributed-optimizer checkpoint
converted to dp = 1, resume with the same next-step losses as the unconverted run (two steps, so the optimizer state
is checked too; relative 1e-5, fixed before measuring: only fp32 summation order differs); export writes one plain
state dict of the full weights."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from training_runs import pretrain_rank

from megatron import checkpoint_files as cf
from megatron.arguments import parse_run_config
from megatron.training import pretrain
from zb_pipeline.testing.harness import run_multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import checkpoint_convert  # noqa: E402

TOL = 1e-5
ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "100", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", "5", "--lr", "5e-3", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5",
    "--distributed-timeout-seconds", "120",
]  # fmt: skip


def _resume_converted(tmp_path: Path, source_flags: list[str], target: dict, load_flags: list[str]) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    reference = run_multiprocess(
        pretrain_rank, 2, args=([*ARGV, *source_flags, "--save", str(src), "--save-interval", "3"],), timeout_s=240
    )[0]["losses"]
    out = checkpoint_convert.convert(src, dst, iteration=3, **target)
    assert out == cf.iteration_dir(dst, 3) and cf.read_tracker(dst) == 3
    torch.set_num_threads(1)
    resumed = pretrain(parse_run_config([*ARGV, *load_flags, "--load", str(dst)]), stream=io.StringIO()).losses
    assert len(resumed) == 2
    for got, want in zip(resumed, reference[3:]):
        assert abs(got - want) <= TOL * abs(want), (resumed, reference[3:])


def test_tp2_to_tp1_resumes_with_same_losses(tmp_path):
    _resume_converted(tmp_path, ["--tensor-model-parallel-size", "2"], {"tp": 1, "pp": 1, "dp": 1}, [])
    full = checkpoint_convert.export_single_file(tmp_path / "dst", tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert loaded.keys() == full.keys() and loaded["embedding.word_embeddings.weight"].shape == (100, 32)
    from megatron.model import GPTConfig, build_gpt_model

    model = build_gpt_model(GPTConfig.from_object(parse_run_config([*ARGV, "--save", str(tmp_path)]).model), seed=5)
    assert {n: tuple(p.shape) for n, p in model.state_dict().items() if "word_embeddings" not in n} == {
        n: tuple(t.shape) for n, t in loaded.items() if "word_embeddings" not in n
    }


def test_dp2_distributed_optimizer_to_dp1(tmp_path):
    _resume_converted(tmp_path, ["--use-distributed-optimizer"], {"tp": 1, "pp": 1, "dp": 1}, [])


@pytest.mark.slow
def test_tp1_to_tp2_and_dp_resharding_roundtrip(tmp_path):
    src = tmp_path / "src"
    run_multiprocess(pretrain_rank, 1, args=([*ARGV, "--save", str(src), "--save-interval", "3"],), timeout_s=240)
    checkpoint_convert.convert(src, tmp_path / "tp2", iteration=3, tp=2, pp=1, dp=3)
    checkpoint_convert.convert(tmp_path / "tp2", tmp_path / "back", tp=1, pp=1, dp=1)
    a = checkpoint_convert.export_single_file(src, tmp_path / "a.pt", iteration=3)
    b = checkpoint_convert.export_single_file(tmp_path / "back", tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert checkpoint_convert.main(["--load", str(tmp_path / "none"), "--save", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
