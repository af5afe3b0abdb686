"""Robustness of the pipeline runtime: plans that only work with buffering, dead and stopped ranks.

- The P2P checking mode turns a plan that would deadlock on NCCL (but runs on gloo, which buffers sends) into a
  ``CommOrderError`` naming the unmatched transfer, and catches two ranks posting a pair's transfers in different
  orders.  The validator rejects both plans statically as well.
- A rank killed with SIGKILL, or frozen with SIGSTOP, makes every other rank fail on its own (not killed by the test
  harness) with a ``PipelineCommError`` naming the peer rank and the action that waited.
"""

from __future__ import annotations

import pytest
from runtime_models import Case, lowered_for, pipeline_rank, reference
from test_runtime_executor import _assert_matches_reference

from zb_pipeline.schedule.validate import ScheduleError, validate_lowered
from zb_pipeline.testing import MultiProcessError, run_multiprocess

P2P_TIMEOUT_S = 4.0


def _fail(case: Case, p: int) -> MultiProcessError:
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(pipeline_rank, p, args=(case,), timeout_s=120, failure_grace_s=4 * P2P_TIMEOUT_S)
    return info.value


def test_validator_rejects_the_hand_made_plans() -> None:
    with pytest.raises(ScheduleError, match="deadlock under strict P2P"):
        validate_lowered(lowered_for(Case("zb-h1", 2, 3, mutate="needs_buffering")))
    with pytest.raises(ScheduleError, match="different orders"):
        validate_lowered(lowered_for(Case("gpipe", 2, 3, mutate="swapped_order")))


def test_plan_that_needs_buffering_runs_on_plain_gloo_but_fails_in_checking_mode() -> None:
    # Without the check, gloo's buffering hides the problem: the run completes with the right numbers ...
    plain = Case("zb-h1", 2, 3, mutate="needs_buffering", check=False, timeout_s=P2P_TIMEOUT_S)
    results = run_multiprocess(pipeline_rank, 2, args=(plain,), timeout_s=120)
    _assert_matches_reference(plain, results)
    # ... which NCCL would never reach.  The checking mode says so.
    err = _fail(Case("zb-h1", 2, 3, mutate="needs_buffering", check=True, timeout_s=P2P_TIMEOUT_S), 2)
    assert set(err.failures) == {0, 1}
    for rank, text in err.failures.items():
        assert "CommOrderError" in text and "relies on buffering" in text, text
    assert "0SEND_F1@1" in err.failures[0] and "1SEND_B0@0" in err.failures[1]


def test_checking_mode_catches_pair_order_mismatch() -> None:
    err = _fail(Case("gpipe", 2, 3, mutate="swapped_order", check=True, timeout_s=P2P_TIMEOUT_S), 2)
    assert "CommOrderError" in err.failures[0] and "different orders" in err.failures[0], err.failures[0]


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_dead_or_stopped_rank_makes_every_other_rank_fail_naming_it(sig: str) -> None:
    case = Case("zb-h1", 3, 4, check=False, timeout_s=P2P_TIMEOUT_S)
    steps = [str(st) for st in lowered_for(case).ranks[1]]
    faulty = Case(**{**case.__dict__, "fault": {"rank": 1, "signal": sig, "at": steps.index("1B1")}})
    err = _fail(faulty, 3)
    assert set(err.failures) == {0, 1, 2}
    for rank in (0, 2):
        text = err.failures[rank]
        assert "PipelineCommError" in text, text
        assert "from rank 1" in text and "waited for" in text, text
        assert "killed" not in text.splitlines()[0], text  # failed by itself, within the P2P timeout
    assert ("exited with code -9" if sig == "KILL" else "killed") in err.failures[1]
    reference(case, 3)  # the healthy plan itself is fine (sanity: the failure came from the fault)
