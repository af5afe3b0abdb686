"""Optimizer post-validation (issue 9): exact equality with the synchronised optimizer, the plan's PV chain, and
no wait between a rank's last backward and its optimizer step.

The multi-rank tests run the same pipeline twice in one gloo group: once with the synchronised optimizer (the
project's ``MainParamOptimizer.step``, or the library's ``synchronised_step`` over the same protocol), once
post-validated.  Per-iteration loss multipliers make clipping
trigger on some iterations (sometimes on one rank's local norm already, sometimes only globally), and gradients
are forced to inf/NaN on chosen ranks at chosen iterations.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_models import BATCH, HIDDEN, MLPStage, mlp_input, mlp_target

from megatron.config.optimizer import OptimizerConfig
from megatron.config.precision import PrecisionConfig
from megatron.optimizer.main_params import MainParamOptimizer
from zb_pipeline.optim.post_validation import OUTCOMES, PostValidator, synchronised_step
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.trace import Tracer
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule, lower
from zb_pipeline.schedule.post_validation_pass import (
    add_post_validation,
    post_validation_ops,
    prologue_ops,
    validation_cut,
    validation_ops,
    without_post_validation,
)
from zb_pipeline.schedule.registry import generate
from zb_pipeline.schedule.validate import ScheduleError, validate_lowered
from zb_pipeline.testing.harness import run_multiprocess

# The optimizer is the trainer's own MainParamOptimizer: it is the PostValidatableOptimizer.
# Loss multipliers per iteration: large ones push the gradient norm over the clip threshold.
# Geometric in 12% steps: the norm crosses the clip threshold first globally only (rollback), then locally too.
FACTORS = [round(1.12**k, 4) for k in range(22)]
CLIP = 0.5


# ------------------------------------------------------------------------------------------------ rank body
@dataclass(frozen=True)
class PVCase:
    p: int
    m: int = 4
    schedule: str = "1f1b"
    precision: str = "fp32"  # "fp16": dynamic loss scaling (parameters stay fp32 here)
    iterations: int = len(FACTORS)
    inject: dict = field(default_factory=dict)  # iteration -> (pipeline rank, "inf" | "nan")
    sync: str = "megatron"  # "megatron": MainParamOptimizer.step; "ordered": synchronised_step
    trace: bool = False
    slow_last_b_ms: float = 0.0  # rank 0 sleeps in its last B (trace test)
    factors: tuple = tuple(FACTORS)
    dropout: float = 0.0  # random masks in every stage: a replayed iteration must restore the RNG state


def _build(case: PVCase, rank: int, with_pv: bool, tracer: Tracer | None):
    lowered = lower(generate(case.schedule, case.p, case.m))
    if with_pv:
        lowered = add_post_validation(lowered)
    validate_lowered(lowered)
    stages = {s: _stage(s, case.dropout) for s in lowered.schedule.stages_of(rank)}
    named = [(f"{s}.{n}", prm) for s, mod in stages.items() for n, prm in mod.named_parameters()]
    for _, prm in named:
        prm.main_grad = torch.zeros_like(prm)
    precision = PrecisionConfig(fp16=True, initial_loss_scale=2.0**8, loss_scale_window=3, hysteresis=2)
    if case.precision == "fp32":
        precision = PrecisionConfig()
    opt = MainParamOptimizer(
        named, OptimizerConfig(clip_grad=CLIP, weight_decay=0.01), precision, pp_group=dist.group.WORLD
    )
    return lowered, stages, opt


def _stage(s: int, dropout: float) -> torch.nn.Module:
    return torch.nn.Sequential(MLPStage(s), torch.nn.Dropout(dropout)) if dropout else MLPStage(s)


def _record(opt: MainParamOptimizer) -> dict:
    out = {"step": opt.step_count, "scale": opt.loss_scale}
    for s in opt.shards:
        st = opt.update_rule.state.get(id(s.main))
        out[s.name] = s.main.detach().numpy().copy()
        out[s.name + "/m"] = None if st is None else st["exp_avg"].numpy().copy()
        out[s.name + "/v"] = None if st is None else st["exp_avg_sq"].numpy().copy()
    return out


def _run(rank: int, case: PVCase, with_pv: bool) -> dict:
    torch.manual_seed(7 + rank)  # dropout masks: the same stream in both runs
    tracer = Tracer(rank) if case.trace else None
    lowered, stages, opt = _build(case, rank, with_pv, tracer)
    it_box = [0]
    m = case.m

    def loss_fn(out: torch.Tensor, mb: int):
        loss = ((out - mlp_target(mb)) ** 2).mean()
        return loss * (case.factors[it_box[0]] * opt.loss_scale / m), loss  # the scale is read after validation

    p2p = PipelineP2P(
        pp_rank=rank, boundary_specs=[TensorSpec((BATCH, HIDDEN))] * (case.p - 1), timeout_s=60, check=not case.trace
    )
    ex = PipelineExecutor(lowered, rank, stages, p2p=p2p, input_fn=mlp_input, loss_fn=loss_fn, tracer=tracer)
    p2p.tracer = tracer
    if case.slow_last_b_ms and rank == 0:
        plain = {k: ex.handlers[k] for k in (Kind.B, Kind.BW)}

        def slow_backward(executor, a):
            if a.microbatch == m - 1:
                time.sleep(case.slow_last_b_ms / 1000)
            plain[a.kind](executor, a)

        ex.handlers[Kind.B] = ex.handlers[Kind.BW] = slow_backward
    records: list[dict] = []
    validator = None
    if with_pv:
        validator = PostValidator(
            opt, pp_rank=rank, pp_size=case.p, on_validated=lambda v: records.append(_record(opt))
        )
        validator.attach(ex)
    if tracer is not None:
        tracer.align()
    losses = []
    for it in range(case.iterations):
        it_box[0] = it
        losses.append([float(x) for x in ex.run(it)])
        if it in case.inject and case.inject[it][0] == rank:
            opt.shards[0].grad.view(-1)[0] = float("inf") if case.inject[it][1] == "inf" else float("nan")
        t0 = time.perf_counter()
        if with_pv:
            validator.step(lr=1e-2)
        else:
            if case.sync == "megatron":
                opt.step(1e-2)
            else:
                synchronised_step(opt, 1e-2, pp_group=dist.group.WORLD)
            for s in opt.shards:
                s.grad.zero_()
            records.append(_record(opt))
        if tracer is not None:
            tracer.mark("optimizer step", t0, time.perf_counter())
    if with_pv:
        validator.flush(dist.group.WORLD)
    dist.barrier()
    return {
        "losses": losses,
        "records": records,
        "counts": dict(validator.counts) if validator else None,
        "replays": ex.replays,
        "trace": tracer.events if tracer is not None else None,
    }


def pv_rank(rank: int, world_size: int, case: PVCase) -> dict:
    torch.set_num_threads(1)
    return {"sync": _run(rank, case, with_pv=False), "pv": _run(rank, case, with_pv=True)}


# ------------------------------------------------------------------------------------------------ the tests
def _assert_identical(sync: dict, pv: dict, rank: int) -> None:
    assert sync["losses"] == pv["losses"], f"rank {rank}: losses differ"
    assert len(sync["records"]) == len(pv["records"])
    for it, (a, b) in enumerate(zip(sync["records"], pv["records"])):
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, np.ndarray):
                assert y is not None and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), (
                    f"rank {rank} iteration {it}: {k} differs"
                )
            else:
                assert x == y, f"rank {rank} iteration {it}: {k} = {x} (sync) vs {y} (post-validated)"


INJECT = {3: (1, "inf"), 9: (0, "nan"), 10: (1, "nan"), 15: (0, "inf")}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_post_validation_matches_megatron_optimizer_p2(precision: str) -> None:
    case = PVCase(p=2, precision=precision, inject=INJECT)
    results = run_multiprocess(pv_rank, 2, args=(case,), timeout_s=180)
    for r, res in enumerate(results):
        _assert_identical(res["sync"], res["pv"], r)
    counts = [res["pv"]["counts"] for res in results]
    total = {k: sum(c[k] for c in counts) for k in OUTCOMES}
    # Every cause is exercised (fixed data, so the counts are deterministic).
    assert total["rollback_nonfinite"] > 0 and total["held_nonfinite"] > 0
    assert total["rollback_clip"] > 0 and total["held_clip"] > 0 and total["validated"] > 0
    for c in counts:
        assert sum(c.values()) == case.iterations  # one validation per iteration on every rank


def test_post_validation_matches_ordered_sync_p4() -> None:
    # Dropout in every stage: iterations whose warm-up forwards ran with weights that validation then changed are
    # replayed with the RNG state of the iteration's start, so the masks (and everything after) still match.
    case = PVCase(
        p=4,
        m=5,
        schedule="zb-h1",
        sync="ordered",
        inject={2: (3, "inf"), 7: (1, "nan"), 12: (2, "inf")},
        dropout=0.2,
    )
    results = run_multiprocess(pv_rank, 4, args=(case,), timeout_s=240)
    for r, res in enumerate(results):
        _assert_identical(res["sync"], res["pv"], r)
    assert sum(res["pv"]["counts"]["rollback_nonfinite"] for res in results) > 0
    replays = {res["pv"]["replays"] for res in results}
    assert len(replays) == 1 and replays.pop() > 0  # every rank replays the same iterations


# Bounds fixed before measuring: rank 0 sleeps 200 ms in its last B.  The synchronised rank p - 1 must wait at
# least ~that long for the reduction (causality: rank 0's last B starts after rank p - 1's last B); the
# post-validated rank must start its step well under half of it after its last compute action.
SLEEP_MS, NO_WAIT_BOUND_MS, SYNC_WAIT_MIN_MS = 200.0, 100.0, 150.0


def _gap_ms(events: list[dict], iteration: int) -> tuple[float, float, list[str]]:
    """(last compute end -> step start, step duration, wait events in between) for one iteration of one rank."""
    comp = [e for e in events if e["args"].get("iteration") == iteration and e["cat"] in ("F", "B", "W", "BW")]
    step = next(e for e in events if e["name"] == "optimizer step" and e["args"]["iteration"] == iteration)
    last_end = max(e["ts"] + e["dur"] for e in comp)
    waits = [e["name"] for e in events if e["cat"] == "wait" and last_end <= e["ts"] < step["ts"]]
    return (step["ts"] - last_end) / 1000, step["dur"] / 1000, waits


@pytest.mark.slow  # wall-clock bounds (with wide margins): kept out of the default run so load cannot flake it
def test_no_wait_between_last_backward_and_step() -> None:
    case = PVCase(p=3, m=3, iterations=2, trace=True, slow_last_b_ms=SLEEP_MS)
    results = run_multiprocess(pv_rank, 3, args=(case,), timeout_s=180)
    last = results[-1]
    for it in range(case.iterations):
        gap, _, waits = _gap_ms(last["pv"]["trace"], it)
        assert not waits and gap < NO_WAIT_BOUND_MS, f"post-validated rank 2 waited {gap:.1f} ms ({waits})"
        sgap, sdur, _ = _gap_ms(last["sync"]["trace"], it)
        assert sgap + sdur >= SYNC_WAIT_MIN_MS, f"synchronised rank 2 spent only {sgap + sdur:.1f} ms"


# ------------------------------------------------------------------------------------- plan (single process)
def _consistent(lowered, cut: list[int]) -> bool:
    """Per ordered pair of ranks, the sends before the sender's cut are the receives before the receiver's cut."""
    p = lowered.schedule.num_ranks
    count = {}
    for r, steps in enumerate(lowered.ranks):
        for st in steps[: cut[r]]:
            if isinstance(st, CommBatch):
                for a in st.actions:
                    send = a.kind in (Kind.SEND_F, Kind.SEND_B)
                    key = (r, a.peer) if send else (a.peer, r)
                    count[key] = count.get(key, 0) + (1 if send else -1)
    return all(v == 0 for v in count.values()) and len(cut) == p


def _first_backward(steps) -> int:
    return next(
        (j for j, st in enumerate(steps) if not isinstance(st, CommBatch) and st.kind in (Kind.B, Kind.BW, Kind.W)),
        len(steps),
    )


@pytest.mark.parametrize(
    "name,p,m,chunks",
    [
        ("1f1b", 4, 8, None),
        ("zb-h2", 3, 6, None),
        ("zb-v", 4, 8, 2),
        ("interleaved-1f1b", 2, 4, 2),
        ("gpipe", 3, 2, None),
    ],
)
def test_pass_puts_the_chain_at_a_consistent_cut(name: str, p: int, m: int, chunks: int | None) -> None:
    plain = lower(generate(name, p, m, chunks=chunks))
    cut = validation_cut(plain)
    assert _consistent(plain, cut)
    lowered = add_post_validation(plain)
    validate_lowered(lowered)
    for r in range(p):
        assert cut[r] <= _first_backward(plain.ranks[r])
        head = [CommBatch((a,)) for a in prologue_ops(r, p)]
        point = [CommBatch((a,)) for a in validation_ops(r, p)]
        steps = list(lowered.ranks[r])
        assert steps[: len(head)] == head
        at = len(head) + cut[r]
        assert steps[at : at + len(point)] == point
        assert without_post_validation(lowered.ranks[r]) == plain.ranks[r]
    assert post_validation_ops(1, 4) == prologue_ops(1, 4) + validation_ops(1, 4)
    with pytest.raises(ValueError, match="already carries"):
        add_post_validation(lowered)


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 3), ("zb-h1", 3, 3), ("zb-v", 2, 2), ("zb-h2", 2, 3)])
def test_validation_cut_is_the_largest_consistent_cut(name: str, p: int, m: int) -> None:
    """Brute force over every cut vector below each rank's first backward action."""
    plain = lower(generate(name, p, m))
    ours = validation_cut(plain)
    limits = [_first_backward(steps) for steps in plain.ranks]
    for cand in itertools.product(*(range(n + 1) for n in limits)):
        if _consistent(plain, list(cand)):
            assert all(c <= o for c, o in zip(cand, ours)), f"{cand} is consistent and not below {ours}"


def test_validator_rejects_a_broken_chain() -> None:
    lowered = add_post_validation(lower(generate("1f1b", 3, 4)))
    ranks = [list(r) for r in lowered.ranks]
    ranks[1] = ranks[1][:1] + ranks[1][2:]  # rank 1 drops its SEND_PV0@2
    with pytest.raises(ScheduleError, match="post-validation chain is incomplete"):
        validate_lowered(LoweredSchedule(lowered.schedule, tuple(map(tuple, ranks))))


def test_validator_rejects_backward_before_the_validation_point() -> None:
    lowered = add_post_validation(lower(generate("1f1b", 2, 3)))
    steps = list(lowered.ranks[1])  # rank 1 (last): validates on its prologue receive; move that after its BW
    first_bw = _first_backward(steps)
    moved = steps[1 : first_bw + 1] + [steps[0]] + steps[first_bw + 1 :]
    ranks = (lowered.ranks[0], tuple(moved))
    with pytest.raises(ScheduleError, match="before the rank's post-validation point"):
        validate_lowered(LoweredSchedule(lowered.schedule, ranks))
