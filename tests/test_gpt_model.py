"""GPT model: stages in sequence equal the whole model; initialisation is layout-independent (shard == slice)."""

from __future__ import annotations

import pytest
import torch
from model_configs import tiny_config

from megatron.config.errors import ConfigError
from megatron.model import GPTConfig, build_gpt_model, build_gpt_stages, stage_layer_ranges
from megatron.parallel.tensor_parallel import TPContext, is_tensor_parallel, merge_shards, shard_tensor
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

torch.set_num_threads(1)


def tiny(**kw) -> GPTConfig:
    return tiny_config(**{"num_layers": 3, **kw})


VARIANTS = {
    "gpt2-tied": dict(),
    "untied": dict(untie_embeddings_and_output_weights=True),
    "llama-like": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False),
    "gqa1-untied-rope": dict(
        num_query_groups=1, position_embedding_type="rope", untie_embeddings_and_output_weights=True
    ),
}


def _batch(cfg: GPTConfig, b: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stages_in_sequence_equal_whole_model(variant: str) -> None:
    cfg = tiny(**VARIANTS[variant])
    tokens, labels = _batch(cfg)
    whole = build_gpt_model(cfg, seed=7)
    loss = whole(tokens, labels)
    loss.mean().backward()

    stages = build_gpt_stages(cfg, 2, seed=7, allow_padding=True)  # 3 layers over 2 stages: 2 + 1
    assert [s.layer_range for s in stages] == [range(0, 2), range(2, 3)]
    hidden = stages[0](tokens)
    boundary = hidden.detach().requires_grad_()  # what the pipeline would send
    staged_loss = stages[1](boundary, labels)
    assert torch.equal(loss, staged_loss)
    staged_loss.mean().backward()
    hidden.backward(boundary.grad)

    whole_grads = {n: p.grad for n, p in whole.named_parameters()}
    seen = set()
    for stage in stages:
        for local, p in stage.named_parameters():
            name = stage.global_name(local)
            if getattr(p, "shared_embedding", False):
                continue  # the tied copy on the last stage: summed below
            assert torch.equal(p.detach(), dict(whole.named_parameters())[name].detach()), name
            seen.add(name)
            if name == "embedding.word_embeddings.weight" and cfg.tied_embeddings:
                total = p.grad + stages[1].output_layer.weight.grad  # the runtime's embedding grad all-reduce
                torch.testing.assert_close(total, whole_grads[name], rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(p.grad, whole_grads[name]), name
    assert seen == set(whole_grads)


def test_stage_split_flags() -> None:
    assert stage_layer_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_ranges(8, 3, first=2, last=2) == [range(0, 2), range(2, 6), range(6, 8)]
    assert stage_layer_ranges(7, 3, allow_padding=True) == [range(0, 3), range(3, 6), range(6, 7)]
    with pytest.raises(ConfigError, match="allow-padding"):
        stage_layer_ranges(7, 3)


def test_uneven_stages_with_first_and_last_equal_whole_model() -> None:
    cfg = tiny(num_layers=5, untie_embeddings_and_output_weights=True)
    tokens, labels = _batch(cfg)
    whole = build_gpt_model(cfg, seed=1)
    ref = whole(tokens, labels)
    stages = build_gpt_stages(cfg, 3, seed=1, first=1, last=1)
    assert [len(s.layers) for s in stages] == [1, 3, 1]
    x = tokens
    for s in stages[:-1]:
        x = s(x)
    assert torch.equal(stages[-1](x, labels), ref)


def _full_params(cfg: GPTConfig, tp_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor, merged from the shards of ``tp_size`` ranks built one after another."""
    ranks = [build_gpt_model(cfg, tp=TPContext(tp_size, r), seed=seed) for r in range(tp_size)]
    out = {}
    for name, p in ranks[0].named_parameters():
        shards = [dict(m.named_parameters())[name].detach() for m in ranks]
        if is_tensor_parallel(p) and tp_size > 1:
            out[name] = merge_shards(shards, dim=p.partition_dim, stride=p.partition_stride)
            for r, shard in enumerate(shards):  # shard == slice of the full tensor, exactly
                full = out[name]
                assert torch.equal(
                    shard,
                    shard_tensor(full, dim=p.partition_dim, tp_rank=r, tp_size=tp_size, stride=p.partition_stride),
                )
        else:
            for shard in shards[1:]:
                assert torch.equal(shard, shards[0]), name  # replicated parameters agree
            out[name] = shards[0]
    return out


@pytest.mark.parametrize("variant", ["gpt2-tied", "llama-like"])
def test_same_seed_same_model_whatever_tp(variant: str) -> None:
    cfg = tiny(**VARIANTS[variant])
    one, two = _full_params(cfg, 1, 5), _full_params(cfg, 2, 5)
    assert one.keys() == two.keys()
    v = cfg.vocab_size
    for name in one:
        a, b = one[name], two[name]
        if a.shape != b.shape:  # vocabulary tables: padding differs with tp (104 vs 112 rows)
            assert torch.equal(a[:v], b[:v]), name
            assert not a[v:].any() and not b[v:].any(), name
        else:
            assert torch.equal(a, b), name
    different_seed = _full_params(cfg, 1, 6)
    assert not torch.equal(different_seed["layers.0.mlp.linear_fc1.weight"], one["layers.0.mlp.linear_fc1.weight"])


def test_deferred_backward_through_whole_model_matches() -> None:
    cfg = tiny(**VARIANTS["llama-like"])
    tokens, labels = _batch(cfg)
    model = build_gpt_model(cfg, seed=2)
    model(tokens, labels).mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    store = WeightGradStore()
    bind_weight_grad_store(model, store)
    loss = model(tokens, labels).mean()
    with store.defer(0, 0):
        loss.backward()
    # B already accumulated the lookup's table gradient (see test_embedding_gradient_runs_in_b); the head's is W.
    assert model.embedding.word_embeddings.weight.grad is not None and store.pending()
    store.run(0, 0)
    for n, p in model.named_parameters():
        if n == "embedding.word_embeddings.weight":  # tied: the head's and the lookup's parts add in another order
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(p.grad, ref[n]), n


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(num_attention_heads=4, num_query_groups=3), "num-query-groups"),
        (dict(seq_length=64, max_position_embeddings=32), "max-position-embeddings"),
        (dict(hidden_size=30), "divisible by --num-attention-heads"),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(hidden_dropout=1.0), "hidden-dropout"),
    ],
)
def test_config_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny(**kw)


def test_tensor_parallel_size_must_divide_heads() -> None:
    with pytest.raises(ConfigError, match="tensor-model-parallel-size"):
        build_gpt_model(tiny(), tp=TPContext(4, 0))  # 2 query groups over 4 ranks
    assert tiny().padded_vocab_size(1) == 104 and tiny().padded_vocab_size(2) == 112


def _held_bytes(work: list, params) -> int:
    """Bytes of the distinct non-parameter storages the deferred W closures hold."""
    from zb_pipeline.runtime.activation_memory import storage_key, tensors_in

    found: list = []
    for fn in work:
        tensors_in(fn, found)
    skip = {storage_key(p)[0] for p in params}
    return sum(n for ptr, n in dict(storage_key(t) for t in found).items() if ptr not in skip)


@pytest.mark.parametrize("defer", [False, True])
def test_embedding_gradient_runs_in_b(defer: bool) -> None:
    """The first stage's embedding tables get their gradient in B: deferring it would hold the ``[s, b, h]`` output
    gradient until W (``defer_weight_grad=True`` restores that, with the same gradients)."""
    cfg = tiny(num_layers=2, untie_embeddings_and_output_weights=True)
    tokens, _ = _batch(cfg)
    (stage,) = build_gpt_stages(cfg, 2, stages=[0], seed=2)
    stage(tokens).square().sum().backward()
    ref = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    emb = stage.embedding
    for table in (emb.word_embeddings, emb.position_embeddings):
        table.defer_weight_grad = defer
    store, held = WeightGradStore(), []
    bind_weight_grad_store(stage, store)
    submit = store.submit
    store.submit = lambda work: (held.append(work), submit(work))[1]
    out = stage(tokens)  # [s, b, h]
    with store.defer(0, 0):
        out.square().sum().backward()
    landed = emb.word_embeddings.weight.grad is not None and emb.position_embeddings.weight.grad is not None
    assert landed is not defer
    held_after_b = _held_bytes(held, stage.parameters())
    store.run(0, 0)
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7)
    if defer:  # deferring holds at least the [s, b, h] output gradient (and the ids) until W
        stage.zero_grad(set_to_none=True)
        for table in (emb.word_embeddings, emb.position_embeddings):
            table.defer_weight_grad = False
        held.clear()
        with store.defer(0, 1):
            stage(tokens).square().sum().backward()
        assert held_after_b - _held_bytes(held, stage.parameters()) >= out.numel() * out.element_size()
        store.run(0, 1)
