"""``--profile``: profile a window of iterations on chosen ranks (``megatron.config.profiling.ProfilingConfig``).

The loop calls ``before_iteration(i)`` and ``after_iteration(i)`` around the iteration that starts after ``i``
completed ones.  With ``--use-pytorch-profiler`` a ``torch.profiler.profile`` records iterations
``[step_start, step_end)`` and writes one Chrome trace per profiled rank,
``<trace_dir>/rank<R>_iters<start>-<end>.pt.trace.json`` (open it in Perfetto or ``chrome://tracing``); without it
the window is a CUDA profiler range (``nsys profile --capture-range=cudaProfilerApi`` records it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from megatron.config.profiling import ProfilingConfig


class ProfileWindow:
    """One rank's part of the profiling window (a no-op on ranks outside ``--profile-ranks``)."""

    def __init__(self, config: ProfilingConfig, *, rank: int, log: Callable[[str], None] = print) -> None:
        self.config = config
        self.rank = rank
        self.active = config.profile and rank in config.ranks
        self.log = log
        self._prof: Any = None
        self._cuda_range = False
        self.trace_path: str | None = None
        if self.active and not config.use_pytorch_profiler and not torch.cuda.is_available():
            log(
                "notice: --profile without --use-pytorch-profiler marks a CUDA profiler range for nsys; there is "
                "nothing to record without CUDA (add --use-pytorch-profiler for a torch.profiler trace)"
            )

    def before_iteration(self, completed: int) -> None:
        if not self.active or completed != self.config.step_start:
            return
        if self.config.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
        elif torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()
            self._cuda_range = True

    def after_iteration(self, completed_after: int) -> None:
        """``completed_after``: iterations completed once this one finished."""
        if self._prof is not None:
            self._prof.step()
        if completed_after == self.config.step_end:
            self.stop()

    def stop(self) -> None:
        """End the window now (its end, or the run stopped inside it)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            c = self.config
            os.makedirs(c.trace_dir, exist_ok=True)
            self.trace_path = os.path.join(
                c.trace_dir, f"rank{self.rank}_iters{c.step_start}-{c.step_end}.pt.trace.json"
            )
            prof.export_chrome_trace(self.trace_path)
            print(f"rank {self.rank}: wrote the torch.profiler trace {self.trace_path}", flush=True)
        if self._cuda_range:
            torch.cuda.cudart().cudaProfilerStop()
            self._cuda_range = False
