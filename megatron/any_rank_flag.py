"""A flag that stops every rank when any one rank raises it, reduced without a wait between synchronisation points.

The training loop asks ``AnyRankFlag.check`` once per iteration on every rank with that rank's own value (SIGTERM
received, ``--exit-duration-in-mins`` passed).  Where the run synchronises anyway (``wait=True``: a log line, an
evaluation, a checkpoint, the last iteration) the flags are all-reduced and read at once.  Elsewhere the all-reduce
is only started and its answer read at the next call -- by then it completed long ago -- so no iteration ends
waiting for the slowest rank; a flag is then acted on one iteration later, at the same iteration on every rank.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from zb_pipeline import comm


class AnyRankFlag:
    """One any-rank flag (see the module docstring); one instance per kind of flag, created on every rank."""

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None  # the flag of the reduction started by the last call (wait=False)
        self._work: Any = None

    def check(self, local: bool, *, distributed: bool, wait: bool = True, timeout: timedelta | None = None) -> bool:
        """Whether any rank's flag is up (a collective when ``distributed``: call it on every rank, with the same
        ``wait``).  ``wait=False``: the answer of the reduction the previous call started (``False`` if none), and
        the next one started; ``wait=True``: that answer or the flags of every rank now."""
        if not distributed:
            return local
        earlier = self._read_started(timeout)
        if wait:
            (anyone,) = comm.all_reduce_values([int(local)], op="max", dtype=torch.int32)
            return earlier or bool(anyone)
        self._start(local)
        return earlier

    def _start(self, local: bool) -> None:
        """Start the all-reduce of this rank's flag.  On a GPU group (NCCL) the result is copied to pinned host
        memory behind the reduction on the compute stream right away (``comm.wait`` only makes the stream wait),
        so reading it at the next call waits for that copy's event, never for the device's later work."""
        where = comm.placement(None)
        self._flag = torch.full((1,), int(local), dtype=torch.int32, device=where.device)
        self._work = comm.all_reduce(self._flag, op="max", async_op=True)
        if where.device.type == "cuda":
            comm.wait(self._work, where=where)  # stream-side on NCCL: the host does not block
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(self._flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._flag, self._work = host, event  # read after ``event.synchronize()``

    def _read_started(self, timeout: timedelta | None) -> bool:
        """The answer of the reduction ``_start`` began (False if none)."""
        work, flag = self._work, self._flag
        if work is None:
            return False
        self._flag = self._work = None
        if isinstance(work, torch.cuda.Event):
            work.synchronize()
        else:
            comm.wait(work, timeout=timeout)
        return bool(flag.item())
