"""--rampup-batch-size with pp = 2: the pipeline runs each iteration's microbatch count with the plan for that count
(from the schedule registry's cache) and gives pp = 1's losses at every batch size, to the bit (untied embeddings,
clipping off: every stage's weight gradients accumulate in microbatch order, as in tests/test_pipeline_training.py).

zb-h1 runs with optimizer post-validation (its chain is re-added to each plan the runtime loads); zb-v runs with a
profiling window inside the ramp, so it is re-planned from measured costs while the microbatch count still grows.
"""

from __future__ import annotations

import io

import pytest

from zb_pipeline.testing.harness import run_multiprocess

# G = 4, ramp 1 -> 4 by 1 over 6 samples: global batches 1, 1, 2, 3, then 4 (19 samples -> 7 iterations)
ARGV = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--rampup-batch-size", "1", "1", "6", "--train-samples", "19", "--lr", "3e-3", "--lr-warmup-samples", "2",
    "--clip-grad", "0", "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--seed", "11", "--eval-iters", "0", "--log-interval", "1", "--distributed-timeout-seconds", "60",
]  # fmt: skip
SIZES = [1, 1, 2, 3, 4, 4, 4]


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    import torch

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    out = io.StringIO()
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=out)
    sizes = [int(line.split("global batch size:")[1].split("|")[0]) for line in out.getvalue().splitlines()
             if "global batch size:" in line]  # fmt: skip
    return {"losses": list(summary.losses), "sizes": sizes, "log": out.getvalue()}


_REFERENCE: list[dict] = []


def _reference() -> dict:
    if not _REFERENCE:
        _REFERENCE.append(_train(0, 1, ARGV))
    return _REFERENCE[0]


def _pp2(extra: list[str]) -> dict:
    argv = [*ARGV, "--pipeline-model-parallel-size", "2", *extra]
    results = run_multiprocess(_train, 2, args=(argv,), timeout_s=240)
    assert results[0]["losses"] == results[1]["losses"]
    return results[0]


def test_rampup_zb_h1_post_validation_pp2_equals_pp1() -> None:
    ref = _reference()
    assert ref["sizes"] == SIZES
    got = _pp2(["--pipeline-schedule", "zb-h1", "--enable-optimizer-post-validation"])
    assert got["losses"] == ref["losses"]


@pytest.mark.slow  # a second pair of processes; the zb-h1 case covers the ramp-up in make test
def test_rampup_zb_v_replanned_inside_the_ramp_pp2_equals_pp1() -> None:
    ref = _reference()
    got = _pp2(["--zero-bubble-v-schedule", "--zero-bubble-pipeline-timers-start-iter", "1",
                "--zero-bubble-pipeline-timers-end-iter", "3"])  # fmt: skip
    assert "replanned zb-v" in got["log"]
    assert got["losses"] == ref["losses"]


ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h2", "zb-auto", "v-half", "v-min", "interleaved-zb")


@pytest.mark.slow  # one pair of processes per schedule
@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_rampup_every_schedule_pp2_equals_pp1(schedule: str) -> None:
    assert _pp2(["--pipeline-schedule", schedule])["losses"] == _reference()["losses"]


def test_rampup_below_what_a_schedule_serves_is_one_line_at_start_up() -> None:
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError

    # dualpipev needs m >= 2p: the ramp's first iterations (1 microbatch) cannot run it
    with pytest.raises(ConfigError, match="dualpipev"):
        parse_run_config(
            [*ARGV, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"], world_size=2
        )
