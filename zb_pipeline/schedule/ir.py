"""The action IR shared by schedule generators, lowering passes, the validator, the simulator and the runtime.

An action is printed as ``{stage}{kind}{microbatch}`` (``3F0``, ``0B12``, ``5W7``, ``2BW4``); communication
actions carry their peer rank after ``@`` (``0SEND_F3@1``).  ``Action.parse`` is the exact inverse of ``str``.

An overlapped pair (DualPipe's F&B) is one step of a plan: a ``PairAction`` holding a forward ``F`` and a full backward
``BW`` of other microbatches on the same rank, printed ``{forward}+{backward}`` (``1F5+6BW2``), of kind ``Kind.PAIR``.
Its forward and its backward are plain ``Action``s; it has no stage or microbatch of its own, so code that reads
those of a step must look at the halves (``halves(step)``).  ``parse_action`` reads any compute step, pair included.

Conventions for communication actions (added only by lowering, never by generators):
- ``SEND_F``: stage ``s`` sends its forward output of microbatch ``mb`` to the rank of stage ``s + 1``.
- ``RECV_F``: stage ``s`` receives its forward input of ``mb`` from the rank of stage ``s - 1``.
- ``SEND_B``: stage ``s`` sends the gradient of its input of ``mb`` to the rank of stage ``s - 1``.
- ``RECV_B``: stage ``s`` receives the gradient of its output of ``mb`` from the rank of stage ``s + 1``.

Plan files hold compute actions only.  Built-in kinds are ``Kind`` members; a kind declared outside this file (an
experiment) is registered with ``register_kind``, which makes it printable and parseable, and the runtime runs it
through the handler registered for it (``PipelineRuntime.set_handler``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does.  The value is its spelling in the IR."""

    F = "F"  # forward of one stage for one microbatch
    B = "B"  # backward w.r.t. the stage input only (weight-gradient work deferred)
    W = "W"  # the deferred weight-gradient work of one stage and microbatch
    BW = "BW"  # full backward: B and W fused
    PAIR = "F+BW"  # an overlapped F and BW on one rank: only as the kind of a ``PairAction``
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # Cross-iteration communication of the optimizer post-validation state (lowering pass of that issue).
    SEND_PV = "SEND_PV"
    RECV_PV = "RECV_PV"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    def __str__(self) -> str:  # str(Kind.F) == "F"
        return self.value


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW, Kind.PAIR})
COMPUTE_KINDS: frozenset[Kind] = _COMPUTE
_PAIR = Kind.PAIR
_F, _B, _W, _BW = Kind.F, Kind.B, Kind.W, Kind.BW
_new = object.__new__


@dataclass(frozen=True)
class CustomKind:
    """An action kind declared with ``register_kind`` (behaves like a ``Kind`` member where the IR reads one)."""

    value: str
    is_compute: bool = True

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    def __str__(self) -> str:
        return self.value


_CUSTOM: dict[str, CustomKind] = {}


def register_kind(spelling: str, *, compute: bool = True) -> CustomKind:
    """Declare action kind ``spelling`` (upper-case letters and ``_``); registering the same kind twice returns it."""
    if not re.fullmatch(r"[A-Z][A-Z_]*", spelling):
        raise ValueError(f"action kind {spelling!r} must be upper-case letters and '_', starting with a letter")
    if spelling in Kind._value2member_map_:
        raise ValueError(f"action kind {spelling!r} is built in")
    have = _CUSTOM.get(spelling)
    if have is not None:
        if have.is_compute != compute:
            raise ValueError(f"action kind {spelling!r} is registered already with compute={have.is_compute}")
        return have
    kind = _CUSTOM[spelling] = CustomKind(spelling, compute)
    _build_action_re()
    return kind


def kind_of(spelling: str) -> Kind | CustomKind:
    """The kind spelled ``spelling`` (built in or registered); ``ValueError`` otherwise."""
    if spelling in _CUSTOM:
        return _CUSTOM[spelling]
    return Kind(spelling)


def _build_action_re() -> None:
    global _ACTION_RE
    # Longest spellings first so that "BW" is not read as "B" followed by garbage.
    spellings = sorted([k.value for k in Kind if k is not Kind.PAIR] + list(_CUSTOM), key=len, reverse=True)
    _ACTION_RE = re.compile(rf"^(\d+)({'|'.join(spellings)})(\d+)(?:@(\d+))?$")


