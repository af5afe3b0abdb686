"""Profiling window of the run: Megatron's ``--profile``, ``--use-pytorch-profiler``, ``--profile-step-start/-end``
and ``--profile-ranks`` (defaults 10, 12 and rank 0, as in Megatron)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require


@dataclass(frozen=True)
class ProfilingConfig:
    """``profile``: profile iterations ``[step_start, step_end)`` (0-based: the iteration that starts after
    ``step_start`` completed ones is the first) on the ranks in ``ranks``.  ``use_pytorch_profiler``: with
    ``torch.profiler`` (a trace per rank under ``trace_dir``); otherwise the CUDA profiler range that ``nsys
    --capture-range=cudaProfilerApi`` records (nothing to record without CUDA)."""

    profile: bool = False
    use_pytorch_profiler: bool = False
    step_start: int = 10
    step_end: int = 12
    ranks: tuple[int, ...] = (0,)
    trace_dir: str = "profiles"

    def __post_init__(self) -> None:
        require(self.step_start >= 0, f"--profile-step-start={self.step_start} must be >= 0")
        require(
            self.step_end > self.step_start,
            f"--profile-step-end={self.step_end} must be > --profile-step-start={self.step_start}",
        )
        require(all(r >= 0 for r in self.ranks), f"--profile-ranks {list(self.ranks)}: ranks must be >= 0")
        require(
            not self.use_pytorch_profiler or self.profile,
            "--use-pytorch-profiler needs --profile (it picks the profiler that --profile runs)",
        )
