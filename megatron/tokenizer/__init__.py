"""Tokenizers: GPT-2 byte-level BPE (Rust-backed, with a pure-Python reference), SentencePiece, HuggingFace, Null."""

from megatron.tokenizer.base import MegatronTokenizer, clean_text
from megatron.tokenizer.build import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "MegatronTokenizer",
    "TokenizerConfig",
    "build_tokenizer",
    "clean_text",
]
