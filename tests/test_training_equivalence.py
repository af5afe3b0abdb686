"""Same seed, different layout, same training: TP=2 vs TP=1 and DP=2 vs gradient accumulation (gloo, CPU).

Every layout trains the same small GPT for 5 steps from the same seed on the same mock samples (dropout 0). Against
the single-process run with the same global batch (accumulated over microbatches):
- first-step gradients (full tensors, merged from tensor-parallel shards) agree to a norm-wise relative error of
  1e-5 over the whole model, and 1e-4 for each parameter;
- the loss of every step agrees to a relative error of 1e-4, and the parameters after 5 steps to a norm-wise
  relative error of 1e-4.
Tolerances fixed before measuring (fp32 throughout; only the order of floating-point sums differs between layouts).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zb_pipeline.testing.harness import run_multiprocess

STEPS = 5
GRAD_TOL_MODEL, GRAD_TOL_PARAM, LOSS_TOL, PARAM_TOL = 1e-5, 1e-4, 1e-4, 1e-4

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--vocab-size", "250", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-warmup-iters", "1", "--min-lr", "3e-4",
    "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "11", "--eval-iters", "0",
    "--distributed-timeout-seconds", "60",
]  # fmt: skip
UNTIED = ["--untie-embeddings-and-output-weights"]
VARIANT = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
           "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"]  # fmt: skip


def _full_tensors(model: torch.nn.Module, ctx, pick) -> dict[str, torch.Tensor]:
    """``pick(param)`` of every parameter as the full (unsharded) tensor, merged over the tensor-parallel group."""
    from megatron.parallel.tensor_parallel.partitioning import merge_shards

    out = {}
    for name, p in model.named_parameters():
        t = pick(p).detach().float().clone()
        if getattr(p, "tensor_model_parallel", False) and ctx.tp_size > 1:
            parts = [torch.empty_like(t) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=ctx.tp_group)
            t = merge_shards(parts, dim=p.partition_dim, stride=getattr(p, "partition_stride", 1))
        out[name] = t
    return out


def train_layout(argv: list[str], world_size: int) -> dict:
    """Train ``STEPS`` steps under the layout in ``argv``; returns first-step grads, losses, grad norms, params."""
    from datetime import timedelta

    from megatron.arguments import parse_run_config
    from megatron.parallel.context import ParallelContext
    from megatron.training_setup import setup
    from megatron.training_step import forward_backward, optimizer_step, train_step

    torch.set_num_threads(1)
    run = parse_run_config(argv, world_size=world_size)
    ctx = ParallelContext.initialize(tp=run.parallel.tp_size, pp=1, timeout=timedelta(seconds=60))
    tr = setup(run, ctx)
    losses = [forward_backward(tr)]
    grads = _full_tensors(tr.model, ctx, lambda p: p.main_grad)
    [settled] = optimizer_step(tr)
    stats, skipped = settled.stats, settled.skipped
    tr.iteration += 1
    norms = [stats.norm]
    assert not skipped
    for _ in range(STEPS - 1):
        res = train_step(tr)
        losses.append(res.loss)
        norms.append(res.grad_stats.norm)
    params = _full_tensors(tr.model, ctx, lambda p: p)
    return {"grads": grads, "losses": losses, "norms": norms, "params": params}


def _to_numpy(result: dict) -> dict:
    # Tensors sent through multiprocessing pipes travel as shared-memory handles that die with the sending rank.
    return {k: ({n: t.numpy() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in result.items()}


def _worker(rank: int, world_size: int, cases: list[list[str]]) -> list[dict] | None:
    results = [_to_numpy(train_layout(argv, world_size)) for argv in cases]
    return results if rank == 0 else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _assert_same_training(got: dict, ref: dict, label: str) -> None:
    names = sorted(ref["grads"])
    assert sorted(got["grads"]) == names, label
    g = torch.cat([got["grads"][n].flatten() for n in names])
    r = torch.cat([ref["grads"][n].flatten() for n in names])
    assert _rel(g, r) < GRAD_TOL_MODEL, f"{label}: first-step gradients differ by {_rel(g, r):.2e}"
    for n in names:
        err = _rel(got["grads"][n], ref["grads"][n])
        assert err < GRAD_TOL_PARAM, f"{label}: first-step gradient of {n} differs by {err:.2e}"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), start=1):
        assert abs(a - b) / abs(b) < LOSS_TOL, f"{label}: loss of step {step}: {a} vs {b}"
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-4), label
    p = torch.cat([got["params"][n].flatten() for n in names])
    q = torch.cat([ref["params"][n].flatten() for n in names])
    assert _rel(p, q) < PARAM_TOL, f"{label}: parameters after {STEPS} steps differ by {_rel(p, q):.2e}"


_REFERENCES: dict[tuple[str, ...], dict] = {}


def _reference(extra: list[str]) -> dict:
    key = tuple(extra)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_layout([*BASE, *extra], 1)
    return _REFERENCES[key]


def _check(world_size: int, groups: list[tuple[list[str], dict[str, list[str]]]]) -> None:
    """One spawn of ``world_size`` ranks trains every layout of every ``(model flags, layouts)`` group."""
    cases, labels, refs = [], [], []
    for model_flags, layouts in groups:
        ref = _reference(model_flags)
        assert ref["losses"][-1] < ref["losses"][0], "the reference run should learn"
        for label, flags in layouts.items():
            cases.append([*BASE, *model_flags, *flags])
            labels.append(f"{label} {' '.join(model_flags)}")
            refs.append(ref)
    results = run_multiprocess(_worker, world_size, args=(cases,), timeout_s=300)[0]
    for label, ref, got in zip(labels, refs, results):
        got = {
            k: ({n: torch.from_numpy(a) for n, a in v.items()} if isinstance(v, dict) else v) for k, v in got.items()
        }
        _assert_same_training(got, ref, label)


TP2 = ["--tensor-model-parallel-size", "2"]
TP2_SP = [*TP2, "--sequence-parallel"]
DP2 = []  # world 2, tp 1 -> dp 2 with half the microbatches each


def test_tp2_sp_and_dp2_match_single_process_tied_and_untied():
    _check(2, [([], {"tp=2": TP2, "tp=2 sp": TP2_SP, "dp=2": DP2}), (UNTIED, {"tp=2 sp": TP2_SP})])


@pytest.mark.slow
def test_full_grid_untied_and_model_variants():
    _check(
        2,
        [
            (UNTIED, {"tp=2": TP2, "dp=2": DP2}),
            (VARIANT, {"tp=2": TP2, "tp=2 sp": TP2_SP, "dp=2": DP2}),
            ([*VARIANT, *UNTIED], {"tp=2 sp": TP2_SP, "dp=2": DP2}),
        ],
    )


@pytest.mark.slow
def test_tp2_dp2_on_four_ranks():
    _check(4, [([], {"tp=2 dp=2": TP2, "tp=2 dp=2 sp": TP2_SP}), (UNTIED, {"tp=2 dp=2 sp": TP2_SP})])
