"""tools/bench_torch_pipelining.py: torch's schedules on our blocks compute what a single process computes.

The peer comparison is only fair if torch.distributed.pipelining runs exactly our model: every torch schedule, on
2 gloo ranks, must give the per-microbatch losses of a single-process run of the same blocks bit for bit (same
kernels on the same microbatch shapes) and the same gradients up to accumulation order.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import bench_torch_pipelining as btp  # noqa: E402

TINY = btp.BenchModel(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, micro_batch=2)
GRAD_RTOL = 1e-5  # norm-wise relative error per parameter (accumulation order may differ)


def _max_rel_err(grads: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    assert sorted(grads) == sorted(ref)
    return max(float(np.linalg.norm(grads[k] - ref[k]) / max(np.linalg.norm(ref[k]), 1e-30)) for k in ref)


def _check_equivalence(m: int, linears: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    ref_losses, ref_grads = btp.reference_losses_and_grads(TINY, m)
    results = btp.torch_losses_and_grads(TINY, names, m, linears=linears)
    for name in names:
        losses, grads = results[name]
        assert losses == ref_losses, f"{name}: losses {losses} != reference {ref_losses}"
        err = _max_rel_err(grads, ref_grads)
        assert err <= GRAD_RTOL, f"{name}: gradient relative error {err:.2e} > {GRAD_RTOL}"


def test_every_torch_schedule_matches_single_process():
    names = btp.available_schedules()
    assert {"1f1b", "zbv"} <= set(names)
    _check_equivalence(4, "autograd", names)


@pytest.mark.slow
@pytest.mark.parametrize("linears", ["autograd", "deferrable"])
def test_every_torch_schedule_matches_single_process_m8(linears):
    _check_equivalence(8, linears, btp.available_schedules())


def test_autograd_linears_keep_the_forward_and_gradients():
    torch.set_num_threads(1)
    ours = btp.build_modules(TINY, [0], 1, linears="deferrable")[0]
    plain = btp.build_modules(TINY, [0], 1, linears="autograd")[0]
    tokens, labels = btp.make_batch(TINY, 1)
    loss_fn = btp.make_loss_fn(TINY)
    a, b = loss_fn(ours(tokens), labels), loss_fn(plain(tokens), labels)
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    for (name, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    # the swapped linears are plain autograd nodes: no custom Function in the graph
    out = plain(tokens)
    assert "DeferrableLinear" not in type(out.grad_fn).__name__


def test_stage_indices_layouts():
    assert [btp.stage_indices(r, 2, 1, "loop") for r in range(2)] == [[0], [1]]
    assert [btp.stage_indices(r, 2, 2, "loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [btp.stage_indices(r, 3, 2, "v") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(ValueError, match="placement"):
        btp.stage_indices(0, 2, 3, "v")


def test_bootstrap_ratio_and_summary():
    base = [1.0, 1.1, 0.9, 1.0, 1.05]
    fast = [t / 1.25 for t in base]
    ratio, lo, hi = btp.bootstrap_ratio_ci(fast, base)
    assert ratio == pytest.approx(1.25)
    assert lo <= ratio <= hi
    assert lo == pytest.approx(1.25) and hi == pytest.approx(1.25)  # every resample keeps the pairing
    rows = btp.summarize({"torch:1f1b": base, "torch:zbv": fast}, 1000, baseline="torch:1f1b")
    by = {r["schedule"]: r for r in rows}
    assert by["torch:1f1b"]["tokens_per_s"] == pytest.approx(1000 / 1.0)
    assert by["torch:zbv"]["ratio"] == pytest.approx(1.25)
    with pytest.raises(ValueError):
        btp.bootstrap_ratio_ci([], base)


def test_report_files(tmp_path):
    report = {
        "settings": {
            "model": asdict(TINY),
            "pp": 2,
            "ms": [4],
            "linears": "autograd",
            "warmup": 1,
            "runs": 2,
            "threads_per_rank": 1,
            "backend": "gloo",
        },
        "results": {4: btp.summarize({"torch:1f1b": [0.5, 0.7]}, 512, baseline="torch:1f1b")},
        "environment": btp.environment(),
    }
    json_path, md_path = btp.write_report(report, str(tmp_path))
    md = open(md_path).read()
    assert "| 4 | torch:1f1b | 0.600 | 853 | 1.000" in md
    assert json.load(open(json_path))["results"]["4"][0]["runs"] == 2
