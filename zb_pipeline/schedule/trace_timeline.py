"""A measured trace drawn above the planned timeline: what the ranks really did against what the plan says.

``--pipeline-trace out.json`` (the runtime's ``Tracer``, gathered over the pipeline) writes a Chrome trace whose
compute events carry ``args = {action, kind, stage, microbatch, iteration}``; the trainer adds the plan itself
under ``"zbPlan"`` (plan-file form).  From one iteration of it this module

- takes each pipeline rank's compute spans (F, B, W, BW) and receive waits, in milliseconds from the iteration's
  first event;
- measures the mean cost of F, B and W per virtual stage (a BW counts as B + W, split evenly) and simulates the plan
  under exactly those costs -- the timeline the plan promises for this machine's speeds;
- draws both on one time axis: measured on top (waits hatched), planned below, idle time grey in both.

The gap between the two rows is communication and runtime overhead (and noise): the plan simulated here assumes free
communication.  Pure Python over the JSON; matplotlib only inside ``plot_trace_vs_plan``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import Action, Kind, PlanAction, Schedule
from zb_pipeline.schedule.plan_file import plan_from_dict
from zb_pipeline.schedule.simulate import SimResult, simulate

PLAN_KEY = "zbPlan"
_COMPUTE = {"F": Kind.F, "B": Kind.B, "W": Kind.W, "BW": Kind.BW}


@dataclass(frozen=True)
class Span:
    """One measured interval on a rank (milliseconds from the iteration's start)."""

    start: float
    end: float
    action: Action | None  # None for a wait
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class MeasuredIteration:
    """One iteration of a trace, per pipeline rank (index = the plan's rank)."""

    iteration: int
    compute: tuple[tuple[Span, ...], ...]
    waits: tuple[tuple[Span, ...], ...]
    t0_us: float = 0.0  # the trace timestamp the spans count from (the iteration's first compute start)

    @property
    def span_ms(self) -> float:
        return max((s.end for spans in self.compute for s in spans), default=0.0)

    @property
    def busy_ms(self) -> tuple[float, ...]:
        return tuple(sum(s.duration for s in spans) for spans in self.compute)

    @property
    def bubble_rate(self) -> float:
        """1 - (busiest rank's compute) / span: the simulator's definition, applied to the measurement."""
        span = self.span_ms
        return 1.0 - max(self.busy_ms, default=0.0) / span if span > 0 else 0.0


def plan_of(doc: Mapping[str, Any]) -> Schedule | None:
    """The plan stored in a trace document, if the writer stored one."""
    plan = doc.get(PLAN_KEY)
    return plan_from_dict(plan) if plan is not None else None


def trace_iterations(doc: Mapping[str, Any]) -> list[int]:
    """The iterations that have compute events, ascending."""
    its = {ev["args"].get("iteration") for ev in _compute_events(doc)}
    return sorted(i for i in its if i is not None)


def _compute_events(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [ev for ev in doc.get("traceEvents", ()) if ev.get("ph") == "X" and ev.get("cat") in _COMPUTE]


def measured_iteration(doc: Mapping[str, Any], schedule: Schedule, iteration: int) -> MeasuredIteration:
    """Rank-by-rank spans of ``iteration``; trace processes (global ranks) map to pipeline ranks in ascending order."""
    events = [ev for ev in doc.get("traceEvents", ()) if ev.get("ph") == "X"]
    pids = sorted({ev["pid"] for ev in _compute_events(doc)})
    if len(pids) != schedule.num_ranks:
        raise ValueError(f"the trace has {len(pids)} ranks with compute events, the plan {schedule.num_ranks}")
    rank_of = {pid: r for r, pid in enumerate(pids)}
    mine = [ev for ev in events if ev.get("args", {}).get("iteration") == iteration and ev.get("pid") in rank_of]
    compute_evs = [ev for ev in mine if ev.get("cat") in _COMPUTE]
    if not compute_evs:
        raise ValueError(f"the trace has no compute events for iteration {iteration}")
    t0 = min(ev["ts"] for ev in compute_evs)
    compute: list[list[Span]] = [[] for _ in pids]
    waits: list[list[Span]] = [[] for _ in pids]
    for ev in mine:
        start = (ev["ts"] - t0) / 1e3
        end = start + ev.get("dur", 0.0) / 1e3
        r = rank_of[ev["pid"]]
        cat = ev.get("cat")
        if cat in _COMPUTE:
            a = ev["args"]
            compute[r].append(Span(start, end, Action(a["stage"], _COMPUTE[cat], a["microbatch"])))
        elif cat == "wait" and end > start:
            waits[r].append(Span(max(start, 0.0), end, None, ev.get("name", "wait")))
    return MeasuredIteration(
        iteration,
        tuple(tuple(sorted(c, key=lambda s: s.start)) for c in compute),
        tuple(tuple(w) for w in waits),
        t0,
    )


def measured_costs(measured: MeasuredIteration, schedule: Schedule) -> StageCosts:
    """Mean F, B, W milliseconds per virtual stage (BW split evenly into B and W; a floor of 1 microsecond)."""
    S = schedule.num_stages
    sums = {k: [0.0] * S for k in ("f", "b", "w")}
    counts = {k: [0] * S for k in ("f", "b", "w")}
    for spans in measured.compute:
        for sp in spans:
            a = sp.action
            parts = {Kind.F: (("f", 1.0),), Kind.B: (("b", 1.0),), Kind.W: (("w", 1.0),)}.get(
                a.kind, (("b", 0.5), ("w", 0.5))
            )
            for key, share in parts:
                sums[key][a.stage] += sp.duration * share
                counts[key][a.stage] += 1
    mean = {k: tuple(max(1e-3, sums[k][s] / counts[k][s]) if counts[k][s] else 1e-3 for s in range(S)) for k in sums}
    return StageCosts(
        f=mean["f"], b=mean["b"], w=mean["w"], comm=0.0, mem_f=(1.0,) * S, mem_b=(0.0,) * S, mem_w=(-1.0,) * S
    )


def plan_under_measured_costs(measured: MeasuredIteration, schedule: Schedule) -> SimResult:
    return simulate(schedule, measured_costs(measured, schedule))


def plot_trace_vs_plan(
    doc: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    schedule: Schedule | None = None,
    iteration: int | None = None,
) -> tuple[MeasuredIteration, SimResult]:
    """Draw one iteration of the trace above the plan simulated with the measured costs; save PNG/SVG."""
    from matplotlib.figure import Figure

    from zb_pipeline.schedule.pictures import KIND_COLORS, chunk_index, shade, step_stage

    schedule = schedule or plan_of(doc)
    if schedule is None:
        raise ValueError("the trace holds no plan (written by an old runtime): name the schedule and its -p/-m")
    it = _pick_iteration(doc, iteration)
    measured = measured_iteration(doc, schedule, it)
    planned = plan_under_measured_costs(measured, schedule)
    p = schedule.num_ranks
    t_end = max(measured.span_ms, planned.end_time) or 1.0
    width = min(30.0, max(10.0, 0.25 * max(len(x) for x in measured.compute) + 3.0))
    row_in = 0.36
    height = 0.8 + 2 * (row_in * p + 0.55)
    fig = Figure(figsize=(width, height), dpi=110)
    chunk_of, chunks = chunk_index(schedule), schedule.chunks

    def color(a: PlanAction) -> tuple[float, float, float]:  # a planned pair (measured: its halves) in one colour
        ci = chunk_of[step_stage(a)]
        return shade(KIND_COLORS[a.kind], 0.45 * ci / max(1, chunks - 1) if chunks > 1 else 0.0)

    px_per_ms = width * 0.9 * fig.dpi / t_end
    panel_h = (row_in * p) / height
    gap = 0.55 / height
    bottom = 0.5 / height
    ax_plan = fig.add_axes((0.07, bottom, 0.9, panel_h))
    ax_meas = fig.add_axes((0.07, bottom + panel_h + gap, 0.9, panel_h), sharex=ax_plan)
    measured_rows = [[(s.start, s.duration, s.action) for s in spans] for spans in measured.compute]
    _draw_rows(ax_meas, measured_rows, measured.waits, p=p, t_end=t_end, px_per_ms=px_per_ms, color=color)
    planned_rows = [[(ta.start, ta.duration, ta.action) for ta in tl] for tl in planned.timeline]
    _draw_rows(ax_plan, planned_rows, None, p=p, t_end=t_end, px_per_ms=px_per_ms, color=color)
    ax_plan.set_xlabel("milliseconds from the iteration's first action", fontsize=9)
    ax_meas.set_title(
        f"measured: iteration {it}, span {measured.span_ms:.1f} ms, bubble rate {measured.bubble_rate:.1%}",
        fontsize=9, loc="left",
    )  # fmt: skip
    ax_plan.set_title(
        f"planned under the measured mean costs (free communication): makespan {planned.makespan:.1f} ms, "
        f"bubble rate {planned.bubble_rate:.1%}",
        fontsize=9, loc="left",
    )  # fmt: skip
    s = schedule
    fig.text(
        0.07, 1 - 0.12 / height, f"{s.name}: p={s.num_ranks} m={s.num_microbatches} chunks={s.chunks} -- trace vs plan",
        fontsize=11, ha="left", va="top",
    )  # fmt: skip
    handles = _legend_handles(measured, pairs=any(a.kind is Kind.PAIR for acts in schedule.ranks for a in acts))
    fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(0.97, 1 - 0.08 / height), ncol=len(handles),
               fontsize=8, frameon=False)  # fmt: skip
    fig.savefig(os.fspath(path))
    return measured, planned


def _pick_iteration(doc: Mapping[str, Any], iteration: int | None) -> int:
    """``iteration`` if the trace has it (``None``: its last one); ``ValueError`` otherwise."""
    its = trace_iterations(doc)
    if not its:
        raise ValueError("the trace has no compute events")
    it = its[-1] if iteration is None else iteration
    if it not in its:
        raise ValueError(f"iteration {it} is not in the trace (it has {its[0]}..{its[-1]})")
    return it


def _draw_rows(
    ax: Any,
    rows: Sequence[Sequence[tuple[float, float, PlanAction]]],
    waits: Sequence[Sequence[Any]] | None,
    *,
    p: int,
    t_end: float,
    px_per_ms: float,
    color: Any,
) -> None:
    """One panel: a bar per action (microbatch written where it fits) over an idle band per rank, receive waits
    hatched; rank 0 on top."""
    from zb_pipeline.schedule.pictures import IDLE_COLOR, step_label

    for r, row in enumerate(rows):
        y = p - 1 - r
        ax.broken_barh([(0, t_end)], (y - 0.4, 0.8), facecolors=IDLE_COLOR, edgecolor="none", zorder=1)
        for start, dur, a in row:
            ax.broken_barh([(start, dur)], (y - 0.4, 0.8), facecolors=[color(a)], edgecolor="white", lw=0.5, zorder=2)
            label = step_label(a)
            if dur * px_per_ms >= 7 * len(label) + 2:
                ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=7, color="white", zorder=3)
        for w in waits[r] if waits is not None else ():
            ax.broken_barh(
                [(w.start, w.duration)], (y - 0.4, 0.8), facecolors="none", edgecolor="#c0392b", hatch="////",
                lw=0.0, zorder=2.5,
            )  # fmt: skip
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {p - 1 - y}" for y in range(p)], fontsize=8)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlim(0, t_end)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _legend_handles(measured: MeasuredIteration, *, pairs: bool = False) -> list[Any]:
    """Legend entries: the kinds the trace ran (and the plan's F+BW pairs), receive waits, idle."""
    from matplotlib.patches import Patch

    from zb_pipeline.schedule.pictures import IDLE_COLOR, KIND_COLORS

    kinds = [
        k for k in (Kind.F, Kind.B, Kind.W, Kind.BW) if any(sp.action.kind is k for r in measured.compute for sp in r)
    ]
    handles = [Patch(facecolor=KIND_COLORS[k], label=k.value) for k in kinds]
    if pairs:
        handles.append(Patch(facecolor=KIND_COLORS[Kind.PAIR], label="F+BW pair"))
    handles += [
        Patch(facecolor="none", edgecolor="#c0392b", hatch="////", label="waiting for a receive"),
        Patch(facecolor=IDLE_COLOR, label="idle"),
    ]
    return handles
