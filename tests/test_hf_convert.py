"""Hugging Face export and import (``megatron.hf``, ``tools/checkpoint_convert.py --export-hf/--import-hf``).

Fixed before measuring: logits of the exported model (``transformers``) equal ours over the real vocabulary within
1e-4 (fp32); an imported model's logits equal the source's within 1e-4; export -> import is bit-exact; greedy
generation equals ``transformers``' greedy ``generate`` token for token; an import at tp = 2 / pp = 2 merges to
exactly the tp = 1 / pp = 1 import.  All models are tiny and random, built here; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from data_assets import tool, train_small_bpe
from model_configs import tiny_config

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from safetensors.torch import load_file  # noqa: E402

from megatron.arguments import parse_run_config  # noqa: E402
from megatron.checkpoint_repartition import read_full_model, write_model_checkpoint  # noqa: E402
from megatron.generation import SamplingConfig, generate, model_from_state  # noqa: E402
from megatron.hf import export_hf, import_hf  # noqa: E402
from megatron.model import GPTConfig, build_gpt_model  # noqa: E402
from megatron.model.config import model_flags  # noqa: E402
from megatron.tokenizer.build import TokenizerConfig  # noqa: E402
from megatron.tokenizer.recorded import tokenizer_sources  # noqa: E402

torch.set_num_threads(1)
TOL = 1e-4
VOCAB = 100  # padded to 104 in our tables (make_vocab_size_divisible_by 8)

OURS = {
    "gpt2-tied": dict(vocab_size=VOCAB, num_query_groups=4, norm_epsilon=1e-6),
    "llama-gqa-untied": dict(
        vocab_size=VOCAB,
        position_embedding_type="rope",
        rotary_base=500,
        normalization="RMSNorm",
        swiglu=True,
        ffn_hidden_size=48,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    ),
    "llama-biases-tied": dict(
        vocab_size=VOCAB, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, kv_channels=12
    ),
}


def _our_model(variant: str):
    config = tiny_config(max_position_embeddings=32, init_method_std=0.3, **OURS[variant])
    model = build_gpt_model(config, seed=11).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 initial values, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    full = {n: t[:VOCAB].clone() if t.shape[0] == 104 else t for n, t in model.state_dict().items()}
    return config, model, full


def _tokens(b: int = 2, s: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(1))


def _greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("variant", list(OURS))
def test_export_logits_match_and_import_round_trip_is_exact(variant: str, tmp_path) -> None:
    config, model, full = _our_model(variant)
    write_model_checkpoint(tmp_path / "ckpt", config, full, tp=2, pp=2)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    tables = ("wte.weight", "embed_tokens.weight", "lm_head.weight")
    rows = {n: t.shape[0] for n, t in tensors.items() if n.endswith(tables)}
    assert set(rows.values()) == {VOCAB} and ("lm_head.weight" in rows) == (not config.tied_embeddings)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.dtype == torch.float32
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens).transpose(0, 1)[..., :VOCAB]
        theirs = hf(tokens).logits
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() <= TOL
    import_hf(tmp_path / "hf", tmp_path / "back")
    back, common = read_full_model(tmp_path / "back")
    assert back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)
    args = {k: v for k, v in common["model_args"].items() if k != "padded_vocab_size"}  # follows tp
    assert GPTConfig(**args) == config
    prompt = [3, 14, 15, 92, 65]
    ours_greedy = generate(model_from_state(config, full), prompt, SamplingConfig(max_new_tokens=10, temperature=0))
    assert ours_greedy == _greedy_hf(hf, prompt, 10)


def _hf_model(kind: str):
    torch.manual_seed(5)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2, n_head=4, activation_function="gelu",
            initializer_range=0.3, layer_norm_epsilon=1e-5,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=24, rope_theta=1000.0, initializer_range=0.3,
        tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_import_of_a_transformers_model(kind: str, tmp_path) -> None:
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    _, config = import_hf(tmp_path / "hf", tmp_path / "tp1", seq_length=16)
    import_hf(tmp_path / "hf", tmp_path / "tp2pp2", tp=2, pp=2, seq_length=16)
    full, common = read_full_model(tmp_path / "tp1")
    split, _ = read_full_model(tmp_path / "tp2pp2")
    assert split.keys() == full.keys() and all(torch.equal(split[n], full[n]) for n in full)
    assert common["iteration"] == 0 and not common["has_optimizer"] and config.seq_length == 16
    # the flags the import prints build this config
    argv = [*model_flags(config), "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1"]
    assert parse_run_config([*argv, "--train-iters", "1", "--lr", "1e-3"]).model == config
    model = model_from_state(config, full)
    tokens = _tokens(s=20)
    with torch.no_grad():
        ours = model(tokens).transpose(0, 1)[..., :VOCAB]
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= TOL
    prompt = [7, 1, 8, 2]
    greedy = generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0))
    assert greedy == _greedy_hf(hf, prompt, 12) and len(set(greedy)) > 1
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # model.safetensors.index.json + shards
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "sharded", tmp_path / "from_shards", seq_length=16)
    sharded, _ = read_full_model(tmp_path / "from_shards")
    assert sharded.keys() == full.keys() and all(torch.equal(sharded[n], full[n]) for n in full)


def test_tokenizer_files_travel_and_load_in_transformers(tmp_path) -> None:
    tok = train_small_bpe(str(tmp_path / "tok"), vocab_size=300)
    config = tiny_config(vocab_size=300, max_position_embeddings=32, num_query_groups=4)
    full = {n: t[:300] if "word_embeddings" in n else t for n, t in build_gpt_model(config).state_dict().items()}
    record, files = tokenizer_sources(TokenizerConfig(**tok))
    write_model_checkpoint(tmp_path / "ckpt", config, full, tokenizer=record, tokenizer_files=files)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0  # <|endoftext|>
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the quick brown fox jumps"
    from megatron.tokenizer.build import build_tokenizer

    assert hf_tok(text)["input_ids"] == build_tokenizer(TokenizerConfig(**tok)).tokenize(text)
    import_hf(tmp_path / "hf", tmp_path / "back")
    _, common = read_full_model(tmp_path / "back")
    assert common["tokenizer"] == record


def _refused(argv: list[str], capsys) -> str:
    assert tool("checkpoint_convert").main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_unsupported_models_are_refused_with_one_line(tmp_path, capsys) -> None:
    transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "bert"
    )
    err = _refused(["--import-hf", str(tmp_path / "bert"), "--save", str(tmp_path / "x")], capsys)
    assert "model_type 'bert'" in err
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert "model_type 'mistral'" in _refused(["--import-hf", str(tmp_path / "mistral"), "--save", "x"], capsys)
    gelu_new = _hf_model("gpt2")
    gelu_new.config.activation_function = "gelu_new"
    gelu_new.save_pretrained(tmp_path / "gelu_new")
    assert "gelu_new" in _refused(["--import-hf", str(tmp_path / "gelu_new"), "--save", "x"], capsys)
    llama = _hf_model("llama")
    llama.save_pretrained(tmp_path / "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    cfg.pop("rope_parameters", None)
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    assert "rotary scaling" in _refused(["--import-hf", str(tmp_path / "llama"), "--save", "x"], capsys)
    llama.config.num_key_value_heads = 4  # config.json no longer fits the k/v weights
    llama.config.save_pretrained(tmp_path / "llama")
    assert "do not match config.json" in _refused(["--import-hf", str(tmp_path / "llama"), "--save", "x"], capsys)
    # our side: a model neither layout expresses
    config = tiny_config(position_embedding_type="rope", normalization="LayerNorm")
    full = {n: t[:VOCAB] if "word_embeddings" in n else t for n, t in build_gpt_model(config).state_dict().items()}
    write_model_checkpoint(tmp_path / "ckpt", config, full)
    err = _refused(["--load", str(tmp_path / "ckpt"), "--export-hf", str(tmp_path / "out")], capsys)
    assert "LayerNorm with rotary positions" in err
