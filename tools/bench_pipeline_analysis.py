"""Analysis of ``tools/bench_pipeline.py``'s real-compute runs: throughput ratios with bootstrap intervals, the
rows of parts (b), (c) and (d) (prediction and memory against the simulator), and the speed-up ceiling.

Pure functions over the ranks' results; nothing here launches processes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zb_pipeline.schedule import registry
from zb_pipeline.schedule.bounds import iteration_lower_bound, theory_ceiling
from zb_pipeline.schedule.memory import peak_memory
from zb_pipeline.schedule.plan_file import plan_from_dict
from zb_pipeline.schedule.profile import Profile, costs_for, predict_makespan, split_cost_ratio
from zb_pipeline.schedule.simulate import simulate

try:  # BENCH's peer benchmark: its bootstrap (the same computation as the fallback below)
    import bench_torch_pipelining as tp_bench
except Exception:  # pragma: no cover - depends on the checkout
    tp_bench = None


def bootstrap_ratio(times: Sequence[float], base: Sequence[float], *, samples: int = 2000, seed: int = 0):
    """``median(base) / median(times)`` (throughput ratio) and its bootstrap 95% interval, runs paired by round."""
    if tp_bench is not None:
        return tp_bench.bootstrap_ratio_ci(times, base, samples=samples, seed=seed)
    a, b = np.asarray(times, float), np.asarray(base, float)
    n = min(len(a), len(b))
    idx = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    r = np.median(b[:n][idx], axis=1) / np.median(a[:n][idx], axis=1)
    lo, hi = np.percentile(r, [2.5, 97.5])
    return float(np.median(b) / np.median(a)), float(lo), float(hi)


def bootstrap_launches(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], *, samples: int = 2000, seed: int = 0):
    """Throughput ratio over several launches, each a pair (schedule's times, its 1F1B times), runs paired by round.

    The estimate is the median of the launches' ratios; the 95% interval resamples launches, then runs within each
    resampled launch, so it carries the launch-to-launch spread (fresh processes land differently on a shared host)
    that one launch's run bootstrap cannot see.  With one launch this is ``bootstrap_ratio``.
    """
    if len(pairs) == 1:
        return bootstrap_ratio(*pairs[0], samples=samples, seed=seed)
    rng = np.random.default_rng(seed)
    arrays = []
    for times, base in pairs:
        n = min(len(times), len(base))
        arrays.append((np.asarray(times[:n], float), np.asarray(base[:n], float)))
    point = float(np.median([np.median(b) / np.median(a) for a, b in arrays]))
    estimates = np.empty(samples)
    for k in range(samples):
        ratios = []
        for i in rng.integers(0, len(arrays), size=len(arrays)):
            a, b = arrays[i]
            j = rng.integers(0, len(a), size=len(a))
            ratios.append(np.median(b[j]) / np.median(a[j]))
        estimates[k] = np.median(ratios)
    lo, hi = np.percentile(estimates, [2.5, 97.5])
    return point, float(lo), float(hi)


def log_real_row(log: Callable[[str], None], m: int, r: dict) -> None:
    log(
        f"  m={m} {r['schedule']:<22} {r['tokens_per_s']:9.0f} tok/s  x{r['ratio']:.3f} "
        f"[{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]"
        + (
            f"  span {r['measured_span_ms']:.1f} pred {r['predicted_span_ms']:.1f} ms "
            f"({r['prediction_error']:+.1%})  peak {max(r['peak_bytes']) / 2**20:.2f} MiB "
            f"(pred err {r['memory_error']:.1%})"
            if "peak_bytes" in r
            else ""
        )
        + (f"  (B+W)/BW {_ratios(r['split_ratio'])}" if r.get("split_ratio") else "")
    )


def _ratios(values: list[float | None]) -> str:
    return ", ".join("-" if v is None else f"{v:.3f}" for v in values)


def aggregate_real(res: list[dict], model: Any, m: int, log: Callable[[str], None]) -> dict:
    """Rows of (b), (c), (d) for one m from every rank's ``_real_rank`` result."""
    tokens = m * model.micro_batch * model.seq_length
    times = res[0]["times"]
    base = times["1f1b"]
    rows = []
    profiles = {k: Profile.from_dict(v) for k, v in res[0]["profiles"].items()}
    for name, ts in times.items():
        ratio, lo, hi = bootstrap_ratio(ts, base)
        row: dict[str, Any] = {
            "schedule": name,
            "median_ms": statistics.median(ts) * 1e3,
            "tokens_per_s": tokens / statistics.median(ts),
            "ratio": ratio,
            "ratio_lo": lo,
            "ratio_hi": hi,
            "runs": len(ts),
            "page_faults": [r.get("page_faults", {}).get(name) for r in res],
        }
        if name in res[0]["plans"]:
            sched = plan_from_dict(res[0]["plans"][name])
            layout = (sched.placement, sched.chunks)
            prof = profiles[f"{layout[0]}/{layout[1]}"]
            _, costs = costs_for(prof, name, chunks=sched.chunks)
            sim = simulate(sched, costs)
            n_it = min(len(r["spans"][name]) for r in res)
            span = statistics.median(max(r["spans"][name][i] for r in res) for i in range(n_it))
            peaks = [r["peaks"][name] for r in res]
            pred = peak_memory(sched, costs)
            own = Profile.from_dict(res[0]["own_profiles"][name])
            predicted = predict_makespan(own, sched)
            planned = predict_makespan(prof, sched)
            row.update(
                measured_span_ms=span,
                predicted_span_ms=predicted,
                prediction_error=predicted / span - 1,
                own_profile=res[0]["own_profiles"][name],
                launch_profile_ms=planned,
                launch_profile_error=planned / span - 1,
                simulated_bubble=sim.bubble_rate,
                peak_bytes=peaks,
                predicted_peak_bytes=list(pred),
                memory_error=max(abs(p / q - 1) if q else 0.0 for p, q in zip(peaks, pred)),
            )
            # In microbatches of each rank's own activation (its stages' profiled mem_f): the unit the
            # schedules' memory bounds are stated in (stages of unequal size skew a comparison of bytes).
            units = [sum(prof.mem_f[st] for st in sched.stages_of(r)) for r in range(sched.num_ranks)]
            counts = [pk / u for pk, u in zip(peaks, units) if u > 0]
            row.update(peak_microbatches=max(counts) if counts else None,
                       stated_bound=registry.get(name).stated_memory_bound(sched.num_ranks, m))  # fmt: skip
        rows.append(row)
    one = next(r for r in rows if r["schedule"] == "1f1b")
    medians = res[0].get("own_profiles_median", res[0]["own_profiles"])  # older results: means only
    for r in rows:
        if "peak_bytes" in r:
            r["peak_vs_1f1b"] = max(r["peak_bytes"]) / max(one["peak_bytes"])
        ratio = split_ratio(medians, r["schedule"])
        if ratio is not None:
            r["split_ratio"] = ratio
        log_real_row(log, m, r)
    ceiling = speedup_ceiling(profiles["loop/1"], rows, res[0]["plans"], m)
    own_cap = f", x{ceiling['own']['ceiling']:.3f} (the runs' own costs)" if ceiling["own"] else ""
    log(f"  m={m} ceiling over 1F1B for any schedule of the loop layout: x{ceiling['launch']['ceiling']:.3f} "
        f"(launch profile){own_cap}")  # fmt: skip
    return {"rows": rows, "profiles": res[0]["profiles"], "latency_ms": profiles["loop/1"].comm,
            "ceiling": ceiling}  # fmt: skip


def split_ratio(profiles: dict[str, dict], name: str) -> list[float | None] | None:
    """The split's cost in place for schedule ``name``: per stage, its B + W over 1F1B's BW, each the median of
    the actions profiled in its own timed runs (``split_cost_ratio``; ``None`` for a fused schedule or another
    layout).

    Medians, not the means the span prediction uses: this compares what one action costs, the same work on both
    sides (a B and its W hold exactly the kernels of a BW; on the last stage both hold the loss's backward), and a
    mean over the 40 actions of ten m = 4 iterations moves by several percent with the few a busy host preempted.
    """
    if "1f1b" not in profiles or name not in profiles:
        return None
    own, fused = Profile.from_dict(profiles[name]), Profile.from_dict(profiles["1f1b"])
    if own.num_stages != fused.num_stages or all(v is None for v in own.b):
        return None
    return list(split_cost_ratio(own, fused))


def speedup_ceiling(launch_profile: Profile, rows: list[dict], plans: dict[str, dict], m: int) -> dict[str, Any]:
    """The largest ratio to 1F1B any schedule with one stage per rank could reach (``iteration_lower_bound``).

    ``launch``: 1F1B's simulated iteration (``SimResult.end_time``: barrier to barrier) over the bound, both under the
    launch's profile (medians, the runtime's per-action overhead added).  ``own``: the same under the timed runs' own
    costs -- 1F1B's own profile for its iteration, the split-backward costs ZB-H2 (else zb-h1, zb-auto) measured in
    its runs for the bound -- the ceiling its measured ratio is to be read against.  ``split_end_ms``: each
    split-backward loop schedule's simulated iteration under its own costs, and ``theory`` the F = B = 2W ceiling.
    """
    p = launch_profile.num_ranks
    place = tuple(range(p))
    fixed_1f1b = registry.generate("1f1b", p, m)

    def one_pass(split: Profile, fused: Profile) -> dict[str, float]:
        bound = iteration_lower_bound(split.to_stage_costs(stage_to_rank=place, overhead=True), place, m)
        end = simulate(fixed_1f1b, fused.to_stage_costs(stage_to_rank=place, fused=True, overhead=True)).end_time
        return {"bound_ms": bound.time, "bound_rank": bound.rank, "bound_reason": bound.reason, "one_f_one_b_ms": end,
                "ceiling": end / bound.time}  # fmt: skip

    out: dict[str, Any] = {"launch": one_pass(launch_profile, launch_profile), "own": None,
                           "theory": theory_ceiling(p, m), "split_end_ms": {}}  # fmt: skip
    by_name = {r["schedule"]: r for r in rows if "own_profile" in r}
    split_rows = [by_name[n] for n in ("zb-h2", "zb-h1", "zb-auto") if n in by_name]
    if "1f1b" in by_name and split_rows:
        ref = Profile.from_dict(split_rows[0]["own_profile"])
        out["own"] = {"from": split_rows[0]["schedule"],
                      **one_pass(ref, Profile.from_dict(by_name["1f1b"]["own_profile"]))}  # fmt: skip
    for r in split_rows:
        own = Profile.from_dict(r["own_profile"]).to_stage_costs(stage_to_rank=place, overhead=True)
        out["split_end_ms"][r["schedule"]] = simulate(plan_from_dict(plans[r["schedule"]]), own).end_time
    return out
