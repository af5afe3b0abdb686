"""``--exit-signal-handler``: turn SIGTERM (preemption) into "save at the end of this iteration, then exit".

The handler only records the signal; the training loop asks ``should_exit()`` once per iteration, which combines
the flag over every rank (one tiny all-reduce over the default group, on its device), so all ranks save and stop at
the same iteration even when the signal reached only some of them.  Between the iterations where the run
synchronises anyway (``wait=True``: a log line, an evaluation, a checkpoint, the end) the all-reduce is only started,
and its answer read at the next call -- by then it completed long ago -- so no iteration ends waiting for the slowest
rank; a signal is then acted on one iteration later.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from types import FrameType
from typing import Any

import torch

from zb_pipeline import comm


class ExitSignalHandler:
    """Context manager: installs the handler on enter, restores the previous one on exit."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._previous = None
        self._flag: torch.Tensor | None = None  # the flag of the reduction started by the last call (wait=False)
        self._work: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> ExitSignalHandler:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)

    def should_exit(self, *, distributed: bool, wait: bool = True, timeout: timedelta | None = None) -> bool:
        """Whether any rank received the signal (a collective when ``distributed``: call it on every rank, with the
        same ``wait``).  ``wait=False``: the answer of the reduction the previous call started (``False`` if none),
        and the next one started; ``wait=True``: that answer or the flags of every rank now."""
        if not distributed:
            return self.received
        earlier = self._read_started(timeout)
        if wait:
            (anyone,) = comm.all_reduce_values([1 if self.received else 0], op="max", dtype=torch.int32)
            return earlier or bool(anyone)
        self._start()
        return earlier

    def _start(self) -> None:
        """Start the all-reduce of this rank's flag.  On a GPU group (NCCL) the result is copied to pinned host
        memory behind the reduction on the compute stream right away (``comm.wait`` only makes the stream wait),
        so reading it at the next call waits for that copy's event, never for the device's later work."""
        where = comm.placement(None)
        self._flag = torch.full((1,), int(self.received), dtype=torch.int32, device=where.device)
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
