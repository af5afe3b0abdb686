"""The tokenizer a checkpoint records, so that text generation and Hugging Face export need no tokenizer flags.

At save time (rank 0) ``common.pt`` gets a ``tokenizer`` record -- the ``--tokenizer-type``, the NullTokenizer's
``--vocab-size`` and the names of the files copied under ``tokenizer/`` in the iteration directory -- and the files
themselves are copied there, listed in the manifest like every other file.  The names are Hugging Face's:

    GPT2BPETokenizer           tokenizer/vocab.json  tokenizer/merges.txt
    HuggingFaceTokenizer       tokenizer/tokenizer.json   (a hub name that is not a local file is recorded by name)
    SentencePieceTokenizer     tokenizer/tokenizer.model
    NullTokenizer              no files (the vocabulary size is in the record)

A run without a tokenizer (``--mock-data`` without ``--tokenizer-type``) records none.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron import checkpoint_files as cf
from megatron.config.errors import ConfigError
from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.build import TokenizerConfig, build_tokenizer

TOKENIZER_DIR = "tokenizer"


def _file_names(kind: str, tokenizer_model: str | None) -> dict[str, str]:
    """Config field -> file name under ``tokenizer/`` for tokenizer type ``kind``."""
    if kind == "GPT2BPETokenizer":
        return {"vocab_file": "vocab.json", "merge_file": "merges.txt"}
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return {"tokenizer_model": "tokenizer.model"}
    if kind == "HuggingFaceTokenizer" and tokenizer_model and _hf_json(tokenizer_model) is not None:
        return {"tokenizer_model": "tokenizer.json"}
    return {}


def _hf_json(source: str) -> str | None:
    """The tokenizer.json file a HuggingFaceTokenizer source names (a file or a directory holding one), if any."""
    path = os.path.join(source, "tokenizer.json") if os.path.isdir(source) else source
    return path if os.path.isfile(path) and path.endswith(".json") else None


def tokenizer_sources(data: Any) -> tuple[dict[str, Any] | None, dict[str, Path]]:
    """(record for ``common.pt``, file name under ``tokenizer/`` -> source path) of the trainer's data config
    (``tokenizer_type``, ``vocab_file``, ``merge_file``, ``tokenizer_model``, ``vocab_size``); ``(None, {})`` when
    the run has no tokenizer."""
    kind = getattr(data, "tokenizer_type", None)
    if not kind:
        return None, {}
    model = getattr(data, "tokenizer_model", None)
    names = _file_names(kind, model)
    sources: dict[str, Path] = {}
    for field, name in names.items():
        value = getattr(data, field, None)
        path = _hf_json(value) if kind == "HuggingFaceTokenizer" else value
        if path is None or not os.path.isfile(path):
            return None, {}  # the trainer refuses such a run before any save; nothing to record
        sources[name] = Path(path)
    record: dict[str, Any] = {"tokenizer_type": kind, "files": {f: n for f, n in names.items()}}
    if kind == "NullTokenizer":
        record["vocab_size"] = int(data.vocab_size)
    if kind == "HuggingFaceTokenizer" and not names:
        record["name"] = model  # a hub name: generation needs it in the local HF cache
    return record, sources


def record_from_files(directory: Path) -> tuple[dict[str, Any] | None, dict[str, Path]]:
    """The record and sources for the tokenizer files found in a Hugging Face model directory (``None``: none).

    ``vocab.json`` + ``merges.txt`` with ``<|endoftext|>`` is GPT-2 byte-level BPE; else ``tokenizer.json`` is a
    HuggingFaceTokenizer; else ``tokenizer.model`` a SentencePiece model."""
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file() and '"<|endoftext|>"' in vocab.read_text(encoding="utf-8"):
        kind, files = "GPT2BPETokenizer", {"vocab_file": vocab, "merge_file": merges}
    elif (directory / "tokenizer.json").is_file():
        kind, files = "HuggingFaceTokenizer", {"tokenizer_model": directory / "tokenizer.json"}
    elif (directory / "tokenizer.model").is_file():
        kind, files = "SentencePieceTokenizer", {"tokenizer_model": directory / "tokenizer.model"}
    else:
        return None, {}
    names = _file_names(kind, str(files.get("tokenizer_model", "")))
    return {"tokenizer_type": kind, "files": names}, {names[f]: p for f, p in files.items()}


def copy_tokenizer_files(sources: dict[str, Path], tmp: Path, *, rank: int = 0) -> dict[str, dict[str, Any]]:
    """Copy the tokenizer files into a checkpoint being written at ``tmp``; returns their manifest entries."""
    return {
        f"{TOKENIZER_DIR}/{name}": cf.copy_file(src, tmp / TOKENIZER_DIR / name, rank=rank)
        for name, src in sorted(sources.items())
    }


def recorded_files(directory: Path, common: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Path]:
    """File name -> verified path of the tokenizer files a checkpoint holds (empty when it records none)."""
    record = common.get("tokenizer")
    if not record:
        return {}
    return {name: cf.verified_path(directory, f"{TOKENIZER_DIR}/{name}", manifest) for name in record["files"].values()}


def recorded_tokenizer(directory: Path, common: dict[str, Any], manifest: dict[str, Any]) -> MegatronTokenizer:
    """The tokenizer a checkpoint records, built from its verified files; ``ConfigError`` (one line) if it has none."""
    record = common.get("tokenizer")
    if not record:
        raise ConfigError(
            f"checkpoint {directory} records no tokenizer (it was trained without --tokenizer-type, e.g. on "
            "--mock-data); train or import with a tokenizer (--tokenizer-type and its files) to generate text"
        )
    paths = recorded_files(directory, common, manifest)
    fields = {field: str(paths[name]) for field, name in record["files"].items()}
    if record["tokenizer_type"] == "HuggingFaceTokenizer" and "tokenizer_model" not in fields:
        fields["tokenizer_model"] = record.get("name")
    config = TokenizerConfig(tokenizer_type=record["tokenizer_type"], vocab_size=record.get("vocab_size"), **fields)
    try:
        return build_tokenizer(config)
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint {directory}: cannot build its tokenizer: {str(err).splitlines()[0]}") from None
