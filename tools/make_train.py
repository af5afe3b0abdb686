"""What ``make train`` runs: a short GPT pretraining run on CPU through torchrun on 4 ranks, as a zero-bubble pipeline.

Layout: pipeline parallel 2 x data parallel 2, schedule ZB-H1 (1F1B's memory, a third of its bubble, the same losses
bit for bit).  Data parallelism rather than tensor parallelism next to the pipeline because on two shared CPU cores
tp's per-layer all-reduces cost more than dp's one bucketed all-reduce per iteration.  Each replica runs 4
microbatches of 2 samples per iteration through the plan.

Model: 4 layers (2 per stage), hidden 128, 4 heads, sequence 128 on the default corpus (the Python standard library's
sources, BPE-tokenised on the first run), so on a 2-core machine the run takes a few minutes and the loss visibly
falls.  The run writes what every rank executed as a Chrome/Perfetto trace, ``runs/make_train/trace.json``, and draws
it above the planned timeline in ``runs/make_train/trace.png`` (``zb-schedule show --trace``).

Usage: ``python tools/make_train.py [--iters N] [--schedule NAME] [--mock-data] [-- extra pretrain_gpt.py flags]``.
``TRAIN_ITERS=N make train`` sets the default of ``--iters`` (as it does for the scripts in ``examples/``).
"""

from __future__ import annotations

import argparse
import json
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


def train_flags(iters: int, schedule: str, trace: Path) -> list[str]:
    return [
        "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, iters // 20)), "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--pipeline-trace", str(trace),
        "--log-interval", "10", "--eval-interval", str(max(1, iters // 2)), "--eval-iters", "2",
        "--seed", "1234", "--distributed-timeout-minutes", "5",
    ]  # fmt: skip


def draw_trace(trace: Path, png: Path) -> None:
    """The last iteration of the trace above the plan simulated with the measured costs."""
    sys.path.insert(0, str(ROOT))
    from zb_pipeline.schedule.trace_timeline import plot_trace_vs_plan

    doc = json.loads(trace.read_text())
    measured, planned = plot_trace_vs_plan(doc, png)
    print(
        f"[make train] iteration {measured.iteration + 1}: measured {measured.span_ms:.0f} ms (bubble rate "
        f"{measured.bubble_rate:.0%}), the plan under the measured costs {planned.makespan:.0f} ms (bubble rate "
        f"{planned.bubble_rate:.0%})"
    )
    print(f"[make train] trace {trace.relative_to(ROOT)} (chrome://tracing, ui.perfetto.dev), picture "
          f"{png.relative_to(ROOT)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iters",
        type=int,
        default=int(os.environ.get("TRAIN_ITERS", "150")),
        help="training iterations (default: $TRAIN_ITERS, else 150; the doc test runs `make train` with TRAIN_ITERS=2)",
    )
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4 = pp 2 x dp 2)")
    parser.add_argument("--schedule", default="zb-h1", help="pipeline schedule (default zb-h1; e.g. zb-v, 1f1b)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="kill the run after this many seconds")
    parser.add_argument("--mock-data", action="store_true", help="train on synthetic data instead of the corpus")
    parser.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = parser.parse_args(argv)

    data, data_desc = data_flags(args.mock_data)
    out = ROOT / "runs" / "make_train"
    out.mkdir(parents=True, exist_ok=True)
    trace, png = out / "trace.json", out / "trace.png"
    trace.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        str(ROOT / "pretrain_gpt.py"), *MODEL_FLAGS, *data, *train_flags(args.iters, args.schedule, trace),
        *args.extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(
        f"[make train] {args.nproc} CPU ranks: pipeline parallel 2 x data parallel {args.nproc // 2}, "
        f"schedule {args.schedule}; {data_desc}"
    )
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
    print(f"[make train] {status} in {time.time() - start:.0f} s (pipeline schedule {args.schedule})", flush=True)
    if code == 0 and trace.exists():
        draw_trace(trace, png)
    return code


if __name__ == "__main__":
    sys.exit(main())
