"""Optimizer post-validation: step without waiting for the other pipeline ranks, roll back exactly when wrong.

The synchronised optimizer needs the global gradient norm and the global inf/NaN flag before any rank may update:
one reduction over all pipeline ranks at every iteration boundary, a bubble.  Post-validation removes that wait:

1. **At the end of iteration i** (``PostValidator.step``, no communication) a rank unscales its gradients and takes
   its *local* sum of squared grads (already reduced over its tensor-parallel group, and its data-parallel group
   when the optimizer is sharded -- the optimizer's ``unscale_and_local_stats``).  The global state can only be worse
   than the local one (partial sums of squares only grow, and stay inf/NaN once they are), so:

   - local inf/NaN: the step is certainly skipped -- do nothing now;
   - local norm already above the clip threshold: the step is certainly clipped, with a coefficient not known yet
     -- do nothing now, step at validation;
   - otherwise step *optimistically* (unclipped), after a snapshot of the main parameters, the optimizer state
     and the step count.

2. **During iteration i + 1** the states travel along the ``SEND_PV``/``RECV_PV`` chain that
   ``zb_pipeline.schedule.post_validation_pass`` puts into the plan: rank ``r`` adds its ``L`` to the partial state
   ``P(r-1)`` from rank ``r - 1`` in float64 and passes ``P(r)`` on (in the prologue); the last rank's ``P`` is the
   total ``T``, sent back rank by rank, and arrives at each rank's *validation point* -- before its first backward
   action, after the warm-up forwards that the plan lets it run meanwhile with the optimistic weights.  On arrival
   of ``T`` the rank validates: exactly what the synchronised optimizer would have done is computed from ``T``,
   and if the optimistic step differs the snapshot is restored (a copy, never an algebraic inversion) and the
   correct action is taken: skip (and the loss scaler sees the overflow) or clip with the global coefficient and
   step again.  Then the gradients are zeroed for the new iteration.  If validation changed the weights of *any*
   rank (``T`` says so to every rank alike: it counts the ranks that stepped optimistically), the forwards already
   run are wrong, so every rank requests a replay: the executor drains the prefix's transfers (a consistent cut of
   the plan), restores the RNG state of the iteration's start and runs the iteration again from its first action.

3. **The synchronised path** (``synchronised_step``) sums the same per-rank states in the same fixed rank order,
   ``((L0 + L1) + L2) + ...`` in float64, so both paths compute the identical norm bit for bit.

The last iteration of a run (or the one before a checkpoint or an evaluation) is validated by ``flush``: the same
ordered sum through one all-gather.

The optimizer is reached through ``PostValidatableOptimizer`` (a small protocol that the trainer's
``megatron.optimizer.MainParamOptimizer`` implements; ``megatron.pipeline.post_validated_step`` wires it into the
training loop).  Nothing here imports ``megatron``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zb_pipeline import comm
from zb_pipeline.optim.grad_stats import GradStats, grad_stats
from zb_pipeline.runtime.p2p import POST_VALIDATION_SPEC
from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.post_validation_pass import PV_BACK, PV_FORWARD

# Decisions taken at step time (``Pending.decision``).
STEPPED = "stepped"  # optimistic step taken; snapshot kept
HELD_NONFINITE = "held_nonfinite"  # local inf/NaN: the step is certainly skipped
HELD_CLIP = "held_clip"  # local norm above the clip threshold: the step is certainly clipped

# Outcome counters (``PostValidator.counts``): validated steps and rollbacks by cause.
OUTCOMES = (
    "validated",  # optimistic step confirmed
    "rollback_nonfinite",  # optimistic step undone: another rank had inf/NaN, step skipped
    "rollback_clip",  # optimistic step undone: the global norm needs clipping, stepped again clipped
    "held_nonfinite",  # no step taken (local inf/NaN), confirmed skip
    "held_clip",  # no step taken (local norm above threshold), clipped step taken at validation
    "held_clip_nonfinite",  # no step taken (local clip), another rank had inf/NaN: skipped
)


class PostValidatableOptimizer(Protocol):
    """What post-validation needs from an optimizer (each call is local: no communication across pipeline ranks)."""

    def unscale_and_local_stats(self) -> torch.Tensor:
        """Unscale the gradients in place (fp16 loss scale) and return the float64 sum of squares (0-d) of the
        gradients this rank counts, reduced over its tensor-parallel (and, if sharded, data-parallel) group."""
        ...

    def clip_coefficient(self, norm: float) -> float:
        """The factor the gradients are multiplied by before the update (1.0: no clipping)."""
        ...

    def apply_update(self, lr: float, coeff: float) -> None:
        """Scale the gradients by ``coeff`` if it is below 1, update, and publish to the model parameters."""
        ...

    def update_loss_scale(self, found_nonfinite: bool) -> None: ...

    def snapshot(self) -> Any:
        """A copy of everything ``apply_update`` changes (main parameters, optimizer state, step count)."""
        ...

    def restore(self, snapshot: Any) -> None:
        """Put the ``snapshot`` back exactly and re-publish the model parameters."""
        ...

    def zero_grad(self) -> None: ...


def local_state(
    stats: torch.Tensor | None, *, stepped: bool = False, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The float64 ``[sum of squares, pending, stepped]`` a rank contributes (zeros on ``device``: no pending step;
    ``stepped``: the rank updated its weights optimistically).

    The state stays on the statistics' device (it travels over the pipeline group, whose device that is); the flags
    are written by fill kernels, not copied from the host, so building it never waits for the device.
    """
    if stats is None:
        return torch.zeros(POST_VALIDATION_SPEC.shape, dtype=torch.float64, device=device)
    flags = torch.ones(2, dtype=torch.float64, device=stats.device)
    if not stepped:
        flags[1] = 0.0
    return torch.cat([stats.detach().to(torch.float64).reshape(1), flags])


