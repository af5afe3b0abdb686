"""``ScheduleError``, what the validator raises, and the rank x step grid it shows with the failing step marked.

Shared by the checks of compute plans (``validate``) and of lowered plans (``lowered_checks``).
"""

from __future__ import annotations

from zb_pipeline.schedule.ir import Action, Kind, Schedule
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule

# How many stuck ranks a deadlock message lists before "... and N more ranks".
MAX_STUCK_LISTED = 4


class ScheduleError(ValueError):
    """A plan is invalid.  ``str()`` is one line; ``grid`` shows the plan with the failing step marked.

    ``rank`` and ``index`` locate the failing step (``index`` is a position in ``schedule.ranks[rank]``, or a step
    in a lowered plan's ``ranks[rank]``); either may be ``None`` when there is no such step (a missing action).
    The grid is rendered on first access, so searches that try many plans pay nothing for it.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        index: int | None = None,
        grid: str | None = None,
        plan: Schedule | LoweredSchedule | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self._grid = grid
        self._plan = plan

    @property
    def grid(self) -> str:
        if self._grid is None:
            mark = None if self.rank is None else (self.rank, self.index)
            self._grid = "" if self._plan is None else render_grid(self._plan, mark=mark)
        return self._grid


def plan_error(
    plan: Schedule | LoweredSchedule, message: str, rank: int | None = None, index: int | None = None
) -> ScheduleError:
    """A ``ScheduleError`` about ``plan``: the message prefixed with the schedule's name, the step located."""
    sched = plan.schedule if isinstance(plan, LoweredSchedule) else plan
    return ScheduleError(f"{sched.name}: {message}", rank=rank, index=index, plan=plan)


# ----------------------------------------------------------------------------------------------------- grid


_COLORS = {Kind.F: "34", Kind.B: "32", Kind.W: "33", Kind.BW: "36", Kind.PAIR: "35"}


def _cell(step: Action | CommBatch) -> str:
    return str(step)


def _color_of(step: Action | CommBatch) -> str:
    if isinstance(step, CommBatch) or step.kind.is_comm:
        return "90"
    return _COLORS[step.kind]


def render_grid(
    plan: Schedule | LoweredSchedule, *, mark: tuple[int, int | None] | None = None, color: bool = False
) -> str:
    """The rank x step grid of a plan, columns aligned; ``mark=(rank, index)`` puts that step in ``[brackets]``.

    With ``index=None`` the rank's label is marked instead.  ``color=True`` adds ANSI colours per kind (the mark in
    red).  Batches of a lowered plan print as ``{op,op}``.
    """
    lowered = isinstance(plan, LoweredSchedule)
    sched = plan.schedule if lowered else plan
    rows: list[list[Action | CommBatch]] = [list(r) for r in plan.ranks]
    cells = [[_cell(step) for step in row] for row in rows]
    mr, mi = mark if mark is not None else (None, None)
    if mr is not None and mi is not None and 0 <= mr < len(cells) and 0 <= mi < len(cells[mr]):
        cells[mr][mi] = f"[{cells[mr][mi]}]"
    ncols = max((len(row) for row in cells), default=0)
    widths = [0] * ncols
    for row in cells:
        for j, c in enumerate(row):
            if len(c) > widths[j]:
                widths[j] = len(c)
    label_w = len(str(len(cells) - 1))
    kind = "lowered, steps" if lowered else "positions"
    lines = [
        f"{sched.name}: p={sched.num_ranks} S={sched.num_stages} m={sched.num_microbatches} "
        f"({sched.placement}; {kind} from 0)"
    ]
    for r, row in enumerate(cells):
        parts = []
        for j, c in enumerate(row):
            text = c.ljust(widths[j])
            if color:
                code = "1;41" if (r == mr and j == mi) else _color_of(rows[r][j])
                text = f"\x1b[{code}m{c}\x1b[0m" + " " * (widths[j] - len(c))
            parts.append(text)
        flag = "*" if (r == mr and mi is None) else " "
        lines.append(f"{flag}rank {r:>{label_w}}: " + " ".join(parts).rstrip())
    return "\n".join(lines)
