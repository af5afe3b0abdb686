"""DualPipeV (``dualpipev``) and the overlapped F+BW pair it is built from.

- The pair in the IR: printed and parsed (``1F5+6BW2``), in plan files, rejected where it cannot be (one microbatch,
  wrong kinds); lowered with both inputs received before it and both outputs sent after it.
- The generator over a grid: every plan passes the validator under the strict P2P model, at its stated memory cap
  ``p + 1/2`` (reached on every rank); ``m < 2p`` is a one-line ``ValueError``.
- Idle time: at uniform per-chunk costs (F = B = W = 1, T_comm = 0) every rank is idle for exactly DualPipe's
  ``(PP/2 - 1)(F&B + B - 3W)`` with ``PP = 2p`` and ``B`` the full backward (b + w); with an overlap factor the ranks
  that overlap the most (p - 2 and p - 1) still match it and the others are idle less, by exactly what their fewer
  pairs save.
- The runtime (gloo, P2P checking mode) against one process: bit-identical losses and gradients; the trace holds the
  pairs as planned.  The trainer: losses within 1e-4 of pp = 1 with tied embeddings (more cases in the slow suite).
"""

from __future__ import annotations

import math

import pytest
from runtime_models import Case, pipeline_cases, reference

from zb_pipeline.runtime.trace import executed_actions, merge_traces
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.dualpipe_v import dualpipe_v_ranks
from zb_pipeline.schedule.ir import BW, Action, F, Kind, PairAction, Schedule, parse_action, v_placement
from zb_pipeline.schedule.lowering import CommBatch, lower
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.plan_file import PlanFileError, dumps_plan, loads_plan, plan_from_dict, plan_to_dict
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import ScheduleError, check_and_lower
from zb_pipeline.testing import run_multiprocess

NAME = "dualpipev"


# ------------------------------------------------------------------------------------------------------ the IR
@pytest.mark.parametrize("text", ["1F5+6BW2", "0F0+3BW1", "12F511+13BW0"])
def test_pair_prints_and_parses_back(text: str) -> None:
    pair = parse_action(text)
    assert type(pair) is PairAction and pair.kind is Kind.PAIR and pair.peer is None
    assert str(pair) == text and PairAction.parse(text) == pair
    assert pair == PairAction(Action.parse(text.split("+")[0]), Action.parse(text.split("+")[1]))


