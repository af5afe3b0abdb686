"""The report of ``tools/bench_pipeline.py``: ``pipeline.md`` (tables with the machine, versions and settings) and
the PNG charts, from the JSON-able report the benchmark assembles."""

from __future__ import annotations

import os
import statistics
from typing import Any

import numpy as np

from zb_pipeline.schedule.profile import Profile

SPEEDUP_SCHEDULES = ("zb-h1", "zb-h2", "zb-auto")  # whose speed-up over 1F1B the emulated target checks


def _bound_cell(r: dict) -> str:
    got, bound = r.get("peak_microbatches"), r.get("stated_bound")
    if got is None:
        return "-"
    if bound is None:
        return f"{got:.2f} / -"
    return f"{got:.2f} / {bound:g} ({'within' if got <= bound + 1e-6 else 'ABOVE'})"


def _f_b_w_ratio(profile: dict) -> str:
    p = Profile.from_dict(profile)
    f, b, w = sum(p.f), sum(v or 0 for v in p.b), sum(v or 0 for v in p.w)
    return f"F : B : W = 1 : {b / f:.2f} : {w / f:.2f} (sums over stages: {f:.1f} / {b:.1f} / {w:.1f} ms)"


def _path_cell(path: dict | None) -> str:
    """``hops, mean hop = posting + transit; local gaps`` of a measured critical path (``-`` when not recorded)."""
    if not path:
        return "-"
    n = path["hops"]
    if not n:
        return f"0 hops; {path['local_gap_ms']:.1f}"
    hop = path["hop_ms"] / n
    split = ""
    if path.get("posting_ms") is not None:
        post = path["posting_ms"] / n
        split = f" = {post:.2f} + {hop - post:.2f}"
    return f"{n}, {hop:.2f}{split}; {path['local_gap_ms']:.1f}"


def to_markdown(report: dict[str, Any]) -> str:
    """``pipeline.md``: the machine and settings, then a section per part the report holds."""
    lines = _header_lines(report)
    if report.get("emulated"):
        lines += _emulated_lines(report["emulated"])
    real = report.get("real")
    if real:
        lines += _real_intro_lines(real)
        for m, block in real["by_m"].items():
            lines += _real_block_lines(m, block)
        lines += _prediction_lines()
    return "\n".join(lines) + "\n"


def _header_lines(report: dict[str, Any]) -> list[str]:
    env, st = report["environment"], report["settings"]
    return [
        "# Pipeline runtime benchmark",
        "",
        f"`python tools/bench_pipeline.py {' '.join(st['argv'])}` on {env['machine']}, {env['cpus']} CPUs, "
        f"{env['system']}; Python {env['python']}, torch {env['torch']}, numpy {env['numpy']}; {env['date']}.",
        f"Load average at start {env['load_average']}, at end {report.get('load_average_end')} (a shared machine: "
        "other jobs ran at the same time, so absolute times are noisy; alternated runs share the noise).",
        "",
    ]


def _spin_text(spin: Any) -> str:
    """The spun end of each emulated sleep: one value (older reports) or one per p."""
    if spin is None:
        return "0.3 ms"
    if isinstance(spin, dict):
        return ", ".join(f"p={p}: {v:g} ms" for p, v in spin.items())
    return f"{spin:g} ms"


