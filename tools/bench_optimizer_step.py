#!/usr/bin/env python
"""The optimizer step's own time on ``make train``'s model (issue 21: the work between iterations).

    python tools/bench_optimizer_step.py [--calls 200] [--optimizer adam] [--bf16] [--out FILE.json]

Builds the stages of ``make train``'s model (tools/make_train.py MODEL_FLAGS, the default corpus's 4096-token
vocabulary) split [3, 1] over two pipeline stages, one thread as each ``make train`` rank, gives every parameter
a data-parallel ``main_grad`` buffer (dp = 1) and the trainer's ``MainParamOptimizer`` (``--weight-decay 0.01
--clip-grad 1.0``), and times, per stage, the median over ``--calls`` calls of

- ``step``: the whole optimizer step (unscale and local statistics, clip, update rule, publish),
- ``update``: the update rule alone (``update_rule.step``), and
- ``zero_grad``: ``UpdateRule.zero_grad`` over the main parameters.

Before every call (untimed) the gradients are put back, so each call does the same work (clipped, as early in a
run), and a 64 MiB buffer is written, so each call starts with cold caches as in the trainer, where the
pipeline's forward and backward work runs between two steps (with warm caches, one stage's optimizer state
fits the L3 cache of a small machine and the timings no longer show its memory traffic). Wall time and the
thread's CPU time (``time.thread_time``) are both reported: on a shared machine the CPU time is what the step
costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.config.optimizer import OptimizerConfig  # noqa: E402
from megatron.config.precision import PrecisionConfig  # noqa: E402
from megatron.model.config import GPTConfig  # noqa: E402
from megatron.model.gpt import build_gpt_stages  # noqa: E402
from megatron.optimizer import MainParamOptimizer  # noqa: E402
from megatron.parallel.data_parallel import DataParallelReducer  # noqa: E402

# tools/make_train.py MODEL_FLAGS with the default corpus's vocabulary
MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
             vocab_size=4096, attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip
SPLIT = [range(0, 3), range(3, 4)]


def timed(fn: Callable[[], object], before: Callable[[], object], calls: int) -> dict[str, float]:
    """Median wall and thread-CPU milliseconds of ``fn`` over ``calls`` calls, ``before`` run untimed first."""
    wall, cpu = [], []
    for _ in range(calls):
        before()
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        c1, w1 = time.thread_time(), time.perf_counter()
        wall.append((w1 - w0) * 1e3)
        cpu.append((c1 - c0) * 1e3)
    return {"wall_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu)}


def bench_stage(stage: int, *, optimizer: str, bf16: bool, calls: int) -> dict[str, object]:
    config = GPTConfig(**MODEL)
    (module,) = build_gpt_stages(config, 2, stages=[stage], ranges=SPLIT)
    if bf16:
        module = module.to(torch.bfloat16)
    named = list(module.named_parameters())
    reducer = DataParallelReducer(named)
    opt = MainParamOptimizer(
        named, OptimizerConfig(optimizer=optimizer, weight_decay=0.01, clip_grad=1.0), PrecisionConfig(bf16=bf16)
    )
    opt.reducer = reducer
    grads = torch.randn(reducer.buffer.shape, generator=torch.Generator().manual_seed(stage)) * 1e-2

    flush = torch.empty(16 << 20)  # 64 MiB, more than the last-level cache

    def put_grads() -> None:
        reducer.buffer.copy_(grads)
        flush.fill_(0.0)

    rule = opt.update_rule
    opt.step(1e-4)  # the first step creates the optimizer state
    return {
        "stage": stage,
        "tensors": len(named),
        "elements": sum(p.numel() for _, p in named),
        "step": timed(lambda: opt.step(1e-4), put_grads, calls),
        "update": timed(lambda: rule.step(1e-4), put_grads, calls),
        "zero_grad": timed(rule.zero_grad, put_grads, calls),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per measurement (default 200)")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--bf16", action="store_true", help="a bf16 model (fp32 main copies published each step)")
    parser.add_argument("--out", help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank, as make train runs
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    rows = [bench_stage(s, optimizer=args.optimizer, bf16=args.bf16, calls=args.calls) for s in range(2)]
    print(f"optimizer {args.optimizer}, {'bf16' if args.bf16 else 'fp32'} model, median of {args.calls} calls, "
          f"load {' '.join(load)}")  # fmt: skip
    print("| stage | tensors | elements | step wall / CPU ms | update wall / CPU ms | zero_grad wall / CPU ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]['wall_ms']:.3f} / {r[k]['cpu_ms']:.3f}" for k in ("step", "update", "zero_grad")]  # type: ignore[index]
        print(f"| {r['stage']} | {r['tensors']} | {r['elements']:,} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"optimizer": args.optimizer, "bf16": args.bf16, "calls": args.calls, "load": load,
                       "stages": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