@pytest.mark.parametrize("bad", ["1F5+6B2", "1BW5+6F2", "1F5+", "+6BW2", "1F5+6BW2+3F1", "1F5+6SEND_B2@1"])
def test_bad_pairs_are_rejected_in_one_line(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_action(bad)
    assert "\n" not in str(info.value) and "pair" in str(info.value)


def test_a_pair_is_not_an_action() -> None:
    with pytest.raises(ValueError, match="PairAction"):
        Action(0, Kind.PAIR, 0)
    with pytest.raises(ValueError):
        Action.parse("1F5+6BW2")  # plain actions only; parse_action reads both


def test_plan_file_round_trip_with_pairs() -> None:
    sched = registry.generate(NAME, 3, 7)
    assert sum(a.kind is Kind.PAIR for acts in sched.ranks for a in acts) > 0
    text = dumps_plan(sched)
    assert '"2F3+3BW1"' in text or "+" in text
    assert loads_plan(text) == sched and dumps_plan(loads_plan(text)) == text
    d = plan_to_dict(sched)
    d["ranks"][0][d["ranks"][0].index(next(x for x in d["ranks"][0] if "+" in x))] = "0F1+4BW2"  # stage 4: rank 1
    with pytest.raises(PlanFileError, match="rank 0 position .*stage 4, which stage_to_rank places on rank 1"):
        plan_from_dict(d)


def _two_rank_plan(rank0: list, rank1: list, m: int = 2) -> Schedule:
    return Schedule("hand", 2, 4, m, v_placement(2, 2), (tuple(rank0), tuple(rank1)))


def test_lowering_a_pair_receives_both_inputs_before_and_sends_both_outputs_after() -> None:
    sched = registry.generate(NAME, 2, 4)
    lowered = check_and_lower(sched)
    for r, steps in enumerate(lowered.ranks):
        for j, st in enumerate(steps):
            if type(st) is not PairAction:
                continue
            f, b = st.forward, st.backward
            after = steps[j + 1] if j + 1 < len(steps) else None
            sends = [(a.kind, a.stage, a.microbatch) for a in after.actions] if isinstance(after, CommBatch) else []
            if f.stage + 1 < 4 and sched.stage_to_rank[f.stage + 1] != r:
                assert (Kind.SEND_F, f.stage, f.microbatch) in sends, (r, st, steps[j + 1])
            if b.stage > 0 and sched.stage_to_rank[b.stage - 1] != r:
                assert (Kind.SEND_B, b.stage, b.microbatch) in sends, (r, st, steps[j + 1])
            before = [(a.kind, a.stage, a.microbatch) for x in steps[:j] if isinstance(x, CommBatch) for a in x.actions]
            if f.stage > 0 and sched.stage_to_rank[f.stage - 1] != r:
                assert (Kind.RECV_F, f.stage, f.microbatch) in before
            if b.stage < 3 and sched.stage_to_rank[b.stage + 1] != r:
                assert (Kind.RECV_B, b.stage, b.microbatch) in before
    assert str(lowered).count("+") == sum(a.kind is Kind.PAIR for acts in sched.ranks for a in acts)


def test_validator_rejects_a_pair_of_one_microbatch_with_the_grid() -> None:
    # Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.  3F0+3BW0 would need its own forward's loss.
    rank0 = [F(0, 0), F(0, 1), F(3, 1), PairAction(F(3, 0), BW(3, 0)), BW(3, 1), BW(0, 0), BW(0, 1)]
    rank1 = [F(1, 0), F(2, 0), F(1, 1), F(2, 1), BW(2, 0), BW(1, 0), BW(2, 1), BW(1, 1)]
    with pytest.raises(ScheduleError) as info:
        check_and_lower(_two_rank_plan(rank0, rank1))
    err = info.value
    assert "\n" not in str(err) and "rank 0 position 3 (3F0+3BW0)" in str(err) and "one microbatch" in str(err)
    assert "[3F0+3BW0]" in err.grid
    with pytest.raises(ValueError, match="one microbatch"):
        simulate(_two_rank_plan(rank0, rank1), StageCosts.uniform(4))


def test_validator_finds_a_pair_waiting_on_itself_across_ranks() -> None:
    # 1F1+2BW0 on rank 1 needs the gradient of 3BW0, which waits for 2F0 -> rank 1 runs 2F0 first: fine; but placing
    # the pair before 2F0 makes 3BW0 wait on a forward that sits after the pair on rank 1 (a cross-rank cycle).
    rank0 = [F(0, 0), F(0, 1), F(3, 0), BW(3, 0), F(3, 1), BW(3, 1), BW(0, 0), BW(0, 1)]
    rank1 = [F(1, 0), PairAction(F(1, 1), BW(2, 0)), F(2, 0), F(2, 1), BW(1, 0), BW(2, 1), BW(1, 1)]
    with pytest.raises(ScheduleError) as info:
        check_and_lower(_two_rank_plan(rank0, rank1))
    assert "1F1+2BW0" in str(info.value)


# ------------------------------------------------------------------------------------------- generator + grid
GRID = [(p, m) for p in range(1, 7) for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p + 3})]


def test_registry_entry() -> None:
    spec = registry.get(NAME)
    assert (spec.chunks, spec.default_chunks, spec.placement, spec.uses_costs) == ((2,), 2, "v", False)
    assert spec.stated_memory_bound(4, 8) == 4.5


@pytest.mark.parametrize(("p", "m"), GRID)
def test_every_plan_is_valid_at_its_memory_cap(p: int, m: int) -> None:
    sched = registry.generate(NAME, p, m)
    assert sched.placement == ("v" if p > 1 else "loop") and sched.num_stages == 2 * p
    cap = registry.get(NAME).stated_memory_bound(p, m)
    check_and_lower(sched, mem_limit=cap)  # complete, dependency-valid, strict P2P, memory
    costs = StageCosts.build(num_ranks=p, chunks=2, stage_to_rank=sched.stage_to_rank)
    assert peak_memory(sched, costs) == (p + 0.5,) * p  # DualPipe's PP + 1 chunk activations on every rank
    with pytest.raises(ValueError, match="needs a memory limit of at least"):
        registry.generate(NAME, p, m, mem_limit=p)
    # each rank: m forwards and m full (or split) backwards per chunk, pairs from the steady state on
    for r, acts in enumerate(sched.ranks):
        pairs = sum(a.kind is Kind.PAIR for a in acts)
        assert pairs == 2 * m - 3 * p + r + 1 - (r == p - 1), (p, m, r)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (3, 5), (8, 15)])
def test_fewer_than_2p_microbatches_is_one_line(p: int, m: int) -> None:
    with pytest.raises(ValueError) as info:
        registry.generate(NAME, p, m)
    assert str(info.value) == f"dualpipev needs m >= 2p microbatches: m={m} < 2 x p={p} (use m >= {2 * p})"
    with pytest.raises(ValueError, match="m >= 2p"):
        dualpipe_v_ranks(p, m)


