"""The Python cost of one pipeline stage's F, B, W and BW: our deferrable functions against torch's autograd ops.

The stages are those of the real-compute benchmark (``bench_torch_pipelining_stages.BenchModel`` split in two:
stage 0 = embedding + the first 2 of 4 layers, stage 1 = the other 2 + head + loss), one module per stage
run three ways, rotated round by round in one process (one thread):

- ``bw``: F, then the full backward with a store bound and not deferring (what our 1F1B's BW runs);
- ``split``: F, then B inside ``store.defer`` and W (``store.run``) right after (a zero-bubble schedule's B and W);
- ``autograd``: F + full backward with the linears and embeddings routed through ``F.linear``/``F.embedding``
  (``use_autograd_linears``; torch.distributed.pipelining's side of the peer benchmark).

``--size tiny`` (the default) shrinks the shapes (hidden 16, 4 tokens) so that the kernels cost next to nothing and
what is measured is the per-op Python and dispatch work: ours minus autograd is our functions' own cost.  ``--size
bench`` runs the benchmark's shapes.  Reported per way, in microseconds per microbatch, the minimum over rounds
(the least disturbed run on a shared machine) and the median of F, B (or BW), W and their sum, by this thread's
CPU time; then the median over rounds of each round's ratio of this way's sum to autograd's, and of the split's
B + W to BW (paired, so drift in the machine's load between rounds cancels).

``--instructions`` counts instructions instead (deterministic, unlike time on a shared machine): the tool re-runs
itself under ``valgrind --tool=callgrind`` with collection switched on only inside the phase being counted (a
four-line helper built with ``gcc`` against ``valgrind/callgrind.h`` issues the client requests), and reports
thousands of instructions per microbatch (about 3 minutes at the tiny size).

    python tools/bench_stage_python.py [--size tiny|bench] [--rounds 200] [--microbatches 4] [--json out.json]
    python tools/bench_stage_python.py --instructions [--reps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tools")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench_torch_pipelining_stages import BenchModel, make_batch, use_autograd_linears  # noqa: E402

from megatron.model import build_gpt_stages  # noqa: E402
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory  # noqa: E402
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store  # noqa: E402

WAYS = ("bw", "split", "autograd")
SIZES = {  # 4 layers, as tools/bench_pipeline.py's real-compute part runs (2 per stage)
    "tiny": BenchModel(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=4, vocab_size=128),
    "bench": BenchModel(num_layers=4),
}


class _StageRun:
    """One stage module run every way; ``step(way)`` returns (F, B or BW, W) CPU seconds per microbatch."""

    def __init__(self, model: BenchModel, stage: int, microbatches: int) -> None:
        (self.module,) = build_gpt_stages(model.gpt_config(), 2, stages=[stage], seed=model.seed)
        self.store = WeightGradStore()
        bind_weight_grad_store(self.module, self.store)
        self.stage, self.m = stage, microbatches
        tokens, labels = make_batch(model, microbatches)
        self.tokens, self.labels = tokens.chunk(microbatches), labels.chunk(microbatches)
        g = torch.Generator().manual_seed(11)
        shape = (model.seq_length, model.micro_batch, model.hidden_size)  # [s, b, h]
        self.hidden = [torch.randn(shape, generator=g) for _ in range(microbatches)]
        self.grads = [torch.randn(shape, generator=g) for _ in range(microbatches)]
        # --instructions: the phase being counted ("F", "B", "W") and the switch of callgrind's collection
        self.counted: str | None = None
        self.toggle: Callable[[], None] = lambda: None

    def _edge(self, phase: str) -> None:
        """Start or end of ``phase``: collection flips at the counted phase's edges."""
        if phase == self.counted:
            self.toggle()

    def step(self, way: str) -> tuple[float, float, float]:
        if way == "autograd":
            use_autograd_linears(self.module)  # instance attributes over the classes' forward, removed below
        try:
            return self._step(way)
        finally:
            for sub in self.module.modules():
                sub.__dict__.pop("forward", None)

    def _step(self, way: str) -> tuple[float, float, float]:
        for prm in self.module.parameters():
            prm.grad = None
        f = b = w = 0.0
        clock = time.thread_time
        for k in range(self.m):
            x = self.tokens[k] if self.stage == 0 else self.hidden[k].clone().requires_grad_()
            self._edge("F")
            t0 = clock()
            out = self.module(x) if self.stage == 0 else self.module(x, labels=self.labels[k]).mean()
            t1 = clock()
            self._edge("F")
            grad = self.grads[k] if self.stage == 0 else None
            self._edge("B")
            if way == "split":
                with self.store.defer(self.stage, k):
                    out.backward(grad)
                t2 = clock()
                self._edge("B")
                self._edge("W")
                self.store.run(self.stage, k)
                self._edge("W")
            else:
                out.backward(grad)
                t2 = clock()
                self._edge("B")
            t3 = clock()
            f, b, w = f + t1 - t0, b + t2 - t1, w + t3 - t2
        return f / self.m, b / self.m, w / self.m


def measure(model: BenchModel, stage: int, rounds: int, microbatches: int, warmup: int = 5) -> dict:
    run = _StageRun(model, stage, microbatches)
    times: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    for r in range(warmup + rounds):
        k = r % len(WAYS)
        for way in WAYS[k:] + WAYS[:k]:
            got = run.step(way)
            if r >= warmup:
                times[way].append(got)
    out: dict = {"stage": stage, "rounds": rounds, "microbatches": microbatches, "ways": {}}
    base = [sum(row) for row in times["autograd"]]
    for way, rows in times.items():
        cols = [[row[i] * 1e6 for row in rows] for i in range(3)] + [[sum(row) * 1e6 for row in rows]]
        out["ways"][way] = {
            "min_us": [min(c) for c in cols],  # F, B|BW, W, total
            "median_us": [statistics.median(c) for c in cols],
            # per round (the ways ran back to back), this way's total over autograd's; the median over the rounds
            "over_autograd": statistics.median(sum(row) / b for row, b in zip(rows, base)),
        }
    # (B + W) of the split over BW, paired per round
    out["split_over_bw"] = statistics.median((s[1] + s[2]) / f[1] for s, f in zip(times["split"], times["bw"]))
    return out


