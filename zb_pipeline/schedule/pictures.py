"""Pictures of schedules: a timeline (PNG/SVG), the same timeline as coloured text, and a comparison chart.

The timeline has one row per rank and one box per compute action, placed at its simulated start and end: a
colour per kind (F, B, W, BW), a lighter shade for a rank's later chunks, the microbatch number in the box.  An
overlapped pair (F+BW) is one box split in two bands, its F's colour above its BW's, labelled ``i+j``.
Idle time is left as a grey band, so the bubbles are what you see.  Matplotlib runs headless (``Figure`` with
the Agg canvas; no pyplot state), the file type follows the extension.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from zb_pipeline.schedule.ir import Kind, PairAction, PlanAction, Schedule, halves
from zb_pipeline.schedule.simulate import SimResult

KIND_COLORS: dict[Kind, str] = {
    Kind.F: "#3b6fb6",
    Kind.B: "#4aa564",
    Kind.W: "#e39a3b",
    Kind.BW: "#8a5cb8",
    Kind.PAIR: "#2f8f83",  # legends and text only: a pair is drawn in its halves' colours
}
IDLE_COLOR = "#e6e6e6"
# ANSI background colours per kind: normal for a rank's first chunk, bright for the others.
_ANSI_BG: dict[Kind, tuple[str, str]] = {
    Kind.F: ("44", "104"),
    Kind.B: ("42", "102"),
    Kind.W: ("43", "103"),
    Kind.BW: ("45", "105"),
    Kind.PAIR: ("46", "106"),
}
_KIND_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}


def step_stage(step: PlanAction) -> int:
    """The stage a step's colour shade follows (a pair's: its forward's)."""
    return step.forward.stage if type(step) is PairAction else step.stage


def step_label(step: PlanAction) -> str:
    """The microbatch number(s) written in a step's box: ``i`` (``i+j`` for a pair)."""
    if type(step) is PairAction:
        return f"{step.forward.microbatch}+{step.backward.microbatch}"
    return str(step.microbatch)


def chunk_index(schedule: Schedule) -> dict[int, int]:
    """Virtual stage -> which of its rank's chunks it is (0 = the rank's first stage)."""
    out = {}
    for r in range(schedule.num_ranks):
        for i, s in enumerate(schedule.stages_of(r)):
            out[s] = i
    return out


