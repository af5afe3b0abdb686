"""Where the norms' weight gradients run (B or W) with the Triton kernels: measured, and checked against every
schedule's stated memory bound.

For first, middle and last GPT stages (one layer each; LayerNorm with GeLU, and RMSNorm with SwiGLU, fp32) the test
measures, as the profiler's saved-tensor accounting does, the bytes a microbatch holds after F (tensors saved in the
autograd graph) and after B (tensors held by the W work B queued), parameters excluded.  Those give each virtual
stage's memory deltas (``mem_f``, ``mem_b = after B - after F``, ``mem_w = -after B``); every registered schedule that
states a memory bound is generated for p in {2, 3, 4}, m in {p, 2p} with them, and its simulated per-rank peak is
compared with the bound (in microbatches of the rank's own ``mem_f``).

- With the selection's choice (``megatron.kernels.select.NORM_WEIGHT_GRAD_IN_W``: weight gradients in B) every bound
  holds.
- Deferring a norm's weight gradients holds its input and output gradient until W: a microbatch then holds more after
  B than after F and ZB-H1 (among others) exceeds its bound, for LayerNorm and for RMSNorm -- which is why the
  selection keeps both in B.  If a change makes deferring fit, this test says so (and the choice should flip).
"""

from __future__ import annotations

import pytest
import torch
from model_configs import tiny_config

import megatron.kernels.select as select
from megatron.config.kernels import KernelConfig
from megatron.kernels.triton_runtime import interpreter_problem
from megatron.model import build_gpt_stages
from zb_pipeline.runtime.activation_memory import graph_saved_tensors, storage_key, tensors_in
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.memory import peak_memory

pytestmark = [
    pytest.mark.skipif(interpreter_problem() is not None, reason=f"no Triton interpreter: {interpreter_problem()}"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter on CPU tensors (no CUDA)"),
]

torch.set_num_threads(1)
VARIANTS = {
    "LayerNorm": dict(),
    "RMSNorm": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False),
}
SHAPES = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p)]


def _distinct_bytes(tensors: list[torch.Tensor], params) -> int:
    skip = {storage_key(p)[0] for p in params}
    return sum(n for ptr, n in dict(storage_key(t) for t in tensors).items() if ptr not in skip)


def _held_after_f_and_b(kind: str) -> list[tuple[int, int]]:
    """(bytes after F, bytes after B) of the first, a middle and the last stage."""
    cfg = tiny_config(num_layers=3, **VARIANTS[kind])
    selection = select.resolve_kernels(KernelConfig(kernels="triton"), cfg, on_cuda=False)
    gen = torch.Generator().manual_seed(0)
    b, s = 2, cfg.seq_length
    out = []
    for index, stage in enumerate(build_gpt_stages(cfg, 3, seed=1)):
        select.apply_kernels(stage, selection)
        for p in stage.parameters():
            p.main_grad = torch.zeros(p.shape)
        store, held = WeightGradStore(), []
        bind_weight_grad_store(stage, store)
        store.on_submit.append(held.append)
        if index == 0:
            y = stage(torch.randint(0, cfg.vocab_size, (b, s), generator=gen))
        else:
            x = torch.randn(s, b, cfg.hidden_size, generator=gen, requires_grad=True)
            y = stage(x, torch.randint(0, cfg.vocab_size, (b, s), generator=gen)) if index == 2 else stage(x)
        saved: list[torch.Tensor] = []
        graph_saved_tensors(y, saved)
        after_f = _distinct_bytes(saved, stage.parameters())
        grad = torch.full(y.shape, 1.0 / y.numel()) if index == 2 else torch.randn(y.shape, generator=gen)
        with store.defer(0, 0):
            y.backward(grad)
        found: list[torch.Tensor] = []
        for work in held:
            tensors_in(work, found)
        out.append((after_f, _distinct_bytes(found, stage.parameters())))
        store.run(0, 0)
    return out


def _bounds_broken(held: list[tuple[int, int]]) -> list[str]:
    """Schedules (with their shape and rank) whose simulated peak under these holdings exceeds the stated bound."""
    broken = []
    for name in registry.available():
        spec = registry.get(name)
        for p, m in SHAPES:
            bound = spec.stated_memory_bound(p, m)
            if bound is None:
                continue
            chunks = spec.default_chunks
            S = p * chunks
            place = registry.placement_of(name, p, chunks)
            per_stage = [held[0 if st == 0 else 2 if st == S - 1 else 1] for st in range(S)]
            mem_f = [float(f) for f, _ in per_stage]
            costs = StageCosts.build(
                num_ranks=p, chunks=chunks, stage_to_rank=place, f=[1.0] * S, b=[1.0] * S, w=[1.0] * S,
                mem_f=mem_f, mem_b=[float(b - f) for f, b in per_stage], mem_w=[-float(b) for _, b in per_stage],
            )  # fmt: skip
            try:
                plan = registry.generate(name, p, m, costs=costs)
            except ValueError:  # a shape the schedule does not serve (dualpipev: m < 2p)
                continue
            peaks = peak_memory(plan, costs)
            for rank, peak in enumerate(peaks):
                unit = sum(f for st, f in enumerate(mem_f) if place[st] == rank)
                if peak > bound * unit * (1 + 1e-9):
                    broken.append(f"{name} p={p} m={m} rank {rank}: {peak / unit:.2f} > {bound:g}")
    return broken


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_norm_weight_grads_stay_in_b_because_deferring_breaks_the_bounds(kind: str, monkeypatch) -> None:
    chosen = _held_after_f_and_b(kind)
    assert _bounds_broken(chosen) == []
    monkeypatch.setitem(select.NORM_WEIGHT_GRAD_IN_W, kind, not select.NORM_WEIGHT_GRAD_IN_W[kind])
    other = _held_after_f_and_b(kind)
    assert all(b_other > b for (_, b), (_, b_other) in zip(chosen, other))  # the other choice defers: holds more
    assert all(b_other > f for f, b_other in other)  # ... more after B than after F, on every stage
    broken = _bounds_broken(other)
    assert any(line.startswith("zb-h1 ") for line in broken), broken
