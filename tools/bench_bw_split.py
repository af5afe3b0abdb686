"""The cost of splitting a backward into B and W, for one transformer layer on CPU.

Compares, alternating, with a warm-up: a full backward; B (input gradient, weight work deferred into a
``WeightGradStore``) then W (the store's run) for our deferrable layer; the generic autograd split on torch's
``nn.TransformerEncoderLayer``; and a naive two-pass split (``autograd.grad`` for the input, then again for the
weights).  Prints medians and the ratios (B + W) / full and W's share of the backward.

    python tools/bench_bw_split.py [--hidden 512] [--seq 256] [--batch 2] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from megatron.model import GPTConfig
from megatron.model.init import initialize_parameters
from megatron.model.transformer_layer import TransformerLayer
from megatron.parallel.tensor_parallel import TPContext
from zb_pipeline.runtime.generic_split import GenericSplit
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

Timed = Callable[[], tuple[float, float]]


def _alternate(fns: dict[str, Timed], reps: int, warmup: int = 2) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            a, b = fn()
            if i >= warmup:
                out[name][0].append(a)
                out[name][1].append(b)
    return out


def measure(hidden: int, seq: int, batch: int, reps: int) -> dict[str, float]:
    """Median milliseconds of each part, and the ratios."""
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    cfg = GPTConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=128, seq_length=seq,
        attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    tp = TPContext()
    layer = TransformerLayer(cfg, layer_number=0, tp=tp)
    initialize_parameters(layer, seed=0, config=cfg, tp=tp)
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    x0, g = torch.randn(seq, batch, hidden), torch.randn(seq, batch, hidden)  # [s, b, h]
    store = WeightGradStore()
    bind_weight_grad_store(layer, store)
    enc = torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, norm_first=True)
    generic = GenericSplit(enc, store)

    def full(mod: torch.nn.Module) -> Timed:
        def run() -> tuple[float, float]:
            y = mod(x0.clone().requires_grad_())
            t = time.perf_counter()
            y.backward(g)
            return time.perf_counter() - t, 0.0

        return run

    def split() -> tuple[float, float]:
        y = layer(x0.clone().requires_grad_())
        t = time.perf_counter()
        with store.defer(0, 0):
            y.backward(g)
        t1 = time.perf_counter()
        store.run(0, 0)
        return t1 - t, time.perf_counter() - t1

    def generic_split() -> tuple[float, float]:
        x = x0.clone().requires_grad_()
        y = enc(x)
        t = time.perf_counter()
        with store.defer(0, 0):
            generic.backward_input([y], [g], [x])
        t1 = time.perf_counter()
        store.run(0, 0)
        return t1 - t, time.perf_counter() - t1

    def naive() -> tuple[float, float]:
        x = x0.clone().requires_grad_()
        y = enc(x)
        t = time.perf_counter()
        torch.autograd.grad(y, x, g, retain_graph=True)
        t1 = time.perf_counter()
        torch.autograd.grad(y, list(enc.parameters()), g)
        return t1 - t, time.perf_counter() - t1

    res = _alternate(
        {"full": full(layer), "split": split, "enc_full": full(enc), "generic": generic_split, "naive": naive}, reps
    )
    med = {k: (statistics.median(a) * 1e3, statistics.median(b) * 1e3) for k, (a, b) in res.items()}
    b, w = med["split"]
    gb, gw = med["generic"]
    nb, nw = med["naive"]
    return {
        "full_ms": med["full"][0],
        "B_ms": b,
        "W_ms": w,
        "split_ratio": (b + w) / med["full"][0],
        "W_share": w / (b + w),
        "generic_ratio": (gb + gw) / med["enc_full"][0],
        "naive_ratio": (nb + nw) / med["enc_full"][0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.hidden, args.seq, args.batch, args.reps)
    print(
        f"one layer, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, 1 thread, median of {args.reps}:\n"
        f"  deferrable layer: full backward {r['full_ms']:.1f} ms, B {r['B_ms']:.1f} ms + W {r['W_ms']:.1f} ms, "
        f"(B+W)/full = {r['split_ratio']:.3f}, W share of backward {r['W_share']:.2f}\n"
        f"  generic split (nn.TransformerEncoderLayer): (B+W)/full = {r['generic_ratio']:.3f}; "
        f"naive two-pass autograd: {r['naive_ratio']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
