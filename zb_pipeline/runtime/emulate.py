"""Emulated compute: every F, B and W sleeps its cost instead of computing, with real P2P between ranks.

``--emulate-compute F,B,W[,OPT]`` gives milliseconds for a rank's *whole share* of layers for one microbatch, as
the simulator reads costs; with several chunks per rank each chunk's action costs its ``1/chunks`` part.  OPT is the
optimizer step per iteration (``optimizer_step``).  Many ranks fit on two cores because sleeping costs nothing.
``--emulate-stage-scale s0,s1,...`` (one factor per pipeline rank, ``parse_stage_scale``) multiplies rank r's F, B
and W by ``s_r`` -- a heterogeneous pipeline, e.g. a last stage 1.5x as slow -- as the simulator's per-rank costs
do; OPT is not scaled.  ``charged`` sums the cost each kind of action was given (seconds), so a test can check what
the emulator charged without timing it.

Each action sleeps until an absolute deadline: it starts at the end of the previous action's deadline, or when its
input arrived if it had to wait for it, and ends ``cost`` later.  Oversleeping one action is therefore made up by
the next instead of accumulating over the iteration, so the measured span tracks the simulator's makespan.

The handlers replace the compute handlers of a runtime or executor
(``EmulatedCompute(costs, chunks).attach(runtime)``) and use the executor's own plumbing (``fetch_input``,
``deliver_output``, ...), so the plan, the P2P layer, the local hand-offs of V placement, the end-of-iteration checks
and the trace all behave exactly as in a real run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import TensorSpec
from zb_pipeline.schedule.ir import Action, Kind

# A wait for input that returns within this many seconds did not block: the input was already there.
_BLOCKED_S = 2e-4


@dataclass(frozen=True)
class EmulatedCosts:
    """Milliseconds per microbatch for a rank's whole share: F, B, W; OPT once per iteration."""

    f_ms: float
    b_ms: float
    w_ms: float
    opt_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f_ms", "b_ms", "w_ms", "opt_ms"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"--emulate-compute: {name[:-3].upper()}={v} must be >= 0 milliseconds")

    @classmethod
    def parse(cls, text: str) -> EmulatedCosts:
        """``"20,20,10"`` or ``"20,20,10,5"`` (F,B,W[,OPT] in ms)."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) not in (3, 4):
            raise ValueError(f"--emulate-compute {text!r}: expected F,B,W[,OPT] in milliseconds, e.g. 20,20,10")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"--emulate-compute {text!r}: every value must be a number of milliseconds") from None
        return cls(*values)


def parse_stage_scale(text: str, num_ranks: int) -> tuple[float, ...]:
    """``"1,1,1.5"`` -> one factor per pipeline rank (each a finite number > 0); ``ValueError`` naming the fix."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--emulate-stage-scale {text!r}: every factor must be a number, e.g. 1,1,1.5") from None
    if len(values) != num_ranks:
        raise ValueError(
            f"--emulate-stage-scale {text!r} gives {len(values)} factor(s) but the pipeline has {num_ranks} ranks; "
            f"give one per rank (--pipeline-model-parallel-size {num_ranks})"
        )
    bad = [p for p, v in zip(parts, values) if not (0 < v < float("inf"))]
    if bad:
        raise ValueError(f"--emulate-stage-scale {text!r}: factor {bad[0]} must be a finite number > 0")
    return values


# The OS wakes a sleeping thread late (about 0.15 ms here, more under load); the last stretch before a deadline is
# spun instead, so an emulated action ends on time and its output is posted when the plan says.  With many more ranks
# than cores the spins compete with the other ranks' wake-ups: ``spin_s`` (``EmulatedCompute(spin_s=...)``) sets it.
SPIN_S = 3e-4


def spin_for(ranks_on_host: int) -> float:
    """``SPIN_S`` while every rank has a core, else 0: with more ranks than cores a spinning rank delays the others'
    wake-ups (measured at p = 16 on 2 cores: the span's error over the simulator fell from 2-9% to 0.6-8%)."""
    return SPIN_S if ranks_on_host <= (os.cpu_count() or 1) else 0.0


