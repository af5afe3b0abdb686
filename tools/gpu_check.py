"""GPU path check: one pipeline stage's F, B and W on CUDA for a 1.5B-style layer stack (bf16).

    python tools/gpu_check.py [--out bench/results] [--layers 6] [--hidden 1600] [--heads 25] [--seq 1024]
                              [--micro-batch 4] [--peak-tflops N] [--device cuda|cpu] [--kernels torch|auto|triton]
    python tools/gpu_check.py --full [--out bench/results] [--budget 285]

``--full`` runs the prepared GPU check of ``tools/gpu_check_full.py`` instead (kernels against their references and
timed, this stage measurement with the kernels on, training through torchrun with NCCL, pp = 2 on gloo), within
5 minutes, writing ``gpu_check.{md,json}``.  The rest of this docstring is the stage measurement.

Builds the transformer layers of one stage from ``megatron.model`` (GPT-2 XL widths by default: hidden 1600,
25 heads, 4x MLP), in bf16 with fp32 ``main_grad`` buffers as the mixed-precision trainer has them, and times

* F  : the stage forward of one microbatch,
* BW : a full backward (input and weight gradients at once, accumulated into ``main_grad``),
* B  : the backward inside ``WeightGradStore.defer``: input gradients only, weight work enqueued,
* W  : ``WeightGradStore.run``: the deferred weight gradients, accumulated into ``main_grad``,

with CUDA events after a warm-up (median of ``--repeats``).  It reports per-action time, achieved TFLOP/s and MFU
(model FLOPs over the device's dense bf16 peak, from a table by device name or ``--peak-tflops``), and
``(B + W) / BW``, the cost of the zero-bubble split.  FLOPs count the matmuls: linears ``2 * tokens * in * out``
per forward, causal attention ``2 * b * s^2 * heads * head_dim`` (half of the full ``QK^T`` and ``PV`` products);
B = the input-gradient half of the linears plus twice the attention forward, W = the weight-gradient half, BW = B + W.

Without CUDA (and without ``--device cpu``) it prints one line and exits 0.  ``--device cpu`` runs the same
measurement code on the CPU (with a small ``--tiny`` stack that is what the tests use).  Pure Python: no build step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, matched in order as substrings of the CUDA device name.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
)

ACTIONS = ("F", "BW", "B", "W")


@dataclass(frozen=True)
class StackShape:
    """One stage's layer stack and microbatch."""

    layers: int = 6
    hidden: int = 1600
    heads: int = 25
    seq: int = 1024
    micro_batch: int = 4
    ffn: int | None = None  # default 4 * hidden

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    def check(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "micro_batch"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden={self.hidden} must be divisible by --heads={self.heads}")


TINY = StackShape(layers=2, hidden=64, heads=4, seq=32, micro_batch=2)


# ------------------------------------------------------------------------------------------------------ FLOPs
def linear_flops(shape: StackShape) -> int:
    """Forward FLOPs of one layer's linears: QKV, attention output, MLP in and out."""
    h, t = shape.hidden, shape.tokens
    return 2 * t * h * (3 * h + h + 2 * shape.ffn_size)


def attention_flops(shape: StackShape) -> int:
    """Forward FLOPs of one layer's causal attention: ``QK^T`` and ``PV``, half of the full square each."""
    return 2 * shape.micro_batch * shape.seq * shape.seq * shape.hidden


def action_flops(shape: StackShape) -> dict[str, int]:
    """Model FLOPs of each action over the whole stack."""
    lin, att = linear_flops(shape) * shape.layers, attention_flops(shape) * shape.layers
    b, w = lin + 2 * att, lin
    return {"F": lin + att, "B": b, "W": w, "BW": b + w}


def peak_tflops_for(device_name: str) -> float | None:
    """The dense bf16 peak of a CUDA device by name, or None if it is not in ``PEAK_BF16_TFLOPS``."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def mfu(flops: int, seconds: float, peak_tflops: float | None) -> float | None:
    """Fraction of the peak achieved (``None`` without a peak)."""
    if peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


# ---------------------------------------------------------------------------------------------------- timing
def time_call(fn: Callable[[], object], *, cuda: bool) -> float:
    """Seconds one call of ``fn`` takes: CUDA events on CUDA, ``perf_counter`` on CPU (the check's one clock)."""
    if cuda:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Timer:
    """``time_call`` on ``device``."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        return time_call(fn, cuda=self.cuda)


def build_stack(shape: StackShape, device, dtype, kernels: str = "torch"):
    """A middle pipeline stage (no embedding, no head) of ``shape.layers`` layers with fp32 ``main_grad``; the fused
    kernels chosen by ``--kernels`` (``megatron.kernels.select``) are applied; ``stage.kernels`` says which."""
    import torch

    from megatron.model import GPTConfig, GPTStage

    cfg = GPTConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn_size,
        vocab_size=128,
        seq_length=shape.seq,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    stage = GPTStage(cfg, layer_range=range(shape.layers), pre_process=False, post_process=False, seed=1234)
    stage = stage.to(device=device, dtype=dtype)
    for p in stage.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    from megatron.config.kernels import KernelConfig
    from megatron.kernels.select import apply_kernels, resolve_kernels

    selection = resolve_kernels(KernelConfig(kernels=kernels), cfg, on_cuda=device.type == "cuda")
    apply_kernels(stage, selection)
    stage.kernels = selection.describe()
    return stage


def _one_round(stage, store, timer: _Timer, x0, dy, *, microbatch: int) -> dict[str, float]:
    """F then a full backward; then F again (untimed), B (deferring) and W.  Seconds per action."""
    x = x0.detach().requires_grad_(True)
    out: list = []
    t_f = timer(lambda: out.append(stage(x)))
    t_bw = timer(lambda: out[0].backward(dy))  # no defer: input and weight gradients now
    out.clear()
    x = x0.detach().requires_grad_(True)
    y = stage(x)

    def b_action() -> None:
        with store.defer(0, microbatch):
            y.backward(dy)

    t_b = timer(b_action)
    t_w = timer(lambda: store.run(0, microbatch))
    store.assert_empty()
    return {"F": t_f, "BW": t_bw, "B": t_b, "W": t_w}


def measure(
    shape: StackShape, *, device_name: str, dtype_name: str, warmup: int, repeats: int, kernels: str = "torch"
) -> dict[str, object]:
    """Time F, BW, B and W of the stack; returns ``{action: [seconds, ...]}`` plus the memory peak."""
    import torch

    from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

    shape.check()
    if warmup < 0 or repeats < 1:
        raise ValueError(f"--warmup={warmup} must be >= 0 and --repeats={repeats} >= 1")
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    stage = build_stack(shape, device, dtype, kernels)
    store = WeightGradStore()
    bind_weight_grad_store(stage, store)
    timer = _Timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x0 = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    times: dict[str, list[float]] = {a: [] for a in ACTIONS}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + repeats):
        measured = _one_round(stage, store, timer, x0, dy, microbatch=i)
        if i >= warmup:
            for a in ACTIONS:
                times[a].append(measured[a])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"times": times, "peak_memory_bytes": peak, "kernels": stage.kernels}


# --------------------------------------------------------------------------------------------------- report
def summarize(
    shape: StackShape, times: dict[str, Sequence[float]], *, peak_tflops: float | None
) -> dict[str, dict[str, float | None]]:
    """Per action: median ms, TFLOP/s, MFU; plus ``split`` = (B + W) / BW from the medians."""
    flops = action_flops(shape)
    rows: dict[str, dict[str, float | None]] = {}
    for a in ACTIONS:
        med = statistics.median(times[a])
        rows[a] = {
            "median_ms": med * 1e3,
            "tflops": flops[a] / med / 1e12 if med > 0 else None,
            "mfu": mfu(flops[a], med, peak_tflops),
            "gflop": flops[a] / 1e9,
        }
    bw = rows["BW"]["median_ms"]
    rows["split"] = {
        "b_plus_w_over_bw": (rows["B"]["median_ms"] + rows["W"]["median_ms"]) / bw if bw else None,
        "w_share_of_b_plus_w": rows["W"]["median_ms"] / (rows["B"]["median_ms"] + rows["W"]["median_ms"]),
    }
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def to_markdown(report: dict[str, object]) -> str:
    s, rows, env = report["shape"], report["rows"], report["environment"]
    peak = report["peak_tflops"]
    lines = [
        "# GPU path check: one stage's F, B and W",
        "",
        f"Device: {env['device_name']} ({report['device']}); peak {_fmt(peak, '.0f')} TFLOP/s dense "
        f"{report['dtype']}; python {env['python']}, torch {env['torch']}; {env['date']}.",
        f"Stack: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, ffn {s['ffn'] or 4 * s['hidden']}, "
        f"seq {s['seq']}, micro-batch {s['micro_batch']}, {report['dtype']} with fp32 main_grad; "
        f"median of {report['repeats']} after {report['warmup']} warm-up.",
        "",
        "| action | median (ms) | GFLOP | TFLOP/s | MFU |",
        "|---|---|---|---|---|",
    ]
    if report.get("kernels"):
        lines[4:4] = [f"Kernels: {report['kernels']}."]
    for a in ACTIONS:
        r = rows[a]
        lines.append(
            f"| {a} | {r['median_ms']:.3f} | {r['gflop']:.4g} | {_fmt(r['tflops'], '.4g')} | "
            f"{_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.1f')}{'' if r['mfu'] is None else '%'} |"
        )
    split = rows["split"]
    lines += [
        "",
        f"(B + W) / BW = {_fmt(split['b_plus_w_over_bw'], '.3f')}; W holds "
        f"{100 * split['w_share_of_b_plus_w']:.1f}% of B + W.",
    ]
    if report.get("peak_memory_bytes"):
        lines.append(f"Peak memory allocated: {report['peak_memory_bytes'] / 2**30:.2f} GiB.")
    lines.append("")
    return "\n".join(lines)


def environment(device_name: str) -> dict[str, object]:
    import torch

    name = torch.cuda.get_device_name(0) if device_name == "cuda" else platform.processor() or platform.machine()
    return {
        "device_name": name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_check(
    shape: StackShape,
    *,
    device: str,
    dtype: str,
    warmup: int,
    repeats: int,
    peak_tflops: float | None,
    kernels: str = "torch",
) -> dict[str, object]:
    """Measure and summarise; the whole report as a JSON-ready dict."""
    env = environment(device)
    if peak_tflops is None and device == "cuda":
        peak_tflops = peak_tflops_for(env["device_name"])
    measured = measure(shape, device_name=device, dtype_name=dtype, warmup=warmup, repeats=repeats, kernels=kernels)
    return {
        "shape": asdict(shape),
        "device": device,
        "dtype": dtype,
        "warmup": warmup,
        "repeats": repeats,
        "peak_tflops": peak_tflops,
        "rows": summarize(shape, measured["times"], peak_tflops=peak_tflops),
        "times_s": measured["times"],
        "peak_memory_bytes": measured["peak_memory_bytes"],
        "kernels": measured["kernels"],
        "environment": env,
    }


def write_report(report: dict[str, object], out_dir: str, stem: str = "gpu_check") -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    with open(md_path, "w") as f:
        f.write(to_markdown(report))
    return json_path, md_path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--layers", type=int, default=StackShape.layers)
    ap.add_argument("--hidden", type=int, default=StackShape.hidden)
    ap.add_argument("--heads", type=int, default=StackShape.heads)
    ap.add_argument("--seq", type=int, default=StackShape.seq)
    ap.add_argument("--micro-batch", type=int, default=StackShape.micro_batch)
    ap.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)")
    ap.add_argument("--tiny", action="store_true", help=f"a tiny stack ({TINY.layers} layers, hidden {TINY.hidden})")
    ap.add_argument("--quick", action="store_true", help="2 layers, 2 warm-up, 5 repeats")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's peak (TFLOP/s)")
    ap.add_argument("--kernels", choices=("torch", "auto", "triton"), default="torch", help="fused kernels (--kernels)")
    ap.add_argument("--full", action="store_true", help="the prepared GPU check (tools/gpu_check_full.py)")
    ap.add_argument("--budget", type=float, default=285.0, help="--full: seconds for all its steps together")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device available (torch {torch.__version__}); nothing to check.")
        return 0
    if args.full:
        return _full(args)
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.quick:
        args.layers, args.warmup, args.repeats = 2, 2, 5
    if args.tiny:
        shape = TINY
    else:
        shape = StackShape(args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.ffn)
    try:
        shape.check()
        if args.peak_tflops is not None and args.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops={args.peak_tflops} must be > 0")
        if args.warmup < 0 or args.repeats < 1:
            raise ValueError(f"--warmup={args.warmup} must be >= 0 and --repeats={args.repeats} >= 1")
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report = run_check(
        shape,
        device=args.device,
        dtype=args.dtype,
        warmup=args.warmup,
        repeats=args.repeats,
        peak_tflops=args.peak_tflops,
        kernels=args.kernels,
    )
    paths = write_report(report, args.out)
    print(to_markdown(report))
    print(f"gpu_check: wrote {paths[0]} and {paths[1]} in {time.perf_counter() - t0:.1f} s")
    return 0


def _full(args: argparse.Namespace) -> int:
    """``--full``: every step guarded and timed out (``gpu_check_full``); exit 1 if any step did not pass."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_check_full

    if not 60 <= args.budget <= 3600:
        print(f"gpu_check: --budget={args.budget} must be between 60 and 3600 seconds", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report = gpu_check_full.run_full(args.out, budget_s=args.budget, micro_batch=min(args.micro_batch, 2))
    print(gpu_check_full.to_markdown(report))
    print(f"gpu_check --full: wrote {args.out}/gpu_check.json and .md in {time.perf_counter() - t0:.0f} s")
    return 0 if gpu_check_full.all_passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
