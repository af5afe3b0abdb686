"""Hugging Face export and import (``megatron.hf``, ``tools/checkpoint_convert.py --export-hf/--import-hf``).

Fixed before measuring: logits of the exported model (``transformers``) equal ours over the real vocabulary within
1e-4 (fp32); an imported model's logits equal the source's within 1e-4; export -> import is bit-exact; greedy
generation equals ``transformers``' greedy ``generate`` token for token; an import at tp = 2 / pp = 2 merges to
exactly the tp = 1 / pp = 1 import.  All models are tiny and random, built here; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from data_assets import tool, train_small_bpe
from model_configs import TINY, tiny_config

from megatron.kernels.triton_runtime import import_triton, triton_importable

# transformers imports triton; megatron.kernels must choose its mode first (the interpreter without CUDA), or the
# kernel tests that run after this module in the same session cannot
if triton_importable() and "triton" not in sys.modules:
    import_triton()
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from safetensors.torch import load_file  # noqa: E402

from megatron.arguments import parse_run_config  # noqa: E402
from megatron.checkpoint_repartition import read_full_model, write_model_checkpoint  # noqa: E402
from megatron.config.errors import ConfigError  # noqa: E402
from megatron.generation import SamplingConfig, generate, model_from_state  # noqa: E402
from megatron.hf import export_hf, import_hf  # noqa: E402
from megatron.hf.convert import fold_layernorm_1p, layout_for  # noqa: E402
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
    # --openai-gelu is GPT-2's gelu_new; --apply-layernorm-1p is folded into the norm weights on export
    "gpt2-tanh-gelu-1p": dict(vocab_size=VOCAB, num_query_groups=4, openai_gelu=True, apply_layernorm_1p=True),
    "gpt2-relu2": dict(vocab_size=VOCAB, num_query_groups=4, squared_relu=True, fp32_residual_connection=True),
}
ACTIVATION = {"gpt2-tied": "gelu", "gpt2-tanh-gelu-1p": "gelu_new", "gpt2-relu2": "relu2"}


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
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config.get("activation_function") == ACTIVATION.get(variant)
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
    folded, plain = fold_layernorm_1p(full, config)  # a 1p model comes back as the plain model it equals
    assert plain.apply_layernorm_1p is False and (plain == config) == (not config.apply_layernorm_1p)
    assert back.keys() == full.keys() and all(torch.equal(back[n], folded[n]) for n in full)
    args = {k: v for k, v in common["model_args"].items() if k != "padded_vocab_size"}  # follows tp
    assert GPTConfig(**args) == plain
    prompt = [3, 14, 15, 92, 65]
    ours_greedy = generate(model_from_state(config, full), prompt, SamplingConfig(max_new_tokens=10, temperature=0))
    assert ours_greedy == _greedy_hf(hf, prompt, 10)


def _hf_model(kind: str):
    torch.manual_seed(5)
    if kind.startswith("gpt2"):  # "gpt2": the exact GeLU; "gpt2-gelu_new": the released GPT-2's tanh GeLU
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2, n_head=4, activation_function="gelu",
            initializer_range=0.3, layer_norm_epsilon=1e-5,
        )  # fmt: skip
        if kind == "gpt2-gelu_new":
            cfg.activation_function = "gelu_new"
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=24, rope_theta=1000.0, initializer_range=0.3,
        tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-gelu_new", "llama"])
def test_import_of_a_transformers_model(kind: str, tmp_path) -> None:
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    _, config = import_hf(tmp_path / "hf", tmp_path / "tp1", seq_length=16)
    assert config.openai_gelu == (kind == "gpt2-gelu_new")
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
    relu = _hf_model("gpt2")
    relu.config.activation_function = "relu"
    relu.save_pretrained(tmp_path / "relu")
    assert "activation_function='relu'" in _refused(["--import-hf", str(tmp_path / "relu"), "--save", "x"], capsys)
    llama = _hf_model("llama")
    llama.save_pretrained(tmp_path / "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    cfg.pop("rope_parameters", None)
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    assert "rotary scaling" in _refused(["--import-hf", str(tmp_path / "llama"), "--save", "x"], capsys)
    cfg["rope_scaling"] = None
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    assert "partial_rotary_factor=0.5" in _refused(["--import-hf", str(tmp_path / "llama"), "--save", "x"], capsys)
    llama.config.num_key_value_heads = 4  # config.json no longer fits the k/v weights
    llama.config.save_pretrained(tmp_path / "llama")
    assert "do not match config.json" in _refused(["--import-hf", str(tmp_path / "llama"), "--save", "x"], capsys)
    # our side: a model neither layout expresses, named in one line (exit 2), nothing written
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    refusals = {
        "LayerNorm with rotary positions": dict(position_embedding_type="rope"),
        "q/k layer norms (--qk-layernorm)": dict(llama, qk_layernorm=True),
        "partial rotary embeddings (--rotary-percent 0.5)": dict(llama, rotary_percent=0.5),
        "no position embeddings (--position-embedding-type none)": dict(position_embedding_type="none"),
        "a squared-ReLU MLP with rotary positions": dict(llama, swiglu=False, squared_relu=True),
    }
    for i, (needle, kw) in enumerate(refusals.items()):
        config = tiny_config(**kw)
        full = {n: t[:VOCAB] if "word_embeddings" in n else t for n, t in build_gpt_model(config).state_dict().items()}
        write_model_checkpoint(tmp_path / f"ckpt{i}", config, full)
        err = _refused(["--load", str(tmp_path / f"ckpt{i}"), "--export-hf", str(tmp_path / f"out{i}")], capsys)
        assert needle in err and not (tmp_path / f"out{i}").exists(), err


def test_a_config_field_no_layout_maps_is_refused_unless_at_its_default() -> None:
    """The rule that keeps a future GPTConfig field from being exported silently wrong: every field a layout does
    not map must hold its default.  A subclass with a new field stands in for a future GPTConfig."""
    from megatron.hf import gpt2_layout, llama_layout
    from megatron.hf.convert import TRAINING_FIELDS

    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    for layout in (gpt2_layout, llama_layout):
        assert layout.MAPPED_FIELDS <= fields  # no stale or misspelt names
    assert set(TRAINING_FIELDS) <= fields
    future = dataclasses.make_dataclass(
        "FutureGPTConfig", [("sliding_window", int, dataclasses.field(default=0))], bases=(GPTConfig,), frozen=True
    )
    gpt2 = {**TINY, "num_query_groups": 4}
    for kw in (gpt2, dict(TINY, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)):
        assert layout_for(future(**kw)) is not None  # at its default: exported
        with pytest.raises(ConfigError, match="--sliding-window=64, which the (gpt2|llama) layout does not map"):
            layout_for(future(**kw, sliding_window=64))
    # current fields caught by the same rule, in their own words (no layout's unsupported() names them)
    with pytest.raises(ConfigError, match=r"q/k layer norms \(--qk-layernorm\)"):
        layout_for(tiny_config(**gpt2, qk_layernorm=True))  # GPT-2 layout
    # a training setting and the folded 1p are not features: exported
    settings = dict(gpt2, hidden_dropout=0.3, fp32_residual_connection=True, apply_layernorm_1p=True)
    assert layout_for(tiny_config(**settings))