def test_p2_m4_exact_order() -> None:
    rows = [[str(a) for a in acts] for acts in registry.generate(NAME, 2, 4).ranks]
    assert rows == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3+3BW1 3F2+0BW0 3BW2 3F3+0BW1 3BW3 0B2 0W2 0B3 0W3".split(),
        "1F0 2F0 1F1 2F1 1F2 2BW0 2F2+1BW0 1F3+2BW1 2F3+1BW1 2BW2 1BW2 2B3 1B3 2W3 1W3".split(),
    ]


# -------------------------------------------------------------------------------------------- idle-time formula
def _idle(p: int, m: int, overlap: float, w: float = 1.0) -> tuple[list[float], float, float]:
    """Per-rank idle time (iteration end - busy time) at F = B = 1, W = ``w`` per chunk, T_comm = 0; DualPipe's
    bubble ``(PP/2 - 1)(F&B + B - 3W)`` with PP = 2p, B = b + w; and what a pair saves against F + BW."""
    sched = registry.generate(NAME, p, m)
    costs = StageCosts.build(
        num_ranks=p, chunks=2, stage_to_rank=sched.stage_to_rank, f=2, b=2, w=2 * w, overlap=overlap
    )  # a rank's whole share is twice a chunk's
    f, b = 1.0, 1.0
    fb = costs.pair(0, 1)  # F&B
    assert fb == max(overlap * (f + b + w), f, b + w)
    result = simulate(sched, costs)
    idle = [result.end_time - busy for busy in result.rank_compute]
    return idle, (p - 1) * (fb + (b + w) - 3 * w), (f + b + w) - fb


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 9) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 3)])
def test_idle_time_is_dualpipes_formula_at_uniform_costs(p: int, m: int) -> None:
    idle, formula, _ = _idle(p, m, 1.0)
    assert formula == 2 * (p - 1)
    assert idle == [formula] * p  # exact: every rank, every m


@pytest.mark.parametrize("w", [0.5, 0.25])  # F = B = 2W, F = B = 4W
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8), (6, 18), (8, 16)])
def test_idle_time_formula_holds_for_lighter_w(p: int, m: int, w: float) -> None:
    idle, formula, _ = _idle(p, m, 1.0, w)
    assert formula == (p - 1) * (3 - w)
    assert idle == [formula] * p


@pytest.mark.parametrize("overlap", [0.875, 0.75, 0.5])  # 0.5: a pair takes its longer half (BW), F&B = 2
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8), (5, 13), (8, 16)])
def test_idle_time_with_an_overlap_factor(p: int, m: int, overlap: float) -> None:
    idle, formula, saved = _idle(p, m, overlap)
    expected = [formula - max(0, p - 2 - r) * saved for r in range(p)]  # rank r runs p - 2 - r fewer pairs
    assert idle == expected
    assert max(idle) == formula