_ACTION_RE: re.Pattern[str]
_build_action_re()


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank's plan: ``kind`` on virtual ``stage`` for ``microbatch`` (``peer`` for comm)."""

    stage: int
    kind: Kind | CustomKind
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"action stage and microbatch must be >= 0, got {self.stage=} {self.microbatch=}")
        kind = self.kind
        # The plain compute kinds by identity first (hashing a str Enum for the set lookup is slow).
        compute = kind is _F or kind is _B or kind is _W or kind is _BW or kind.is_compute
        if compute and self.peer is not None:
            raise ValueError(f"compute action {kind.value} takes no peer, got peer={self.peer}")
        if not compute and self.peer is None:
            raise ValueError(f"communication action {kind.value} needs a peer rank")
        if kind is _PAIR:
            raise ValueError("an overlapped F+BW pair is a PairAction(forward, backward), not an Action")

    def __str__(self) -> str:
        s = f"{self.stage}{self.kind.value}{self.microbatch}"
        return s if self.peer is None else f"{s}@{self.peer}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"3F0"``, ``"2BW4"`` or ``"0SEND_F3@1"``; raises ``ValueError`` naming the bad text."""
        m = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(
                f"bad action {text!r}: expected '{{stage}}{{kind}}{{microbatch}}' such as '3F0', '0B12', '2BW4' "
                f"(kinds: {', '.join([k.value for k in Kind if k is not Kind.PAIR] + list(_CUSTOM))})"
            )
        stage, kind, mb, peer = m.groups()
        return cls(int(stage), kind_of(kind), int(mb), None if peer is None else int(peer))


@dataclass(frozen=True, slots=True)
class PairAction:
    """DualPipe's overlapped pair: ``forward`` (an ``F``) and ``backward`` (a ``BW`` of another microbatch) run as one
    step on one rank.  Its inputs must all have arrived before it starts, its outputs are sent after it ends (lowering);
    the runtime runs the forward, then the backward (``compute_handlers``)."""

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if not isinstance(self.forward, Action) or self.forward.kind is not Kind.F:
            raise ValueError(f"a pair's first half must be an F action, got {self.forward!r}")
        if not isinstance(self.backward, Action) or self.backward.kind is not Kind.BW:
            raise ValueError(f"a pair's second half must be a BW action (full backward), got {self.backward!r}")

    @property
    def kind(self) -> Kind:
        return Kind.PAIR

    @property
    def peer(self) -> None:
        return None

    def __str__(self) -> str:
        return f"{self.forward}+{self.backward}"

    def __repr__(self) -> str:
        return f"PairAction({self})"

    @classmethod
    def parse(cls, text: str) -> PairAction:
        """Parse ``"1F5+6BW2"``; raises ``ValueError`` naming the bad text."""
        parts = text.strip().split("+") if isinstance(text, str) else []
        if len(parts) != 2:
            raise ValueError(f"bad pair {text!r}: expected '{{stage}}F{{mb}}+{{stage}}BW{{mb}}' such as '1F5+6BW2'")
        try:
            return cls(Action.parse(parts[0]), Action.parse(parts[1]))
        except ValueError as e:
            raise ValueError(f"bad pair {text!r}: {e}") from None


PlanAction = Action | PairAction  # one step of a compute plan


def parse_action(text: str) -> PlanAction:
    """``Action.parse``, or ``PairAction.parse`` for text with a ``+`` (``"1F5+6BW2"``)."""
    if isinstance(text, str) and "+" in text:
        return PairAction.parse(text)
    return Action.parse(text)


def halves(step: PlanAction) -> tuple[Action, ...]:
    """The plain actions a step does: ``(forward, backward)`` of a pair, else ``(step,)``."""
    if type(step) is PairAction:
        return (step.forward, step.backward)
    return (step,)


# Slot setters of Action: building an action field by field skips __init__'s and __post_init__'s general checks.
_SET_STAGE, _SET_KIND, _SET_MB, _SET_PEER = (
    Action.__dict__[f].__set__ for f in ("stage", "kind", "microbatch", "peer")
)


def unchecked_action(stage: int, kind: Kind | CustomKind, microbatch: int, peer: int | None = None) -> Action:
    """``Action(stage, kind, microbatch, peer)`` without checking its fields: only for passes that build actions
    valid by construction (lowering creates millions of them for p = 512, m = 2048)."""
    a = _new(Action)
    _SET_STAGE(a, stage)
    _SET_KIND(a, kind)
    _SET_MB(a, microbatch)
    _SET_PEER(a, peer)
    return a


