"""Profiling for zb-auto: measure what every F, B and W really costs, then plan from it.

In a window of iterations ``[start_iter, end_iter)`` an ``ActionProfiler`` attached to a rank's executor records

- the time of every compute action per virtual stage (its input wait excluded: the clock starts once
  ``fetch_input`` / ``fetch_output_grad`` has returned), with ``time.perf_counter`` on CPU and CUDA events on GPU;
- the activation memory each action adds or frees:
  * on GPU, the change of ``torch.cuda.memory_allocated`` across the action;
  * on CPU, the bytes of the distinct storages the action's microbatch keeps alive: the tensors autograd has saved
    in its graph (read from the graph F built, parameters excluded, for as long as autograd keeps them) plus the
    tensors held by the deferred weight-gradient work B enqueues (captured from ``store.submit``) until W runs it;
- the resident activation bytes of the rank after every action, whose maximum is the measured peak.

``gather`` (collective over the pipeline group) adds the point-to-point latency (a ping-pong of one boundary
tensor between neighbouring ranks), takes per-stage medians and returns the same ``Profile`` on every rank.  A
``Profile`` converts to ``StageCosts`` (milliseconds, bytes), saves to and loads from JSON (``prof.json``, which
``zb-schedule simulate/show/compare --profile`` reads), and ``regenerate`` plans from it.  ``WindowReplanner`` ties
it together for a trainer: profile the window, regenerate at its end, switch the executor to the new plan at the
iteration boundary and log the predicted bubble rate and memory.

Only the recording half needs torch (imported lazily), so the schedule CLI can read profiles without it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Kind, Schedule
from zb_pipeline.schedule.profile import (  # re-exported: the profile's home is zb_pipeline.schedule.profile
    PROFILE_VERSION,
    STATISTICS,
    Profile,
    costs_for,
    load_profile,
    mem_limit_for_microbatches,
    placement_of,
    predict_makespan,
    profile_is_finite,
)
from zb_pipeline.schedule.simulate import SimResult, simulate

if TYPE_CHECKING:
    import torch

    from zb_pipeline.runtime.executor import PipelineExecutor
    from zb_pipeline.schedule.lowering import LoweredSchedule

__all__ = [
    "PROFILE_VERSION",
    "ActionProfiler",
    "Profile",
    "Replan",
    "WindowReplanner",
    "adaptive_mem_limit",
    "costs_for",
    "load_profile",
    "measure_p2p_latency",
    "mem_limit_for_microbatches",
    "placement_of",
    "predict_makespan",
    "profile_is_finite",
    "regenerate",
    "switch_plan",
]
_COMPUTE = (Kind.F, Kind.B, Kind.W, Kind.BW)


# ------------------------------------------------------------------------------------------------- replanning
@dataclass(frozen=True)
class Replan:
    """A plan generated from a profile, with the simulator's prediction under the profiled costs."""

    schedule: Schedule
    costs: StageCosts
    result: SimResult
    mem_limit: float | None

    def summary(self) -> str:
        mib = ", ".join(f"{v / 2**20:.1f}" for v in self.result.peak_memory)
        limit = "none" if self.mem_limit is None else f"{self.mem_limit / 2**20:.1f} MiB"
        s = self.schedule
        return (
            f"replanned {s.name} (p={s.num_ranks}, m={s.num_microbatches}) from profiled costs: predicted iteration "
            f"{self.result.makespan:.2f} ms, bubble rate {self.result.bubble_rate:.1%}, peak activation memory per "
            f"rank [{mib}] MiB (limit {limit}), T_comm {self.costs.comm:.3f} ms"
        )


def regenerate(
    profile: Profile,
    num_microbatches: int,
    *,
    name: str = "zb-auto",
    chunks: int | None = None,
    mem_limit: float | None = None,
) -> Replan:
    """Generate schedule ``name`` from the profiled per-stage costs; ``mem_limit`` is per rank in bytes."""
    c, costs = costs_for(profile, name, chunks=chunks)
    sched = registry.generate(name, profile.num_ranks, num_microbatches, chunks=c, costs=costs, mem_limit=mem_limit)
    return Replan(sched, costs, simulate(sched, costs), mem_limit)


