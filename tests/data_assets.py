"""Test assets for the data tests, generated on the spot (no downloads): a varied Unicode corpus and small trained
tokenizers."""

from __future__ import annotations

import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "Jumps",
    "OVER",
    "lazy",
    "dog",
    "über",
    "naïve",
    "café",
    "façade",
    "日本語",
    "テキスト",
    "中文字符",
    "한국어",
    "Ελληνικά",
    "русский",
    "עברית",
    "العربية",
    "हिन्दी",
    "😀",
    "🚀",
    "👩‍👩‍👧",
    "🇫🇷",
    "e\u0301",
    "def",
    "return",
    "self.x",
    "__init__",
    "0x1F",
    "3.14159",
    "1e-9",
    "don't",
    "we'll",
    "IT'S",
    "they've",
    "I'm",
    "you'd",
    "'re",
    "<|endoftext|>",
    "http://example.com/a?b=c&d",
    "λx.x",
    "∑",
    "≠",
    "€100",
    "½",
    "Ⅻ",
    "\u200b",
    "\ufeff",
    "\ufffd",
]
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "    ", " \n ", "\x00", "\x07", "\x1b", "\x7f", "\u2028"]


def varied_text(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        parts.append(rng.choice(WORDS))
        parts.append(rng.choice(SEPARATORS))
    if rng.random() < 0.3:
        parts.insert(0, rng.choice(["  ", "\n", "\t", " "]))
    return "".join(parts)


def varied_corpus(n_docs: int, seed: int = 0, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [varied_text(rng, rng.randint(1, max_words)) for _ in range(n_docs)]


def train_small_bpe(out_dir: str, vocab_size: int = 600, seed: int = 0) -> dict:
    import train_tokenizer

    return train_tokenizer.train_bpe(varied_corpus(400, seed), out_dir, vocab_size=vocab_size)


def train_small_sentencepiece(out_dir: str, vocab_size: int = 600, normalization: str = "nmt_nfkc") -> dict:
    import train_tokenizer

    return train_tokenizer.train_sentencepiece(
        varied_corpus(400, 1), out_dir, vocab_size=vocab_size, normalization=normalization
    )


def tool(name: str):
    """Import tools/<name>.py as a module."""
    import importlib

    return importlib.import_module(name)
