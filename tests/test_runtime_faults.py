"""Robustness of the pipeline runtime: plans that only work with buffering, dead and stopped ranks.

- The P2P checking mode turns a plan that would deadlock on NCCL (but runs on gloo, which buffers sends) into a
  ``CommOrderError`` naming the unmatched transfer, and catches two ranks posting a pair's transfers in different
  orders.  The validator rejects both plans statically as well.
- A rank killed with SIGKILL, or frozen with SIGSTOP, makes every other rank fail on its own (not killed by the test
  harness) with a ``PipelinePeerError`` (a ``PipelineCommError`` and a ``comm.PeerFailedError``) naming the peer
  rank and the action that waited.
"""

from __future__ import annotations

import re

import pytest
from runtime_models import Case, lowered_for, pipeline_rank, reference
from test_runtime_executor import _assert_matches_reference

from zb_pipeline.schedule.validate import ScheduleError, validate_lowered
from zb_pipeline.testing import MultiProcessError, run_multiprocess

P2P_TIMEOUT_S = 4.0


def _fail(case: Case, p: int) -> MultiProcessError:
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(pipeline_rank, p, args=(case,), timeout_s=120, failure_grace_s=1.5 * P2P_TIMEOUT_S)
    return info.value


def test_validator_rejects_the_hand_made_plans() -> None:
    with pytest.raises(ScheduleError, match="deadlock under strict P2P"):
        validate_lowered(lowered_for(Case("zb-h1", 2, 3, mutate="needs_buffering")))
    with pytest.raises(ScheduleError, match="different orders"):
        validate_lowered(lowered_for(Case("gpipe", 2, 3, mutate="swapped_order")))


@pytest.mark.slow
def test_plan_that_needs_buffering_runs_on_plain_gloo() -> None:
    # Without the check, gloo's buffering hides the problem: the run completes with the right numbers, which NCCL
    # would never reach (its strict matching deadlocks this plan).
    plain = Case("zb-h1", 2, 3, mutate="needs_buffering", check=False, timeout_s=P2P_TIMEOUT_S)
    results = run_multiprocess(pipeline_rank, 2, args=(plain,), timeout_s=120)
    _assert_matches_reference(plain, results)


def test_checking_mode_catches_plan_that_needs_buffering() -> None:
    err = _fail(Case("zb-h1", 2, 3, mutate="needs_buffering", check=True, timeout_s=P2P_TIMEOUT_S), 2)
    assert set(err.failures) == {0, 1}
    # Both ranks block; whichever times out first reports the unmatched send (the other may instead see it leave).
    assert all(
        "PipelineCommError" in t or "PipelinePeerError" in t or "CommOrderError" in t for t in err.failures.values()
    ), err
    caught = [r for r, t in err.failures.items() if "CommOrderError" in t and "relies on buffering" in t]
    assert caught, err
    assert all({0: "0SEND_F1@1", 1: "1SEND_B0@0"}[r] in err.failures[r] for r in caught)


@pytest.mark.slow
def test_checking_mode_catches_pair_order_mismatch() -> None:
    err = _fail(Case("gpipe", 2, 3, mutate="swapped_order", check=True, timeout_s=P2P_TIMEOUT_S), 2)
    assert "CommOrderError" in err.failures[0] and "different orders" in err.failures[0], err.failures[0]


@pytest.mark.parametrize("sig", ["KILL", pytest.param("STOP", marks=pytest.mark.slow)])
def test_dead_or_stopped_rank_makes_every_other_rank_fail_naming_it(sig: str) -> None:
    case = Case("zb-h1", 3, 4, check=False, timeout_s=P2P_TIMEOUT_S)
    steps = [str(st) for st in lowered_for(case).ranks[1]]
    faulty = Case(**{**case.__dict__, "fault": {"rank": 1, "signal": sig, "at": steps.index("1B1")}})
    err = _fail(faulty, 3)
    assert set(err.failures) == {0, 1, 2}
    for rank in (0, 2):
        text = err.failures[rank]
        # PipelinePeerError: a PipelineCommError that is also the communication layer's PeerFailedError.
        lines = [ln for ln in text.splitlines() if ln.startswith("zb_pipeline.runtime.p2p.PipelinePeerError:")]
        assert lines, f"rank {rank} did not fail with a PipelinePeerError (killed by the harness?):\n{text}"
        message = lines[-1]
        assert re.search(r"(from|to) rank\(?s?\)? \[?1\b", message), message  # names the peer ...
        assert re.search(r"\b\d+(RECV|SEND)_[FB]\d+@1\b", message), message  # ... and the transfer it waited on
        assert re.search(r"\b\d+(F|B|W|BW)\d+ waited|posting", message), message  # ... and the action
    assert ("exited with code -9" if sig == "KILL" else "killed") in err.failures[1]
    reference(case, 3)  # the healthy plan itself is fine (sanity: the failure came from the fault)
