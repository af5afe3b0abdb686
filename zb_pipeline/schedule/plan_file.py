"""Plan files: a schedule as JSON, written by ``zb-schedule simulate --export`` or by hand, read by the runtime.

The format (compute actions only, in execution order per rank)::

    {
      "schedule": "1f1b",
      "num_ranks": 2,
      "num_stages": 2,
      "num_microbatches": 2,
      "stage_to_rank": [0, 1],
      "ranks": [
        ["0F0", "0F1", "0BW0", "0BW1"],
        ["1F0", "1BW0", "1F1", "1BW1"]
      ]
    }

An overlapped pair is written ``"1F5+6BW2"`` (``ir.PairAction``).  ``save_plan`` always writes this exact layout
(keys in this order, two-space indent, one line per rank, a final newline), so export -> load -> export gives the
same bytes.  ``load_plan`` checks the structure -- types, sizes, every action string, each action on the rank its
stage is placed on, nothing out of range -- and raises ``PlanFileError`` naming the rank, the position and the
problem; a plan over the size limits (``limits``) is refused from its size and header, before its actions are
parsed.  Whether the plan can run (dependencies, the communication order, memory) is the validator's question, not
this module's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zb_pipeline.schedule import limits
from zb_pipeline.schedule.ir import PlanAction, Schedule, halves, parse_action

KEYS: tuple[str, ...] = ("schedule", "num_ranks", "num_stages", "num_microbatches", "stage_to_rank", "ranks")


class PlanFileError(ValueError):
    """A plan file that cannot be read; the message names where (rank, position) and what is wrong."""


def plan_to_dict(schedule: Schedule) -> dict[str, Any]:
    """The JSON-ready form of ``schedule`` (compute actions only)."""
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                raise ValueError(f"rank {r} position {i}: {a} is a communication action; plan files hold compute only")
    return {
        "schedule": schedule.name,
        "num_ranks": schedule.num_ranks,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "stage_to_rank": list(schedule.stage_to_rank),
        "ranks": [[str(a) for a in acts] for acts in schedule.ranks],
    }


def _int_field(d: dict[str, Any], key: str, minimum: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanFileError(f'"{key}" must be an integer, got {json.dumps(v)}')
    if v < minimum:
        raise PlanFileError(f'"{key}" is {v}, must be >= {minimum}')
    return v


def plan_from_dict(d: Any) -> Schedule:
    """Check and convert the JSON form; raises ``PlanFileError`` naming what is wrong and where."""
    if not isinstance(d, dict):
        raise PlanFileError(f"a plan file holds one JSON object with keys {', '.join(KEYS)}; got {type(d).__name__}")
    missing = [k for k in KEYS if k not in d]
    if missing:
        raise PlanFileError(f"missing key(s) {', '.join(repr(k) for k in missing)}; a plan needs {', '.join(KEYS)}")
    unknown = [k for k in d if k not in KEYS]
    if unknown:
        raise PlanFileError(f"unknown key(s) {', '.join(repr(k) for k in unknown)}; a plan has {', '.join(KEYS)}")
    name = d["schedule"]
    if not isinstance(name, str) or not name:
        raise PlanFileError(f'"schedule" must be a non-empty string (the plan\'s name), got {json.dumps(name)}')
    p = _int_field(d, "num_ranks", 1)
    S = _int_field(d, "num_stages", 1)
    m = _int_field(d, "num_microbatches", 1)
    if S % p:
        raise PlanFileError(f'"num_stages" {S} must be a multiple of "num_ranks" {p}')
    # The size limits from the header and the list lengths, before any action is parsed.
    ranks_in = d["ranks"]
    n_actions = sum(len(a) for a in ranks_in if isinstance(a, list)) if isinstance(ranks_in, list) else 0
    try:
        limits.check_plan_size(p, S, m, n_actions, what="the plan")
    except limits.LimitError as e:
        raise PlanFileError(str(e)) from None

    placement = d["stage_to_rank"]
    if not isinstance(placement, list) or len(placement) != S:
        got = f"{len(placement)} entries" if isinstance(placement, list) else json.dumps(placement)
        raise PlanFileError(f'"stage_to_rank" must be a list of {S} ranks (one per stage), got {got}')
    for s, r in enumerate(placement):
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < p:
            raise PlanFileError(f'"stage_to_rank"[{s}] is {json.dumps(r)}: must be a rank in 0..{p - 1}')
    per_rank = [0] * p  # one pass (not one count per rank: O(stages))
    for r in placement:
        per_rank[r] += 1
    if any(c != S // p for c in per_rank):
        r = next(r for r, c in enumerate(per_rank) if c != S // p)
        raise PlanFileError(f'"stage_to_rank" places {per_rank[r]} stages on rank {r}; each rank needs {S // p}')

    if not isinstance(ranks_in, list) or len(ranks_in) != p:
        got = f"{len(ranks_in)} lists" if isinstance(ranks_in, list) else json.dumps(ranks_in)[:40]
        raise PlanFileError(f'"ranks" must be a list of {p} action lists (one per rank), got {got}')
    ranks: list[tuple[PlanAction, ...]] = []
    for r, acts_in in enumerate(ranks_in):
        if not isinstance(acts_in, list):
            raise PlanFileError(f"rank {r}: expected a list of action strings, got {json.dumps(acts_in)[:40]}")
        acts = []
        for i, text in enumerate(acts_in):
            where = f"rank {r} position {i}"
            if not isinstance(text, str):
                raise PlanFileError(f"{where}: expected an action string such as '0F0', got {json.dumps(text)}")
            try:
                step = parse_action(text)
            except ValueError as e:
                raise PlanFileError(f"{where}: {e}") from None
            if str(step) != text:
                raise PlanFileError(f"{where}: write {text!r} as {str(step)!r} (no spaces or leading zeros)")
            if not step.kind.is_compute:
                raise PlanFileError(f"{where}: {text!r} is a communication action; plan files hold compute only")
            for a in halves(step):
                if a.stage >= S:
                    raise PlanFileError(f"{where}: {text!r} names stage {a.stage}, but stages are 0..{S - 1}")
                if a.microbatch >= m:
                    raise PlanFileError(
                        f"{where}: {text!r} names microbatch {a.microbatch}, but microbatches are 0..{m - 1}"
                    )
                if placement[a.stage] != r:
                    raise PlanFileError(
                        f"{where}: {text!r} runs stage {a.stage}, which stage_to_rank places on rank "
                        f"{placement[a.stage]}"
                    )
            acts.append(step)
        ranks.append(tuple(acts))
    return Schedule(name=name, num_ranks=p, num_stages=S, num_microbatches=m, stage_to_rank=placement, ranks=ranks)


def dumps_plan(schedule: Schedule) -> str:
    """The canonical text of a plan file (stable layout: one line per rank)."""
    d = plan_to_dict(schedule)
    lines = ["{"]
    for key in KEYS[:-1]:
        lines.append(f"  {json.dumps(key)}: {json.dumps(d[key], separators=(', ', ': '))},")
    lines.append('  "ranks": [')
    rows = [f"    {json.dumps(acts, separators=(', ', ': '))}" for acts in d["ranks"]]
    lines.append(",\n".join(rows))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _header(text: str) -> dict[str, Any]:
    """The top-level members of a plan file's JSON that come before ``"ranks"`` (all of them in the canonical layout
    but the action lists), decoded one by one without reading the actions; ``{}`` if the text is not that shape (the
    full parse then says what is wrong)."""
    decode, out = json.JSONDecoder().raw_decode, {}
    ws = " \t\r\n"
    try:
        i = len(text) - len(text.lstrip(ws))
        if text[i] != "{":
            return {}
        i += 1
        while True:
            while text[i] in ws:
                i += 1
            if text[i] != '"':
                return out
            key, i = decode(text, i)
            while text[i] in ws:
                i += 1
            if text[i] != ":" or key == "ranks":
                return out
            i += 1
            while text[i] in ws:
                i += 1
            out[key], i = decode(text, i)
            while text[i] in ws:
                i += 1
            if text[i] != ",":
                return out
            i += 1
    except (ValueError, IndexError):
        return out


def _check_header_size(text: str) -> None:
    """The size limits from the header alone (ranks, stages, microbatches), before the action lists are parsed."""
    head = _header(text)
    p, S, m = (head.get(k) for k in ("num_ranks", "num_stages", "num_microbatches"))
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (p, S, m)):
        try:
            limits.check_plan_size(p, S, m, 0, what="the plan")
        except limits.LimitError as e:
            raise PlanFileError(str(e)) from None


def loads_plan(text: str) -> Schedule:
    """Parse plan-file text; raises ``PlanFileError`` (with line and column for broken JSON).  A plan over the size
    limits is refused from its header, before its actions are read (``limits``)."""
    _check_header_size(text)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return plan_from_dict(d)


def save_plan(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as a plan file."""
    Path(path).write_text(dumps_plan(schedule), encoding="utf-8")


def load_plan(path: str | os.PathLike[str]) -> Schedule:
    """Read a plan file; raises ``PlanFileError`` (prefixed with the path) if it cannot be read, or if it is over
    the size limits (``limits``: the file's size first, then its header, before any action is parsed)."""
    try:
        size = os.stat(path).st_size
        if size > limits.MAX_PLAN_FILE_BYTES:
            raise PlanFileError(
                f"{path}: the plan file is {size} bytes, over the limit of {limits.MAX_PLAN_FILE_BYTES} bytes "
                f"({limits.MAX_ACTIONS} actions); split the plan"
            )
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlanFileError(f"{path}: cannot read plan file: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PlanFileError(f"{path}: not a text (UTF-8) file") from None
    try:
        return loads_plan(text)
    except PlanFileError as e:
        raise PlanFileError(f"{path}: {e}") from None