def adaptive_mem_limit(percentile: float = 85.0, device: Any = None) -> float | None:
    """``--zero-bubble-max-pending-backward auto``: bytes left for activations within ``percentile`` % of the GPU
    (total * percentile / 100 minus what is allocated now, between iterations: parameters, gradients, optimizer).
    ``None`` on CPU (no device limit to fit)."""
    import torch

    if not 0 < percentile <= 100:
        raise ValueError(f"--zero-bubble-adaptive-memory-limit-percentile {percentile} must be in (0, 100]")
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0.0, total * percentile / 100.0 - torch.cuda.memory_allocated(device))


def switch_plan(executor: PipelineExecutor, schedule: Schedule) -> LoweredSchedule:
    """Make ``executor`` run ``schedule`` from its next iteration on (call between iterations).

    The new plan must keep every rank's stages and the microbatch count (stage modules, P2P boundaries and the
    trainer's data stay as they are); it is validated and lowered here, so a bad plan fails before any transfer.
    """
    from zb_pipeline.schedule.post_validation_pass import add_post_validation, has_post_validation
    from zb_pipeline.schedule.validate import validate, validate_lowered

    old = executor.lowered.schedule
    if schedule.num_microbatches != old.num_microbatches:
        raise ValueError(
            f"cannot switch from {old.name!r} to {schedule.name!r}: the new plan must keep p={old.num_ranks}, "
            f"m={old.num_microbatches} and the placement {list(old.stage_to_rank)}"
        )
    lowered = validate(schedule)
    if has_post_validation(executor.lowered):  # keep the optimizer post-validation chain of the running plan
        lowered = add_post_validation(lowered)
        validate_lowered(lowered)
    executor.load_plan(lowered)  # checks p and the placement
    return lowered


# ----------------------------------------------------------------------------------------------- measurement
def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _summarise(values: Sequence[float], statistic: str) -> float | None:
    if statistic == "median" or not values:
        return _median(values)
    return float(statistics.fmean(values))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _tensors_in(obj: Any, out: list, depth: int = 4, _seen: set | None = None) -> None:
    """Tensors reachable from ``obj`` through closures, containers and plain attributes (bounded depth)."""
    import torch

    seen = set() if _seen is None else _seen
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, torch.nn.Module):
        return
    elif callable(obj) and getattr(obj, "__closure__", None):
        items = [cell.cell_contents for cell in obj.__closure__ if cell.cell_contents is not None]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).values()
    else:
        return
    for item in items:
        _tensors_in(item, out, depth - 1, seen)


class ActionProfiler:
    """Records one rank's F/B/W/BW times and activation memory in ``[start_iter, end_iter)``.

    ``memory``: ``"auto"`` (CUDA statistics when the stages live on a GPU, saved-tensor bytes otherwise),
    ``"cuda"``, ``"saved-tensors"`` or ``"none"``.  ``end_iter=None`` profiles every iteration from ``start_iter``.
    """

    def __init__(
        self,
        executor: PipelineExecutor,
        *,
        start_iter: int = 0,
        end_iter: int | None = None,
        memory: str = "auto",
    ) -> None:
        import torch

        if end_iter is not None and end_iter <= start_iter:
            raise ValueError(f"profiling window [{start_iter}, {end_iter}) is empty: end must be > start")
        params = [p for mod in executor.stages.values() for p in mod.parameters()]
        on_cuda = any(p.is_cuda for p in params)
        if memory == "auto":
            memory = "cuda" if on_cuda else "saved-tensors"
        if memory not in ("cuda", "saved-tensors", "none"):
            raise ValueError(f"{memory=} must be one of auto, cuda, saved-tensors, none")
        self.ex = executor
        self.start_iter, self.end_iter = start_iter, end_iter
        self.memory = memory
        self.cuda = on_cuda
        self.device = str(params[0].device) if params else "cpu"
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.active = False
        self.times: dict[tuple[Kind, int], list[float]] = {}
        self.mem: dict[tuple[Kind, int], list[float]] = {}
        self.residual: dict[int, list[float]] = {}
        self.peaks: list[float] = []
        self._events: list[tuple[Kind, int, Any, Any]] = []  # CUDA: (kind, stage, start event, end event)
        self._start: Any = None
        self._in_action = False
        self._roots: dict[tuple[int, int], Any] = {}  # key -> what F saved for backward (autograd edge/tensor)
        self._work: dict[tuple[int, int], list[Any]] = {}  # key -> deferred W work objects
        self._live: dict[tuple[int, int], float] = {}  # key -> resident bytes
        self._peak = 0.0
        self._iteration_open = False
        self._cuda_base = 0
        self._torch = torch
        # CPU only (on a GPU the host work between actions overlaps the device's): the runtime's gap between actions
        self.gaps: list[float] = []  # ms from one action's end to the next handler call, profiler's own time out
        self._prev_end: float | None = None
        self._own_time = 0.0
        self._install()

    # -- wiring -----------------------------------------------------------------------------------------------
    def _install(self) -> None:
        ex = self.ex
        for kind in _COMPUTE:
            if kind in ex.handlers:
                ex.wrap_handler(kind, lambda inner, kind=kind: self._wrap(kind, inner))
        ex.hooks.input_ready.append(self._input_ready)
        if self.memory == "saved-tensors":
            ex.hooks.saved_for_backward.append(self._capture_root)
        store = ex.store

        def submitted(work: Callable[[], None]) -> None:
            # Only work from this executor's own profiled actions: the store may be shared with other executors
            # (a benchmark running several plans over the same stages), which would otherwise be held here forever.
            if self.active and self._in_action and self.memory == "saved-tensors" and store.active_key is not None:
                self._work.setdefault(store.active_key, []).append(work)

        store.on_submit.append(submitted)
        ex.hooks.iteration_start.append(self._begin_iteration)

    def _begin_iteration(self, ex: PipelineExecutor) -> None:
        self._close_iteration()
        it = ex.iteration
        self.active = it >= self.start_iter and (self.end_iter is None or it < self.end_iter)
        self._prev_end = None
        if self.active:
            self._live.clear()
            self._peak = 0.0
            if self.memory == "cuda":
                self._torch.cuda.reset_peak_memory_stats(self.device)
                self._cuda_base = self._torch.cuda.memory_allocated(self.device)
            self._iteration_open = True

    def _close_iteration(self) -> None:
        if not self._iteration_open:
            return
        self._iteration_open = False
        if self.memory == "cuda":
            self._peak = self._torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        self.peaks.append(self._peak)

    def _now(self) -> Any:
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _input_ready(self, a: Any) -> None:
        if self._in_action:
            self._start = self._now()  # the action's own work starts once its input is here

    def _wrap(self, kind: Kind, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def handler(ex: Any, a: Any) -> Any:
            if not self.active:
                return inner(ex, a)
            called = time.perf_counter()
            if self._prev_end is not None and not self.cuda:
                self.gaps.append(max(0.0, called - self._prev_end - self._own_time) * 1e3)
            key = (a.stage, a.microbatch)
            cuda_mem = self.memory == "cuda"
            before = self._torch.cuda.memory_allocated(self.device) if cuda_mem else 0
            self._in_action = True
            self._start = self._now()
            try:
                out = inner(ex, a)
                end = self._now()
            finally:
                self._in_action = False
            if self.cuda:
                self._events.append((kind, a.stage, self._start, end))
            else:
                self.times.setdefault((kind, a.stage), []).append((end - self._start) * 1e3)
            if cuda_mem:
                self.mem.setdefault((kind, a.stage), []).append(
                    float(self._torch.cuda.memory_allocated(self.device) - before)
                )
            elif self.memory == "saved-tensors":
                self._account(kind, key)
            if not self.cuda:
                self._prev_end = end
                self._own_time = time.perf_counter() - end  # the accounting above is the profiler's, not the runtime's
            return out

        return handler

    def _capture_root(self, a: Any, inp: Any, root: Any) -> None:
        if self.active:
            self._roots[(a.stage, a.microbatch)] = root

    def _resident(self, key: tuple[int, int]) -> float:
        """Bytes of the distinct live storages microbatch ``key`` holds: saved in F, or held by its W work."""
        storages: dict[int, int] = {}
        found: list = []
        root = self._roots.get(key)
        if root is not None:
            _graph_saved_tensors(root, found)
        for work in self._work.get(key, ()):
            _tensors_in(work, found)
        for t in found:
            ptr, nbytes = _storage_key(t)
            if ptr not in self._param_ptrs and nbytes > 0:
                storages[ptr] = nbytes
        return float(sum(storages.values()))

    def _account(self, kind: Kind, key: tuple[int, int]) -> None:
        if kind is Kind.W or kind is Kind.BW:
            self._work.pop(key, None)
        live = self._resident(key)
        prev = self._live.get(key, 0.0)
        self.mem.setdefault((kind, key[0]), []).append(live - prev)
        if kind is Kind.W or kind is Kind.BW:
            self.residual.setdefault(key[0], []).append(live)
            self._roots.pop(key, None)
            self._live.pop(key, None)
        else:
            self._live[key] = live
        total = sum(self._live.values())
        if total > self._peak:
            self._peak = total

    # -- results ----------------------------------------------------------------------------------------------
    def _resolve_events(self) -> None:
        if not self._events:
            return
        self._torch.cuda.synchronize(self.device)
        for kind, stage, start, end in self._events:
            self.times.setdefault((kind, stage), []).append(float(start.elapsed_time(end)))
        self._events.clear()

    def local_summary(self, statistic: str = "median") -> dict[str, Any]:
        """Per-stage summaries of this rank's samples (JSON-able; what ``gather`` exchanges): times and the gap
        between compute actions by ``statistic`` (see ``gather``), memory deltas by their median."""
        if statistic not in STATISTICS:
            raise ValueError(f"{statistic=} must be one of {STATISTICS}")
        self._close_iteration()
        self._resolve_events()
        out: dict[str, Any] = {"stages": {}, "peak": max(self.peaks, default=0.0)}
        for s in self.ex.stages:
            entry = {k.value: _summarise(self.times.get((k, s), []), statistic) for k in _COMPUTE}
            entry.update({"mem_" + k.value: _median(self.mem.get((k, s), [])) for k in _COMPUTE})
            entry["residual"] = _median(self.residual.get(s, [])) or 0.0
            entry["samples"] = len(self.times.get((Kind.F, s), []))
            out["stages"][s] = entry
        out["gap"] = _summarise(self.gaps, statistic)
        return out

    def gather(
        self, *, group: Any = None, comm_ms: float | None = None, latency_repeats: int = 20, statistic: str = "median"
    ) -> Profile:
        """Every rank's summaries and the P2P latency, combined into one ``Profile`` (collective on ``group``).

        ``statistic="median"`` (the default) gives the typical cost of each action, what a planner should plan
        with, robust to a stray slow sample.  ``"mean"`` is the statistic for *predicting* an iteration: a span is a
        sum of actions and gaps, and a sum is n times the mean, not the median (the gap between actions, mostly
        posting transfers, has a long tail on a busy host: median 0.1-0.3 ms, mean 0.4-0.8 ms here).
        """
        import torch.distributed as dist

        mine = self.local_summary(statistic)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (self.ex.rank, mine), group=group)
        else:
            gathered = [(self.ex.rank, mine)]
        if comm_ms is None:
            p2p = self.ex.p2p
            if p2p is None or not distributed or self.ex.lowered.schedule.num_ranks == 1:
                comm_ms = 0.0
            else:
                comm_ms = measure_p2p_latency(
                    pp_rank=p2p.pp_rank,
                    pp_ranks=p2p.pp_ranks,
                    group=p2p.group,
                    shape=p2p.specs[0].shape if p2p.specs else (1,),
                    dtype=p2p.specs[0].dtype if p2p.specs else None,
                    device=p2p.device,
                    repeats=latency_repeats,
                )
        sched = self.ex.lowered.schedule
        S = sched.num_stages
        per_stage: dict[int, dict[str, Any]] = {}
        peaks = [0.0] * sched.num_ranks
        for rank, summary in gathered:
            peaks[rank] = float(summary["peak"])
            for s, entry in summary["stages"].items():
                per_stage[int(s)] = entry
        missing = [s for s in range(S) if s not in per_stage or per_stage[s]["F"] is None]
        if missing:
            raise RuntimeError(
                f"profiling window [{self.start_iter}, {self.end_iter}) recorded nothing for stages {missing}: "
                "run at least one iteration inside the window before gather()"
            )

        def col(name: str) -> tuple:
            return tuple(per_stage[s][name] for s in range(S))

        gaps = [summary["gap"] for _, summary in gathered if summary.get("gap") is not None]

        mem_f = tuple(float(v or 0.0) for v in col("mem_F"))
        mem_b = []
        for s in range(S):
            e = per_stage[s]
            mem_b.append(float(e["mem_B"]) if e["mem_B"] is not None else 0.0)
        return Profile(
            num_ranks=sched.num_ranks,
            stage_to_rank=tuple(sched.stage_to_rank),
            f=tuple(float(v) for v in col("F")),
            b=col("B"),
            w=col("W"),
            bw=col("BW"),
            comm=float(comm_ms),
            mem_f=mem_f,
            mem_b=tuple(mem_b),
            mem_w=tuple(-(x + y) for x, y in zip(mem_f, mem_b)),
            residual=tuple(float(v) for v in col("residual")),
            peak_bytes=tuple(peaks),
            samples=tuple(int(v) for v in col("samples")),
            schedule=sched.name,
            num_microbatches=sched.num_microbatches,
            window=(self.start_iter, -1 if self.end_iter is None else self.end_iter),
            memory_source=self.memory,
            device=self.device,
            overhead=float(_summarise(gaps, statistic)) if gaps else 0.0,
            statistic=statistic,
        )


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _graph_saved_tensors(root: Any, out: list) -> None:
    """The tensors autograd has saved in the graph behind ``root`` (a tensor or a gradient edge), while it lives.

    Reads every node's ``_saved_*`` attributes (built-in ops) and ``saved_tensors`` (custom functions); a node
    whose buffers were freed by backward contributes nothing.  ``saved_tensors_hooks`` would see the same tensors
    as F runs, but autograd re-wraps what a hook returns, so a custom function that accumulates into the object it
    saved (a deferrable linear's weight) would lose its parameter: reading the graph changes nothing.
    """
    import torch

    node = root.grad_fn if isinstance(root, torch.Tensor) else getattr(root, "node", None)
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        names = _SAVED_NAMES.get(type(n))
        if names is None:
            names = tuple(a for a in dir(n) if a.startswith("_saved_") or a == "saved_tensors")
            _SAVED_NAMES[type(n)] = names
        for name in names:
            try:
                v = getattr(n, name)
            except RuntimeError:  # freed by backward
                continue
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (tuple, list)):
                out.extend(t for t in v if isinstance(t, torch.Tensor))
        stack.extend(nxt for nxt, _ in n.next_functions)


def measure_p2p_latency(
    *,
    pp_rank: int,
    pp_ranks: Sequence[int],
    group: Any = None,
    shape: Sequence[int] = (1,),
    dtype: Any = None,
    device: Any = "cpu",
    repeats: int = 20,
    warmup: int = 3,
    idle_s: float = 0.0,
) -> float:
    """One-way latency (ms) of one boundary tensor between neighbouring pipeline ranks: the median over every
    neighbour pair of half a blocking round trip.  Collective over the pipeline ranks (pairs run one after the
    other, so it cannot deadlock); every rank returns the same number.

    ``idle_s > 0`` measures what a pipeline hop costs when the receiver has been waiting, idle, as a rank in a
    bubble does: each side holds the message ``idle_s`` (timed exactly) before sending, so each receive finds its
    rank blocked that long; ``idle_s`` is subtracted twice from the round trip.  On a machine whose idle cores
    wake slowly (virtual machines) this is several times the back-to-back figure of ``idle_s = 0``.
    """
    import torch
    import torch.distributed as dist

    from zb_pipeline.runtime.emulate import sleep_until

    buf = torch.zeros(tuple(shape), dtype=dtype or torch.float32, device=device)
    on_cuda = buf.is_cuda
    mine: list[float] = []
    n = len(pp_ranks)
    for pair in range(n - 1):
        if pp_rank not in (pair, pair + 1):
            continue
        peer = pp_ranks[pair + 1] if pp_rank == pair else pp_ranks[pair]
        rtts = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if pp_rank == pair:
                if idle_s > 0:
                    sleep_until(t0 + idle_s)
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                if idle_s > 0:
                    sleep_until(time.perf_counter() + idle_s)
                dist.send(buf, peer, group=group)
            if on_cuda:
                torch.cuda.synchronize(buf.device)
            if i >= warmup and pp_rank == pair:
                rtts.append(time.perf_counter() - t0 - 2 * idle_s)
        if rtts:
            mine.append(statistics.median(rtts) / 2 * 1e3)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    values = [v for vs in gathered for v in vs]
    return float(statistics.median(values)) if values else 0.0


