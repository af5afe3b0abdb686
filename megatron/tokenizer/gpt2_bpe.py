"""GPT-2 style byte-level BPE (`--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`).

Three encoders give identical ids (the tests prove it): the Rust `tokenizers` package, `ReferenceByteLevelBPE`
(pure Python, the reference) and `CachedByteLevelBPE` (bpe_fast.py: a faster split, a pre-token cache, Rust merges
for unseen pre-tokens). Text is text: a literal "<|endoftext|>" inside a document is encoded as ordinary characters,
and the end-of-document id only comes from `--append-eod` (as in Megatron).

Backends: "rust" (the `tokenizers` package end to end), "python" (the reference), "fast" (CachedByteLevelBPE) or
"auto" (default): "fast", after checking on the first ~16k characters of the first batch that it agrees with the
reference (it stops with an error rather than write data that depends on the backend). "fast" costs 3-5x less CPU
than "rust" here: the Rust ByteLevel pre-tokenizer's regex is its bottleneck (see bpe_fast.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer, clean_text
from megatron.tokenizer.bpe_fast import CachedByteLevelBPE
from megatron.tokenizer.bpe_reference import ReferenceByteLevelBPE, read_vocab_and_merges

EOD_TOKEN = "<|endoftext|>"
BACKENDS = ("auto", "fast", "rust", "python")


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE over a GPT-2 style vocab.json + merges.txt; backend "auto", "rust" or "python"."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike, *, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"{backend=} must be one of {', '.join(map(repr, BACKENDS))}")
        vocab, merges = read_vocab_and_merges(vocab_file, merge_file)
        if EOD_TOKEN not in vocab:
            raise ValueError(
                f"--vocab-file {os.fspath(vocab_file)!r} has no {EOD_TOKEN!r} token (needed as end-of-document)"
            )
        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        self.vocab = vocab
        self.inv_vocab = {i: t for t, i in vocab.items()}
        self._eod = vocab[EOD_TOKEN]
        self._vocab_size = max(vocab.values()) + 1
        self.reference = ReferenceByteLevelBPE(vocab, merges)
        self.backend = backend  # "auto" becomes "fast" after its first batch is checked against the reference
        self._rust = _build_rust(vocab, merges) if backend == "rust" else None
        self._fast = CachedByteLevelBPE(self.reference, vocab, merges) if backend in ("auto", "fast") else None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def describe(self) -> str:
        return f"{super().describe()}, backend {self.backend}"

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        text = clean_text(text)
        if self.backend == "python":
            return self.reference.encode(text)
        if self.backend == "rust":
            return self._rust.encode(text, add_special_tokens=False).ids
        self._check_fast([text])
        return self._fast.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        texts = [clean_text(t) for t in texts]
        if self.backend == "python":
            return [self.reference.encode(t) for t in texts]
        if self.backend == "rust":
            return [e.ids for e in self._rust.encode_batch_fast(texts, add_special_tokens=False)]
        self._check_fast(texts)
        return self._fast.encode_batch(texts)

    def tokenize_flat(self, texts: list[str], append_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(int32 ids back to back, int64 lengths); the fast backend builds it without per-token Python ints."""
        if self.backend in ("python", "rust"):
            return super().tokenize_flat(texts, append_id)
        texts = [clean_text(t) for t in texts]
        self._check_fast(texts)
        return self._fast.encode_flat(texts, append_id)

    calibration_chars = 16 * 1024
    _checked_chars = 0

    def _check_fast(self, texts: list[str]) -> None:
        """While "auto": encode the head of `texts` with the fast encoder and the reference and compare; after
        `calibration_chars` characters agreed, the backend becomes "fast" (about 10 ms of reference encoding)."""
        if self.backend != "auto":
            return
        head, chars = [], 0
        for t in texts:
            if chars >= self.calibration_chars:
                break
            head.append(t[: self.calibration_chars - chars])
            chars += len(head[-1])
        if self._fast.encode_batch(head) != [self.reference.encode(t) for t in head]:
            # a bug: stop rather than write data that depends on the backend
            raise RuntimeError("the fast and the reference byte-level BPE disagree on a batch; please report this")
        self._checked_chars += chars
        if self._checked_chars >= self.calibration_chars:
            self.backend = "fast"

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.reference.decode(ids)


def _build_rust(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A `tokenizers.Tokenizer` doing GPT-2 byte-level BPE over the given vocabulary (no special-token splitting)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok
