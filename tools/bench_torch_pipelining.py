"""torch.distributed.pipelining's schedules on our GPT blocks: tokens/s per schedule, CPU gloo, one thread per rank.

    python tools/bench_torch_pipelining.py [--out bench/results] [--quick] [--runs 10] [--m 4 8]

The peer comparison of the measurement issue.  Each rank builds its (virtual) stages from ``megatron.model``
(``build_gpt_stages``: the embedding on the first stage, transformer layers, the final norm and output head on the
last, vocab-parallel cross-entropy as the loss), wraps them in ``torch.distributed.pipelining.PipelineStage`` and runs
torch's schedules: GPipe and 1F1B (one stage per rank), interleaved 1F1B and interleaved zero bubble (two stages per
rank, loop placement), ZBV and DualPipeV (two stages per rank, V placement).  Every layout splits the same model the
same way (the same layers, the same seed), so all schedules compute the same losses and gradients; the test
``tests/test_bench_torch_pipelining.py`` checks that against a single-process run of the same blocks.

Linears.  Our layers' linears are ``deferrable_linear`` (one custom autograd node that yields both gradients, and
defers the weight part through our own ``WeightGradStore``).  torch splits B and W through the autograd graph, which
cannot see inside one custom node, so its zero-bubble schedules would redo the whole linear backward at W.  By
default the torch side therefore runs the same modules with their linears and embeddings routed through the plain
``F.linear`` / ``F.embedding`` autograd nodes (``use_autograd_linears``): same weights, same forward kernels, the
split torch expects.  ``--linears deferrable`` keeps ours, to measure that cost.

Timing: every schedule is built once; after ``--warmup`` iterations each, ``--runs`` rounds run every schedule once
per round in a rotating order (alternated, so load drift on a shared machine hits all alike).  An iteration is
timed between two barriers and its time is the slowest rank's.  Reported: median tokens/s and a bootstrap 95%
interval of each schedule's tokens/s ratio to 1F1B.  ``time_alternated`` and ``torch_schedule_steps`` are what the
ours-vs-theirs benchmark reuses to put both in one process group and one alternation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.model import GPTConfig, GPTStage, build_gpt_stages  # noqa: E402
from megatron.model.embedding import PositionEmbedding  # noqa: E402
from megatron.parallel.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

# name -> (torch schedule class name, stages per rank, placement)
TORCH_SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


@dataclass(frozen=True)
class BenchModel:
    """The GPT both sides run; ``micro_batch`` sequences of ``seq_length`` tokens per microbatch."""

    num_layers: int = 8
    hidden_size: int = 256
    num_attention_heads: int = 8
    seq_length: int = 128
    vocab_size: int = 1024
    micro_batch: int = 1
    seed: int = 1234

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            make_vocab_size_divisible_by=128,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            untie_embeddings_and_output_weights=True,  # torch's runtime does not sync a tied copy across stages
        )

    def tokens_per_iteration(self, m: int) -> int:
        return m * self.micro_batch * self.seq_length


QUICK_MODEL = BenchModel(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512)


def available_schedules() -> list[str]:
    """The entries of ``TORCH_SCHEDULES`` that this torch provides."""
    import torch.distributed.pipelining as pipelining

    return [name for name, (cls, _, _) in TORCH_SCHEDULES.items() if hasattr(pipelining, cls)]


# ------------------------------------------------------------------------------------------------- model pieces
def make_batch(model: BenchModel, m: int, *, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[m * micro_batch, s]`` and their next-token labels, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, model.vocab_size, (m * model.micro_batch, model.seq_length + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def make_loss_fn(model: BenchModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean token loss of logits ``[s, b, V_padded]`` against labels ``[b, s]`` (our cross-entropy)."""
    tp, vocab = TPContext(), model.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels.t(), tp, vocab_size=vocab).mean()

    return loss_fn


def _column_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, self.weight if weight is None else weight, self.bias)


def _row_forward(self, x: torch.Tensor) -> torch.Tensor:
    y = F.linear(x, self.weight)
    return y if self.bias is None else y + self.bias


def _vocab_embedding_forward(self, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, self.weight)


def _position_forward(self, seq_len: int) -> torch.Tensor:
    return F.embedding(torch.arange(seq_len, device=self.weight.device), self.weight).unsqueeze(1)


def use_autograd_linears(module: torch.nn.Module) -> int:
    """Route ``module``'s linears and embeddings (tp = 1) through the built-in autograd ops; returns how many.

    Same parameters and forward kernels as ``deferrable_linear``; the backward becomes the ordinary autograd nodes
    that ``torch.distributed.pipelining`` splits into input and weight gradients.
    """
    table = {
        ColumnParallelLinear: _column_forward,
        RowParallelLinear: _row_forward,
        VocabParallelEmbedding: _vocab_embedding_forward,
        PositionEmbedding: _position_forward,
    }
    done = 0
    for sub in module.modules():
        fn = table.get(type(sub))
        if fn is None:
            continue
        tp = getattr(sub, "tp", None)
        if tp is not None and tp.tp_size != 1:
            raise ValueError(f"use_autograd_linears needs tp_size=1, got {tp.tp_size} in {type(sub).__name__}")
        if getattr(sub, "sequence_parallel", False):
            raise ValueError("use_autograd_linears does not support sequence parallelism")
        sub.forward = types.MethodType(fn, sub)
        done += 1
    return done


def stage_indices(rank: int, pp: int, chunks: int, placement: str) -> list[int]:
    """The virtual stages rank ``rank`` holds, in chunk order (loop: r, r + pp, ...; V: r, 2pp - 1 - r)."""
    if chunks == 1:
        return [rank]
    if placement == "loop":
        return [rank + c * pp for c in range(chunks)]
    if placement == "v" and chunks == 2:
        return [rank, 2 * pp - 1 - rank]
    raise ValueError(f"placement={placement!r} with chunks={chunks} is not supported")


class ContiguousOutput(torch.nn.Module):
    """A stage whose output is made contiguous: P2P sends and receives need dense buffers (our hidden states are
    ``[s, b, h]`` views of ``[b, s, h]`` embeddings)."""

    def __init__(self, stage: GPTStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x).contiguous()


def build_modules(
    model: BenchModel, indices: Sequence[int], num_stages: int, *, linears: str
) -> list[ContiguousOutput]:
    """Our GPT stages ``indices`` of a ``num_stages``-way split, with ``linears`` in {"autograd", "deferrable"}."""
    if linears not in ("autograd", "deferrable"):
        raise ValueError(f"linears={linears!r} must be 'autograd' or 'deferrable'")
    mods = build_gpt_stages(model.gpt_config(), num_stages, stages=list(indices), seed=model.seed)
    if linears == "autograd":
        for mod in mods:
            use_autograd_linears(mod)
    return [ContiguousOutput(mod) for mod in mods]


# ------------------------------------------------------------------------------------------- one torch schedule
@dataclass
class TorchRunner:
    """One built torch schedule on this rank: ``step()`` runs one iteration (forward + backward, no optimizer)."""

    name: str
    m: int
    modules: list[ContiguousOutput]
    schedule: object
    has_first: bool
    has_last: bool
    tokens: torch.Tensor
    labels: torch.Tensor

    def zero_grad(self) -> None:
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)

    def step(self) -> list[float]:
        """One iteration; returns the per-microbatch losses on the rank holding the last stage, else ``[]``."""
        losses: list[torch.Tensor] = []
        args = (self.tokens,) if self.has_first else ()
        target = self.labels if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        return [float(x.detach()) for x in losses]

    def grads(self) -> dict[str, np.ndarray]:
        """Parameter gradients by global name (numpy, for the harness's pipe)."""
        out = {}
        for mod in self.modules:
            for name, param in mod.stage.named_parameters():
                if param.grad is not None:
                    out[mod.stage.global_name(name)] = param.grad.detach().numpy().copy()
        return out