# -------------------------------------------------------------------------------------------- for a trainer
@dataclass
class WindowReplanner:
    """Profile ``[start_iter, end_iter)``, then regenerate and switch the plan at the iteration boundary.

    Call ``after_iteration(iteration)`` after every ``executor.run``; at ``end_iter - 1`` it gathers the profile
    (collective over ``group``), regenerates ``name`` with the memory limit (bytes, or ``mem_limit_microbatches``
    microbatches, or ``"auto"`` for ``percentile`` % of the GPU), switches the executor and logs one line.  It
    returns the ``Replan`` then (the trainer updates its own copies of the plan), ``None`` otherwise.  Every rank
    of the job calls it: the profile of global rank ``broadcast_src`` (one collective over the default group) and
    the smallest memory limit are used everywhere, so all tensor- and data-parallel replicas switch to one plan.
    """

    executor: PipelineExecutor
    start_iter: int
    end_iter: int
    name: str = "zb-auto"
    mem_limit: float | str | None = None
    mem_limit_microbatches: float | None = None
    percentile: float = 85.0
    group: Any = None
    save_path: str | None = None
    log: Callable[[str], None] = print
    broadcast_src: int | None = 0  # global rank whose profile every rank adopts (None: keep the group's own)
    profiler: ActionProfiler | None = field(default=None, init=False)
    profile: Profile | None = field(default=None, init=False)
    replan: Replan | None = field(default=None, init=False)
    runtime: Any = field(default=None, init=False)  # set by ``attach``

    def __post_init__(self) -> None:
        if self.end_iter <= self.start_iter:
            raise ValueError(
                f"--zero-bubble-pipeline-timers-start-iter {self.start_iter} must be below -end-iter {self.end_iter}"
            )
        self.profiler = ActionProfiler(self.executor, start_iter=self.start_iter, end_iter=self.end_iter)

    def resolve_mem_limit(self, profile: Profile) -> float | None:
        if self.mem_limit == "auto":
            return adaptive_mem_limit(self.percentile, self.profiler.device if self.profiler else None)
        if self.mem_limit is not None:
            return float(self.mem_limit)
        if self.mem_limit_microbatches is not None:
            return mem_limit_for_microbatches(profile, self.mem_limit_microbatches)
        return None

    def attach(self, runtime: Any) -> None:
        """Run inside ``runtime`` (a ``PipelineRuntime`` over this replanner's executor): called after each of its
        iterations, the switch goes through ``runtime.switch_plan`` so the runtime keeps owning its plans."""
        if runtime.executor is not self.executor:
            raise ValueError("attach the WindowReplanner to the runtime whose executor it profiles")
        self.runtime = runtime
        runtime.after_iteration.append(self.after_iteration)

    def after_iteration(self, iteration: int) -> Replan | None:
        if iteration != self.end_iter - 1 or self.replan is not None:
            return None
        profile = self.profiler.gather(group=self.group)
        profile, limit = self._agree(profile, self.resolve_mem_limit(profile))
        self.profile = profile
        current = self.executor.lowered.schedule  # keep its chunks (interleaved-zb may run 2..8)
        replan = regenerate(profile, current.num_microbatches, name=self.name, chunks=current.chunks, mem_limit=limit)
        if self.runtime is not None:
            self.runtime.switch_plan(self.runtime.plans.replanned(costs=replan.costs, mem_limit=limit))
        else:
            switch_plan(self.executor, replan.schedule)
        self.replan = replan
        rank0 = self.executor.rank == 0
        if self.save_path and rank0:
            profile.save(self.save_path)
        if rank0:
            self.log(replan.summary())
        return replan

    def _agree(self, profile: Profile, limit: float | None) -> tuple[Profile, float | None]:
        """Every rank of the job must switch to the same plan (tensor- and data-parallel peers run their
        collectives in plan order): take global rank ``broadcast_src``'s profile and the smallest memory limit."""
        import torch
        import torch.distributed as dist

        if self.broadcast_src is None or not (dist.is_available() and dist.is_initialized()):
            return profile, limit
        box: list[Any] = [profile.to_dict()]
        dist.broadcast_object_list(box, src=self.broadcast_src)
        if limit is not None or self.mem_limit == "auto":
            t = torch.tensor([math.inf if limit is None else limit], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            limit = None if math.isinf(float(t)) else float(t)
        return Profile.from_dict(box[0]), limit