def _compute_action(stage: int, kind: Kind, mb: int) -> Action:
    """``Action(stage, kind, mb)`` for a built-in compute kind: the same checks, without ``__post_init__``'s general
    ones (generators build millions of these)."""
    if stage < 0 or mb < 0:
        raise ValueError(f"action stage and microbatch must be >= 0, got self.stage={stage!r} self.microbatch={mb!r}")
    a = _new(Action)
    _SET_STAGE(a, stage)
    _SET_KIND(a, kind)
    _SET_MB(a, mb)
    _SET_PEER(a, None)
    return a


def F(stage: int, mb: int) -> Action:  # noqa: N802 - reads like the IR
    return _compute_action(stage, _F, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return _compute_action(stage, _B, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return _compute_action(stage, _W, mb)


def BW(stage: int, mb: int) -> Action:  # noqa: N802
    return _compute_action(stage, _BW, mb)


def loop_placement(num_ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """Virtual stage ``s`` on rank ``s % p`` (Megatron's interleaved layout)."""
    _check_shape(num_ranks, chunks)
    return tuple(s % num_ranks for s in range(num_ranks * chunks))


def v_placement(num_ranks: int, chunks: int = 2) -> tuple[int, ...]:
    """Zig-zag placement: chunk 0 goes down the ranks, chunk 1 comes back up (ZB-V), and so on.

    With ``chunks=2`` and ``p=4``: stages 0..7 live on ranks 0,1,2,3,3,2,1,0, so the first and the last stage share
    rank 0 and the loss is computed where the input is loaded.
    """
    _check_shape(num_ranks, chunks)
    out = []
    for s in range(num_ranks * chunks):
        chunk, pos = divmod(s, num_ranks)
        out.append(pos if chunk % 2 == 0 else num_ranks - 1 - pos)
    return tuple(out)


def _check_shape(num_ranks: int, chunks: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"number of ranks p={num_ranks} must be >= 1")
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be >= 1")


@dataclass(frozen=True)
class Schedule:
    """A generated plan: each rank's ordered compute actions (lowering adds communication)."""

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[PlanAction, ...], ...]

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"schedule {self.name!r}: num_ranks={self.num_ranks} must be >= 1")
        if self.num_microbatches < 1:
            raise ValueError(f"schedule {self.name!r}: num_microbatches={self.num_microbatches} must be >= 1")
        if self.num_stages < 1 or self.num_stages % self.num_ranks:
            raise ValueError(
                f"schedule {self.name!r}: num_stages={self.num_stages} must be a positive multiple of "
                f"num_ranks={self.num_ranks}"
            )
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"schedule {self.name!r}: stage_to_rank has {len(self.stage_to_rank)} entries, "
                f"expected num_stages={self.num_stages}"
            )
        for s, r in enumerate(self.stage_to_rank):
            if not 0 <= r < self.num_ranks:
                raise ValueError(
                    f"schedule {self.name!r}: stage {s} placed on rank {r}, outside 0..{self.num_ranks - 1}"
                )
        if len(self.ranks) != self.num_ranks:
            raise ValueError(
                f"schedule {self.name!r}: {len(self.ranks)} rank action lists, expected num_ranks={self.num_ranks}"
            )
        # Normalise to tuples so that schedules hash and compare by value.
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))

    @property
    def chunks(self) -> int:
        """Virtual stages per rank."""
        return self.num_stages // self.num_ranks

    @property
    def placement(self) -> str:
        """``"loop"``, ``"v"`` or ``"custom"`` (for p = 1 or one chunk, loop and V coincide: ``"loop"``)."""
        if self.stage_to_rank == loop_placement(self.num_ranks, self.chunks):
            return "loop"
        if self.stage_to_rank == v_placement(self.num_ranks, self.chunks):
            return "v"
        return "custom"

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages that live on ``rank``, in increasing order (the table is built once per plan, so
        asking for every rank costs O(stages), not O(ranks x stages))."""
        table = self.__dict__.get("_stages_by_rank")
        if table is None:
            by_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
            for s, r in enumerate(self.stage_to_rank):
                by_rank[r].append(s)
            table = tuple(map(tuple, by_rank))
            object.__setattr__(self, "_stages_by_rank", table)
        return table[rank]

    def __str__(self) -> str:
        lines = [f"{self.name}: p={self.num_ranks} S={self.num_stages} m={self.num_microbatches} ({self.placement})"]
        for r, acts in enumerate(self.ranks):
            lines.append(f"  rank {r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)