def build_torch_runner(
    rank: int, world_size: int, model: BenchModel, name: str, m: int, *, linears: str
) -> TorchRunner:
    """Build torch schedule ``name`` (a key of ``TORCH_SCHEDULES``) for ``world_size`` ranks on this rank."""
    import torch.distributed.pipelining as pipelining

    if name not in TORCH_SCHEDULES:
        raise ValueError(f"schedule {name!r} is not one of {sorted(TORCH_SCHEDULES)}")
    cls_name, chunks, placement = TORCH_SCHEDULES[name]
    num_stages = world_size * chunks
    indices = stage_indices(rank, world_size, chunks, placement)
    modules = build_modules(model, indices, num_stages, linears=linears)
    device = torch.device("cpu")
    stages = [
        pipelining.PipelineStage(mod, idx, num_stages, device)  # shapes inferred on the first step
        for mod, idx in zip(modules, indices)
    ]
    cls = getattr(pipelining, cls_name)
    loss_fn = make_loss_fn(model)
    schedule = cls(stages[0], m, loss_fn=loss_fn) if chunks == 1 else cls(stages, m, loss_fn=loss_fn)
    tokens, labels = make_batch(model, m)
    return TorchRunner(
        name=name,
        m=m,
        modules=modules,
        schedule=schedule,
        has_first=0 in indices,
        has_last=num_stages - 1 in indices,
        tokens=tokens,
        labels=labels,
    )


def torch_schedule_steps(
    rank: int, world_size: int, model: BenchModel, names: Sequence[str], m: int, *, linears: str = "autograd"
) -> dict[str, Callable[[], None]]:
    """``{"torch:<name>": step}`` for each torch schedule, ready for ``time_alternated`` (grads zeroed per step)."""
    steps = {}
    for name in names:
        runner = build_torch_runner(rank, world_size, model, name, m, linears=linears)

        def step(r: TorchRunner = runner) -> None:
            r.zero_grad()
            r.step()

        steps[f"torch:{name}"] = step
    return steps


# ---------------------------------------------------------------------------------------------------- timing
def time_alternated(
    steps: dict[str, Callable[[], None]], *, warmup: int, runs: int, cuda: bool = False
) -> dict[str, list[float]]:
    """Seconds per iteration of each step function (collective: every rank calls this with the same keys).

    ``warmup`` untimed iterations each, then ``runs`` rounds; round ``r`` runs the schedules in an order rotated by
    ``r``.  Each iteration sits between two barriers and counts as the slowest rank's time; ``cuda``: the device is
    synchronised before the clock stops (the reduction then runs on the GPU, as NCCL needs).
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    dist.barrier()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            if cuda:
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device="cuda" if cuda else "cpu")
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(float(dt))
    return times


def bootstrap_ratio_ci(
    times: Sequence[float], base: Sequence[float], *, samples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Throughput ratio ``median(base) / median(times)`` and its bootstrap 95% interval (runs resampled in pairs)."""
    a, b = np.asarray(times, dtype=float), np.asarray(base, dtype=float)
    n = min(len(a), len(b))
    if n == 0:
        raise ValueError("bootstrap_ratio_ci needs at least one run of each")
    a, b = a[:n], b[:n]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))
    ratios = np.median(b[idx], axis=1) / np.median(a[idx], axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(np.median(b) / np.median(a)), float(lo), float(hi)


def summarize(
    times: dict[str, list[float]], tokens_per_iteration: int, *, baseline: str | None
) -> list[dict[str, object]]:
    """Rows ``{schedule, median_s, tokens_per_s, ratio, ratio_lo, ratio_hi, runs}``, ratio to ``baseline``."""
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row: dict[str, object] = {
            "schedule": name,
            "median_s": med,
            "tokens_per_s": tokens_per_iteration / med,
            "runs": len(ts),
        }
        if baseline is not None and baseline in times:
            row["ratio"], row["ratio_lo"], row["ratio_hi"] = bootstrap_ratio_ci(ts, times[baseline])
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ rank bodies
def _rank_bench(
    rank: int, world_size: int, model: BenchModel, names: list[str], m: int, linears: str, warmup: int, runs: int
) -> dict[str, list[float]]:
    torch.manual_seed(0)
    steps = torch_schedule_steps(rank, world_size, model, names, m, linears=linears)
    return time_alternated(steps, warmup=warmup, runs=runs)


def _rank_losses_and_grads(
    rank: int, world_size: int, model: BenchModel, names: list[str], m: int, linears: str
) -> dict[str, tuple[list[float], dict[str, np.ndarray]]]:
    """Per schedule: this rank's per-microbatch losses (last stage only) and gradients after one step."""
    out = {}
    for name in names:
        runner = build_torch_runner(rank, world_size, model, name, m, linears=linears)
        losses = runner.step()
        out[name] = (losses, runner.grads())
    return out


def reference_losses_and_grads(model: BenchModel, m: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same blocks in one process (one stage, deferrable linears): per-microbatch losses and the gradient of
    their mean, by global name."""
    (whole,) = build_gpt_stages(model.gpt_config(), 1, seed=model.seed)
    tokens, labels = make_batch(model, m)
    loss_fn = make_loss_fn(model)
    losses = []
    for tok, lab in zip(tokens.chunk(m), labels.chunk(m)):
        loss = loss_fn(whole(tok), lab)
        (loss / m).backward()
        losses.append(float(loss.detach()))
    grads = {whole.global_name(n): p.grad.detach().numpy().copy() for n, p in whole.named_parameters()}
    return losses, grads


def torch_losses_and_grads(
    model: BenchModel, names: Sequence[str], m: int, *, pp: int = 2, linears: str = "autograd", timeout_s: float = 120
) -> dict[str, tuple[list[float], dict[str, np.ndarray]]]:
    """One step of each torch schedule on ``pp`` gloo ranks: losses (from the last stage) and all gradients."""
    from zb_pipeline.testing.harness import run_multiprocess

    per_rank = run_multiprocess(_rank_losses_and_grads, pp, args=(model, list(names), m, linears), timeout_s=timeout_s)
    out = {}
    for name in names:
        losses = [x for r in per_rank for x in r[name][0]]
        grads = {k: v for r in per_rank for k, v in r[name][1].items()}
        out[name] = (losses, grads)
    return out


# ------------------------------------------------------------------------------------------- the benchmark
def measure_torch_pipelining(
    model: BenchModel,
    *,
    ms: Sequence[int] = (4, 8),
    pp: int = 2,
    names: Sequence[str] | None = None,
    linears: str = "autograd",
    warmup: int = 2,
    runs: int = 10,
    timeout_s: float = 1800,
) -> dict[str, object]:
    """Run the benchmark; returns ``{"settings": ..., "results": {m: rows}}`` (rows as in ``summarize``)."""
    from zb_pipeline.testing.harness import run_multiprocess

    names = list(names or available_schedules())
    results = {}
    for m in ms:
        usable = [n for n in names if TORCH_SCHEDULES[n][0] != "ScheduleDualPipeV" or m >= 2 * pp]
        per_rank = run_multiprocess(
            _rank_bench, pp, args=(model, usable, m, linears, warmup, runs), timeout_s=timeout_s
        )
        times = per_rank[0]
        rows = summarize(times, model.tokens_per_iteration(m), baseline="torch:1f1b")
        results[m] = rows
    settings = {
        "model": asdict(model),
        "pp": pp,
        "ms": list(ms),
        "linears": linears,
        "warmup": warmup,
        "runs": runs,
        "threads_per_rank": 1,
        "backend": "gloo",
    }
    return {"settings": settings, "results": results, "environment": environment()}


def environment() -> dict[str, object]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "load_average": load,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def to_markdown(report: dict[str, object]) -> str:
    s, env = report["settings"], report["environment"]
    mdl = s["model"]
    load = env["load_average"]
    lines = [
        "# torch.distributed.pipelining on our GPT blocks",
        "",
        f"Machine: {env['machine']}, {env['cpus']} CPUs"
        + (f", load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end" if load else "")
        + f"; python {env['python']}, torch {env['torch']}, numpy {env['numpy']}; {env['date']}.",
        "",
        f"Model: {mdl['num_layers']} layers, hidden {mdl['hidden_size']}, {mdl['num_attention_heads']} heads, "
        f"seq {mdl['seq_length']}, vocab {mdl['vocab_size']}, micro-batch {mdl['micro_batch']} "
        f"(fp32, dropout 0). pp = {s['pp']} gloo ranks, {s['threads_per_rank']} thread each; linears: "
        f"{s['linears']}. Forward + backward per iteration (no optimizer); {s['warmup']} warm-up iterations, then "
        f"{s['runs']} alternated runs per schedule; time = slowest rank; ratio = tokens/s over torch 1F1B with a "
        "bootstrap 95% interval.",
        "",
        "| m | schedule | median iteration (s) | tokens/s | vs 1F1B [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for m, rows in report["results"].items():
        for row in rows:
            ratio = f"{row['ratio']:.3f} [{row['ratio_lo']:.3f}, {row['ratio_hi']:.3f}]" if "ratio" in row else "-"
            lines.append(f"| {m} | {row['schedule']} | {row['median_s']:.3f} | {row['tokens_per_s']:,.0f} | {ratio} |")
    lines += [
        "",
        "DualPipeV needs m >= 2 pp here; interleaved schedules use 2 stages per rank (loop placement), ZBV and "
        "DualPipeV 2 per rank in V placement, all over the same layers. Shared machine: other jobs ran concurrently.",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, object], out_dir: str, stem: str = "torch_pipelining") -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump({**report, "results": {str(k): v for k, v in report["results"].items()}}, f, indent=1)
    with open(md_path, "w") as f:
        f.write(to_markdown(report))
    return json_path, md_path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="a smaller model, m = 4 only, 3 runs (smoke test)")
    ap.add_argument("--m", type=int, nargs="+", default=None, help="microbatch counts (default 4 8)")
    ap.add_argument("--runs", type=int, default=None, help="alternated runs per schedule (default 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=None, choices=sorted(TORCH_SCHEDULES))
    ap.add_argument("--linears", choices=("autograd", "deferrable"), default="autograd")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = QUICK_MODEL if args.quick else BenchModel()
    for field, value in (
        ("num_layers", args.layers),
        ("hidden_size", args.hidden),
        ("seq_length", args.seq),
        ("micro_batch", args.micro_batch),
    ):
        if value is not None:
            if value < 1:
                ap.error(f"--{field}={value} must be >= 1")
            model = replace(model, **{field: value})
    if model.num_layers % 4:
        ap.error(f"--layers={model.num_layers} must be a multiple of 4 (pp = 2 ranks x 2 chunks)")
    ms = args.m or ([4] if args.quick else [4, 8])
    if any(m < 2 for m in ms):
        ap.error(f"--m {ms}: every microbatch count must be >= pp = 2")
    runs = args.runs or (3 if args.quick else 10)
    t0 = time.perf_counter()
    report = measure_torch_pipelining(
        model, ms=ms, names=args.schedules, linears=args.linears, warmup=args.warmup, runs=runs
    )
    paths = write_report(report, args.out)
    print(to_markdown(report))
    print(f"wrote {paths[0]} and {paths[1]} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    # Run through the importable module so that the rank bodies pickle by module name.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_torch_pipelining

    sys.exit(bench_torch_pipelining.main())
