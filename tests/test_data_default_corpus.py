"""tools/prepare_default_corpus.py: the standard library as a corpus, built once and reused."""

from __future__ import annotations

import os

import pytest
from data_assets import tool

from megatron.data.blended_dataset import build_gpt_datasets
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import TokenizerConfig, build_tokenizer

prepare_default_corpus = tool("prepare_default_corpus")


def _check(result: dict) -> None:
    ds = IndexedDataset(result["data_prefix"])
    assert ds.num_documents == result["documents"] and ds.num_tokens == result["tokens"]
    tok = build_tokenizer(TokenizerConfig(vocab_file=result["vocab_file"], merge_file=result["merge_file"]))
    assert tok.vocab_size == result["vocab_size"]
    assert ds[0][-1] == tok.eod  # --append-eod
    assert "import" in tok.detokenize(ds.document(0)) or "def" in tok.detokenize(ds.document(0))
    train, valid, test = build_gpt_datasets(result["data_prefix"], split=result["split"], seq_length=64, seed=1,
                                            num_samples=(100, 10, 10), vocab_size=tok.vocab_size)  # fmt: skip
    assert len(train) == 100 and train.tokens(99).max() < tok.vocab_size


def test_small_default_corpus_is_built_then_reused(tmp_path):
    logs = []
    first = prepare_default_corpus.prepare(str(tmp_path), max_bytes=400_000, vocab_size=512, workers=1, log=logs.append)
    assert not first["reused"] and first["documents"] > 10
    _check(first)
    again = prepare_default_corpus.prepare(str(tmp_path), max_bytes=400_000, vocab_size=512, workers=1, log=logs.append)
    assert again == {**first, "reused": True}
    other = prepare_default_corpus.prepare(str(tmp_path), max_bytes=300_000, vocab_size=512, workers=1, log=logs.append)
    assert not other["reused"]  # different parameters: rebuilt
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


@pytest.mark.slow
def test_full_default_corpus(tmp_path):
    result = prepare_default_corpus.prepare(str(tmp_path), log=lambda s: None)
    _check(result)
    assert result["vocab_size"] == prepare_default_corpus.DEFAULT_VOCAB_SIZE
