#!/usr/bin/env python
"""The default corpus: the Python standard library's own source files, so `make train` needs no download.

    python tools/prepare_default_corpus.py [--data-dir data] [--force]

Steps (cached under `<data-dir>/default_corpus/`, reused while the manifest matches):
1. collect the standard library's *.py files (found through `sysconfig`), skipping test suites (test/, tests/,
   idlelib/, lib2to3/) and site-packages, in a fixed pseudo-random order, up to --max-bytes of source (default 8 MB:
   about 500 files; the subset is deterministic for a given Python installation), into `stdlib.jsonl`, one file a
   line;
2. train a byte-level BPE tokenizer on them (tools/train_tokenizer.py; --vocab-size, default 4096);
3. preprocess with tools/preprocess_data.py (--append-eod) into `stdlib_text_document.bin/.idx`.

The whole thing takes well under a minute on 2 cores. `prepare(data_dir)` returns the paths the trainer needs:
data_prefix (for --data-path), tokenizer_type, vocab_file, merge_file, vocab_size, and the recommended split
("90,5,5": with a few hundred documents Megatron's 969,30,1 would leave one file for testing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import sysconfig
import time
from types import SimpleNamespace

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)
sys.path.insert(1, os.path.dirname(TOOLS_DIR))

import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

from megatron.data.indexed_dataset import IndexedDataset  # noqa: E402

CORPUS_VERSION = 2
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SPLIT = "90,5,5"  # a few hundred documents: 969,30,1 would leave the test split a single file


def stdlib_source_files(max_bytes: int) -> tuple[str, list[str]]:
    """(stdlib root, sorted relative paths of *.py files totalling at most about max_bytes)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    files.sort()
    random.Random(0).shuffle(files)  # so the valid/test documents (at the end) are a random sample of the library
    chosen, total = [], 0
    for rel in files:
        size = os.path.getsize(os.path.join(root, rel))
        if total + size > max_bytes:
            continue
        chosen.append(rel)
        total += size
    if not chosen:
        raise ValueError(f"no standard-library sources found under {root!r} (is this a full Python installation?)")
    return root, chosen


def _expected_manifest(max_bytes: int, vocab_size: int) -> dict:
    return {
        "corpus_version": CORPUS_VERSION,
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
    }


def _result(out_dir: str, manifest: dict, reused: bool) -> dict:
    return {
        "data_prefix": os.path.join(out_dir, "stdlib_text_document"),
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": os.path.join(out_dir, "tokenizer", "vocab.json"),
        "merge_file": os.path.join(out_dir, "tokenizer", "merges.txt"),
        "vocab_size": manifest["tokenizer_vocab_size"],
        "split": DEFAULT_SPLIT,
        "documents": manifest["documents"],
        "tokens": manifest["tokens"],
        "reused": reused,
    }


def _load_if_valid(out_dir: str, expected: dict) -> dict | None:
    path = os.path.join(out_dir, "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
        if {k: manifest.get(k) for k in expected} != expected:
            return None
        result = _result(out_dir, manifest, True)
        IndexedDataset(result["data_prefix"])  # validates the pair
        if not (os.path.isfile(result["vocab_file"]) and os.path.isfile(result["merge_file"])):
            return None
        return result
    except (OSError, ValueError, KeyError):
        return None


def prepare(
    data_dir: str = "data",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    workers: int = 2,
    force: bool = False,
    log=print,
) -> dict:
    """Build (or reuse) the default corpus under `<data_dir>/default_corpus`; returns the trainer's data settings."""
    out_dir = os.path.join(os.path.abspath(data_dir), "default_corpus")
    expected = _expected_manifest(max_bytes, vocab_size)
    if not force:
        cached = _load_if_valid(out_dir, expected)
        if cached is not None:
            log(
                f"[data] reusing default corpus {cached['data_prefix']} ({cached['documents']} documents, "
                f"{cached['tokens']} tokens)"
            )
            return cached
    t0 = time.perf_counter()
    tmp_dir = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        root, files = stdlib_source_files(max_bytes)
        jsonl = os.path.join(tmp_dir, "stdlib.jsonl")
        n_bytes = 0
        with open(jsonl, "w", encoding="utf-8") as f:
            for rel in files:
                try:
                    with open(os.path.join(root, rel), encoding="utf-8") as src:
                        text = src.read()
                except (UnicodeDecodeError, OSError):
                    continue
                n_bytes += len(text.encode("utf-8"))
                f.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
        log(f"[data] default corpus: {len(files)} standard-library files ({n_bytes / 1e6:.1f} MB) from {root}")
        t1 = time.perf_counter()
        tok = train_tokenizer.train_bpe(
            train_tokenizer.iter_documents([jsonl], "text"), os.path.join(tmp_dir, "tokenizer"), vocab_size=vocab_size
        )
        log(f"[data] trained byte-level BPE, vocab {tok['vocab_size']}, in {time.perf_counter() - t1:.1f}s")
        args = SimpleNamespace(
            input=[jsonl],
            json_keys=["text"],
            output_prefix=os.path.join(tmp_dir, "stdlib"),
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=tok["vocab_file"],
            merge_file=tok["merge_file"],
            tokenizer_model=None,
            vocab_size=None,
            workers=max(1, min(workers, os.cpu_count() or 1)),
            append_eod=True,
            input_format="auto",
            chunk_bytes=1 << 20,
            no_progress=True,
        )
        summary = preprocess_data.preprocess(args)
        log("[data] " + preprocess_data.format_summary(summary).replace("\n", "\n[data] "))
        manifest = {
            **expected,
            "files": len(files),
            "input_bytes": n_bytes,
            "tokenizer_vocab_size": tok["vocab_size"],
            "documents": summary["documents"]["text"],
            "tokens": summary["tokens"]["text"],
        }
        with open(os.path.join(tmp_dir, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    log(f"[data] default corpus ready in {time.perf_counter() - t0:.1f}s: {out_dir}")
    return _result(out_dir, manifest, False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even when a matching cache exists")
    args = parser.parse_args(argv)
    try:
        result = prepare(
            args.data_dir, max_bytes=args.max_bytes, vocab_size=args.vocab_size, workers=args.workers, force=args.force
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
