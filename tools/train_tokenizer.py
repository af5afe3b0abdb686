#!/usr/bin/env python
"""Train a tokenizer on a corpus: byte-level BPE (GPT-2 style vocab.json + merges.txt) or SentencePiece (.model).

    python tools/train_tokenizer.py --input corpus.jsonl [more files or directories] --json-key text \
        --type bpe --vocab-size 8192 --output-dir tok/
    python tools/train_tokenizer.py --input corpus.txt --type sentencepiece --vocab-size 8000 --output-dir tok/

JSONL files (*.jsonl, *.json) give one document per line from --json-key; other files are plain text, one
document per line. Lines that are not UTF-8 or not valid JSON are skipped. The outputs are what
`--tokenizer-type GPT2BPETokenizer --vocab-file tok/vocab.json --merge-file tok/merges.txt` and
`--tokenizer-type SentencePieceTokenizer --tokenizer-model tok/tokenizer.model` expect.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator

EOD_TOKEN = "<|endoftext|>"


def expand_inputs(paths: Iterable[str]) -> list[str]:
    """Files named directly, plus every *.jsonl/*.json/*.txt file under named directories (sorted)."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, _, names in os.walk(p):
                found += [os.path.join(root, n) for n in names if n.endswith((".jsonl", ".json", ".txt"))]
            files += sorted(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"--input {p!r} does not exist")
    if not files:
        raise ValueError(f"--input {list(paths)} holds no .jsonl/.json/.txt files")
    return files


def iter_documents(files: Iterable[str], json_key: str = "text", max_bytes: int | None = None) -> Iterator[str]:
    """Documents of the corpus (stops after about `max_bytes` of text when given)."""
    seen = 0
    for path in files:
        is_json = path.endswith((".jsonl", ".json"))
        with open(path, "rb") as f:
            for raw in f:
                try:
                    line = raw.decode("utf-8")
                    text = json.loads(line)[json_key] if is_json else line.rstrip("\r\n")
                except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                    continue
                if not isinstance(text, str) or not text:
                    continue
                yield text
                seen += len(raw)
                if max_bytes is not None and seen >= max_bytes:
                    return


def train_bpe(documents: Iterable[str], output_dir: str, *, vocab_size: int = 8192, min_frequency: int = 2) -> dict:
    """Train byte-level BPE; write vocab.json and merges.txt into `output_dir` (id 0 is <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"{vocab_size=} must be >= 257 (256 byte symbols + <|endoftext|>)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    os.makedirs(output_dir, exist_ok=True)
    tok.model.save(output_dir)
    return {
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": os.path.join(output_dir, "vocab.json"),
        "merge_file": os.path.join(output_dir, "merges.txt"),
        "vocab_size": tok.get_vocab_size(),
    }


def train_sentencepiece(
    documents: Iterable[str],
    output_dir: str,
    *,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    normalization: str = "nmt_nfkc",
    byte_fallback: bool = True,
) -> dict:
    """Train a SentencePiece model (unk 0, bos 1, eos 2 = end of document, pad 3); write tokenizer.model."""
    import sentencepiece as spm

    os.makedirs(output_dir, exist_ok=True)
    prefix = os.path.join(output_dir, "tokenizer")

    def lines() -> Iterator[str]:  # SentencePiece trains on sentences: feed the documents line by line
        for doc in documents:
            for line in doc.splitlines():
                if line.strip():
                    yield line

    try:
        _train_sp(
            spm,
            sentence_iterator=lines(),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            normalization_rule_name=normalization,
            byte_fallback=byte_fallback,
            character_coverage=0.9995,  # rarer characters are spelled as bytes (byte_fallback)
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            hard_vocab_limit=False,
            minloglevel=2,
            num_threads=1,
        )
    except RuntimeError as exc:
        raise ValueError(f"SentencePiece training failed: {str(exc).splitlines()[0]}") from None
    return {
        "tokenizer_type": "SentencePieceTokenizer",
        "tokenizer_model": prefix + ".model",
        "vocab_size": vocab_size,
    }


def _train_sp(spm, **kwargs) -> None:
    spm.SentencePieceTrainer.train(**kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="corpus files or directories")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-bytes", type=int, default=None, help="train on about this much text only")
    parser.add_argument("--sp-model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--sp-normalization", default="nmt_nfkc", help="nmt_nfkc, nfkc or identity")
    args = parser.parse_args(argv)
    try:
        docs = iter_documents(expand_inputs(args.input), args.json_key, args.max_bytes)
        if args.type == "bpe":
            out = train_bpe(docs, args.output_dir, vocab_size=args.vocab_size)
        else:
            out = train_sentencepiece(
                docs,
                args.output_dir,
                vocab_size=args.vocab_size,
                model_type=args.sp_model_type,
                normalization=args.sp_normalization,
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
