"""The fast byte-level BPE encoder behind `GPT2BPETokenizer(backend="fast")` (and "auto"): same ids as the reference.

Where the time goes (measured on the default corpus, CPU seconds per MB of text, one process; see
bench/results/data.md): the Rust `tokenizers` ByteLevel pre-tokenizer (its Oniguruma regex) manages only about
1.2 MB per CPU second here, and that is nearly all of the Rust encoder's cost; the `regex` module's `findall` with
the same pattern does about 4-7 MB/s and the standard library's `re` about 15-18 MB/s. The BPE merges themselves are
cheap once cached: a corpus repeats most of its pre-tokens (words, indentation, punctuation runs).

So this encoder
1. splits with `re` when the text has no character outside the Basic Multilingual Plane, with GPT-2's pattern whose
   classes \\p{L}, \\p{N} and \\s are spelled out as explicit BMP ranges *derived from the `regex` module itself* at
   start-up (so both agree character for character, whatever Unicode version `regex` ships); other text (emoji,
   astral CJK) is split by `regex` with the original pattern, as the reference does;
2. looks every pre-token up in a cache of pre-token -> ids (kept as int32 bytes, joined per document);
3. encodes the pre-tokens it has not seen with the Rust BPE model alone (`models.BPE.tokenize` on the byte-spelled
   pre-token: ~2.5 us each, 4x less than `encode_batch_fast` on single words) when `tokenizers` is installed, else
   with the reference's merge loop.

Steps 1 and 3 produce exactly what the reference produces (tests/test_data_fast_paths.py compares the splits on random
Unicode and the ids on a varied corpus), so only speed differs.
"""

from __future__ import annotations

import re
from array import array
from functools import lru_cache
from itertools import chain

import numpy as np
import regex

from megatron.tokenizer.bpe_reference import GPT2_SPLIT_PATTERN, ReferenceByteLevelBPE, byte_to_char

_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _bmp_class(prop: str) -> str:
    """The BMP code points matching the `regex` class `prop`, as the body of an `re` character class."""
    bmp = "".join(map(chr, chain(range(0xD800), range(0xE000, 0x10000))))
    points = [ord(c) for c in regex.findall(prop, bmp)]
    if not points:
        return ""
    parts = []
    start = prev = points[0]
    for p in chain(points[1:], [-2]):
        if p != prev + 1:
            parts.append(re.escape(chr(start)) + ("" if start == prev else "-" + re.escape(chr(prev))))
            start = p
        prev = p
    return "".join(parts)


@lru_cache(maxsize=1)
def bmp_split_pattern() -> re.Pattern:
    """GPT-2's split pattern for `re`, exact on text without astral characters (built once per process, ~0.1 s)."""
    letters, numbers, space = _bmp_class(r"\p{L}"), _bmp_class(r"\p{N}"), _bmp_class(r"\s")
    return re.compile(
        rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"""
        rf"""|[{space}]+(?![^{space}])|[{space}]+"""
    )


class GPT2PreTokenizer:
    """`split(text)` == `regex.findall(GPT2_SPLIT_PATTERN, text)` for any text without surrogates, faster."""

    def __init__(self) -> None:
        self._bmp = bmp_split_pattern().findall
        self._full = regex.compile(GPT2_SPLIT_PATTERN).findall

    def split(self, text: str) -> list[str]:
        if text.isascii() or _ASTRAL.search(text) is None:
            return self._bmp(text)
        return self._full(text)


def _rust_bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """The Rust `tokenizers` BPE model alone (`model.tokenize(word)` merges one byte-spelled word), or None."""
    try:
        from tokenizers import models
    except ImportError:
        return None
    return models.BPE(vocab=vocab, merges=merges)


@lru_cache(maxsize=1)
def _latin1_to_byte_chars() -> dict[int, str]:
    """str.translate table: the Latin-1 character of byte b -> the byte-level BPE character of b."""
    return {b: c for b, c in enumerate(byte_to_char())}


class _PieceCache(dict):
    """pre-token -> its ids as native int32 bytes; looking up an unseen pre-token encodes (and remembers) it."""

    __slots__ = ("encode_piece", "limit")

    def __missing__(self, piece: str) -> bytes:
        ids = self.encode_piece(piece)
        if len(self) < self.limit:
            self[piece] = ids
        return ids


class CachedByteLevelBPE:
    """Byte-level BPE with a fast split, a pre-token cache and Rust merges for unseen pre-tokens.

    Cached ids are kept as int32 bytes, so a document's ids are one `b"".join` over its pre-tokens (no Python int is
    created until a caller asks for a list) and a batch becomes a NumPy array without a per-token conversion.
    """

    cache_size = 1_000_000  # pre-tokens remembered (tens of bytes each); when full, new ones are encoded every time

    def __init__(self, reference: ReferenceByteLevelBPE, vocab: dict[str, int], merges: list[tuple[str, str]],
                 *, use_rust: bool = True) -> None:  # fmt: skip
        self.reference = reference
        self.pretokenizer = GPT2PreTokenizer()
        self._model = _rust_bpe_model(vocab, merges) if use_rust else None
        self._spell = _latin1_to_byte_chars()
        self._cache = _PieceCache()
        self._cache.encode_piece = self._encode_piece_rust if self._model is not None else self._encode_piece_python
        self._cache.limit = self.cache_size

    @property
    def merges_in_rust(self) -> bool:
        return self._model is not None

    def _encode_piece_rust(self, piece: str) -> bytes:  # ~2.5 us (encode_batch_fast on one word: ~10 us)
        spelled = piece.encode("utf-8").decode("latin-1").translate(self._spell)
        return array("i", [t.id for t in self._model.tokenize(spelled)]).tobytes()

    def _encode_piece_python(self, piece: str) -> bytes:  # ~20 us
        return array("i", self.reference._encode_piece(piece)).tobytes()

    def encode_bytes(self, text: str) -> bytes:
        """Token ids of `text` (already cleaned of surrogates) as native int32 bytes."""
        return b"".join(map(self._cache.__getitem__, self.pretokenizer.split(text)))

    def encode(self, text: str) -> list[int]:
        return array("i", self.encode_bytes(text)).tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_flat(self, texts: list[str], append_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(int32 ids of all texts back to back, int64 ids per text), `append_id` after each text if given."""
        get, split = self._cache.__getitem__, self.pretokenizer.split
        tail = b"" if append_id is None else array("i", [append_id]).tobytes()
        parts = [b"".join(map(get, split(t))) + tail for t in texts]
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)) // 4
        return np.frombuffer(b"".join(parts), dtype=np.int32), lengths
