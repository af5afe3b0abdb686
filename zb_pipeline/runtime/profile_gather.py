"""From one rank's samples to the pipeline's ``Profile``: summaries, the collective gather, the P2P latency.

Every rank summarises its own samples per virtual stage (``local_summary``: JSON-able, what the ranks exchange);
``gather`` exchanges the summaries over the pipeline group, adds the point-to-point latency (a ping-pong of one
boundary tensor between neighbouring ranks, ``measure_p2p_latency``) and returns the same ``Profile`` on every
rank.  ``ActionProfiler.gather`` (``zb_pipeline.runtime.profiler``) is the usual way in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from zb_pipeline import comm
from zb_pipeline.runtime.emulate import sleep_until
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.profile import STATISTICS, Profile

if TYPE_CHECKING:
    from zb_pipeline.runtime.executor import PipelineExecutor

__all__ = ["COMPUTE_KINDS", "executor_p2p_latency", "gather", "local_summary", "measure_p2p_latency", "summarise"]

COMPUTE_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)


def summarise(values: Sequence[float], statistic: str = "median") -> float | None:
    """``statistic`` (``"median"`` or ``"mean"``) of ``values``; ``None`` when there are none."""
    if not values:
        return None
    if statistic == "median":
        return float(statistics.median(values))
    return float(statistics.fmean(values))


def local_summary(
    stages: Iterable[int],
    *,
    times: Mapping[tuple[Kind, int], Sequence[float]],
    mem: Mapping[tuple[Kind, int], Sequence[float]],
    residual: Mapping[int, Sequence[float]],
    gaps: Sequence[float],
    boundaries: Sequence[float] = (),
    transient: Mapping[tuple[Kind, int], Sequence[float]] | None = None,
    peaks: Sequence[float],
    statistic: str = "median",
) -> dict[str, Any]:
    """Per-stage summaries of one rank's samples (JSON-able; what ``gather`` exchanges): times and the gap between
    compute actions and between iterations (``boundaries``) by ``statistic`` (see ``gather``), memory deltas and
    residuals by their median."""
    if statistic not in STATISTICS:
        raise ValueError(f"{statistic=} must be one of {STATISTICS}")
    out: dict[str, Any] = {"stages": {}, "peak": max(peaks, default=0.0)}
    for s in stages:
        entry = {k.value: summarise(times.get((k, s), []), statistic) for k in COMPUTE_KINDS}
        entry.update({"mem_" + k.value: summarise(mem.get((k, s), [])) for k in COMPUTE_KINDS})
        entry["residual"] = summarise(residual.get(s, [])) or 0.0
        for k in (Kind.B, Kind.BW):  # None: no such action ran
            entry[f"mem_{k.value}_transient"] = summarise((transient or {}).get((k, s), []))
        entry["samples"] = len(times.get((Kind.F, s), []))
        out["stages"][s] = entry
    out["gap"] = summarise(gaps, statistic)
    out["boundary"] = summarise(boundaries, statistic)
    return out


def _distributed() -> bool:
    return comm.is_initialized()


def _exchange(rank: int, summary: dict[str, Any], group: Any) -> list[tuple[int, dict[str, Any]]]:
    """Every rank's ``(rank, summary)`` (collective on ``group`` when torch.distributed is up)."""
    if not _distributed():
        return [(rank, summary)]
    gathered: list[Any] = [None] * comm.world_size(group)
    comm.all_gather_object(gathered, (rank, summary), group=group)
    return gathered


def executor_p2p_latency(executor: PipelineExecutor, *, repeats: int = 20) -> float:
    """One-way latency (ms) of ``executor``'s boundary tensor between its neighbouring ranks; 0 without a
    pipeline to measure (no P2P layer, one rank, or no process group)."""
    p2p = executor.p2p
    if p2p is None or not _distributed() or executor.lowered.schedule.num_ranks == 1:
        return 0.0
    return measure_p2p_latency(
        pp_rank=p2p.pp_rank,
        pp_ranks=p2p.pp_ranks,
        group=p2p.group,
        shape=p2p.specs[0].shape if p2p.specs else (1,),
        dtype=p2p.specs[0].dtype if p2p.specs else None,
        device=p2p.device,
        repeats=repeats,
    )


def gather(
    executor: PipelineExecutor,
    summary: dict[str, Any],
    *,
    window: tuple[int, int | None],
    memory_source: str,
    device: str,
    group: Any = None,
    comm_ms: float | None = None,
    latency_repeats: int = 20,
    statistic: str = "median",
) -> Profile:
    """Every rank's ``summary`` (``local_summary`` of its samples in iterations ``window``) and the P2P latency,
    combined into one ``Profile`` of ``executor``'s plan (collective on ``group``).

    ``statistic="median"`` gives the typical cost of each action, what a planner should plan with, robust to a
    stray slow sample.  ``"mean"`` is the statistic for *predicting* an iteration: a span is a sum of actions and
    gaps, and a sum is n times the mean, not the median (the gap between actions, mostly posting transfers, has a
    long tail on a busy host: median 0.1-0.3 ms, mean 0.4-0.8 ms here).
    """
    gathered = _exchange(executor.rank, summary, group)
    if comm_ms is None:
        comm_ms = executor_p2p_latency(executor, repeats=latency_repeats)
    sched = executor.lowered.schedule
    S = sched.num_stages
    per_stage: dict[int, dict[str, Any]] = {}
    peaks = [0.0] * sched.num_ranks
    for rank, one in gathered:
        peaks[rank] = float(one["peak"])
        for s, entry in one["stages"].items():
            per_stage[int(s)] = entry
    missing = [s for s in range(S) if s not in per_stage or per_stage[s]["F"] is None]
    if missing:
        raise RuntimeError(
            f"profiling window [{window[0]}, {window[1]}) recorded nothing for stages {missing}: "
            "run at least one iteration inside the window before gather()"
        )

    def col(name: str) -> tuple:
        return tuple(per_stage[s][name] for s in range(S))

    gaps = [one["gap"] for _, one in gathered if one.get("gap") is not None]
    # Between iterations every rank but the one whose plan ends last also waits for it (the collectives of the step):
    # the shortest rank's time is the work the next iteration's start waits for.
    boundaries = [one["boundary"] for _, one in gathered if one.get("boundary") is not None]
    mem_f = tuple(float(v or 0.0) for v in col("mem_F"))
    mem_b = tuple(float(v) if v is not None else 0.0 for v in col("mem_B"))
    return Profile(
        num_ranks=sched.num_ranks,
        stage_to_rank=tuple(sched.stage_to_rank),
        f=tuple(float(v) for v in col("F")),
        b=col("B"),
        w=col("W"),
        bw=col("BW"),
        comm=float(comm_ms),
        mem_f=mem_f,
        mem_b=mem_b,
        mem_w=tuple(-(x + y) for x, y in zip(mem_f, mem_b)),
        residual=tuple(float(v) for v in col("residual")),
        mem_b_transient=_transients(per_stage, S, "mem_B_transient", "mem_BW_transient"),
        mem_bw_transient=_transients(per_stage, S, "mem_BW_transient", "mem_B_transient"),
        peak_bytes=tuple(peaks),
        samples=tuple(int(v) for v in col("samples")),
        schedule=sched.name,
        num_microbatches=sched.num_microbatches,
        window=(window[0], -1 if window[1] is None else window[1]),
        memory_source=memory_source,
        device=device,
        overhead=float(summarise(gaps, statistic)) if gaps else 0.0,
        boundary=float(min(boundaries)) if boundaries else 0.0,
        statistic=statistic,
    )


def _ping_pong(
    buf: torch.Tensor, *, first: bool, peer: int, group: Any, repeats: int, warmup: int, idle_s: float
) -> list[float]:
    """Round trips (s) of ``buf`` with ``peer``, as timed by the side that sends first (the other gets none)."""
    rtts = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        if first:
            if idle_s > 0:
                sleep_until(t0 + idle_s)
            comm.send(buf, peer, group=group)
            comm.recv(buf, peer, group=group)
        else:
            comm.recv(buf, peer, group=group)
            if idle_s > 0:
                sleep_until(time.perf_counter() + idle_s)
            comm.send(buf, peer, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        if i >= warmup and first:
            rtts.append(time.perf_counter() - t0 - 2 * idle_s)
    return rtts


def measure_p2p_latency(
    *,
    pp_rank: int,
    pp_ranks: Sequence[int],
    group: Any = None,
    shape: Sequence[int] = (1,),
    dtype: Any = None,
    device: Any = None,
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
    buf = torch.zeros(tuple(shape), dtype=dtype or torch.float32, device=device or comm.device_of(group))
    mine: list[float] = []
    for pair in range(len(pp_ranks) - 1):
        if pp_rank not in (pair, pair + 1):
            continue
        first = pp_rank == pair
        peer = pp_ranks[pair + 1] if first else pp_ranks[pair]
        rtts = _ping_pong(buf, first=first, peer=peer, group=group, repeats=repeats, warmup=warmup, idle_s=idle_s)
        if rtts:
            mine.append(statistics.median(rtts) / 2 * 1e3)
    gathered: list[Any] = [None] * comm.world_size(group)
    comm.all_gather_object(gathered, mine, group=group)
    values = [v for vs in gathered for v in vs]
    return float(statistics.median(values)) if values else 0.0


def _transients(per_stage: Mapping[int, Mapping[str, Any]], n: int, name: str, fallback: str) -> tuple[float, ...]:
    """Each stage's B (or BW) transient; a stage that ran only the other kind takes that one's (a B's, which also
    holds its queued W work, bounds a BW's)."""
    out = []
    for s in range(n):
        v = per_stage[s].get(name)
        out.append(float(v if v is not None else (per_stage[s].get(fallback) or 0.0)))
    return tuple(out)
