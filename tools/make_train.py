"""What ``make train`` runs: a short GPT pretraining run on CPU through torchrun on 4 ranks.

Layout: tensor parallel 2 x data parallel 2 (the pipeline runtime will turn this into a zero-bubble pipeline).
Model: 4 layers, hidden 128, 4 heads, sequence 128 (about 1M parameters) on mock data (a seeded Markov chain the
model learns quickly), so on a 2-core machine the run takes a few minutes and the loss visibly falls from about
ln(1024) = 6.9.

Usage: ``python tools/make_train.py [--iters N] [--nproc N] [-- extra pretrain_gpt.py flags]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL_FLAGS = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
]  # fmt: skip


def data_flags(mock: bool) -> tuple[list[str], str]:
    """The data the demo trains on, and a one-line description of it.

    By default the corpus made from the Python standard library's sources (tools/prepare_default_corpus.py: built on
    the first run, about a minute, then reused from ``data/``); ``--mock-data`` for the synthetic Markov-chain data.
    """
    if mock:
        return ["--mock-data", "--vocab-size", "1024"], "mock data"
    sys.path.insert(0, str(ROOT / "tools"))
    import prepare_default_corpus

    info = prepare_default_corpus.prepare(str(ROOT / "data"))
    flags = [
        "--data-path", info["data_prefix"], "--split", info["split"],
        "--tokenizer-type", info["tokenizer_type"], "--vocab-file", info["vocab_file"],
        "--merge-file", info["merge_file"],
    ]  # fmt: skip
    return flags, f"default corpus ({info['documents']} stdlib files, {info['tokens']} tokens)"


def train_flags(iters: int) -> list[str]:
    return [
        "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, iters // 20)), "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--log-interval", "10", "--eval-interval", str(max(1, iters // 2)), "--eval-iters", "2",
        "--seed", "1234", "--distributed-timeout-minutes", "5",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=150, help="training iterations (default 150)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4 = tp 2 x dp 2)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="kill the run after this many seconds")
    parser.add_argument("--mock-data", action="store_true", help="train on synthetic data instead of the corpus")
    parser.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = parser.parse_args(argv)

    data, data_desc = data_flags(args.mock_data)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        str(ROOT / "pretrain_gpt.py"), *MODEL_FLAGS, *data, *train_flags(args.iters), *args.extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"[make train] {args.nproc} CPU ranks (tensor parallel 2 x data parallel {args.nproc // 2}), {data_desc}")
    print("[make train] " + " ".join(cmd[1:]), flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        why = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else "interrupted"
        print(f"[make train] {why} after {time.time() - start:.0f} s", file=sys.stderr)
        return 1
    status = "done" if code == 0 else f"FAILED (exit code {code})"
    print(f"[make train] {status} in {time.time() - start:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
