"""A pure-Python byte-level BPE encoder/decoder (GPT-2 scheme), the reference the Rust-backed tokenizer is tested
against.

Byte-level BPE in three steps:
1. split the text into pre-tokens with GPT-2's regular expression (contractions, letter runs with an optional
   leading space, digit runs, punctuation runs, whitespace);
2. write each pre-token's UTF-8 bytes as printable characters, one character per byte (`byte_to_char`), so every
   byte string has a spelling in the vocabulary's alphabet and no text is ever unknown;
3. repeatedly merge the adjacent pair of symbols whose merge rule comes first in `merges.txt` (all occurrences of
   that pair, left to right), until no adjacent pair has a rule; look the symbols up in `vocab.json`.

Decoding concatenates the tokens' spellings, maps characters back to bytes and decodes UTF-8 (invalid byte
sequences, which only occur for cut-off id slices, become U+FFFD).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import lru_cache
from itertools import chain

import regex

# GPT-2's pre-tokenizer pattern (also used by the Rust `tokenizers` ByteLevel pre-tokenizer).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=1)
def byte_to_char() -> tuple[str, ...]:
    """The byte -> printable character table of byte-level BPE.

    Bytes that are printable Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68
    bytes (control characters, space, soft hyphen, ...) take the code points 256, 257, ... in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table = []
    extra = 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return tuple(table)


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_to_char())}


def read_vocab_and_merges(vocab_file: str | os.PathLike, merge_file: str | os.PathLike):
    """Load `vocab.json` (token -> id) and `merges.txt` (one "left right" rule per line, best first)."""
    for path, flag in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {os.fspath(path)!r} does not exist; pass the GPT-2 style file of your tokenizer")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--vocab-file {os.fspath(vocab_file)!r} is not a JSON token->id map ({exc})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"--vocab-file {os.fspath(vocab_file)!r} must hold a JSON object mapping tokens to int ids")
    merges: list[tuple[str, str]] = []
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"--merge-file {os.fspath(merge_file)!r} line {lineno}: expected 'left right'")
            merges.append((parts[0], parts[1]))
    return vocab, merges


class ReferenceByteLevelBPE:
    """Byte-level BPE over a GPT-2 style vocabulary, in plain Python (slow, simple, obviously right)."""

    cache_size = 500_000  # pre-tokens remembered (a few hundred MB at most)

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self.encoder = dict(vocab)
        self.decoder = {i: t for t, i in vocab.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self._split = regex.compile(GPT2_SPLIT_PATTERN)
        self._b2c = byte_to_char()
        self._c2b = char_to_byte()
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_files(cls, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> ReferenceByteLevelBPE:
        return cls(*read_vocab_and_merges(vocab_file, merge_file))

    def _merge(self, symbols: list[str]) -> list[str]:
        ranks = self.ranks
        while len(symbols) > 1:
            best_rank = None
            best_pair = None
            for pair in zip(symbols, symbols[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best_pair = r, pair
            if best_pair is None:
                break
            left, right = best_pair
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def _encode_piece(self, piece: str) -> list[int]:
        spelled = [self._b2c[b] for b in piece.encode("utf-8")]
        try:
            return [self.encoder[s] for s in self._merge(spelled)]
        except KeyError as exc:
            raise ValueError(
                f"symbol {exc.args[0]!r} is missing from the vocabulary (an incomplete vocab.json?)"
            ) from None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (pre-tokens are cached: a corpus repeats most of them)."""
        pieces = self._split.findall(text)
        cache = self._cache
        try:  # fast path: every piece seen before
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))
        except KeyError:
            pass
        out: list[int] = []
        room = len(cache) < self.cache_size
        for piece in pieces:
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece)
                if room:
                    cache[piece] = ids
            out.extend(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        c2b = self._c2b
        data = bytearray()
        for i in ids:
            token = self.decoder.get(int(i))
            if token is None:
                raise ValueError(f"token id {int(i)} is outside the vocabulary (size {len(self.decoder)})")
            for c in token:
                b = c2b.get(c)
                if b is None:  # not a byte character: keep the character itself
                    data.extend(c.encode("utf-8"))
                else:
                    data.append(b)
        return data.decode("utf-8", errors="replace")
