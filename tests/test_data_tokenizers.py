"""Tokenizers: Rust vs pure-Python byte-level BPE ids, lossless Unicode, SentencePiece, Null, HF, the factory."""

from __future__ import annotations

import random

import pytest
from data_assets import train_small_bpe, train_small_sentencepiece, varied_corpus

from megatron.model.config import padded_vocab_size
from megatron.tokenizer import TokenizerConfig, build_tokenizer, clean_text
from megatron.tokenizer.bpe_reference import byte_to_char
from megatron.tokenizer.build import model_vocab_size
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return train_small_bpe(str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="module")
def bpe(bpe_files):
    return GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="rust")


@pytest.fixture(scope="module")
def bpe_py(bpe_files):
    return GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="python")


def test_byte_table_is_a_bijection_onto_printable_characters():
    table = byte_to_char()
    assert len(set(table)) == 256
    assert all(c.isprintable() and not c.isspace() for c in table)


def test_rust_and_python_give_identical_ids_on_a_varied_corpus(bpe, bpe_py):
    corpus = varied_corpus(300, seed=7) + [
        "",
        " ",
        "   leading and trailing   ",
        "a\n\n\nb\t\tc \r\n",
        "x" * 500,
        "aaaaaaaaab" * 20,
        "'s's's'S",
        " ".join(chr(c) for c in range(0x20, 0x250)),
        "".join(chr(c) for c in range(0, 0x20)),
    ]
    assert bpe.tokenize_batch(corpus) == bpe_py.tokenize_batch(corpus)
    for text in corpus[:50]:
        assert bpe.tokenize(text) == bpe_py.tokenize(text)


def test_arbitrary_unicode_round_trips(bpe):
    rng = random.Random(3)
    for _ in range(200):  # random code points from every plane except surrogates
        chars = []
        for _ in range(rng.randint(1, 40)):
            c = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
            if 0xD800 <= c <= 0xDFFF:
                c = 0xFFFD
            chars.append(chr(c))
        text = "".join(chars)
        assert bpe.detokenize(bpe.tokenize(text)) == text
    for text in varied_corpus(100, seed=11):
        assert bpe.detokenize(bpe.tokenize(text)) == text


def test_lone_surrogates_become_replacement_characters(bpe, bpe_py):
    text = "a\ud800b \udfff c \ud83d\ude00"  # two lone surrogates and one valid pair (an emoji)
    assert clean_text(text) == "a\ufffdb \ufffd c 😀"
    for tok in (bpe, bpe_py):
        assert tok.detokenize(tok.tokenize(text)) == "a\ufffdb \ufffd c 😀"


def test_literal_eod_text_is_ordinary_text(bpe):
    ids = bpe.tokenize("x <|endoftext|> y")
    assert bpe.eod not in ids
    assert bpe.detokenize(ids) == "x <|endoftext|> y"
    assert bpe.detokenize([bpe.eod]) == "<|endoftext|>"


def test_auto_backend_agrees_and_chooses(bpe_files, bpe):
    tok = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"])
    corpus = varied_corpus(400, seed=5)
    assert tok.backend == "auto"
    tok.calibration_chars = 4096  # calibrate on the first few documents
    assert tok.tokenize_batch(corpus) == bpe.tokenize_batch(corpus)
    assert tok.backend == "fast"  # checked against the reference on the first calibration_chars, then used


def test_sentencepiece_round_trip_up_to_normalisation(tmp_path):
    files = train_small_sentencepiece(str(tmp_path))
    tok = build_tokenizer(
        TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files["tokenizer_model"])
    )
    assert tok.eod == tok.sp.eos_id() == 2 and tok.pad == 3
    for text in varied_corpus(50, seed=9):
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        # the model's own normaliser (NFKC, whitespace folding; its "▁" spelling of spaces written back as " ")
        normalised = tok.sp.Normalize(text).replace("\u2581", " ").strip(" ")
        assert tok.detokenize(ids) == normalised


def test_sentencepiece_identity_normalisation_is_lossless_up_to_spaces(tmp_path):
    files = train_small_sentencepiece(str(tmp_path), normalization="identity")
    tok = build_tokenizer(
        TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files["tokenizer_model"])
    )
    for text in ["héllo wörld 😀 日本語", "x = f(y) + 3.5", "Ελληνικά and русский"]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tok.vocab_size == 101 and tok.eod == 100  # Megatron's: ids 0..99, then the end-of-document id
    assert model_vocab_size("NullTokenizer", 100) == 101 and model_vocab_size("GPT2BPETokenizer", 100) == 100
    assert tok.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="integer"):
        tok.tokenize("hello")


def test_huggingface_tokenizer_json_offline(tmp_path, bpe_files):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    t = Tokenizer(models.BPE.from_file(bpe_files["vocab_file"], bpe_files["merge_file"]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert tok.eod == 0
    assert tok.detokenize(tok.tokenize("héllo 😀")) == "héllo 😀"


def test_huggingface_by_name_needs_transformers_or_cache():
    try:
        import transformers  # noqa: F401

        match = "not available offline"
    except ImportError:
        match = "transformers"
    with pytest.raises(ValueError, match=match):
        build_tokenizer(
            TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="no-such-org/no-such-model")
        )


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(tokenizer_type="Nope"), "not one of"),
        (dict(tokenizer_type="GPT2BPETokenizer"), "--vocab-file and --merge-file"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/v.json", merge_file="/no/m.txt"), "does not exist"),
        (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/no/x.model"), "does not exist"),
    ],
)
def test_bad_tokenizer_flags_give_clear_errors(config, match):
    with pytest.raises(ValueError, match=match):
        build_tokenizer(TokenizerConfig(**config))


def test_build_tokenizer_accepts_any_config_object(bpe_files):
    class Args:
        tokenizer_type = "GPT2BPETokenizer"
        vocab_file = bpe_files["vocab_file"]
        merge_file = bpe_files["merge_file"]

    tok = build_tokenizer(Args())
    assert tok.vocab_size == bpe_files["vocab_size"]
    assert padded_vocab_size(tok.vocab_size, divisible_by=128, tensor_parallel_size=2) % 256 == 0
