#!/usr/bin/env python
"""Per-iteration batch loading on ``make train``'s data shapes (issue 21: the work between iterations).

    python tools/bench_batch_loading.py [--microbatches 2000] [--workdir /tmp/zb-bench-batches] [--out FILE.json]

Times ``megatron.microbatches.load_microbatch`` -- what the trainer calls for each microbatch of each iteration
(``--num-workers 0``) -- for microbatches of 2 samples of 128 tokens (``make train``: ``--micro-batch-size 2
--seq-length 128``) from

- ``mock``: ``--mock-data`` (``make train --mock-data``: vocabulary 1024), and
- ``indexed``: a GPT dataset over a generated indexed dataset (uint16 tokens, 4096-token vocabulary, 2,000
  documents of 1-600 tokens; ``make train``'s default corpus is read the same way),

reporting the median wall and thread-CPU (``time.thread_time``) microseconds per sample over ``--microbatches``
consecutive microbatches (an iteration of ``make train`` loads 8 samples per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.data.gpt_dataset import GPTDataset  # noqa: E402
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter  # noqa: E402
from megatron.data.mock_data import MockGPTDataset  # noqa: E402
from megatron.microbatches import load_microbatch  # noqa: E402

SEQ, MICRO = 128, 2


def indexed_dataset(workdir: str, num_samples: int) -> GPTDataset:
    prefix = os.path.join(workdir, "bench")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(2000):
            w.add_document(rng.integers(0, 4096, size=int(rng.integers(1, 600))))
    return GPTDataset(IndexedDataset(prefix), split_name="train", document_range=(0, 2000), seq_length=SEQ,
                      seed=1234, num_samples=num_samples, cache_dir=os.path.join(workdir, "cache"))  # fmt: skip


def per_sample_us(dataset: object, microbatches: int) -> dict[str, float]:
    """Median wall and thread-CPU microseconds per sample of ``load_microbatch`` over consecutive microbatches."""
    wall, cpu = [], []
    device = torch.device("cpu")
    for k in range(microbatches):
        indices = list(range(k * MICRO, (k + 1) * MICRO))
        w0, c0 = time.perf_counter(), time.thread_time()
        load_microbatch(dataset, indices, device)
        c1, w1 = time.thread_time(), time.perf_counter()
        wall.append((w1 - w0) * 1e6 / MICRO)
        cpu.append((c1 - c0) * 1e6 / MICRO)
    return {"wall_us": statistics.median(wall), "cpu_us": statistics.median(cpu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=2000, help="timed microbatches per dataset")
    parser.add_argument("--workdir", default="/tmp/zb-bench-batches", help="where the indexed dataset is written")
    parser.add_argument("--out", help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank, as make train runs
    os.makedirs(args.workdir, exist_ok=True)
    n = args.microbatches * MICRO
    datasets = {
        "mock": MockGPTDataset(seed=1234, seq_length=SEQ, vocab_size=1024, num_samples=n),
        "indexed": indexed_dataset(args.workdir, n),
    }
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    rows = {name: per_sample_us(ds, args.microbatches) for name, ds in datasets.items()}
    print(f"load_microbatch, {MICRO} samples of {SEQ} tokens, median of {args.microbatches}, load {' '.join(load)}")
    print("| data | wall us/sample | CPU us/sample |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_us']:.1f} | {r['cpu_us']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"microbatches": args.microbatches, "load": load, "per_sample": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
