"""A failed or stalled peer rank, reported as one line per surviving rank (what ``pretrain_gpt.py`` prints).

The communication layer raises ``comm.PeerFailedError`` wherever a collective or transfer meets a dead peer (a
closed connection) or a stopped one (the ``--distributed-timeout-minutes``/``--distributed-timeout-seconds``
timeout): it knows the call, the group and the global ranks waited for.  ``pretrain`` adds what only the trainer
knows -- each rank's pipeline stage(s) -- and raises ``PeerFailedRunError`` with the line; ``pretrain_gpt.py``
prints it on every rank and exits with ``EXIT_PEER_FAILURE``.  Rank 0's line also says what to do.

No traceback goes with the line unless ``ZB_DEBUG=1`` is set in the environment (``debug_tracebacks``).
"""

from __future__ import annotations

import os

from megatron.parallel.rank_math import RankLayout
from zb_pipeline import comm

__all__ = ["DEBUG_ENV", "EXIT_PEER_FAILURE", "PeerFailedRunError", "debug_tracebacks", "peer_failure_line"]

EXIT_PEER_FAILURE = 3  # distinct from 2 (bad input) and 1 (run aborted: full disk, NaN)
DEBUG_ENV = "ZB_DEBUG"


class PeerFailedRunError(RuntimeError):
    """Another rank died or stopped during a collective or transfer: the message is this rank's one line."""


def debug_tracebacks() -> bool:
    """Whether ``ZB_DEBUG`` asks for tracebacks with the one-line errors (any value but empty or ``0``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def stage_labels(layout: RankLayout, *, chunks: int = 1, placement: str = "loop") -> dict[int, str]:
    """``{global rank: "stage s"}`` (``"stages s1, s2"`` with virtual stages) for every rank of ``layout``."""
    labels = {}
    for r in range(layout.world_size):
        stages = layout.stages_of(r, chunks=chunks, placement=placement)
        labels[r] = ("stage " if len(stages) == 1 else "stages ") + ", ".join(str(s) for s in stages)
    return labels


def peer_failure_line(err: comm.PeerFailedError, *, labels: dict[int, str], first_rank: bool, timeout_s: float) -> str:
    """This rank's line for ``err``; on the first rank (``first_rank``) followed by what to do."""
    line = "peer failure: " + err.line(labels)
    if not first_rank:
        return line
    peers = ", ".join(str(r) for r in err.peers) or "?"
    what = "did not answer in time" if err.timed_out else "closed its connection"
    return (
        f"{line}; rank {peers} {what}: check its log for its own error (the first rank to fail is the cause, every "
        f"other names the rank it waited for); if a rank was only slow, raise --distributed-timeout-minutes (now "
        f"{timeout_s:g} s); ZB_DEBUG=1 adds tracebacks"
    )
