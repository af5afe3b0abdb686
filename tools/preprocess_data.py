#!/usr/bin/env python
"""Tokenize a corpus into Megatron's memory-mapped format: `{output_prefix}_{key}_document.bin/.idx`.

    python tools/preprocess_data.py --input corpus.jsonl [more files or directories] --json-keys text \
        --output-prefix data/my --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --workers 2 --append-eod

then train with `--data-path data/my_text_document`. Files ending in .jsonl/.json are JSON lines (one document per
line, the text under each --json-keys key); other files are plain text with one document per line. Directories are
searched for .jsonl/.json/.txt files. Reading streams in chunks through --workers processes with a bounded number of
chunks in flight, so memory stays flat whatever the input size. A line that is not UTF-8, not valid JSON, lacks a
key or holds an empty text is skipped and counted (the summary gives the reasons); it never stops the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import IndexedDatasetWriter, token_dtype_for  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer  # noqa: E402

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)

_TOKENIZER = None  # one per worker process
_OPTIONS: dict = {}


def expand_inputs(paths: list[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, _, names in os.walk(p):
                found += [os.path.join(root, n) for n in names if n.endswith(JSON_SUFFIXES + TEXT_SUFFIXES)]
            if not found:
                raise ValueError(f"--input directory {p!r} holds no .jsonl/.json/.txt files")
            files += sorted(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"--input {p!r} does not exist")
    return files


def _init_worker(config: TokenizerConfig, keys: list[str], append_eod: bool) -> None:
    """Set up a worker: a forked one inherits the parent's tokenizer (built before the pool), a spawned one builds."""
    global _TOKENIZER
    if _TOKENIZER is None or _OPTIONS.get("config") != config:
        _TOKENIZER = build_tokenizer(config)
    _OPTIONS.update(config=config, keys=keys, append_eod=append_eod)


def _set_worker_tokenizer(tokenizer, config: TokenizerConfig | None) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer
    _OPTIONS["config"] = config


def process_chunk(lines: list[bytes], is_json: bool) -> tuple[dict, collections.Counter, int, str | None]:
    """Tokenize one chunk of raw lines -> ({key: (flat tokens, lengths)}, skip counts, bytes read, BPE backend)."""
    keys, append_eod, tok = _OPTIONS["keys"], _OPTIONS["append_eod"], _TOKENIZER
    skips: collections.Counter = collections.Counter()
    texts: dict[str, list[str]] = {k: [] for k in keys}
    nbytes = 0
    for raw in lines:
        nbytes += len(raw)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            skips["not UTF-8"] += 1
            continue
        if not line.strip():
            skips["blank line"] += 1
            continue
        if not is_json:
            texts[keys[0]].append(line.rstrip("\r\n"))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skips["malformed JSON"] += 1
            continue
        if not isinstance(record, dict):
            skips["JSON line is not an object"] += 1
            continue
        for k in keys:
            value = record.get(k)
            if value is None:
                skips[f"missing key {k!r}"] += 1
            elif not isinstance(value, str):
                skips[f"{k!r} is not a string"] += 1
            elif not value:
                skips[f"empty {k!r}"] += 1
            else:
                texts[k].append(value)
    out = {}
    for k, docs in texts.items():
        if docs:
            flat, lengths = tok.tokenize_flat(docs, tok.eod if append_eod else None)
        else:
            flat, lengths = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        empty = lengths == 0
        if empty.any():  # e.g. a text the tokenizer maps to nothing (the flat array holds nothing for it)
            skips[f"no tokens in {k!r}"] += int(empty.sum())
            lengths = lengths[~empty]
        out[k] = (flat, lengths)  # the writer checks the ids fit its dtype and converts
    return out, skips, nbytes, getattr(tok, "backend", None)


def iter_chunks(files: list[str], chunk_bytes: int, input_format: str) -> Iterator[tuple[list[bytes], bool]]:
    for path in files:
        is_json = path.endswith(JSON_SUFFIXES) if input_format == "auto" else input_format == "jsonl"
        chunk: list[bytes] = []
        size = 0
        with open(path, "rb") as f:
            for raw in f:
                chunk.append(raw)
                size += len(raw)
                if size >= chunk_bytes:
                    yield chunk, is_json
                    chunk, size = [], 0
        if chunk:
            yield chunk, is_json


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