def test_cli_cost_overlap(capsys) -> None:
    import json

    from zb_pipeline.schedule.cli import main

    assert main(["simulate", NAME, "-p", "4", "-m", "8", "--cost-overlap", "0.75", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost_overlap"] == 0.75 and out["peak_memory"] == [4.5] * 4
    assert main(["simulate", NAME, "-p", "4", "-m", "8", "--cost-overlap", "0"]) == 2
    assert "--cost-overlap 0 must be in (0, 1]" in capsys.readouterr().err
    assert main(["simulate", NAME, "-p", "4", "-m", "7"]) == 2
    assert "m >= 2p" in capsys.readouterr().err


def test_pictures_draw_pairs(tmp_path) -> None:
    from zb_pipeline.schedule.pictures import ansi_timeline, plot_timeline

    result = simulate(
        registry.generate(NAME, 2, 4), StageCosts.build(num_ranks=2, chunks=2, stage_to_rank=(0, 1, 1, 0))
    )
    text = ansi_timeline(result, color=False)
    assert "F3+x1" in text and "overlapped pair" in text
    assert "3+1" in ansi_timeline(result, color=True)
    plot_timeline(result, tmp_path / "dpv.png")
    assert (tmp_path / "dpv.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------- the runtime
def test_runtime_matches_one_process_bit_for_bit() -> None:
    """p = 2 (m = 4, and m = 5 traced over two iterations) on the deferrable MLP and the GPT stages: losses and every
    gradient equal to the same stages run in sequence; the trace holds each planned step once, a pair as its two
    halves tagged with it."""
    cases = [Case(NAME, 2, 4), Case(NAME, 2, 5, iterations=2, trace=True), Case(NAME, 2, 4, model="gpt")]
    per_rank = run_multiprocess(pipeline_cases, 2, args=(cases,), timeout_s=240)
    for i, case in enumerate(cases):
        results = [per_rank[r][i] for r in range(2)]
        sched = case.schedule()
        S, owner = sched.num_stages, sched.stage_to_rank
        ref_losses, ref_grads = reference(case, S)
        assert [x for it in results[owner[S - 1]]["losses"] for x in it] == ref_losses, case
        for s in range(S):
            got = results[owner[s]]["grads"][s]
            assert set(got) == set(ref_grads[s])
            for name, ref in ref_grads[s].items():
                assert (got[name] == ref).all(), (case, s, name)
        if case.trace:
            doc = merge_traces([r["trace"] for r in results])
            lowered = lower(sched)
            for rank, steps in enumerate(lowered.ranks):
                planned = [str(a) for st in steps for a in (st.actions if isinstance(st, CommBatch) else (st,))]
                for it in range(case.iterations):
                    assert executed_actions(doc, rank, iteration=it) == planned, (rank, it)
            halves = [ev for ev in doc["traceEvents"] if ev.get("args", {}).get("pair")]
            assert halves and {ev["cat"] for ev in halves} == {"F", "BW"}


@pytest.mark.slow
def test_runtime_three_and_four_ranks() -> None:
    for p, cases in ((3, [Case(NAME, 3, 6), Case(NAME, 3, 8, model="generic")]), (4, [Case(NAME, 4, 9)])):
        per_rank = run_multiprocess(pipeline_cases, p, args=(cases,), timeout_s=600)
        for i, case in enumerate(cases):
            results = [per_rank[r][i] for r in range(p)]
            sched = case.schedule()
            ref_losses, ref_grads = reference(case, sched.num_stages)
            assert results[0]["losses"][0] == ref_losses, case  # rank 0 holds the loss (V)
            for s in range(sched.num_stages):
                for name, ref in ref_grads[s].items():
                    assert (results[sched.stage_to_rank[s]]["grads"][s][name] == ref).all(), (case, s, name)


# ------------------------------------------------------------------------------------------------- the trainer
TRAIN = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "2", "--train-iters", "2",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--seed", "7", "--eval-iters", "1", "--eval-interval", "2",
    "--log-interval", "1", "--distributed-timeout-seconds", "60",
]  # fmt: skip
LOSS_TOL = 1e-4


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    import io

    import torch

    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    torch.set_num_threads(1)
    summary = pretrain(parse_run_config(argv, world_size=world_size), stream=io.StringIO())
    return {"losses": list(summary.losses), "valid": [v for _, v in summary.validation_losses]}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isfinite(x) and abs(x - y) <= LOSS_TOL * abs(y) for x, y in zip(a, b))


def _compare(argv: list[str], pp: int, world: int, *, exact: bool) -> None:
    ref = run_multiprocess(_train, world // pp, args=(argv,), timeout_s=240)[0]
    got = run_multiprocess(
        _train, world, args=([*argv, "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", NAME],),
        timeout_s=240,
    )  # fmt: skip
    assert all(r == got[0] for r in got[1:])
    if exact:
        assert got[0] == ref, (got[0], ref)
    else:
        assert _close(got[0]["losses"], ref["losses"]) and _close(got[0]["valid"], ref["valid"]), (got[0], ref)


def test_trainer_tied_embeddings_match_pp1() -> None:
    """pretrain with pp = 2, m = 4 = 2p, tied embeddings (both copies on rank 0), clipping on: within 1e-4 of pp = 1."""
    _compare([*TRAIN, "--global-batch-size", "8", "--clip-grad", "1.0"], 2, 2, exact=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "pp", "world", "exact"),
    [
        (["--untie-embeddings-and-output-weights", "--global-batch-size", "10", "--clip-grad", "0"], 2, 2, True),
        (["--global-batch-size", "12", "--clip-grad", "1.0", "--num-layers", "6"], 3, 3, False),
        (["--global-batch-size", "8", "--clip-grad", "1.0", "--tensor-model-parallel-size", "2"], 2, 4, False),
    ],
)
def test_trainer_more_shapes(extra: list[str], pp: int, world: int, exact: bool) -> None:
    """Untied and bit-identical (m = 5); pp = 3 (m = 6); tp = 2 in the mix."""
    _compare([*TRAIN, *extra], pp, world, exact=exact)


def test_trainer_refuses_fewer_than_2p_microbatches_in_one_line() -> None:
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError

    argv = [*TRAIN, "--global-batch-size", "6", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", NAME]
    with pytest.raises(ConfigError) as info:
        parse_run_config(argv, world_size=2)
    assert str(info.value) == (
        "--pipeline-schedule dualpipev: dualpipev needs m >= 2p microbatches: m=3 < 2 x p=2 (use m >= 4)"
    )
