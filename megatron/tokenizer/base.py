"""The interface every tokenizer offers the data pipeline and the trainer (Megatron's tokenizer contract).

A tokenizer turns one document's text into token ids (`tokenize`) and back (`detokenize`), knows its `vocab_size`
(the number of ids it can produce, before the trainer pads the embedding table) and names two special ids:
`eod` (appended after each document by `tools/preprocess_data.py --append-eod`, so samples that run across
document boundaries see where one ends) and `pad`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from itertools import chain

import numpy as np

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Return `text` as valid Unicode: surrogate pairs are joined, lone surrogates become U+FFFD.

    Python strings may hold lone surrogates (e.g. from `json.loads('"\\ud800"')`); they have no UTF-8 encoding, so
    every tokenizer replaces them the same way before encoding.
    """
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class MegatronTokenizer(ABC):
    """Base class: `tokenize`, `detokenize`, `vocab_size`, `eod`, `pad` (and a batched `tokenize_batch`)."""

    name: str = "tokenizer"

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids this tokenizer can emit (ids lie in [0, vocab_size))."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id."""

    @property
    def pad(self) -> int:
        """Padding id (the end-of-document id unless the tokenizer defines its own)."""
        return self.eod

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of one document (no end-of-document id appended)."""

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several documents; subclasses override this with a faster batched path."""
        return [self.tokenize(t) for t in texts]

    def tokenize_flat(self, texts: list[str], append_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids of all texts back to back, int64 count per text), with `append_id` after each text when given.

        The form preprocessing writes; subclasses with a faster path override it (GPT2BPETokenizer does).
        """
        ids = self.tokenize_batch(texts)
        if append_id is not None:
            for d in ids:
                d.append(append_id)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())), lengths

    def describe(self) -> str:
        return f"{self.name} (vocab size {self.vocab_size}, eod {self.eod}, pad {self.pad})"

    def __repr__(self) -> str:
        return f"<{self.describe()}>"


class StoredIdsMixin:
    """``vocab_size``, ``eod`` and ``pad`` read from ``_vocab_size``, ``_eod`` and ``_pad`` set in ``__init__``.

    Put it before ``MegatronTokenizer`` in the bases so these properties fill its abstract ones.
    """

    _vocab_size: int
    _eod: int
    _pad: int

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad
