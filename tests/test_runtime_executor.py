"""The pipeline executor end to end on gloo: every schedule against the same stages run in sequence in one process.

Losses and gradients must be bit-identical (``np.array_equal`` on the fp32 bits): every built-in schedule accumulates
each stage's weight gradients in microbatch order, exactly as the sequential reference does.  All runs use the P2P
layer's checking mode (strict per-pair order, no buffering), so a pass here also means the posting order is safe on
NCCL.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_models import Case, pipeline_cases, posted_as_planned, reference

from zb_pipeline.runtime.trace import executed_actions, merge_traces
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.lowering import CommBatch, lower
from zb_pipeline.schedule.plan_file import save_plan
from zb_pipeline.schedule.registry import available, generate, get
from zb_pipeline.testing import run_multiprocess


def _run(cases: list[Case], p: int, timeout_s: float = 240.0) -> list[list[dict]]:
    """Run every case on p ranks; result[i][rank] is case i's result on that rank."""
    per_rank = run_multiprocess(pipeline_cases, p, args=(cases,), timeout_s=timeout_s)
    return [[per_rank[r][i] for r in range(p)] for i in range(len(cases))]


def _assert_matches_reference(case: Case, results: list[dict]) -> None:
    sched = case.schedule()
    S, owner = sched.num_stages, sched.stage_to_rank
    ref_losses, ref_grads = reference(case, S)
    got_losses = [x for it in results[owner[S - 1]]["losses"] for x in it]
    assert got_losses == ref_losses, f"{case}: losses differ: {got_losses} vs {ref_losses}"
    for s in range(S):
        got = results[owner[s]]["grads"][s]
        assert set(got) == set(ref_grads[s]), f"{case}: stage {s} has gradients for {sorted(got)}"
        for name, ref in ref_grads[s].items():
            assert np.array_equal(got[name], ref), (
                f"{case}: stage {s} {name} differs (max abs {np.abs(got[name] - ref).max():.3g})"
            )


def _shape_ok(name: str, p: int, m: int, chunks: int | None) -> bool:
    try:
        generate(name, p, m, chunks=chunks)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ default run
P2_CASES = [
    Case("1f1b", 2, 3),
    Case("zb-h1", 2, 3),
    Case("zb-h2", 2, 5),
    Case("zb-v", 2, 3),
    Case("interleaved-1f1b", 2, 4, chunks=2),
    Case("gpipe", 2, 1),
    Case("zb-h1", 2, 3, model="gpt"),
    Case("zb-v", 2, 3, model="gpt"),
    Case("zb-h2", 2, 3, model="generic"),
    Case("v-half", 2, 3, model="generic"),
]


def test_two_ranks_every_kind_of_plan_matches_sequential_run() -> None:
    cases = [c for c in P2_CASES if c.name in available()]
    for case, results in zip(cases, _run(cases, 2)):
        _assert_matches_reference(case, results)


@pytest.mark.slow
def test_three_ranks_odd_and_few_microbatches() -> None:
    cases = [Case("zb-h1", 3, 5), Case("zb-auto", 3, 4), Case("v-min", 3, 5), Case("1f1b", 3, 2, model="gpt")]
    cases = [c for c in cases if c.name in available() and _shape_ok(c.name, c.p, c.m, c.chunks)]
    for case, results in zip(cases, _run(cases, 3)):
        _assert_matches_reference(case, results)


def test_plan_file_runs_like_the_builtin(tmp_path) -> None:
    path = tmp_path / "zb_h1.json"
    save_plan(generate("zb-h1", 2, 3), path)
    builtin, from_file = Case("zb-h1", 2, 3), Case("zb-h1", 2, 3, plan_file=str(path))
    a, b = _run([builtin, from_file], 2)
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        for s in ra["grads"]:
            for name in ra["grads"][s]:
                assert np.array_equal(ra["grads"][s][name], rb["grads"][s][name])
    _assert_matches_reference(from_file, b)


def test_trace_holds_every_planned_action_once_in_order() -> None:
    # Normal mode (receives waited for when consumed; on gloo posted one compute action ahead of their batch) and
    # checking mode (every op posted with its batch, receives waited for when posted).
    cases = [Case("zb-v", 2, 3, trace=True, iterations=2, check=False), Case("zb-h1", 2, 3, trace=True, iterations=2)]
    for case, results in zip(cases, _run(cases, 2)):
        lowered = lower(case.schedule())
        doc = merge_traces([r["trace"] for r in results])
        for rank, steps in enumerate(lowered.ranks):
            planned = [a for st in steps for a in (st.actions if isinstance(st, CommBatch) else (st,))]
            for it in range(case.iterations):
                got = executed_actions(doc, rank, iteration=it)
                where = f"{case.name} rank {rank} iter {it}"
                if case.check:  # nothing moves: exactly the plan
                    assert got == [str(a) for a in planned], where
                    continue
                assert posted_as_planned(got, planned) is None, f"{where}: {posted_as_planned(got, planned)}"
                if any(a.kind in (Kind.RECV_F, Kind.RECV_B) for a in planned[1:]):  # gloo posts some ahead
                    assert got != [str(a) for a in planned], f"{where}: no receive was posted ahead"
        waits = [ev for ev in doc["traceEvents"] if ev.get("cat") == "wait"]
        assert waits and all(ev["args"]["waiter"] for ev in waits)


# ------------------------------------------------------------------------------------------------- full grid
def _grid() -> list[Case]:
    cases = []
    for name in available():
        spec = get(name)
        chunk_options = [spec.default_chunks] if spec.chunks is not None else [1, 2]
        for p in (2, 3, 4):
            for m in sorted({1, p - 1, p + 1, 2 * p - 1, 2 * p + 1} - {0}):
                for chunks in chunk_options:
                    for model in ("mlp", "gpt"):
                        if _shape_ok(name, p, m, chunks):
                            cases.append(Case(name, p, m, chunks=chunks, model=model))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3, 4])
def test_full_grid(p: int) -> None:
    cases = [c for c in _grid() if c.p == p]
    assert cases
    for case, results in zip(cases, _run(cases, p, timeout_s=1500)):
        _assert_matches_reference(case, results)


@pytest.mark.parametrize("ahead", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "interleaved-1f1b", "v-min"])
def test_prepost_windows_post_each_receive_in_order_and_at_most_ahead_actions_early(name: str, ahead: int) -> None:
    from zb_pipeline.runtime.executor import prepost_windows

    p, m = 3, 6
    chunks = get(name).default_chunks
    lowered = lower(generate(name, p, m, chunks=chunks))
    for rank in range(p):
        steps = lowered.ranks[rank]
        windows = prepost_windows(steps, ahead)
        assert len(windows) == len(steps)
        posted_at: dict = {}
        for j, picked in enumerate(windows):
            assert not picked or type(steps[j]) is CommBatch
            for a in picked:
                posted_at.setdefault(a, j)  # the first window that holds it posts it
        computes_before = [sum(type(s) is not CommBatch for s in steps[:j]) for j in range(len(steps) + 1)]
        planned = [(j, a) for j, s in enumerate(steps) if type(s) is CommBatch for a in s.actions
                   if a.kind in (Kind.RECV_F, Kind.RECV_B)]  # fmt: skip
        # The plan's order of receives is kept: a later receive is never posted at an earlier batch than an earlier
        # one (a batch posts its own receives first, then the ones it posts ahead, in plan order).
        at = [posted_at.get(a, j) for j, a in planned]
        assert at == sorted(at)
        for j, a in planned:
            if a in posted_at:
                assert posted_at[a] < j
                assert computes_before[j] - computes_before[posted_at[a]] <= ahead
        if ahead == 0:
            assert not posted_at


def test_prepost_two_ahead_covers_the_last_stage_of_1f1b() -> None:
    """1F1B's last stage runs F(i), BW(i), then the batch {SEND_B(i), RECV_F(i + 1)} in the steady state: that
    receive is posted at the batch before F(i) with two actions ahead, and only in its own batch with one."""
    from zb_pipeline.runtime.executor import PREPOST_AHEAD, prepost_windows

    assert PREPOST_AHEAD == 2
    steps = lower(generate("1f1b", 2, 4)).ranks[1]
    recv_next = {a for s in steps if type(s) is CommBatch for a in s.actions if a.kind is Kind.RECV_F}
    early = {a for picked in prepost_windows(steps, 2) for a in picked}
    assert {a.microbatch for a in recv_next & early} == {1, 2, 3}
    assert {a.microbatch for picked in prepost_windows(steps, 1) for a in picked} == {1}  # the warm-up's only
