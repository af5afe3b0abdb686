"""The trainer with pp = 2 (pretrain_gpt.py's ``pretrain``) against pp = 1 of the same code, seed and tp/dp.

- Untied, clipping off: the losses of 3 steps and the validation loss are bit-identical (``==``), with learned
  positions and with RoPE's implicit positions (each stage builds its own tables) -- every stage's
  weight gradients accumulate in microbatch order, the data-parallel all-reduce of two ranks is a commutative sum,
  and AdamW is elementwise.  (With clipping on, the global norm is a sum of squares split differently over ranks,
  so the clip factor may differ in the last bit.)
- Tied embeddings (zb-v, whose V placement puts both copies on one rank; 1f1b with the copies on two ranks): the two
  copies' gradients are summed in another order than the single model accumulates them, so losses agree to a
  relative 1e-4 (tolerance fixed before measuring).
- Bad schedule flags, and shapes a plan cannot serve, exit 2 with one line before any communication.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zb_pipeline.testing.harness import run_multiprocess

ROOT = Path(__file__).resolve().parents[1]
LOSS_TOL = 1e-4
STEPS = 3

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "2", "--train-iters", str(STEPS),
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--seed", "7", "--eval-iters", "1", "--eval-interval", str(STEPS),
    "--log-interval", "1", "--distributed-timeout-seconds", "60",
]  # fmt: skip
UNTIED = ["--untie-embeddings-and-output-weights"]
ROPE = ["--position-embedding-type", "rope"]


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    import torch

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=io.StringIO())
    return {"losses": list(summary.losses), "valid": [v for _, v in summary.validation_losses]}


_REFERENCE: dict[tuple, dict] = {}


def _reference(argv: list[str], world_size: int) -> dict:
    key = (tuple(argv), world_size)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_multiprocess(_train, world_size, args=(argv,), timeout_s=240)[0]
    return _REFERENCE[key]


def _pipeline(argv: list[str], world_size: int) -> list[dict]:
    results = run_multiprocess(_train, world_size, args=(argv,), timeout_s=240)
    for r in results[1:]:  # every rank reports the same global-batch losses
        assert r == results[0]
    return results


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isfinite(x) and abs(x - y) <= LOSS_TOL * abs(y) for x, y in zip(a, b))


def test_zb_h1_pp2_dp2_bit_identical_to_pp1_dp2(tmp_path) -> None:
    """zb-h1 on pp = 2 x dp = 2 (4 microbatches of 2 per replica): the same losses, to the bit, as pp = 1 x dp = 2.

    The run's --pipeline-trace holds every planned compute action once per iteration in the planned order per rank,
    and the plan itself, and ``zb-schedule show --trace`` draws it.
    """
    from zb_pipeline.schedule.cli import main as zb_schedule
    from zb_pipeline.schedule.plan_file import plan_from_dict

    argv = [*BASE, *UNTIED, "--global-batch-size", "16", "--clip-grad", "0"]
    ref = _reference(argv, 2)
    trace = tmp_path / "runs" / "trace.json"  # --pipeline-trace creates the directory
    pp = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--pipeline-trace", str(trace)]
    got = _pipeline([*argv, *pp], 4)[0]
    assert got["losses"] == ref["losses"], (got, ref)
    assert got["valid"] == ref["valid"] and len(ref["valid"]) == 1

    doc = json.loads(trace.read_text())
    plan = plan_from_dict(doc["zbPlan"])
    assert (plan.name, plan.num_ranks, plan.num_microbatches) == ("zb-h1", 2, 4)
    pids = sorted({ev["pid"] for ev in doc["traceEvents"] if ev.get("ph") == "X"})
    assert len(pids) == 2  # data-parallel replica 0's pipeline: global ranks 0 and 2
    for r, pid in enumerate(pids):
        for it in range(STEPS):
            ran = [
                ev["args"]["action"]
                for ev in doc["traceEvents"]
                if ev.get("ph") == "X" and ev.get("pid") == pid and ev.get("cat") in ("F", "B", "W", "BW")
                and ev["args"]["iteration"] == it
            ]  # fmt: skip
            assert ran == [str(a) for a in plan.ranks[r]], (r, it)
    png = tmp_path / "trace.png"
    assert zb_schedule(["show", "--trace", str(trace), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_rope_implicit_positions_pp2_bit_identical_to_pp1() -> None:
    """RoPE without position ids (every stage builds its own implicit ``[s, 1, 1, r]`` tables), zb-h1, m = 4: the
    losses and the validation loss of pp = 2 equal pp = 1's to the bit."""
    argv = [*BASE, *UNTIED, *ROPE, "--global-batch-size", "8", "--clip-grad", "0"]
    ref = _reference(argv, 1)
    got = _pipeline([*argv, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"], 2)[0]
    assert got["losses"] == ref["losses"], (got, ref)
    assert got["valid"] == ref["valid"] and len(ref["valid"]) == 1


def test_zb_v_tied_embeddings_match_pp1() -> None:
    """zb-v (both tied copies on rank 0, summed locally) with clipping on: losses within 1e-4 of pp = 1."""
    argv = [*BASE, "--global-batch-size", "6", "--clip-grad", "1.0"]
    ref = _reference(argv, 1)
    got = _pipeline([*argv, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"], 2)[0]
    assert _close(got["losses"], ref["losses"]), (got, ref)
    assert _close(got["valid"], ref["valid"]), (got, ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,extra",
    [
        ("interleaved-1f1b", []),
        ("zb-h2", []),
        ("zb-auto", []),
        ("interleaved-zb", []),
        ("v-half", []),
        ("1f1b", ["--global-batch-size", "2"]),  # m = 1 < p = 2
    ],
)
def test_pp2_tp2_tied_matches_pp1_tp2(schedule: str, extra: list[str]) -> None:
    """Tied embeddings on two ranks (loop placement) or one (V), tp = 2 in the mix: losses within 1e-4."""
    argv = [*BASE, "--global-batch-size", "6", "--clip-grad", "1.0", "--tensor-model-parallel-size", "2", *extra]
    ref = _reference(argv, 2)
    got = _pipeline([*argv, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule], 4)[0]
    assert _close(got["losses"], ref["losses"]), (schedule, got, ref)
    assert _close(got["valid"], ref["valid"]), (schedule, got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "interleaved-1f1b", "interleaved-zb", "zb-auto"])
def test_untied_bit_identical_slow(schedule: str) -> None:
    """Untied, clipping off, odd m = 3: bit-identical losses for every loop-placement schedule."""
    argv = [*BASE, *UNTIED, "--global-batch-size", "6", "--clip-grad", "0"]
    ref = _reference(argv, 1)
    got = _pipeline([*argv, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule], 2)[0]
    assert got["losses"] == ref["losses"], (schedule, got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "zb-v", "interleaved-zb"])
def test_rope_implicit_positions_bit_identical_slow(schedule: str) -> None:
    """RoPE without position ids, untied, clipping off: bit-identical losses for the other schedule families."""
    argv = [*BASE, *UNTIED, *ROPE, "--global-batch-size", "8", "--clip-grad", "0"]
    ref = _reference(argv, 1)
    got = _pipeline([*argv, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule], 2)[0]
    assert got["losses"] == ref["losses"], (schedule, got, ref)
    assert got["valid"] == ref["valid"], (schedule, got, ref)


def _bucket_launch_rank(rank: int, world_size: int) -> dict:
    from datetime import timedelta

    import torch

    from megatron.arguments import parse_run_config
    from megatron.parallel.context import ParallelContext
    from megatron.training_setup import setup
    from megatron.training_step import forward_backward

    torch.set_num_threads(1)
    ctx = ParallelContext.initialize(pp=2, timeout=timedelta(seconds=60))
    out = {}
    for name, extra in (("untied", UNTIED), ("tied", [])):
        argv = [*BASE, *extra, "--global-batch-size", "6", "--pipeline-model-parallel-size", "2"]
        tr = setup(parse_run_config(argv, world_size=world_size), ctx)
        seen: list[list[bool]] = []
        finish = tr.reducer.finish

        def spy(*args, _finish=finish, _tr=tr, _seen=seen, **kwargs):
            _seen.append([b.launched for b in _tr.reducer.buckets])
            return _finish(*args, **kwargs)

        tr.reducer.finish = spy
        forward_backward(tr)
        tied = {id(p) for p in tr.pipeline.tied_embedding_params()}
        out[name] = (seen, [any(id(p) in tied for p in b.params) for b in tr.reducer.buckets])
    return out


def test_buckets_launch_after_each_stages_last_w_and_tied_copies_after_their_sum() -> None:
    """Before ``reducer.finish()``: every bucket without a tied-embedding copy has launched (the stage's last W marked
    its gradients final), and every bucket holding a copy has not (its sum over the embedding group comes first)."""
    for result in run_multiprocess(_bucket_launch_rank, 2, timeout_s=180):
        for name, (seen, holds_tied) in result.items():
            assert len(seen) == 1, name
            assert seen[0] == [not t for t in holds_tied], (name, seen, holds_tied)
        assert not any(result["untied"][1]) and any(result["tied"][1])


@pytest.mark.slow
def test_resume_pp2_zero_bubble_is_bit_exact(tmp_path) -> None:
    """zb-v with tied embeddings (both copies on rank 0) and zb-h1 with dp = 2: 6 steps in one launch equal, bit for
    bit, 3 steps that save and exit followed by a fresh launch that loads and runs to 6."""
    from megatron import checkpoint_files as cf

    for schedule, world, extra in (("zb-v", 2, []), ("zb-h1", 4, ["--use-distributed-optimizer"])):
        argv = [*BASE, "--train-iters", "6", "--global-batch-size", "8", "--eval-iters", "0", *extra]
        argv += ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule]
        full = _pipeline(argv, world)[0]["losses"]
        ckpt = str(tmp_path / schedule)
        first = _pipeline([*argv, "--save", ckpt, "--exit-interval", "3"], world)[0]["losses"]
        assert cf.read_tracker(ckpt) == 3
        second = _pipeline([*argv, "--load", ckpt], world)[0]["losses"]
        assert first + second == full, (schedule, first, second, full)


# ------------------------------------------------------------------------------------------------ bad input
def _parse_error(extra: list[str], world_size: int = 2) -> str:
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_run_config([*BASE, "--global-batch-size", "4", *extra], world_size=world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_schedule_flags_fail_at_parse_time(tmp_path) -> None:
    from zb_pipeline.schedule.plan_file import save_plan
    from zb_pipeline.schedule.registry import generate

    pp2 = ["--pipeline-model-parallel-size", "2"]
    assert "invalid choice" in _parse_error([*pp2, "--pipeline-schedule", "zb-h3"])
    assert "contradicts" in _parse_error([*pp2, "--pipeline-schedule", "1f1b", "--zero-bubble-v-schedule"])
    # one chunk per rank only: a virtual-stage size that asks for two
    per_chunk = ["--num-layers-per-virtual-pipeline-stage", "1"]
    assert "chunks" in _parse_error([*pp2, "--pipeline-schedule", "zb-h1", *per_chunk])
    # a plan file made for m = 4 cannot serve m = 1 < p (global batch 2 = one microbatch of 2)
    plan = tmp_path / "plan.json"
    save_plan(generate("zb-h1", 2, 4), plan)
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError

    with pytest.raises(ConfigError, match="is for p=2, m=4"):
        parse_run_config([*BASE, "--global-batch-size", "2", *pp2, "--schedule-file", str(plan)], world_size=2)
    # a zb-auto memory limit below one microbatch's activations
    assert "memory" in _parse_error([*pp2, "--enable-zero-bubble", "--zero-bubble-max-pending-backward", "0.5"])
    # layers that do not split over the V schedule's 2 x pp virtual stages
    assert "split" in _parse_error([*pp2, "--pipeline-schedule", "zb-v", "--num-layers", "6"])


@pytest.mark.slow  # the default run covers it: test_arguments.py's exit-2 battery has a --pipeline-schedule case
def test_bad_schedule_flag_exits_2_on_every_rank_with_one_line() -> None:
    """pretrain_gpt.py as torchrun starts it (RANK/WORLD_SIZE set): every rank exits 2 before any rendezvous; rank 0
    prints one line, the others nothing."""
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, "--pipeline-model-parallel-size", "2"]
    for extra in (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "0.5"],):  # below one microbatch
        procs = [
            subprocess.Popen(
                [*argv, *extra],
                env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", OMP_NUM_THREADS="1"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [2, 2], outs
        lines = outs[0][1].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), outs[0]
        assert outs[1] == ("", ""), outs[1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