class _Tally:
    """What the tokenized chunks add up to: written to the per-key writers, counted, shown on a progress bar."""

    def __init__(self, writers: dict[str, IndexedDatasetWriter], total_bytes: int, *, progress: bool) -> None:
        self.writers = writers
        self.docs: collections.Counter = collections.Counter()
        self.tokens: collections.Counter = collections.Counter()
        self.skips: collections.Counter = collections.Counter()
        self.backends: set[str] = set()
        self.done_bytes = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="preprocess", mininterval=1.0, file=sys.stderr
            )

    def consume(self, result: tuple[dict, collections.Counter, int, str | None]) -> None:
        """Add one ``process_chunk`` result: its documents to the writers, its counts to the totals."""
        per_key, chunk_skips, nbytes, backend = result
        for k, (flat, lengths) in per_key.items():
            if lengths.size:
                self.writers[k].add_sequences(flat, lengths)
                self.docs[k] += int(lengths.size)
                self.tokens[k] += int(flat.size)
        self.skips.update(chunk_skips)
        if backend is not None:
            self.backends.add(backend)
        self.done_bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{sum(self.docs.values()) / elapsed:,.0f} docs/s", refresh=False)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tokenize_inline(
    chunks: Iterator[tuple[list[bytes], bool]],
    tally: _Tally,
    tokenizer,
    config: TokenizerConfig,
    keys: list[str],
    append_eod: bool,
) -> None:
    """``--workers 1``: tokenize every chunk in this process."""
    _set_worker_tokenizer(tokenizer, config)
    _init_worker(config, keys, append_eod)
    for chunk, is_json in chunks:
        tally.consume(process_chunk(chunk, is_json))


def _tokenize_in_pool(
    chunks: Iterator[tuple[list[bytes], bool]],
    tally: _Tally,
    tokenizer,
    config: TokenizerConfig,
    keys: list[str],
    append_eod: bool,
    workers: int,
) -> None:
    """Tokenize the chunks on ``workers`` processes, at most ``2 * workers`` chunks in flight, results in order."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _set_worker_tokenizer(tokenizer, config)  # forked workers inherit it (no rebuild: vocab, regex tables)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(config, keys, append_eod)) as pool:
        pending: collections.deque = collections.deque()
        for chunk, is_json in chunks:
            pending.append(pool.apply_async(process_chunk, (chunk, is_json)))
            while len(pending) >= 2 * workers:  # bounded in-flight work keeps memory flat
                tally.consume(pending.popleft().get())
        while pending:
            tally.consume(pending.popleft().get())


def preprocess(args: argparse.Namespace) -> dict:
    """Run the preprocessing; returns the summary (raises ValueError on bad input)."""
    config = TokenizerConfig(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )
    files = expand_inputs(args.input)
    keys = list(args.json_keys)
    tokenizer = build_tokenizer(config)  # fail early on a bad tokenizer, in the parent
    dtype = token_dtype_for(tokenizer.vocab_size)
    total_bytes = sum(os.path.getsize(p) for p in files)
    writers = {k: IndexedDatasetWriter(output_prefix_for(args.output_prefix, k), dtype) for k in keys}
    tally = _Tally(writers, total_bytes, progress=not args.no_progress)
    chunks = iter_chunks(files, args.chunk_bytes, args.input_format)
    try:
        if args.workers <= 1:
            _tokenize_inline(chunks, tally, tokenizer, config, keys, args.append_eod)
        else:
            _tokenize_in_pool(chunks, tally, tokenizer, config, keys, args.append_eod, args.workers)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        _set_worker_tokenizer(None, None)
        tally.close_bar()
    elapsed = time.perf_counter() - tally.t0
    if sum(tally.docs.values()) == 0:
        for w in writers.values():
            w.abort()
        reasons = ", ".join(f"{n} {r}" for r, n in tally.skips.most_common()) or "the input is empty"
        raise ValueError(f"no documents found in --input {' '.join(args.input)} ({reasons}); nothing written")
    for w in writers.values():
        w.finalize()
    backends = tally.backends
    return {
        "files": len(files),
        "input_bytes": tally.done_bytes,
        "seconds": elapsed,
        "mb_per_s": tally.done_bytes / 1e6 / max(elapsed, 1e-9),
        "documents": dict(tally.docs),
        "tokens": dict(tally.tokens),
        "skipped": dict(tally.skips),
        "outputs": {k: output_prefix_for(args.output_prefix, k) for k in keys},
        "tokenizer": tokenizer.describe() if not backends else f"{tokenizer.name} ({'/'.join(sorted(backends))})",
        "dtype": str(dtype),
    }


def format_summary(s: dict) -> str:
    lines = [
        f"preprocessed {s['files']} file(s), {s['input_bytes'] / 1e6:.2f} MB in {s['seconds']:.2f} s "
        f"({s['mb_per_s']:.2f} MB/s) with {s['tokenizer']}, tokens as {s['dtype']}",
    ]
    for k, prefix in s["outputs"].items():
        lines.append(
            f"  {k!r}: {s['documents'].get(k, 0)} documents, {s['tokens'].get(k, 0)} tokens -> {prefix}.bin/.idx"
        )
    skipped = s["skipped"]
    if skipped:
        lines.append(
            f"  skipped {sum(skipped.values())} line(s): " + ", ".join(f"{n} {r}" for r, n in sorted(skipped.items()))
        )
    else:
        lines.append("  skipped 0 lines")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL/text files or directories")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (one output pair per key)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="input bytes per work item")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dataset-impl", choices=("mmap",), default="mmap", help="accepted for Megatron compatibility")
    p.add_argument("--log-interval", type=int, default=None, help="accepted for Megatron compatibility")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers {args.workers} must be >= 1", file=sys.stderr)
        return 2
    try:
        summary = preprocess(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
