"""The fast paths of the data pipeline give exactly what their references give.

- `GPT2PreTokenizer.split` (stdlib `re` with derived BMP classes) == `regex.findall(GPT2_SPLIT_PATTERN)`;
- the "fast" byte-level BPE (cached pre-tokens, Rust or Python merges for new ones) == the reference == Rust;
- `tokenize_flat` == `tokenize_batch` with the end-of-document id appended, for every backend;
- the C++ `SampleReader` behind `GPTDataset.tokens(k)` == the Python loop, for every token dtype and both
  document-index dtypes, and it rejects out-of-range indices.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import regex
from data_assets import train_small_bpe, varied_corpus

from megatron.data import helpers
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron.tokenizer.bpe_fast import GPT2PreTokenizer
from megatron.tokenizer.bpe_reference import GPT2_SPLIT_PATTERN
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

needs_cpp = pytest.mark.skipif(not helpers.HAVE_CPP, reason="megatron.data._helpers_cpp not built")

EDGE_TEXTS = [
    "",
    " ",
    "   leading and trailing   ",
    "a\n\n\nb\t\tc \r\n",
    "x  \nfoo\n    bar(1, 2)\n\n\tbaz's we'll 'LL 'd'",
    "'s's's'S",
    "1,234.5e-6 ½ Ⅻ ² ٣ 三",
    "\u00a0\u2028\u2029\u3000\u1680\u180e\u200b\x1c\x1d\x85 mixed\u00a0spaces",
    " ".join(chr(c) for c in range(0x20, 0x250)),
    "".join(chr(c) for c in range(0, 0x20)),
    "emoji 😀🚀 and astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠀀𠀁 letters",
]


def random_text(rng: random.Random, n: int, astral: bool) -> str:
    chars = []
    for _ in range(n):
        pick = rng.random()
        if pick < 0.4:
            c = rng.randint(0x20, 0x7E)
        elif pick < 0.55:
            c = rng.choice([0x20, 0x20, 0x0A, 0x09, 0x27, 0x0D, 0xA0, 0x3000])
        elif pick < 0.9 or not astral:
            c = rng.randint(0x80, 0xFFFF)
        else:
            c = rng.randint(0x10000, 0x10FFFF)
        if 0xD800 <= c <= 0xDFFF:
            c = 0xFFFD
        chars.append(chr(c))
    return "".join(chars)


def test_fast_split_equals_the_regex_split_on_random_unicode():
    split = GPT2PreTokenizer().split
    reference = regex.compile(GPT2_SPLIT_PATTERN).findall
    rng = random.Random(0)
    texts = EDGE_TEXTS + [random_text(rng, rng.randint(1, 300), astral=i % 3 == 0) for i in range(600)]
    texts += varied_corpus(200, seed=3)
    for text in texts:
        assert split(text) == reference(text), repr(text)
    # every BMP code point (but surrogates), each between letters and after a space
    bmp = [chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF]
    for i in range(0, len(bmp), 512):
        text = "".join(f"a{c} {c}'s" for c in bmp[i : i + 512])
        assert split(text) == reference(text)


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return train_small_bpe(str(tmp_path_factory.mktemp("bpe")))


def corpus() -> list[str]:
    return varied_corpus(300, seed=17) + EDGE_TEXTS + ["x" * 500, "aaaaaaaaab" * 20]


@pytest.mark.parametrize("python_merges", [False, True])
def test_fast_backend_gives_the_reference_ids(bpe_files, python_merges):
    fast = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="fast")
    if python_merges:
        fast._fast._cache.encode_piece = fast._fast._encode_piece_python
    ref = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="python")
    rust = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="rust")
    texts = corpus()
    expected = ref.tokenize_batch(texts)
    assert fast.tokenize_batch(texts) == expected  # cold cache
    assert fast.tokenize_batch(texts) == expected  # warm cache
    assert rust.tokenize_batch(texts) == expected
    assert [fast.tokenize(t) for t in texts[:40]] == expected[:40]


def test_fast_backend_with_a_full_cache_still_encodes_new_pieces(bpe_files):
    fast = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="fast")
    ref = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="python")
    fast._fast._cache.limit = 10
    texts = corpus()
    assert fast.tokenize_batch(texts) == ref.tokenize_batch(texts)
    assert len(fast._fast._cache) == 10


@pytest.mark.parametrize("backend", ["auto", "fast", "rust", "python"])
def test_tokenize_flat_matches_tokenize_batch(bpe_files, backend):
    tok = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend=backend)
    texts = corpus()
    ids = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"], backend="python").tokenize_batch(texts)
    flat, lengths = tok.tokenize_flat(texts, tok.eod)
    assert lengths.tolist() == [len(d) + 1 for d in ids]
    assert flat.tolist() == [t for d in ids for t in [*d, tok.eod]]
    flat, lengths = tok.tokenize_flat(texts)
    assert lengths.tolist() == [len(d) for d in ids] and flat.tolist() == [t for d in ids for t in d]


def test_auto_backend_stops_when_the_fast_encoder_disagrees(bpe_files):
    tok = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"])
    tok._fast.encode_batch = lambda texts: [[0] for _ in texts]  # a broken fast path must not write data
    with pytest.raises(RuntimeError, match="disagree"):
        tok.tokenize_batch(corpus())


def build_dataset(tmp_path, dtype, n_docs: int, seq_length: int, num_samples: int, seed: int = 0) -> GPTDataset:
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / f"d_{np.dtype(dtype).name}")
    info = np.iinfo(dtype)
    with IndexedDatasetWriter(prefix, dtype) as w:
        for _ in range(n_docs):
            n = int(rng.integers(0, 3 * seq_length))
            w.add_document(rng.integers(max(info.min, -1000), min(info.max, 10**6), size=n, endpoint=True))
    return GPTDataset(IndexedDataset(prefix), split_name="train", document_range=(0, n_docs), seq_length=seq_length,
                      seed=seed, num_samples=num_samples, cache_dir=str(tmp_path / "cache"))  # fmt: skip


@needs_cpp
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64])
def test_cpp_sample_reader_equals_the_python_loop(tmp_path, dtype):
    gds = build_dataset(tmp_path, dtype, n_docs=60, seq_length=17, num_samples=700)  # several epochs
    assert gds._reader is not None
    for k in range(len(gds)):
        got = gds.tokens(k)
        assert got.dtype == np.int64 and got.shape == (18,)
        np.testing.assert_array_equal(got, gds._tokens_python(k))
    ks = np.random.default_rng(1).integers(0, len(gds), size=300)
    np.testing.assert_array_equal(gds._reader.get_batch(ks), np.stack([gds._tokens_python(int(k)) for k in ks]))
    for bad in (-1, len(gds)):
        with pytest.raises(IndexError):
            gds.tokens(bad)
    with pytest.raises(IndexError):  # beyond the shuffle index: checked in C++ too
        gds._reader.get(gds._reader.num_samples)


@needs_cpp
def test_cpp_sample_reader_with_an_int64_document_index(tmp_path):
    gds = build_dataset(tmp_path, np.uint16, n_docs=40, seq_length=9, num_samples=200, seed=2)
    reader = helpers.sample_reader(
        gds._tokens, gds._offsets, gds._lengths, gds.document_index.astype(np.int64), gds.sample_index,
        gds.shuffle_index, gds.seq_length + 1,
    )  # fmt: skip
    for k in range(len(gds)):
        np.testing.assert_array_equal(reader.get(k), gds._tokens_python(k))


def test_python_fallback_when_cpp_is_off(tmp_path):
    gds = build_dataset(tmp_path, np.int32, n_docs=30, seq_length=11, num_samples=50, seed=3)
    slow = GPTDataset(gds.indexed, split_name="train", document_range=(0, 30), seq_length=11, seed=3,
                      num_samples=50, cache_dir=str(tmp_path / "cache"), use_cpp=False)  # fmt: skip
    assert slow._reader is None
    for k in range(50):
        np.testing.assert_array_equal(slow.tokens(k), gds.tokens(k))
