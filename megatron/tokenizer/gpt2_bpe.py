"""GPT-2 style byte-level BPE (`--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`).

Encoding runs in the Rust `tokenizers` package; `ReferenceByteLevelBPE` (pure Python) implements the same
algorithm and the tests prove both give identical ids. Text is text: a literal "<|endoftext|>" inside a document is
encoded as ordinary characters, and the end-of-document id only comes from `--append-eod` (as in Megatron).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from megatron.tokenizer.base import MegatronTokenizer, clean_text
from megatron.tokenizer.bpe_reference import ReferenceByteLevelBPE, read_vocab_and_merges

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE; `backend="rust"` (default, fast) or `"python"` (the reference implementation)."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike, *, backend: str = "rust") -> None:
        if backend not in ("rust", "python"):
            raise ValueError(f"{backend=} must be 'rust' or 'python'")
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
        self.backend = backend
        self._rust = _build_rust(vocab, merges) if backend == "rust" else None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        text = clean_text(text)
        if self._rust is None:
            return self.reference.encode(text)
        return self._rust.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._rust is None:
            return [self.reference.encode(clean_text(t)) for t in texts]
        encs = self._rust.encode_batch([clean_text(t) for t in texts], add_special_tokens=False)
        return [e.ids for e in encs]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.reference.decode(ids)


def _build_rust(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A `tokenizers.Tokenizer` doing GPT-2 byte-level BPE over the given vocabulary (no special-token splitting)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok
