"""Tensor parallelism on gloo: TP=2 gives the TP=1 model's loss and first-step gradients (with and without sequence
parallelism, tied and untied), and the B/W split stays exact under TP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from model_configs import TINY

from megatron.config.documents import DocumentMaskConfig
from megatron.data.document_masks import apply_document_masks, model_inputs
from megatron.model import GPTConfig, build_gpt_model
from megatron.parallel.tensor_parallel import (
    TPContext,
    allreduce_sequence_parallel_grads,
    is_tensor_parallel,
    merge_shards,
    vocab_parallel_cross_entropy,
)
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store
from zb_pipeline.testing.harness import run_multiprocess

SEED = 11
BASE = TINY
CASES = {
    "tied": (dict(), False),
    "tied-sp": (dict(), True),
    "untied-sp-llama": (
        dict(
            untie_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
        ),
        True,
    ),
    "untied": (dict(untie_embeddings_and_output_weights=True, num_query_groups=4), False),
    # model variants, on packed documents (explicit attention mask and position ids; tests/test_document_masks.py)
    "variants-docs-sp": (
        dict(
            position_embedding_type="rope",
            rotary_percent=0.5,
            qk_layernorm=True,
            apply_layernorm_1p=True,
            squared_relu=True,
        ),
        True,
    ),
}
DOCUMENT_CASES = {"variants-docs-sp"}


def _batch(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def _document_inputs(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Position ids and attention mask of ``tokens`` packed from documents ended by token 0 (every 5th token)."""
    tokens = tokens.clone()
    tokens[:, 4::5] = 0
    config = DocumentMaskConfig(reset_position_ids=True, reset_attention_mask=True)
    fields = [apply_document_masks({"tokens": t, "loss_mask": torch.ones(t.shape)}, 0, config) for t in tokens]
    return model_inputs({k: torch.stack([f[k] for f in fields]) for k in ("position_ids", "document_ids")})


def _step(
    model: torch.nn.Module, cfg: GPTConfig, tp, store: WeightGradStore | None, documents: bool = False
) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    bind_weight_grad_store(model, store)
    tokens, labels = _batch(cfg)
    loss = model(tokens, labels, **(_document_inputs(tokens) if documents else {})).mean()
    if store is None:
        loss.backward()
    else:
        with store.defer(0, 0):
            loss.backward()
        store.run(0, 0)
        store.assert_empty()
    allreduce_sequence_parallel_grads(model.parameters(), tp)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _full_grads(model: torch.nn.Module, grads: dict, tp) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = grads[name]
        if is_tensor_parallel(p) and tp.tp_size > 1:
            parts = [torch.empty_like(g) for _ in range(tp.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=tp.tp_group)
            g = merge_shards(parts, dim=p.partition_dim, stride=p.partition_stride)
        out[name] = g
    return out


def _tp_worker(rank: int, world_size: int, case_names: list[str]) -> dict:
    tp = TPContext(world_size, rank, dist.group.WORLD)
    results = {}
    for name in case_names:
        kw, sp = CASES[name]
        cfg = GPTConfig(**{**BASE, **kw})
        model = build_gpt_model(cfg, tp=tp, sequence_parallel=sp, seed=SEED)
        docs = name in DOCUMENT_CASES
        loss, grads = _step(model, cfg, tp, None, docs)
        loss_split, grads_split = _step(model, cfg, tp, WeightGradStore(), docs)
        assert loss_split == loss
        for n in grads:  # B then W under TP (+SP): exact, except the tied table (two parts, another order)
            if n == "embedding.word_embeddings.weight" and cfg.tied_embeddings:
                torch.testing.assert_close(grads_split[n], grads[n], rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(grads_split[n], grads[n]), f"{name}: {n}"
        # numpy, not tensors: torch pickles tensors as shared memory that dies with the rank process
        results[name] = (loss, {n: g.numpy() for n, g in _full_grads(model, grads, tp).items()})
    return results


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_tp2_matches_tp1() -> None:
    names = list(CASES)
    per_rank = run_multiprocess(_tp_worker, 2, args=(names,), timeout_s=240)
    torch.set_num_threads(1)
    for name in names:
        kw, _ = CASES[name]
        cfg = GPTConfig(**{**BASE, **kw})
        ref_model = build_gpt_model(cfg, seed=SEED)
        ref_loss, ref = _step(ref_model, cfg, TPContext(), None, name in DOCUMENT_CASES)
        for rank in range(2):
            loss, grads = per_rank[rank][name]
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (name, loss, ref_loss)
            assert grads.keys() == ref.keys()
            for n, g in grads.items():
                g, r = torch.from_numpy(g), ref[n]
                if g.shape != r.shape:  # vocabulary tables: compare the real rows; padding rows get no gradient
                    v = cfg.vocab_size
                    assert not g[v:].any() and not r[v:].any(), (name, n)
                    g, r = g[:v], r[:v]
                assert _rel_err(g, r) <= 1e-5, (name, n, _rel_err(g, r))


def _ce_worker(rank: int, world_size: int) -> float:
    tp = TPContext(world_size, rank, dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 12, generator=gen)
    target = torch.randint(0, 10, (5, 3), generator=gen)
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab_size=10)
    loss.sum().backward()
    full = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full[..., :10].reshape(-1, 10), target.reshape(-1), reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss, ref.view(5, 3))
    torch.testing.assert_close(local.grad, full.grad.chunk(world_size, dim=-1)[rank])
    return loss.sum().item()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_vocab_parallel_cross_entropy_matches_torch(world_size: int) -> None:
    run_multiprocess(_ce_worker, world_size, timeout_s=120)
