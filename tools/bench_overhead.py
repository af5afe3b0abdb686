"""Per-action overhead of the pipeline runtime: the gap between one compute action's end and the next one's start
when the next one's input is already there, split into the time inside the backend's calls, the CPU time the runtime's
own code used and the time the main thread was off the CPU.

    python tools/bench_overhead.py                      # pp = 2 and 4, emulated and real compute, a few schedules
    python tools/bench_overhead.py --pp 2 --compute emulated --schedules 1f1b zb-h2 --iterations 20
    python tools/bench_overhead.py --profile-out bench/results/overhead.prof   # cProfile of rank 0, long emulated run

How it measures (one launch of p gloo ranks per case; no wall-clock asserts anywhere):

- every compute action's handler is wrapped (outermost) and records when it was entered and left, in wall time
  (``perf_counter``) and in the main thread's CPU time (``thread_time``, ``CLOCK_THREAD_CPUTIME_ID``);
- the communication layer runs over a timing wrapper of ``torch.distributed`` (``comm.use``), which records every
  transfer -- the process group's own ``send``/``recv``, which the P2P layer's ``comm.P2PLink`` calls (or an
  ``isend``/``irecv``/``batch_isend_irecv``) -- and every wait on their work, with start and end in both clocks.
  The spans are the backend's calls themselves; the wrapper's own cost outside them (a method call per transfer and
  per wait, a small object per receive, and the clock reads' halves) stays in the runtime CPU share;
- the gap after action k = (entry of action k+1 - exit of action k) + (inside k+1: from its entry to the end of its
  input's wait, when it waited for a receive).  It counts only when that wait returned within ``BLOCKED_S`` (the
  input was there: a wait that blocked is the pipeline's dependency, not overhead);
- the gap's three parts: **backend** = the wall time inside the backend calls and waits in the gap; **runtime CPU**
  = the main thread's CPU time in the gap outside those calls (plan walking, the P2P layer's bookkeeping, hooks,
  handler dispatch, allocating receive buffers: what our code costs); **off-CPU** = the rest, gap - backend -
  runtime CPU: wall time outside the backend calls while the main thread did not run (descheduled for another
  process or for gloo's own threads, or waiting for the GIL or a page).  On a host with fewer cores than ranks the
  off-CPU part is the host's, not the runtime's; "runtime (wall)" = runtime CPU + off-CPU is what the earlier
  reports called the runtime's share.

The clocks themselves cost about 0.1 us (``perf_counter``) and 1 us (``thread_time``, a system call) per read; a gap
holds two reads of each around every backend call in it and at each action boundary.

Compute: ``emulated`` sleeps F, B, W (``zb_pipeline.runtime.emulate``, 4,4,2 ms by default), ``real`` runs small
MLP stages of the deferrable linear (hidden 256, 4 layers per stage) so B/W and autograd are real.
Writes ``overhead.md`` (and ``.json``) into ``--out`` (default ``bench/results``).  Results depend on the machine's
load: note ``uptime``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from time import perf_counter, thread_time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from zb_pipeline import comm  # noqa: E402
from zb_pipeline.comm.backend import direct_group_of  # noqa: E402
from zb_pipeline.runtime.deferrable_linear import DeferrableLinear  # noqa: E402
from zb_pipeline.runtime.emulate import EmulatedCompute, EmulatedCosts  # noqa: E402
from zb_pipeline.runtime.executor import PipelineExecutor  # noqa: E402
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec  # noqa: E402
from zb_pipeline.schedule import registry  # noqa: E402
from zb_pipeline.schedule.ir import Kind  # noqa: E402
from zb_pipeline.schedule.lowering import lower  # noqa: E402
from zb_pipeline.testing import run_multiprocess  # noqa: E402

BLOCKED_S = 2e-4  # a wait longer than this blocked: its gap is the pipeline's dependency, not overhead
TARGET_MEDIAN_MS, TARGET_MEAN_MS = 0.1, 0.2  # issue 21: the runtime's own share per gap, median and mean
COMPUTE_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)
HIDDEN, LAYERS, TOKENS = 256, 4, 64
DEFAULT_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-zb")


Span = tuple[float, float, float, float]  # (wall start, wall end, thread CPU start, thread CPU end), seconds


class TimedBackend:
    """``torch.distributed`` whose P2P calls and waits are timed: ``spans`` holds a ``Span`` of each.

    The pipeline's P2P layer calls the process group's own ``send``/``recv`` (``comm.P2PLink``); this stand-in offers
    it a timed process group (``direct_group``), so the span is the backend call itself and the only cost of the
    timing outside the spans is a method call per transfer and a small object per receive (and its wait).
    """

    _TIMED = frozenset({"isend", "irecv", "batch_isend_irecv"})

    def __init__(self, real: Any) -> None:
        self._real = real
        self.spans: list[Span] = []
        self.waits: list[Span] = []  # waits on receives only (a consumer's input)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name in self._TIMED:
            attr = functools.partial(self._timed, name, attr)
        setattr(self, name, attr)  # looked up once: the wrapper's own cost stays out of the runtime's share
        return attr

    def direct_group(self, group: Any = None) -> Any:
        real = direct_group_of(self._real, group)
        return None if real is None else _TimedGroup(real, self)

    def _timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        c0, t0 = thread_time(), perf_counter()
        out = fn(*args, **kwargs)
        t1 = perf_counter()
        self.spans.append((t0, t1, c0, thread_time()))
        if name == "batch_isend_irecv":
            return [_TimedWork(w, self, op.op is self._real.irecv) for w, op in zip(out, args[0])]
        return _TimedWork(out, self, name == "irecv")


class _TimedGroup:
    """A process group whose ``send``/``recv`` calls are timed (``TimedBackend.direct_group``)."""

    __slots__ = ("_owner", "_recv", "_send", "_spans")

    def __init__(self, pg: Any, owner: TimedBackend) -> None:
        self._send, self._recv, self._owner, self._spans = pg.send, pg.recv, owner, owner.spans

    def send(self, tensors: list, peer: int, tag: int) -> Any:
        c0, t0 = thread_time(), perf_counter()
        out = self._send(tensors, peer, tag)
        t1 = perf_counter()
        self._spans.append((t0, t1, c0, thread_time()))
        # The work itself: on gloo the P2P layer waits for sends only at the end of the iteration, outside every gap
        # (a wait inside one would count as the runtime's, overstating it, never hiding it).
        return out

    def recv(self, tensors: list, peer: int, tag: int) -> _TimedWork:
        c0, t0 = thread_time(), perf_counter()
        out = self._recv(tensors, peer, tag)
        t1 = perf_counter()
        self._spans.append((t0, t1, c0, thread_time()))
        return _TimedWork(out, self._owner, True)


class _TimedWork:
    __slots__ = ("_is_recv", "_owner", "_work")

    def __init__(self, work: Any, owner: TimedBackend, is_recv: bool) -> None:
        self._work, self._owner, self._is_recv = work, owner, is_recv

    def wait(self, *args: Any) -> Any:
        c0, t0 = thread_time(), perf_counter()
        out = self._work.wait(*args)
        t1 = perf_counter()
        span = (t0, t1, c0, thread_time())
        owner = self._owner
        owner.spans.append(span)
        if self._is_recv:
            owner.waits.append(span)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _MLPStage(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleList(DeferrableLinear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        with torch.no_grad():
            for lin in self.layers:
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * HIDDEN**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def _record_actions(ex: PipelineExecutor, log: list) -> None:
    def wrap(handler: Any) -> Any:
        def run(e: Any, a: Any) -> None:
            t0, c0 = perf_counter(), thread_time()
            handler(e, a)
            c1 = thread_time()
            log.append((t0, perf_counter(), c0, c1))

        return run

    for kind in COMPUTE_KINDS:
        ex.wrap_handler(kind, wrap)


def gaps(actions: list[Span], spans: list[Span], waits: list[Span]) -> list[tuple[float, float, float]]:
    """(gap, backend share, runtime CPU) in seconds for each pair of consecutive actions whose second one's input was
    there: the gap's wall time, the wall time inside backend calls in it, and the main thread's CPU time in it outside
    those calls.  The remainder, gap - backend - runtime CPU, is time off the CPU.

    ``actions`` are one thread's, in the order they ran (each starts after the previous one ended), so the gaps move
    forward in time and one sorted sweep over ``spans`` and ``waits`` serves them all: sorting, then linear in n + s + w
    rather than a scan of every span per gap."""
    out = []
    spans = sorted(spans)
    waits = sorted(waits)
    si = wi = 0  # next span not yet started before a gap's end; next wait not yet before an action's start
    live: list[Span] = []  # started spans (sorted) that may still reach into this gap or a later one
    for (_, end, _, cpu_end), (start, stop, cpu_start, _) in zip(actions, actions[1:]):
        while wi < len(waits) and waits[wi][0] < start:
            wi += 1
        inside = None  # the consumer's input wait, if any: the first wait within [start, stop]
        for j in range(wi, len(waits)):
            if waits[j][0] > stop:
                break
            if waits[j][1] <= stop:
                inside = waits[j]
                break
        if inside is not None and inside[1] - inside[0] > BLOCKED_S:
            continue
        until, cpu_until = (inside[1], inside[3]) if inside else (start, cpu_start)
        while si < len(spans) and spans[si][0] < until:
            live.append(spans[si])
            si += 1
        live = [s for s in live if s[1] > end]  # ended by this gap's end: by every later one's too
        backend = backend_cpu = 0.0
        for a, b, ca, cb in live:
            overlap = min(b, until) - max(a, end)
            backend += overlap
            backend_cpu += (cb - ca) * (overlap / (b - a) if b > a else 1.0)  # clipped: that share of its CPU
        out.append((until - end, backend, max(cpu_until - cpu_end - backend_cpu, 0.0)))
    return out


def _rank(rank: int, world: int, name: str, m: int, compute: str, iterations: int, costs: str, *profiling: Any):
    prof, prof_rank, prof_clock = profiling  # cProfile output path (or None), the rank it profiles, its clock
    torch.set_num_threads(1)
    import torch.distributed as dist

    sched = registry.generate(name, world, m)
    lowered = lower(sched)
    real = compute == "real"
    spec = TensorSpec((TOKENS, HIDDEN) if real else (4, 16))
    specs = [spec] * (sched.num_stages - 1)
    backend = TimedBackend(dist)
    with comm.use(backend):
        p2p = PipelineP2P(pp_rank=rank, boundary_specs=specs, timeout_s=120)
        if real:
            stages = {s: _MLPStage(s) for s in sched.stages_of(rank)}
            x0 = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
            ex = PipelineExecutor(
                lowered, rank, stages, p2p=p2p, input_fn=lambda mb: x0, loss_fn=lambda out, mb: out.square().mean()
            )
        else:
            stages = {s: torch.nn.Identity() for s in sched.stages_of(rank)}
            ex = PipelineExecutor(lowered, rank, stages, p2p=p2p, input_fn=lambda mb: None, loss_fn=lambda o, mb: None)
            EmulatedCompute(EmulatedCosts.parse(costs), chunks=sched.chunks, boundary_specs=specs).attach(ex)
        actions: list[tuple[float, float]] = []
        _record_actions(ex, actions)
        clock = thread_time if prof_clock == "cpu" else perf_counter  # cpu: what each function costs on the CPU
        profiler = cProfile.Profile(clock) if prof and rank == prof_rank else None
        per_iter = []
        warmup = 2
        for it in range(iterations + warmup):
            comm.barrier()
            backend.spans.clear()
            backend.waits.clear()
            actions.clear()
            if profiler is not None and it >= warmup:
                profiler.enable()
            ex.run(it)
            if profiler is not None:
                profiler.disable()
            if real:
                for st in stages.values():
                    for p in st.parameters():
                        p.grad = None
            if it >= warmup:
                per_iter.append(gaps(list(actions), list(backend.spans), list(backend.waits)))
        if profiler is not None:
            profiler.dump_stats(prof)
    flat = [g for it in per_iter for g in it]
    return {"gaps": flat}


def summarise(samples: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    """Median and mean of the gap and of its parts (backend, runtime CPU, off-CPU, runtime wall = the gap outside the
    backend's calls), in ms."""
    if not samples:
        return {"n": 0}
    parts = {
        "gap": [g for g, _, _ in samples],
        "backend": [b for _, b, _ in samples],
        "runtime": [g - b for g, b, _ in samples],  # wall: the earlier reports' "runtime's own share"
        "runtime_cpu": [c for _, _, c in samples],
        "off_cpu": [max(g - b - c, 0.0) for g, b, c in samples],
    }
    out: dict[str, float] = {"n": len(samples)}
    for name, values in parts.items():
        out[f"{name}_median"] = statistics.median(values) * 1e3
        out[f"{name}_mean"] = statistics.fmean(values) * 1e3
    return out


def run_case(
    name: str,
    pp: int,
    m: int,
    compute: str,
    iterations: int,
    costs: str,
    prof: str | None,
    prof_rank: int = 0,
    prof_clock: str = "wall",
) -> list[dict]:
    """One launch of ``pp`` ranks; per rank the ``summarise``d gaps (``prof``: cProfile ``prof_rank`` into it, timed
    by ``prof_clock``: "wall" or "cpu", the main thread's CPU time)."""
    args = (name, m, compute, iterations, costs, prof, prof_rank, prof_clock)
    results = run_multiprocess(_rank, pp, args=args, timeout_s=600)
    return [summarise(r["gaps"]) for r in results]


_COLUMNS = ("gap", "backend", "runtime_cpu", "off_cpu", "runtime")


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| compute | schedule | p | m | rank | gaps | gap median / mean (ms) | backend median / mean "
        "| runtime CPU median / mean | off-CPU median / mean | runtime wall (CPU + off-CPU) median / mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["stats"]
        head = f"| {r['compute']} | {r['schedule']} | {r['pp']} | {r['m']} | {r['rank']} |"
        if not s.get("n"):
            lines.append(f"{head} 0 |" + " - |" * len(_COLUMNS))
            continue
        cells = " | ".join(f"{s[c + '_median']:.3f} / {s[c + '_mean']:.3f}" for c in _COLUMNS)
        lines.append(f"{head} {s['n']} | {cells} |")
    return lines


def _worst(rows: list[dict]) -> list[str]:
    """Per (compute, p): the largest median and mean over schedules and ranks of runtime CPU and of runtime wall."""
    out = []
    for compute, p in sorted({(r["compute"], r["pp"]) for r in rows}):
        cells = [r["stats"] for r in rows if (r["compute"], r["pp"]) == (compute, p) and r["stats"].get("n")]
        if not cells:
            continue
        part = []
        for col, label in (("runtime_cpu", "runtime CPU"), ("runtime", "runtime wall")):
            med, mean = max(c[col + "_median"] for c in cells), max(c[col + "_mean"] for c in cells)
            ok = "within" if med <= TARGET_MEDIAN_MS and mean <= TARGET_MEAN_MS else "over"
            part.append(f"{label} {med:.3f} / {mean:.3f} ms ({ok})")
        out.append(f"- {compute}, p = {p}: " + "; ".join(part))
    return out


def _profile_summary(path: str, top: int = 25) -> list[str]:
    stats = pstats.Stats(path)
    stats.sort_stats("tottime")
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in sorted(
        stats.stats.items(), key=lambda kv: kv[1][2], reverse=True
    )[:top]:
        where = file.replace(ROOT + os.sep, "")
        rows.append(f"| {where}:{line} {fn} | {calls} | {tottime * 1e3:.1f} | {cumtime * 1e3:.1f} |")
    return ["| function | calls | own ms | cumulative ms |", "|---|---|---|---|", *rows]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES))
    ap.add_argument("--compute", nargs="+", choices=("emulated", "real"), default=["emulated", "real"])
    ap.add_argument("--m-per-rank", type=int, default=2, help="m = this x p (default 2)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--emulate-compute", default="4,4,2", help="F,B,W ms (emulated compute)")
    ap.add_argument("--profile-out", default=None, help="cProfile one rank of one long emulated zb-h2 run (pp 4) here")
    ap.add_argument("--profile-rank", type=int, default=0, choices=range(4), help="the rank --profile-out profiles")
    ap.add_argument("--profile-schedule", default="zb-h2", help="the schedule --profile-out runs (default zb-h2)")
    ap.add_argument(
        "--profile-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cProfile's clock: wall time, or the main thread's CPU time (what each function costs, not counting "
        "time descheduled)",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="directory for overhead.md/.json")
    ap.add_argument("--quick", action="store_true", help="pp 2 only, two schedules, 2 iterations")
    args = ap.parse_args(argv)
    if args.quick:
        args.pp, args.schedules, args.iterations = [2], ["1f1b", "zb-h2"], 2
    for p in args.pp:
        if p < 2:
            print(f"bench_overhead: --pp {p} must be >= 2 (a pipeline)", file=sys.stderr)
            return 2
    unknown = [s for s in args.schedules if s not in registry.available()]
    if unknown:
        print(f"bench_overhead: unknown schedule(s) {unknown}; pick from {registry.available()}", file=sys.stderr)
        return 2
    t_start, load_start = time.time(), _load()
    rows = []
    for compute in args.compute:
        for p in args.pp:
            m = args.m_per_rank * p
            for name in args.schedules:
                try:
                    stats = run_case(name, p, m, compute, args.iterations, args.emulate_compute, None)
                except ValueError as err:  # a schedule that does not serve this shape
                    print(f"skip {name} p={p} m={m}: {str(err).splitlines()[0]}")
                    continue
                for rank, s in enumerate(stats):
                    rows.append({"compute": compute, "schedule": name, "pp": p, "m": m, "rank": rank, "stats": s})
                    print(_table([rows[-1]])[-1], flush=True)
    lines = [
        "# Per-action overhead of the pipeline runtime",
        "",
        f"`python tools/bench_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}` -- "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}, load average {load_start} at the start, "
        f"{_load()} at the end (shared machine: compare within one run only).",
        "",
        "Gap = a compute action's end to the next one's start when its input was already there; backend = wall time "
        "inside gloo's send/recv calls (the process group's own, which the P2P layer calls) and waits; runtime CPU = "
        "the main thread's CPU time in the gap outside them (what the runtime's code costs); off-CPU = gap - "
        "backend - runtime CPU (the main thread descheduled or waiting for the GIL: the host's share); runtime wall = "
        "runtime CPU + off-CPU (tools/bench_overhead.py docstring).",
        "",
        *_table(rows),
        "",
        f"Against issue 21's target (runtime's own share at most {TARGET_MEDIAN_MS} ms median and {TARGET_MEAN_MS} ms "
        "mean), the largest cell of each setting over schedules and ranks:",
        "",
        *_worst(rows),
    ]
    if args.profile_out:
        name = args.profile_schedule
        run_case(
            name, 4, 32, "emulated", 30, args.emulate_compute, args.profile_out, args.profile_rank, args.profile_clock
        )
        where = f"rank {args.profile_rank} ({name}, p = 4, m = 32, 30 iterations, emulated, {args.profile_clock} clock)"
        lines += ["", f"## cProfile of {where}: {args.profile_out}", ""]
        lines += _profile_summary(args.profile_out)
    os.makedirs(args.out, exist_ok=True)
    md = os.path.join(args.out, "overhead.md")
    with open(md, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "overhead.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
