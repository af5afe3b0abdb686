"""`build_tokenizer(config)`: the tokenizer named by Megatron's flags.

`config` is a `TokenizerConfig` or any object with the same attribute names (the trainer's data config):
tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.tokenizer.base import MegatronTokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
        needs = {
            "GPT2BPETokenizer": ("vocab_file", "merge_file"),
            "SentencePieceTokenizer": ("tokenizer_model",),
            "GPTSentencePieceTokenizer": ("tokenizer_model",),
            "HuggingFaceTokenizer": ("tokenizer_model",),
            "NullTokenizer": ("vocab_size",),
        }[self.tokenizer_type]
        missing = ["--" + n.replace("_", "-") for n in needs if getattr(self, n) in (None, "")]
        if missing:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type} needs {' and '.join(missing)}")


def model_vocab_size(tokenizer_type: str | None, vocab_size: int) -> int:
    """The model's vocabulary for `--vocab-size N`: NullTokenizer's own (N ids plus its end-of-document id N, as
    Megatron), else N (no tokenizer is built: mock data, or a vocabulary given outright)."""
    if tokenizer_type == "NullTokenizer":
        from megatron.tokenizer.simple_tokenizers import NullTokenizer

        return NullTokenizer(vocab_size).vocab_size
    return vocab_size


def build_tokenizer(config: Any, *, backend: str = "auto") -> MegatronTokenizer:
    """Build the tokenizer that `config` describes (raises ValueError naming the missing/bad flag)."""
    if not isinstance(config, TokenizerConfig):
        config = TokenizerConfig(
            tokenizer_type=getattr(config, "tokenizer_type", "GPT2BPETokenizer"),
            vocab_file=getattr(config, "vocab_file", None),
            merge_file=getattr(config, "merge_file", None),
            tokenizer_model=getattr(config, "tokenizer_model", None),
            vocab_size=getattr(config, "vocab_size", None),
        )
    kind = config.tokenizer_type
    if kind == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(config.vocab_file, config.merge_file, backend=backend)
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(config.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.simple_tokenizers import HuggingFaceTokenizer

        return HuggingFaceTokenizer(config.tokenizer_model)
    from megatron.tokenizer.simple_tokenizers import NullTokenizer

    return NullTokenizer(config.vocab_size)
