"""``PeerFailedError``: the one error every call of the layer raises when a peer died, stopped or stalled.

A dead peer shows up in the backend as a closed or reset connection ("Read error [127.0.0.1]:8627: Connection reset
by peer"), a stopped or stalled one as a timeout ("Timed out waiting 3000ms for recv operation to complete"); either
way torch names an address, not a rank, and says nothing of the group or the call.  The layer catches those errors
where it calls ``torch.distributed`` and raises ``PeerFailedError`` instead, carrying what a user needs:

- ``op``: the call (``all_reduce``, ``wait``, ... or a caller's richer description such as a pipeline transfer);
- ``group``: the group's name (``ProcessGroup.group_desc``, given at ``new_group(..., name=...)``; ``world`` for the
  default group) and its members (global ranks);
- ``rank``: this process's global rank; ``peers``: the global ranks it was waiting for (the other members of the
  group for a collective, the peer for a transfer);
- ``timed_out``: a timeout (a stopped or slow peer) rather than a closed connection (a dead one); ``cause``: the
  backend's message, shortened to its first sentence.

The layer knows global ranks only; a caller that knows more (the trainer knows each rank's pipeline stage) passes
``labels`` to ``line``, which writes the one line a user reads.

On NCCL the process group's watchdog, not the layer, times a collective out: with asynchronous error handling on
(``zb_pipeline.comm.groups``) it aborts the process after logging the collective, so a ``PeerFailedError`` arises there
only from calls that surface the error in Python.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from zb_pipeline.comm.backend import DistError, current

__all__ = ["PeerFailedError", "calling", "group_name", "is_peer_error", "peer_failure", "raise_peer_failure"]

# What the backends say when a peer is gone or silent: gloo's transport errors (closed/reset connections, timeouts),
# socket errors, NCCL's watchdog and aborted communicators.  Anything else (a bad argument) is not a peer failure.
_PEER_ERROR = re.compile(
    r"gloo/transport|[Cc]onnection (reset|closed|refused)|[Bb]roken pipe|[Tt]imed out|[Tt]imeout|"
    r"NCCL (error|communicator)|[Ww]atchdog|[Ss]ocket",
)
_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


class PeerFailedError(RuntimeError):
    """A collective or transfer failed because a peer died (connection closed) or stopped (timeout).

    ``str()`` is the caller's ``message`` if one was given, else ``line()`` without labels.
    """

    def __init__(
        self,
        *,
        op: str,
        group: str,
        members: Sequence[int],
        rank: int,
        peers: Sequence[int],
        timed_out: bool,
        cause: str,
        message: str | None = None,
    ) -> None:
        self.op = op
        self.group = group
        self.members = tuple(members)
        self.rank = rank
        self.peers = tuple(peers)
        self.timed_out = timed_out
        self.cause = cause
        super().__init__(message if message is not None else self.line())

    def line(self, labels: Mapping[int, str] | None = None) -> str:
        """One line: who (this rank), what (the call), where (the group), whom it waited for, what happened.

        ``labels`` maps global ranks to what the caller knows of them (the trainer: ``"stage 1"``); each named rank
        gets its label in parentheses.
        """

        def who(r: int) -> str:
            return f"rank {r} ({labels[r]})" if labels and r in labels else f"rank {r}"

        peers = ", ".join(who(r) for r in self.peers) or "none"
        what = "timed out" if self.timed_out else "failed"
        group = f"{self.group} [{', '.join(str(r) for r in self.members)}]"
        return f"{who(self.rank)}: {self.op} over group {group} {what} waiting for {peers}: {self.cause}"


def is_peer_error(err: BaseException) -> bool:
    """Whether ``err`` (raised by a ``torch.distributed`` call) means a peer died, stopped or stalled."""
    if isinstance(err, PeerFailedError):
        return True
    if isinstance(err, DistError):
        return True
    return isinstance(err, RuntimeError) and bool(_PEER_ERROR.search(str(err)))


def group_name(group: Any = None) -> str:
    """A group's name for messages: its ``group_desc`` (set by ``new_group(..., name=...)``), ``world`` for the
    default group, else ``unnamed``."""
    if group is None:
        return "world"
    desc = getattr(group, "group_desc", None)
    if not isinstance(desc, str) or not desc or desc == "undefined":
        return "unnamed"
    return "world" if desc == "default_pg" else desc


def _cause(err: BaseException) -> str:
    """The backend's message, first line and first sentence, without gloo's source-file prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = _SOURCE_PREFIX.sub("", text)
    cut = text.find(". ")
    return text[:cut] if cut > 0 else text.rstrip(".")


def peer_failure(
    err: BaseException,
    *,
    op: str,
    group: Any = None,
    peers: Sequence[int] | None = None,
    message: str | None = None,
    kind: type[PeerFailedError] = PeerFailedError,
) -> PeerFailedError:
    """The ``PeerFailedError`` for backend error ``err`` of call ``op`` on ``group`` (raise it ``from err``).

    ``peers``: the global ranks waited for (default: every other member of ``group``).  Asking the backend for this
    rank and the group's members is local bookkeeping: it works with a peer gone.  ``kind``: a subclass to raise
    (the pipeline's ``PipelinePeerError``).
    """
    b = current()
    me = int(b.get_rank())
    if group is None:
        members: tuple[int, ...] = tuple(range(int(b.get_world_size())))
    else:
        try:
            members = tuple(int(r) for r in b.get_process_group_ranks(group))
        except Exception:  # a test's fake group: name the peers only
            members = tuple(peers or ())
    if peers is None:
        peers = tuple(r for r in members if r != me)
    if isinstance(err, PeerFailedError):
        timed_out, cause = err.timed_out, err.cause
    else:
        timed_out, cause = bool(_TIMED_OUT.search(str(err))), _cause(err)
    return kind(
        op=op,
        group=group_name(group),
        members=members,
        rank=me,
        peers=tuple(peers),
        timed_out=timed_out,
        cause=cause,
        message=message,
    )


def raise_peer_failure(err: BaseException, *, op: str, group: Any = None, peers: Sequence[int] | None = None) -> None:
    """Raise ``peer_failure(err, ...)`` from ``err`` if ``err`` is a peer error not yet turned into one; else return
    (the caller re-raises ``err`` unchanged).  The one translation behind ``calling`` and ``P2PLink``'s calls, which
    catch instead of entering a context (a transfer's hot path)."""
    if not isinstance(err, PeerFailedError) and is_peer_error(err):
        raise peer_failure(err, op=op, group=group, peers=peers) from err


class calling:  # noqa: N801 - used as a statement: ``with calling("all_reduce", group): ...``
    """Turn a peer error raised inside the block into ``PeerFailedError`` (``from`` the backend's error); anything else
    passes through unchanged.  A class, not a generator, because it wraps every transfer of the pipeline."""

    __slots__ = ("group", "op", "peers")

    def __init__(self, op: str, group: Any = None, peers: Sequence[int] | None = None) -> None:
        self.op, self.group, self.peers = op, group, peers

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> bool:
        if err is not None:
            raise_peer_failure(err, op=self.op, group=self.group, peers=self.peers)
        return False