def _emulated_lines(emu: dict[str, Any]) -> list[str]:
    """(a): the runtime on emulated compute against the simulator."""
    c = emu["costs_ms"]
    lat = ", ".join(f"p={p}: {v:.3f} ms" for p, v in emu["latency_ms"].items())
    hot = emu.get("hot_latency_ms", {})
    hot_text = ", ".join(f"p={p}: {v:.3f} ms" for p, v in hot.items())
    lines = [
        "## (a) Emulated compute: runtime vs simulator",
        "",
        f"F = {c['f_ms']:g} ms, B = {c['b_ms']:g} ms, W = {c['w_ms']:g} ms per rank's share, optimizer step "
        f"{c['opt_ms']:g} ms; T_comm in the simulation = measured gloo one-way latency to a receiver that waited "
        f"idle {emu['idle_s'] * 1e3:g} ms before each message, as a rank in a bubble does ({lat}; back-to-back "
        f"round trips give {hot_text or 'n/a'}: this VM's idle cores wake slowly). Emulated actions sleep, then "
        f"spin the last {_spin_text(emu.get('spin_ms'))} of each sleep (`--emulated-spin-ms`; by default 0 when the "
        "ranks outnumber the cores), so they end on time. Every schedule is planned for these costs (those whose "
        "plan depends on the costs -- zb-auto, ZB-H2, the V schedules, interleaved-zb -- as the trainer plans them "
        "from profiled costs). "
        f"Span: the slowest rank's first compute start to last compute end (trace), median over iterations "
        "after the first. Every schedule is planned before the first is run, and they run in turns: each round "
        "runs one iteration of every schedule, every iteration starting with a barrier, so host noise spreads "
        "over all schedules. Targets: span within 3% of the makespan; speed-up within 2 points of the simulated. "
        "In-pipeline T_comm: for every receive that blocked, the end of the wait minus the moment the producing "
        "plan step on the other rank was due to end (an overlapped F&B pair's: its start + F + BW, since it posts "
        "both outputs at its end; from the traces, host clock): what a hop really costs in the "
        "running pipeline -- the sender oversleeping before it posts, the transfer, the receiver's wake-up on "
        "the busy host; its mean (a chain of hops adds up their mean, not their median) and the simulation with "
        "it are shown beside. Hops: how many cross-rank hops the simulated critical path holds (the makespan's "
        "growth per ms of T_comm), i.e. how much a per-hop error weighs. Measured path: the critical path of the "
        "last iteration walked back through the trace (`zb_pipeline.schedule.critical_path`; what `zb-schedule "
        "show --trace` prints): its hops and their mean length split into *posting* (the producing step's end -- "
        "a pair's: its backward half's -- to its send posted, `isend` returned) and *transit* (posted to the "
        "consumer's start: transfer, wake-up), and the sum of the gaps between consecutive actions of a rank on "
        "the path.",
        "",
        "| p | m | schedule | measured span ms | simulated ms | error | hops | in-pipeline T_comm ms (mean): "
        "simulated (error) | measured path: hops, mean hop ms = posting + transit; local gaps ms "
        "| speed-up vs 1F1B (measured / simulated) | iteration incl. OPT ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in emu["rows"]:
        sp = "-"
        if "speedup" in r:
            gap = (r["speedup"] - r["simulated_speedup"]) * 100
            sp = f"{r['speedup']:.3f} / {r['simulated_speedup']:.3f} ({gap:+.1f} pt)"
        lines.append(
            f"| {r['p']} | {r['m']} | {r['schedule']} | {r['measured_span_ms']:.1f} | {r['simulated_ms']:.1f} "
            f"| {r['error']:+.1%} | {r.get('critical_hops', 0):.0f} "
            f"| {r['in_pipeline_latency_ms'] or 0:.2f}: {r['simulated_in_pipeline_ms']:.1f} "
            f"({r['error_in_pipeline']:+.1%}) | {_path_cell(r.get('path'))} | {sp} | {r['iteration_ms']:.1f} |"
        )
    errs = [abs(r["error"]) for r in emu["rows"]]
    pts = [abs(r["speedup"] - r["simulated_speedup"]) * 100 for r in emu["rows"] if r["schedule"] in SPEEDUP_SCHEDULES]
    lines += [
        "",
        f"Largest span error {max(errs):.1%} (median {statistics.median(errs):.1%}); largest speed-up gap of "
        f"ZB-H1/ZB-H2/zb-auto {max(pts, default=0):.1f} points.",
        "",
        "![emulated](pipeline_emulated.png)",
        "",
    ]
    return lines


def _real_intro_lines(real: dict[str, Any]) -> list[str]:
    """(b): the model, the method and the theory."""
    mdl = real["model"]
    return [
        "## (b) Real compute: tokens/s of every schedule (small GPT on CPU)",
        "",
        f"GPT with {mdl['num_layers']} layers, hidden {mdl['hidden_size']}, {mdl['num_attention_heads']} heads, "
        f"sequence {mdl['seq_length']}, vocabulary {mdl['vocab_size']}, micro-batch {mdl['micro_batch']}; "
        f"pp = {real['pp']}, gloo, one thread per rank. "
        + (
            "All schedules alternated in one launch (`--one-launch`), "
            if real.get("method", "").startswith("one launch")
            else "Each schedule runs in its own launch (fresh processes), alternated with our 1F1B, "
        )
        + f"{real['runs']} runs of each (rounds rotate the order), "
        + (
            f"every pair launched {real['launches']} times (ratio: the median of the launches' ratios, its "
            "interval resampling launches and then runs, so it carries the launch-to-launch spread; the other "
            "columns from the first launch), "
            if real.get("launches", 1) > 1
            else ""
        )
        + "an iteration timed "
        "between barriers as the slowest rank's time, forward + backward without the optimizer step. Ratio = "
        "tokens/s over the 1F1B runs of the same launch, median with a bootstrap 95% interval; the 1F1B row is "
        "the median over all launches. `torch:*` rows are torch.distributed.pipelining's schedules on the same "
        "blocks, timed the same way. Our schedules whose plan depends on the costs (zb-auto, ZB-H2, ZB-V, V-Half, "
        "V-Min, interleaved-zb) are planned from the profile taken at the start of the launch, as the trainer "
        "re-plans them after its profiling window. Host memory: "
        + (
            "freed blocks kept in the process (`keep_freed_host_memory`, as the trainer does on CPU). "
            if real.get("host_malloc", "keep") == "keep"
            else "glibc's default thresholds (`--host-malloc default`). "
        )
        + "The last column divides each split-backward schedule's profiled B + W by 1F1B's profiled BW, per stage, "
        "both measured inside their own timed runs, each the median of its actions (the same work: a B and its W "
        "hold a BW's kernels), then the median over the launches: what the split costs in place (1.000: nothing; "
        "`tools/bench_split_cost.py` breaks it down). "
        + "Theory at F = B = 2W, p = 2, m = 4: ZB-H2 1.14x; target ZB-H2 >= 1.08x."
        + _theory_sentence(real["by_m"]),
        "",
    ]


def _real_block_lines(m: str, block: dict[str, Any]) -> list[str]:
    """(b), (c), (d) for one m: the profile, the ceiling, and a row per schedule."""
    prof = block["profiles"].get("loop/1")
    lines = [
        f"### m = {m}",
        "",
        f"Profiled (zb-h1, loop layout): {_f_b_w_ratio(prof)}; P2P latency {block['latency_ms']:.3f} ms.",
        "",
        *_ceiling_lines(block.get("ceiling")),
        "| schedule | tokens/s | ratio to 1F1B [95% CI] | measured span ms | predicted ms | pred. error "
        "| from the launch's first profile ms (error) | peak act. MiB per rank | predicted MiB | mem. error "
        "| peak / 1F1B | peak in microbatches / stated bound | minor page faults per iteration, per rank "
        "| in-pipeline (B + W) / 1F1B's BW per stage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in block["rows"]:
        pf = r.get("page_faults") or []
        faults = ", ".join("-" if v is None else f"{v:.0f}" for v in pf) or "-"
        split = r.get("split_ratio")
        faults += " | " + (", ".join("-" if v is None else f"{v:.3f}" for v in split) if split else "-")
        extra = f"| - | - | - | - | - | - | - | - | - | {faults} |"
        if "peak_bytes" in r:
            extra = (
                f"| {r['measured_span_ms']:.1f} | {r['predicted_span_ms']:.1f} | {r['prediction_error']:+.1%} "
                f"| {r['launch_profile_ms']:.1f} ({r['launch_profile_error']:+.1%}) "
                f"| {', '.join(f'{v / 2**20:.2f}' for v in r['peak_bytes'])} "
                f"| {', '.join(f'{v / 2**20:.2f}' for v in r['predicted_peak_bytes'])} "
                f"| {r['memory_error']:.1%} | {r['peak_vs_1f1b']:.2f} | {_bound_cell(r)} | {faults} |"
            )
        per_launch = r.get("launch_ratios")
        launches = f" (launches: {', '.join(f'{x:.3f}' for x in per_launch)})" if per_launch else ""
        caps = r.get("launch_ceilings")
        if per_launch and caps and len(caps) == len(per_launch):
            launches += f" (their ceilings: {', '.join(f'{x:.3f}' for x in caps)})"
        lines.append(
            f"| {r['schedule']} | {r['tokens_per_s']:.0f} | {r['ratio']:.3f} [{r['ratio_lo']:.3f}, "
            f"{r['ratio_hi']:.3f}]{launches} {extra}"
        )
    lines.append("")
    return lines


def _prediction_lines() -> list[str]:
    """How (c) and (d) are measured and predicted."""
    return [
        "## (c) Prediction and (d) memory",
        "",
        "Predicted span: the simulator (`predict_makespan`) under the costs the profiler (`ActionProfiler`, "
        "time only) recorded over the timed runs themselves: per-stage means of T_F, T_B, T_W (T_BW for "
        "fused schedules), T_comm = measured P2P latency, plus the runtime's overhead per compute action (the "
        "mean gap between one action's end and the next one's start on a rank); means, because a span is a sum "
        "of actions and gaps (the gap has a long tail: posting a transfer "
        "sometimes blocks for milliseconds). Target: within 10% of the "
        "measured span. The next column feeds the simulator the profile taken at the start of the launch from a "
        "split-backward schedule of the same layout (zb-h1 for one chunk, interleaved-zb for two looped chunks, "
        "zb-v for V; the cost-dependent schedules are planned from it; medians): on this shared VM the speed of "
        "the same code drifts by 10-30% "
        "within seconds to minutes, so a profile taken earlier carries that drift into the prediction. "
        "Peak activation memory: the profiler's saved-tensor bytes (what autograd's graph saved plus what the "
        "deferred W work holds), resident per rank, maximum over a profiled window; predicted: the simulator's "
        "running sum of the profiled per-stage deltas over the plan. Target: within 10%. Stated bounds, in "
        "microbatches of each rank's own activation (peak bytes / its stages' profiled per-microbatch bytes, max "
        "over ranks): 1F1B, ZB-H1 and ZB-V p; ZB-H2 and zb-auto (default limit) 2p - 1; V-Half floor((p + 2) / 2); "
        "V-Min floor((p + 4) / 3); GPipe m (the registry's memory_bound of each schedule).",
        "",
        "![real](pipeline_real.png)",
        "",
        "![memory](pipeline_memory.png)",
        "",
    ]


def _theory_sentence(by_m: dict[str, Any]) -> str:
    """What the F = B = 2W ceilings of the blocks say (``bounds.theory_ceiling``), for the m's this report holds."""
    caps = [(m, block["ceiling"]["theory"]) for m, block in by_m.items() if block.get("ceiling")]
    if not caps:
        return ""
    listed = ", ".join(f"{cap:.3f}x at m = {m}" for m, cap in caps)
    return f" At those costs no schedule can beat 1F1B by more than {listed} (see each block's ceiling)."


def _ceiling_lines(ceiling: dict[str, Any] | None) -> list[str]:
    """The block's speed-up ceiling (``bench_pipeline_analysis.speedup_ceiling``) in words."""
    if not ceiling:
        return []
    launch, own = ceiling["launch"], ceiling.get("own")
    whose = f"the profile taken at the start of {own['from']}'s launch" if own else "the launch's profile"
    why = {
        "first input": "waits for its first input, then works to the end",
        "first gradient": "waits for its first gradient, then does all its B and W",
    }.get(launch.get("bound_reason", ""), "sets it")
    text = (
        f"Ceiling (`zb_pipeline.schedule.bounds`): no schedule with one stage per rank can end an iteration before "
        f"{launch['bound_ms']:.1f} ms under {whose} (rank {launch['bound_rank']} {why}); 1F1B's simulated "
        f"iteration is {launch['one_f_one_b_ms']:.1f} ms, so no "
        f"schedule can beat 1F1B by more than **{launch['ceiling']:.3f}x** (at F = B = 2W: {ceiling['theory']:.3f}x)."
    )
    if own:
        text += (
            f" Under the timed runs' own costs (1F1B's for 1F1B, {own['from']}'s for the bound): "
            f"{own['one_f_one_b_ms']:.1f} / {own['bound_ms']:.1f} ms = **{own['ceiling']:.3f}x**; "
        )
        text += ", ".join(
            f"{name}'s plan simulates to {end:.1f} ms ({end / own['bound_ms'] - 1:+.1%} over the bound)"
            for name, end in ceiling.get("split_end_ms", {}).items()
        )
        text += "."
    return [text, ""]


def plot(report: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    emu = report.get("emulated")
    if emu:
        shapes = sorted({(r["p"], r["m"]) for r in emu["rows"]})
        fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4.2), squeeze=False)
        for ax, (p, m) in zip(axes[0], shapes):
            rows = [r for r in emu["rows"] if r["p"] == p and r["m"] == m]
            x = np.arange(len(rows))
            ax.bar(x - 0.2, [r["simulated_ms"] for r in rows], 0.4, label="simulated makespan", color="#9bb")
            ax.bar(x + 0.2, [r["measured_span_ms"] for r in rows], 0.4, label="measured span", color="#36a")
            ax.set_xticks(x, [r["schedule"] for r in rows], rotation=60, ha="right", fontsize=8)
            ax.set_title(f"emulated p={p} m={m}")
            ax.set_ylabel("ms per iteration")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, "pipeline_emulated.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    real = report.get("real")
    if real:
        ms = list(real["by_m"])
        fig, axes = plt.subplots(1, len(ms), figsize=(6.5 * len(ms), 4.4), squeeze=False)
        for ax, m in zip(axes[0], ms):
            rows = real["by_m"][m]["rows"]
            x = np.arange(len(rows))
            ratio = np.array([r["ratio"] for r in rows])
            err = np.array([[r["ratio"] - r["ratio_lo"] for r in rows], [r["ratio_hi"] - r["ratio"] for r in rows]])
            colors = ["#c64" if r["schedule"].startswith("torch:") else "#36a" for r in rows]
            ax.bar(x, ratio, yerr=err, color=colors, capsize=3)
            ax.axhline(1.0, color="k", lw=0.8)
            cap = real["by_m"][m].get("ceiling")
            if cap:  # the largest ratio any one-stage-per-rank schedule could reach (bounds.iteration_lower_bound)
                ax.axhline(cap["launch"]["ceiling"], color="#444", lw=1.0, ls="--",
                           label=f"ceiling, launch profile ({cap['launch']['ceiling']:.3f})")  # fmt: skip
                if cap.get("own"):
                    ax.axhline(cap["own"]["ceiling"], color="#444", lw=1.0, ls=":",
                               label=f"ceiling, runs' own costs ({cap['own']['ceiling']:.3f})")  # fmt: skip
                ax.legend(fontsize=7, loc="upper right")
            ax.set_xticks(x, [r["schedule"] for r in rows], rotation=60, ha="right", fontsize=8)
            ax.set_ylabel("tokens/s relative to our 1F1B")
            ax.set_title(f"real GPT on CPU, pp=2, m={m} (blue: ours, red: torch)")
            lo = min(0.6, float(np.min(ratio - err[0])) - 0.05)
            ax.set_ylim(lo, max(1.35, float(np.max(ratio + err[1])) + 0.05))
        fig.tight_layout()
        path = os.path.join(out_dir, "pipeline_real.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        fig, axes = plt.subplots(1, len(ms), figsize=(6.5 * len(ms), 4.4), squeeze=False)
        for ax, m in zip(axes[0], ms):
            rows = [r for r in real["by_m"][m]["rows"] if "peak_bytes" in r]
            x = np.arange(len(rows))
            for rank, off, col in ((0, -0.3, "#36a"), (1, 0.1, "#6a3")):
                ax.bar(x + off, [r["peak_bytes"][rank] / 2**20 for r in rows], 0.2, color=col,
                       label=f"rank {rank} measured")  # fmt: skip
                ax.bar(x + off + 0.2, [r["predicted_peak_bytes"][rank] / 2**20 for r in rows], 0.2, color=col,
                       alpha=0.4, label=f"rank {rank} simulated")  # fmt: skip
            ax.set_xticks(x, [r["schedule"] for r in rows], rotation=60, ha="right", fontsize=8)
            ax.set_ylabel("peak activation MiB")
            ax.set_title(f"peak activation memory, pp=2, m={m}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "pipeline_memory.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
