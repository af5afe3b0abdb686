"""``--exit-signal-handler``: turn SIGTERM (preemption) into "save at the end of this iteration, then exit".

The handler only records the signal; the training loop asks ``should_exit()`` once per iteration, which combines
the flag over every rank (one tiny all-reduce, staged on the default group's device by ``zb_pipeline.comm``), so all
ranks save and stop at the same iteration even when the signal reached only some of them.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch

from zb_pipeline import comm


class ExitSignalHandler:
    """Context manager: installs the handler on enter, restores the previous one on exit."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> ExitSignalHandler:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)

    def should_exit(self, *, distributed: bool) -> bool:
        """Whether any rank received the signal (a collective when ``distributed``: call it on every rank)."""
        if not distributed:
            return self.received
        (anyone,) = comm.all_reduce_values([1 if self.received else 0], op="max", dtype=torch.int32)
        return bool(anyone)
