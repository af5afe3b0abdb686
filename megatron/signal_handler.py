"""``--exit-signal-handler``: turn SIGTERM (preemption) into "save at the end of this iteration, then exit".

The handler only records the signal; the training loop asks ``should_exit()`` once per iteration, which combines
the flag over every rank (``megatron.any_rank_flag``: reduced without a wait between synchronisation points), so all
ranks save and stop at the same iteration even when the signal reached only some of them.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from types import FrameType

from megatron.any_rank_flag import AnyRankFlag


class ExitSignalHandler:
    """Context manager: installs the handler on enter, restores the previous one on exit."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._previous = None
        self._any = AnyRankFlag()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> ExitSignalHandler:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)

    def should_exit(self, *, distributed: bool, wait: bool = True, timeout: timedelta | None = None) -> bool:
        """Whether any rank received the signal (a collective when ``distributed``; see ``AnyRankFlag.check``)."""
        return self._any.check(self.received, distributed=distributed, wait=wait, timeout=timeout)