def sleep_until(deadline: float, spin_s: float = SPIN_S) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (the last ``spin_s`` spun, for punctuality)."""
    left = deadline - time.perf_counter()
    while left > spin_s:
        time.sleep(left - spin_s)
        left = deadline - time.perf_counter()
    while time.perf_counter() < deadline:
        pass


class EmulatedCompute:
    """F/B/W/BW handlers that sleep (see the module docstring); one instance per executor."""

    def __init__(
        self,
        costs: EmulatedCosts,
        *,
        chunks: int,
        boundary_specs: Sequence[TensorSpec],
        device: torch.device | str = "cpu",
        scale: float = 1.0,
        spin_s: float = SPIN_S,
    ) -> None:
        """``device``: the P2P layer's (the hand-off buffers it sends live there); ``scale``: this rank's factor on
        F, B and W (``--emulate-stage-scale``); ``spin_s``: how much of each sleep's end is spun (``sleep_until``)."""
        if chunks < 1:
            raise ValueError(f"{chunks=} must be >= 1")
        if not 0 < scale < float("inf"):
            raise ValueError(f"{scale=} must be a finite number > 0")
        if not spin_s >= 0:
            raise ValueError(f"{spin_s=} must be >= 0 seconds")
        self.costs, self.scale, self.spin_s = costs, scale, spin_s
        self.f_s = costs.f_ms / 1e3 / chunks * scale
        self.b_s = costs.b_ms / 1e3 / chunks * scale
        self.w_s = costs.w_ms / 1e3 / chunks * scale
        self.buffers = [torch.zeros(spec.shape, dtype=spec.dtype, device=device) for spec in boundary_specs]
        self.deadline = 0.0
        self.charged = {Kind.F: 0.0, Kind.B: 0.0, Kind.W: 0.0, Kind.BW: 0.0}  # seconds given to each kind

    def attach(self, target: Any) -> None:
        """Replace the compute handlers of ``target`` (a ``PipelineRuntime`` or ``PipelineExecutor``) by sleeping
        ones."""
        target.set_handler(Kind.F, self._forward)
        target.set_handler(Kind.B, self._b)
        target.set_handler(Kind.W, self._w)
        target.set_handler(Kind.BW, self._bw)
        target.hooks.iteration_start.append(self.start_iteration)

    def start_iteration(self, ex: PipelineExecutor | None = None) -> None:
        self.deadline = time.perf_counter()

    def _run(self, cost_s: float, t_ready: float | None) -> None:
        start = self.deadline if t_ready is None else max(self.deadline, t_ready)
        self.deadline = start + cost_s
        sleep_until(self.deadline, self.spin_s)

    def _forward(self, ex: PipelineExecutor, a: Action) -> None:
        t0 = time.perf_counter()
        ex.fetch_input(a)
        t1 = time.perf_counter()
        self._run(self.f_s, t1 if t1 - t0 > _BLOCKED_S else None)
        self.charged[Kind.F] += self.f_s
        if a.stage < ex.num_stages - 1:
            ex.deliver_output(a, self.buffers[a.stage])
        ex.save_for_backward(a, None, None)

    def _backward(self, ex: PipelineExecutor, a: Action, cost_s: float) -> None:
        ex.pop_saved(a)
        t0 = time.perf_counter()
        ex.fetch_output_grad(a)
        t1 = time.perf_counter()
        self._run(cost_s, t1 if t1 - t0 > _BLOCKED_S else None)
        if a.stage > 0:
            ex.deliver_input_grad(a, self.buffers[a.stage - 1])

    def _b(self, ex: PipelineExecutor, a: Action) -> None:
        self._backward(ex, a, self.b_s)
        self.charged[Kind.B] += self.b_s
        ex.defer_w(a)

    def _bw(self, ex: PipelineExecutor, a: Action) -> None:
        self._backward(ex, a, self.b_s + self.w_s)
        self.charged[Kind.BW] += self.b_s + self.w_s

    def _w(self, ex: PipelineExecutor, a: Action) -> None:
        ex.complete_w(a)
        self._run(self.w_s, None)
        self.charged[Kind.W] += self.w_s

    def optimizer_step(self) -> None:
        """Sleep the OPT share (call once per iteration after ``executor.run``)."""
        self.deadline = max(self.deadline, time.perf_counter())
        self._run(self.costs.opt_ms / 1e3, None)