def sum_in_rank_order(states: list[torch.Tensor]) -> torch.Tensor:
    """``((s0 + s1) + s2) + ...``: the one summation order of both paths."""
    total = states[0].clone()
    for s in states[1:]:
        total = total + s
    return total


def gather_in_rank_order(state: torch.Tensor, group: comm.ProcessGroup | None) -> torch.Tensor:
    """Sum every pipeline rank's ``state`` in rank order (one all-gather, on the state's device): the synchronised
    reduction."""
    if group is None or not comm.is_initialized() or comm.world_size(group) == 1:
        return state.clone()
    parts = [torch.empty_like(state) for _ in range(comm.world_size(group))]
    comm.all_gather(parts, state.contiguous(), group=group)
    return sum_in_rank_order(parts)


@dataclass(frozen=True)
class SyncOutcome:
    stats: GradStats
    skipped: bool


@torch.no_grad()
def synchronised_step(opt: PostValidatableOptimizer, lr: float, *, pp_group: comm.ProcessGroup | None) -> SyncOutcome:
    """The synchronised optimizer over the same protocol: reduce (ordered), then skip or clip and step."""
    local = local_state(opt.unscale_and_local_stats())
    stats = grad_stats(gather_in_rank_order(local, pp_group)[0])
    opt.update_loss_scale(stats.found_nonfinite)
    if stats.found_nonfinite:
        return SyncOutcome(stats, skipped=True)
    opt.apply_update(lr, opt.clip_coefficient(stats.norm))
    return SyncOutcome(stats, skipped=False)


@dataclass
class Pending:
    """A step taken (or held back) at the end of an iteration, waiting for the global state."""

    lr: float
    decision: str
    state: torch.Tensor  # this rank's local_state
    snapshot: Any = None


@dataclass(frozen=True)
class Validation:
    """What validation found for one iteration's step on this rank."""

    outcome: str  # one of OUTCOMES
    stats: GradStats
    skipped: bool
    # Some rank's weights changed at validation (rollback, or a held step taken), so every forward run since the
    # step used wrong weights or wrong inputs: the whole pipeline replays the iteration (same on every rank).
    replay: bool = False


@dataclass
class PostValidator:
    """One pipeline rank's post-validated optimizer step (module docstring).

    ``attach(runtime)`` wires the plan's ``SEND_PV``/``RECV_PV`` actions to it; ``on_validated(validation)`` is
    called after each validation (the trainer logs it; tests record the parameters there).  ``device`` is the
    pipeline group's (where the states travel).  Each step reads the statistics to the host twice: this rank's at
    ``step`` (the local decision) and the total at validation.
    """

    optimizer: PostValidatableOptimizer
    pp_rank: int
    pp_size: int
    on_validated: Callable[[Validation], None] | None = None
    device: torch.device | str = "cpu"
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    pending: Pending | None = None
    last: Validation | None = None
    _partial: torch.Tensor | None = None
    _total: torch.Tensor | None = None
    _validated: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={self.pp_rank} must be in 0..pp_size-1 (pp_size={self.pp_size})")

    # -- end of an iteration: no communication ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> str:
        """Take (or hold back) this iteration's step from local information only; returns the decision."""
        if self.pending is not None:
            raise RuntimeError(
                f"pipeline rank {self.pp_rank}: the previous step was never validated; run the next iteration's "
                "plan (with its SEND_PV/RECV_PV actions) or call flush() before stepping again"
            )
        opt = self.optimizer
        local = opt.unscale_and_local_stats()
        mine = grad_stats(local)  # a lower bound of the global state
        if mine.found_nonfinite:
            decision, snap = HELD_NONFINITE, None
        elif opt.clip_coefficient(mine.norm) < 1.0:
            decision, snap = HELD_CLIP, None
        else:
            decision, snap = STEPPED, opt.snapshot()
            opt.apply_update(lr, 1.0)
        self.pending = Pending(
            lr=lr, decision=decision, state=local_state(local, stepped=decision == STEPPED), snapshot=snap
        )
        return decision

    def own_state(self) -> torch.Tensor:
        return self.pending.state if self.pending is not None else local_state(None, device=self.device)

    # -- validation -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, total: torch.Tensor) -> Validation | None:
        """Resolve the pending step against the fully reduced state; zero the gradients for the next iteration."""
        pend, self.pending = self.pending, None
        opt = self.optimizer
        values = total.tolist()  # the one host read of the validated state
        ranks_pending = int(values[1])
        if pend is None:
            if ranks_pending != 0:
                raise RuntimeError(f"pipeline rank {self.pp_rank}: other ranks validate a step this rank never took")
            opt.zero_grad()
            return None
        if ranks_pending != self.pp_size:
            raise RuntimeError(
                f"pipeline rank {self.pp_rank}: only {ranks_pending} of {self.pp_size} pipeline ranks took a step "
                "this iteration; every rank must call PostValidator.step once per iteration"
            )
        stats = grad_stats(values[0])
        opt.update_loss_scale(stats.found_nonfinite)
        coeff = 1.0 if stats.found_nonfinite else opt.clip_coefficient(stats.norm)
        if pend.decision == STEPPED:
            if stats.found_nonfinite:
                opt.restore(pend.snapshot)
                outcome = "rollback_nonfinite"
            elif coeff < 1.0:
                opt.restore(pend.snapshot)
                opt.apply_update(pend.lr, coeff)
                outcome = "rollback_clip"
            else:
                outcome = "validated"
        elif pend.decision == HELD_NONFINITE:
            outcome = "held_nonfinite"  # the global sum of squares is non-finite too
        elif stats.found_nonfinite:
            outcome = "held_clip_nonfinite"
        else:
            opt.apply_update(pend.lr, coeff)
            outcome = "held_clip"
        opt.zero_grad()
        self.counts[outcome] += 1
        stepped_somewhere = int(values[2]) > 0
        replay = stepped_somewhere if stats.found_nonfinite else coeff < 1.0
        result = Validation(outcome=outcome, stats=stats, skipped=stats.found_nonfinite, replay=replay)
        self.last = result
        if self.on_validated is not None:
            self.on_validated(result)
        return result

    def flush(self, group: comm.ProcessGroup | None) -> Validation | None:
        """Validate the pending step now, synchronously (end of run, before a checkpoint or an evaluation)."""
        return self.validate(gather_in_rank_order(self.own_state(), group))

    def rollbacks(self) -> int:
        return self.counts["rollback_nonfinite"] + self.counts["rollback_clip"]

    def log_summary(self) -> str:
        """``validated steps: N | rollbacks: inf/nan A, clip B | held back: ...`` for the trainer's log line."""
        c = self.counts
        return (
            f"validated steps: {c['validated']} | rollbacks: inf/nan {c['rollback_nonfinite']}, clip "
            f"{c['rollback_clip']} | held back: inf/nan {c['held_nonfinite']}, clip {c['held_clip']}"
            f"{', clip+inf/nan ' + str(c['held_clip_nonfinite']) if c['held_clip_nonfinite'] else ''}"
        )

    # -- the plan's SEND_PV / RECV_PV actions ------------------------------------------------------------------
    def attach(self, target: Any) -> None:
        """Register the post-validation actions' handlers and hooks on a ``PipelineRuntime`` or ``PipelineExecutor``."""
        target.set_handler(Kind.SEND_PV, self._send_handler)
        target.set_handler(Kind.RECV_PV, _no_payload)
        target.hooks.add_after_post(Kind.RECV_PV, self._received)
        target.hooks.iteration_start.append(self._iteration_start)
        target.hooks.iteration_end.append(self._iteration_end)

    def _iteration_start(self, executor: Any) -> None:
        self._partial = self._total = None
        self._validated = False
        if self.pp_size == 1:  # no chain: the local state is the total, validated before the first forward
            self.validate(self.own_state())
            self._validated = True

    def _iteration_end(self, executor: Any) -> None:
        """The executor's end-of-iteration check: the plan's chain delivered and this rank validated."""
        if not self._validated:
            raise RuntimeError(
                f"pipeline rank {self.pp_rank}: the iteration ended without the fully reduced post-validation state; "
                "the plan lacks its SEND_PV/RECV_PV chain (lower it with add_post_validation)"
            )

    def _send_handler(self, executor: Any, a: Action) -> torch.Tensor:
        if a.microbatch == PV_FORWARD:
            if self.pp_rank == 0:
                self._partial = self.own_state()
            return self._partial
        return self._total

    def _received(self, executor: Any, a: Action) -> None:
        buf = executor.p2p.take(Kind.RECV_PV, a.stage, a.microbatch, a)
        if a.microbatch == PV_FORWARD:
            self._partial = buf + self.own_state()  # P(r) = P(r-1) + L(r), the order of sum_in_rank_order
            if self.pp_rank == self.pp_size - 1:
                self._total = self._partial
                self._validate_in_plan(executor)
        elif a.microbatch == PV_BACK:
            self._total = buf.clone()
            self._validate_in_plan(executor)

    def _validate_in_plan(self, executor: Any) -> None:
        result = self.validate(self._total)
        self._validated = True
        if result is not None and result.replay:
            executor.request_replay()


def _no_payload(executor: Any, a: Action) -> None:
    return None