# ---------------------------------------------------------------------------------------- instruction counts
_CALLGRIND_HELPER = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def _callgrind_child(model: BenchModel, stages: list[int], microbatches: int, reps: int) -> None:
    """Under callgrind (instrumentation off until the warm-up is done): for every stage, way and phase, ``reps``
    steps with collection on inside that phase only, dumped under the label ``stage:way:phase``."""
    cg = ctypes.CDLL(os.environ["ZB_CALLGRIND_HELPER"])
    runs = [_StageRun(model, s, microbatches) for s in stages]
    for warm in (3, 2):
        for run in runs:
            for way in WAYS:
                for _ in range(warm):
                    run.step(way)
        if warm == 3:
            cg.cg_start()  # instrument from here on (its first steps re-warm the translated code)
    for run in runs:
        run.toggle = cg.cg_toggle
        for way in WAYS:
            for phase in ("F", "B", "W") if way == "split" else ("F", "B"):
                run.counted = phase
                cg.cg_zero()
                for _ in range(reps):
                    run.step(way)
                cg.cg_dump(f"{run.stage}:{way}:{phase}".encode())
        run.counted = None


def count_instructions(size: str, stages: list[int], microbatches: int, reps: int) -> list[dict] | str:
    """Thousands of instructions per microbatch per stage, way and phase; or why they cannot be counted."""
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        return f"--instructions needs {' and '.join(missing)} on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        helper = os.path.join(tmp, "callgrind_helper.so")
        src = os.path.join(tmp, "callgrind_helper.c")
        with open(src, "w") as fh:
            fh.write(_CALLGRIND_HELPER)
        built = subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", helper, src], capture_output=True, text=True)
        if built.returncode != 0:
            return f"--instructions could not build its callgrind helper (is valgrind/callgrind.h installed?): {built.stderr.strip()[:200]}"  # noqa: E501
        child = [sys.executable, os.path.abspath(__file__), "--size", size, "--microbatches", str(microbatches),
                 "--reps", str(reps), "--stages", *map(str, stages), "--callgrind-child"]  # fmt: skip
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={os.path.join(tmp, 'cg.%p')}", *child]  # fmt: skip
        env = {**os.environ, "ZB_CALLGRIND_HELPER": helper}
        ran = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if ran.returncode != 0:
            return f"the callgrind run failed (exit {ran.returncode}): {ran.stderr.strip()[-300:]}"
        counts: dict[str, float] = {}
        for path in glob.glob(os.path.join(tmp, "cg.*")):
            with open(path) as fh:
                text = fh.read()
            label = re.search(r"Client Request: (\S+)", text)
            total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
            if label and total:
                counts[label.group(1)] = int(total.group(1)) / reps / microbatches / 1e3
    results = []
    for stage in stages:
        ways = {}
        for way in WAYS:
            per = [counts.get(f"{stage}:{way}:{phase}", 0.0) for phase in ("F", "B", "W")]
            ways[way] = {"kilo_instructions": per + [sum(per)]}
        results.append({"stage": stage, "reps": reps, "microbatches": microbatches, "ways": ways})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--instructions", action="store_true", help="count instructions under callgrind, not time")
    ap.add_argument("--reps", type=int, default=3, help="--instructions: steps counted per way and phase")
    ap.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.microbatches < 1 or args.reps < 1:
        print("--rounds, --microbatches and --reps must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as the benchmark's ranks do
    model = SIZES[args.size]
    if args.callgrind_child:
        _callgrind_child(model, args.stages, args.microbatches, args.reps)
        return 0
    if args.instructions:
        counted = count_instructions(args.size, args.stages, args.microbatches, args.reps)
        if isinstance(counted, str):
            print(counted, file=sys.stderr)
            return 2
        for res in counted:
            print(f"stage {res['stage']} ({args.size}, {res['reps']} steps x {res['microbatches']} microbatches): "
                  "thousands of instructions per microbatch")  # fmt: skip
            print(f"  {'way':<9} " + " ".join(f"{c:>9}" for c in ("F", "B|BW", "W", "sum")) + "  /autograd")
            base = res["ways"]["autograd"]["kilo_instructions"][3]
            for way, v in res["ways"].items():
                k = v["kilo_instructions"]
                print(f"  {way:<9} " + " ".join(f"{t:9.1f}" for t in k) + f"  {k[3] / base:9.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"size": args.size, "instructions": counted}, fh, indent=1)
        return 0
    results = [measure(model, s, args.rounds, args.microbatches) for s in args.stages]
    for res in results:
        print(f"stage {res['stage']} ({args.size}, {res['rounds']} rounds x {res['microbatches']} microbatches): "
              "CPU us per microbatch, min | median")  # fmt: skip
        cols = " ".join(f"{c:>8}" for c in ("F", "B|BW", "W", "sum"))
        print(f"  {'way':<9} {cols} | {cols} | /autograd")
        for way, v in res["ways"].items():
            lo, med = v["min_us"], v["median_us"]
            row = " ".join(f"{t:8.1f}" for t in lo) + " | " + " ".join(f"{t:8.1f}" for t in med)
            print(f"  {way:<9} {row} | {v['over_autograd']:9.3f}")
        print(f"  (B + W) / BW, paired per round: {res['split_over_bw']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"size": args.size, "stages": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
