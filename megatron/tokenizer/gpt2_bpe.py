"""GPT-2 style byte-level BPE (`--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`).

Encoding runs in the Rust `tokenizers` package; `ReferenceByteLevelBPE` (pure Python) implements the same
algorithm and the tests prove both give identical ids. Text is text: a literal "<|endoftext|>" inside a document is
encoded as ordinary characters, and the end-of-document id only comes from `--append-eod` (as in Megatron).

Backends: "rust" (the `tokenizers` package), "python" (the reference, with a pre-token cache) or "auto" (default):
the first large `tokenize_batch` call encodes with both, checks they agree and keeps whichever used less CPU time.
The ids are the same either way; only speed differs (on some machines the cached Python path is faster).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from megatron.tokenizer.base import MegatronTokenizer, clean_text
from megatron.tokenizer.bpe_reference import ReferenceByteLevelBPE, read_vocab_and_merges

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE over a GPT-2 style vocab.json + merges.txt; backend "auto", "rust" or "python"."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike, *, backend: str = "auto") -> None:
        if backend not in ("auto", "rust", "python"):
            raise ValueError(f"{backend=} must be 'auto', 'rust' or 'python'")
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
        self.backend = backend  # "auto" becomes "rust" or "python" after calibration
        self._rust = _build_rust(vocab, merges) if backend != "python" else None

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
        return self._rust.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        texts = [clean_text(t) for t in texts]
        if self.backend == "python":
            return [self.reference.encode(t) for t in texts]
        if self.backend == "auto":
            return self._calibrate(texts)
        return [e.ids for e in self._rust.encode_batch_fast(texts, add_special_tokens=False)]

    calibration_chars = 256 * 1024

    def _calibrate(self, texts: list[str]) -> list[list[int]]:
        """Encode the first ~256k characters with both backends, check they agree, keep the cheaper one."""
        n, chars = 0, 0
        while n < len(texts) and chars < self.calibration_chars:
            chars += len(texts[n])
            n += 1
        head, rest = texts[:n], texts[n:]
        t0 = time.process_time()
        fast = [e.ids for e in self._rust.encode_batch_fast(head, add_special_tokens=False)]
        t1 = time.process_time()
        ref = [self.reference.encode(t) for t in head]
        t2 = time.process_time()
        if fast != ref:  # a bug: stop rather than write data that depends on the backend
            raise RuntimeError("the Rust and Python byte-level BPE disagree on a batch; please report this")
        if chars >= self.calibration_chars:
            self.backend = "python" if t2 - t1 < t1 - t0 else "rust"
        return ref + (self.tokenize_batch(rest) if rest else [])

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.reference.decode(ids)


def _build_rust(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A `tokenizers.Tokenizer` doing GPT-2 byte-level BPE over the given vocabulary (no special-token splitting)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok
