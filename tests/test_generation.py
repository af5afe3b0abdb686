"""Text generation: the KV-cache path equals recomputing the whole sequence (logits within 1e-5 fp32, tokens
identical, greedy and sampled), the training forward is untouched by it, sampling honours its settings, and
``tools/generate.py`` prints one JSON object from a checkpoint or one error line (exit 2) for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from data_assets import tool, train_small_bpe
from model_configs import tiny_config

from megatron.checkpoint_repartition import write_model_checkpoint
from megatron.generation import SamplingConfig, generate, load_for_generation, model_from_state, next_token
from megatron.model import build_gpt_model
from megatron.model.kv_cache import KVCache
from megatron.tokenizer.build import TokenizerConfig
from megatron.tokenizer.recorded import tokenizer_sources

torch.set_num_threads(1)
TOL = 1e-5  # fp32; only the attention's summation order differs between the two paths

VARIANTS = {
    "gpt2": dict(),
    "llama-gqa": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False),
    # the model variants that change the attention: RoPE on half of each head's channels, q/k norms
    "rope-partial-qknorm": dict(position_embedding_type="rope", rotary_percent=0.5, qk_layernorm=True),
}


def _model(variant: str, **kw):
    config = tiny_config(max_position_embeddings=32, init_method_std=0.3, **{**VARIANTS[variant], **kw})
    return build_gpt_model(config, seed=7).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_logits_equal_full_recomputation(variant: str) -> None:
    model = _model(variant)
    tokens = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)  # [s, b, V]
        cache = KVCache(20)
        pieces = [model(tokens[:, :7], kv_cache=cache)]  # a prompt, then one token at a time, then a run of 3
        pieces += [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(7, 17)]
        pieces.append(model(tokens[:, 17:20], kv_cache=cache))
    cached = torch.cat(pieces)
    assert cache.length == 20
    assert (cached - full).abs().max().item() <= TOL
    with torch.no_grad():  # the prompt pass from an empty cache is the training computation, bit for bit
        assert torch.equal(pieces[0], model(tokens[:, :7]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_generation_equals_recomputation(variant: str) -> None:
    model = _model(variant)
    prompt = [5, 17, 3, 99, 42]
    for sampling in (SamplingConfig(max_new_tokens=12, temperature=0), SamplingConfig(12, 0.9, 20, 0.8, seed=3)):
        cached = generate(model, prompt, sampling)
        assert cached == generate(model, prompt, sampling, use_cache=False)
        assert len(cached) == 12
    greedy = generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0))
    assert len(set(greedy)) > 1, "a degenerate model proves little"
    seeded = SamplingConfig(12, 0.9, seed=4)
    assert generate(model, prompt, seeded) == generate(model, prompt, seeded)


def test_sampling_settings() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, SamplingConfig(temperature=0), None) == 1
    assert {next_token(logits, SamplingConfig(top_k=2), gen) for _ in range(200)} == {1, 2}
    # top-p 0.5: token 1 alone has ~49% of the mass, tokens 1 and 2 reach it
    assert {next_token(logits, SamplingConfig(top_p=0.5), gen) for _ in range(200)} == {1, 2}
    assert next_token(logits, SamplingConfig(top_p=0.01), gen) == 1
    model = _model("gpt2")
    greedy = generate(model, [1, 2], SamplingConfig(max_new_tokens=8, temperature=0))
    stop = greedy[2]
    out = generate(model, [1, 2], SamplingConfig(max_new_tokens=8, temperature=0), eod=stop)
    assert out == greedy[: greedy.index(stop) + 1]  # ends at the first end-of-document id, kept
    assert max(generate(model, [1, 2], SamplingConfig(max_new_tokens=20), vocab_size=10)) < 10


def _checkpoint(tmp_path, *, with_tokenizer: bool):
    tok = train_small_bpe(str(tmp_path / "tok"), vocab_size=300)
    config = tiny_config(vocab_size=300, max_position_embeddings=64, init_method_std=0.3)
    model = build_gpt_model(config, seed=3)
    full = {n: t[:300] if "word_embeddings" in n else t for n, t in model.state_dict().items()}
    record, files = tokenizer_sources(TokenizerConfig(**tok)) if with_tokenizer else (None, {})
    write_model_checkpoint(tmp_path / "ckpt", config, full, tp=2, pp=2, tokenizer=record, tokenizer_files=files)
    return tmp_path / "ckpt", model.eval()


def test_generate_cli_json_from_sharded_checkpoint(tmp_path, capsys) -> None:
    ckpt, reference = _checkpoint(tmp_path, with_tokenizer=True)
    argv = ["--load", str(ckpt), "--prompt", "the quick brown fox", "--max-new-tokens", "6", "--device", "cpu"]
    assert tool("generate").main([*argv, "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tokenizer = load_for_generation(ckpt)
    assert out["prompt_ids"] == tokenizer.tokenize("the quick brown fox")
    want = generate(reference, out["prompt_ids"], SamplingConfig(max_new_tokens=6, temperature=0), eod=tokenizer.eod)
    assert out["generated_ids"] == want and out["text"] == tokenizer.detokenize(want)
    assert tool("generate").main([*argv, "--top-k", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("the quick brown fox")


def test_generate_cli_bad_input_is_one_line(tmp_path, capsys) -> None:
    ckpt, _ = _checkpoint(tmp_path, with_tokenizer=False)
    generate_tool = tool("generate")
    cases = {
        "records no tokenizer": ["--load", str(ckpt), "--prompt", "x"],
        "does not exist": ["--load", str(tmp_path / "none"), "--prompt", "x"],
        "--temperature=-1.0 must be >= 0": ["--load", str(ckpt), "--prompt", "x", "--temperature", "-1"],
    }
    for needle, argv in cases.items():
        assert generate_tool.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    model = model_from_state(tiny_config(), {n: t for n, t in build_gpt_model(tiny_config()).state_dict().items()})
    with pytest.raises(ValueError, match="positions"):
        generate(model, [1] * 10, SamplingConfig(max_new_tokens=10))


def test_training_run_records_its_tokenizer(tmp_path, capsys) -> None:
    import io

    from megatron import checkpoint_files as cf
    from megatron.arguments import parse_run_config
    from megatron.training import pretrain

    tok = train_small_bpe(str(tmp_path / "tok"), vocab_size=300)
    # trained with the per-document and attention variants; generation reads them from the checkpoint's model
    argv = [
        "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tok["vocab_file"],
        "--merge-file", tok["merge_file"], "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", "1", "--eval-iters", "0", "--lr", "1e-3", "--save", str(tmp_path / "ckpt"),
        "--reset-position-ids", "--reset-attention-mask", "--position-embedding-type", "rope",
        "--rotary-percent", "0.5", "--qk-layernorm",
    ]  # fmt: skip
    pretrain(parse_run_config(argv), stream=io.StringIO())
    manifest = cf.read_manifest(cf.iteration_dir(tmp_path / "ckpt", 1))
    assert {"tokenizer/vocab.json", "tokenizer/merges.txt"} <= set(manifest)
    model, _ = load_for_generation(tmp_path / "ckpt")
    assert model.config.qk_layernorm and model.config.rotary_dim == 4
    argv = ["--load", str(tmp_path / "ckpt"), "--prompt", "fox", "--max-new-tokens", "8", "--json"]
    outs = []
    for extra in ([], ["--no-kv-cache"]):
        assert tool("generate").main([*argv, *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert 1 <= len(outs[0]["generated_ids"]) <= 8 and max(outs[0]["generated_ids"]) < 300
    assert outs[0] == outs[1]  # the KV cache changes nothing (same seed, same draws)