def shade(hex_color: str, amount: float) -> tuple[float, float, float]:
    """Mix ``hex_color`` with white by ``amount`` (0 = unchanged)."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)  # type: ignore[return-value]


def timeline_title(result: SimResult) -> str:
    s = result.schedule
    chunks = f" chunks={s.chunks} ({s.placement})" if s.chunks > 1 else ""
    return (
        f"{s.name}: p={s.num_ranks} m={s.num_microbatches}{chunks} | bubble rate {result.bubble_rate:.1%} | "
        f"makespan {result.makespan:g}"
    )


def plot_timeline(result: SimResult, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Draw ``result`` as a timeline and save it (``.png`` or ``.svg``, by the extension)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sched = result.schedule
    p = sched.num_ranks
    t_end = result.end_time or 1.0
    n_actions = max((len(tl) for tl in result.timeline), default=1)
    width = min(32.0, max(8.0, 0.28 * n_actions + 2.0))
    top_in, row_in, bottom_in = 0.72, 0.42, 0.55  # title + legend band, one rank row, the time axis
    height = top_in + row_in * p + bottom_in
    fig = Figure(figsize=(width, height), dpi=110)
    left, axes_w = 0.9 / width, 1 - 1.1 / width
    ax = fig.add_axes((left, bottom_in / height, axes_w, row_in * p / height))
    px_per_unit = width * axes_w * fig.dpi / t_end
    label_size = 8 if p <= 16 else 6
    chunk_of = chunk_index(sched)
    chunks = sched.chunks

    for r, tl in enumerate(result.timeline):
        y = p - 1 - r
        ax.broken_barh([(0, t_end)], (y - 0.4, 0.8), facecolors=IDLE_COLOR, edgecolor="none", zorder=1)
        for ta in tl:
            a = ta.action
            ci = chunk_of[step_stage(a)]
            bands = [(a.forward, y, 0.4), (a.backward, y - 0.4, 0.4)] if type(a) is PairAction else [(a, y - 0.4, 0.8)]
            for part, y0, h in bands:
                pci = chunk_of[part.stage]
                color = shade(KIND_COLORS[part.kind], 0.45 * pci / max(1, chunks - 1) if chunks > 1 else 0.0)
                ax.broken_barh(
                    [(ta.start, ta.duration)],
                    (y0, h),
                    facecolors=[color],
                    edgecolor="white",
                    linewidth=0.6,
                    zorder=2,
                )
            text = step_label(a)
            if ta.duration * px_per_unit >= 6.5 * len(text) + 2:
                dark_text = ci > 0 and chunks > 1 and a.kind in (Kind.W, Kind.F, Kind.B)
                ax.text(
                    ta.start + ta.duration / 2,
                    y,
                    text,
                    ha="center",
                    va="center",
                    fontsize=label_size,
                    color="black" if dark_text else "white",
                    zorder=3,
                )
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {p - 1 - y}" for y in range(p)], fontsize=8)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlim(0, t_end)
    ax.set_xlabel("time", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.text(left, 1 - 0.1 / height, title or timeline_title(result), fontsize=11, ha="left", va="top")

    ran = {ta.action.kind for tl in result.timeline for ta in tl}
    if Kind.PAIR in ran:  # its halves' colours
        ran |= {Kind.F, Kind.BW}
    kinds = [k for k in (Kind.F, Kind.B, Kind.W, Kind.BW) if k in ran]
    handles = [Patch(facecolor=KIND_COLORS[k], label={Kind.BW: "BW (full backward)"}.get(k, k.value)) for k in kinds]
    if Kind.PAIR in ran:
        handles.append(Patch(facecolor="white", edgecolor="#555555", label="F+BW pair: F above, BW below"))
    if chunks > 1:
        handles += [Patch(facecolor=shade("#777777", 0.5), label="later chunk (lighter)")]
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle (bubble)"))
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(left, 1 - 0.38 / height),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        borderaxespad=0,
        handlelength=1.4,
    )
    fig.savefig(os.fspath(path))


def ansi_timeline(result: SimResult, *, color: bool = True, max_width: int = 160) -> str:
    """The timeline as text, one line per rank and time running right; ANSI colours per kind if ``color``.

    With colour a box shows the microbatch number (the colour says the kind; later chunks in bright colours);
    without it, the kind letter too (``X`` = BW; lower case for later chunks).  Idle time prints as ``.``.
    Time is scaled so the shortest action is a few characters wide, squeezed to ``max_width`` columns if needed.
    """
    sched = result.schedule
    t_end = result.end_time
    all_actions = [ta for tl in result.timeline for ta in tl]
    if not all_actions or t_end <= 0:
        return timeline_title(result)
    chunk_of = chunk_index(sched)
    shortest = min(ta.duration for ta in all_actions)
    label_w = len(str(sched.num_microbatches - 1)) + (0 if color else 1)
    scale = (label_w + 1) / shortest
    scale = min(scale, max(1.0, (max_width - 10) / t_end))
    ncols = max(1, math.ceil(t_end * scale - 1e-9))
    label_col = len(f"rank {sched.num_ranks - 1}")
    lines = [timeline_title(result)]
    for r, tl in enumerate(result.timeline):
        cells: list[str] = []
        col = 0
        for ta in tl:
            c0 = min(ncols, round(ta.start * scale))
            c1 = max(c0 + 1, min(ncols, round(ta.end * scale)))
            if c0 < col:  # rounding overlap with the previous box
                c0 = col
                c1 = max(c1, c0 + 1)
            if c0 > col:
                cells.append(("\x1b[2m" + "." * (c0 - col) + "\x1b[0m") if color else "." * (c0 - col))
            w = c1 - c0
            a = ta.action
            if color:
                text = step_label(a)
            else:  # later chunks in lower case; a pair as its two halves, "F5+x2"
                parts = []
                for half in halves(a):
                    letter = _KIND_LETTER[half.kind]
                    parts.append(f"{letter.lower() if chunk_of[half.stage] > 0 else letter}{half.microbatch}")
                text = "+".join(parts)
            box = text[:w].center(w)
            if color:
                bg = _ANSI_BG[a.kind][1 if chunk_of[step_stage(a)] > 0 else 0]
                cells.append(f"\x1b[{bg};30m{box}\x1b[0m")
            else:
                cells.append(box if w >= len(text) else "#" * w)
            col = c1
        if col < ncols:
            cells.append(("\x1b[2m" + "." * (ncols - col) + "\x1b[0m") if color else "." * (ncols - col))
        lines.append(f"{f'rank {r}':>{label_col}} |" + "".join(cells) + "|")
    has_pairs = any(ta.action.kind is Kind.PAIR for ta in all_actions)
    if color:
        shown = (Kind.F, Kind.B, Kind.W, Kind.BW) + ((Kind.PAIR,) if has_pairs else ())
        legend = " ".join(f"\x1b[{_ANSI_BG[k][0]};30m {k.value} \x1b[0m" for k in shown)
        lines.append(f"{'':>{label_col}}  {legend}  \x1b[2m.\x1b[0m idle   (bright = later chunk)")
    else:
        pair = " F5+x2=overlapped pair (F then BW)" if has_pairs else ""
        lines.append(
            f"{'':>{label_col}}  F=forward B=backward(input) W=weight grad X=full backward(BW){pair} .=idle "
            "(lower case: later chunk)"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ComparisonRow:
    """One schedule in ``zb-schedule compare``."""

    name: str
    chunks: int
    bubble_rate: float
    makespan: float
    peak_memory: tuple[float, ...]
    p2p_messages: int


def plot_comparison(
    rows: Sequence[ComparisonRow], path: str | os.PathLike[str], *, title: str, skipped: Sequence[str] = ()
) -> None:
    """Bar charts side by side: bubble rate, makespan, largest per-rank peak memory, P2P messages."""
    from matplotlib.figure import Figure

    n = len(rows)
    fig = Figure(figsize=(14, 1.2 + 0.4 * max(n, 1)), dpi=110)
    panels = [
        ("bubble rate", [r.bubble_rate for r in rows], "{:.1%}"),
        ("makespan", [r.makespan for r in rows], "{:g}"),
        ("peak memory (max rank)", [max(r.peak_memory, default=0.0) for r in rows], "{:g}"),
        ("P2P messages / iteration", [float(r.p2p_messages) for r in rows], "{:.0f}"),
    ]
    names = [r.name if r.chunks == 1 else f"{r.name} (x{r.chunks})" for r in rows]
    palette = ["#3b6fb6", "#4aa564", "#e39a3b", "#8a5cb8", "#c44e52", "#64b5cd", "#8c8c8c", "#b5a33b", "#d17ab5"]
    palette += ["#6f4e37", "#2f8f83", "#9c9ede"]
    colors = [palette[i % len(palette)] for i in range(n)]
    for k, (label, values, fmt) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        ys = list(range(n))[::-1]
        ax.barh(ys, values, color=colors, height=0.65)
        ax.set_yticks(ys)
        ax.set_yticklabels(names if k == 0 else [""] * n, fontsize=9)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        top = max(values, default=0.0) or 1.0
        ax.set_xlim(0, top * 1.3)
        for y, v in zip(ys, values):
            ax.text(v + top * 0.02, y, fmt.format(v), va="center", fontsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    note = f"  (not shown: {'; '.join(skipped)})" if skipped else ""
    fig.suptitle(title + note, fontsize=11, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (1.2 + 0.4 * max(n, 1))))
    fig.savefig(os.fspath(path))
