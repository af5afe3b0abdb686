"""One training iteration on one rank: forward/backward over the microbatches, then the optimizer step.

::

    zero the main_grad buffers
    for each of the m microbatches of this data-parallel rank:
        loss_k = masked mean of the per-token loss of microbatch k
        backward(loss_k / m)          # gradients accumulate in fp32 param.main_grad; the reducer launches a bucket's
                                      # data-parallel all-reduce as soon as every gradient in it is final
    wait for the reducer (main_grad = mean over the whole global batch); sum sequence-parallel grads over tp
    optimizer step (megatron.optimizer.main_params): unscale (fp16), one reduction of grad norm + inf/NaN over every
    model-parallel rank, skip on inf/NaN (fp16: the loss scaler backs off), clip, the update rule (--optimizer) on
    fp32 main params, copy them into the (bf16/fp16/fp32) model; the LR schedule advances only when the step was
    applied (as in Megatron)

With pp > 1 the plan runs the microbatches instead (``megatron.pipeline.trainer_hooks.pipeline_forward_backward``);
with post-validation the step's outcome settles one iteration later (``settle``).  The iteration's loss is reduced
over the pipeline and data-parallel groups without a wait (``megatron.deferred_loss``): ``train_step`` returns it
pending, and ``settle_losses`` reads every pending loss back at a log line, an evaluation, a checkpoint and the end
of the run (with ``--check-for-nan-in-loss-and-grad`` at once, every iteration).  ``forward_backward``,
``optimizer_step`` and ``train_step`` are public so tests can compare gradients and parameters between layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.config.errors import RunAbortedError
from megatron.data.loader import train_microbatches
from megatron.deferred_loss import PendingLoss, resolve_losses
from megatron.microbatches import microbatch_loss
from megatron.optimizer import GradStats
from megatron.parallel.tensor_parallel.partitioning import allreduce_sequence_parallel_grads
from megatron.pipeline.post_validated_step import SettledStep
from megatron.pipeline.trainer_hooks import pipeline_forward_backward
from megatron.trainer_state import Trainer
from megatron.training_metrics import num_zeros_in_grad


@dataclass(frozen=True)
class StepResult:
    pending_loss: PendingLoss  # the global-batch mean loss, read back by ``loss`` (``settle_losses``)
    learning_rate: float
    grad_stats: GradStats | None  # of the step settled in this call (None: none settled, post-validation's 1st)
    skipped: bool  # a step settled in this call was skipped (post-validation: the previous iteration's step)
    loss_scale: float = 1.0
    nan_grads: bool = False  # inf/NaN gradients without fp16 dynamic scaling (counted at once)
    num_zeros_in_grad: int | None = None  # --log-num-zeros-in-grad: zero gradient entries of this iteration

    @property
    def loss(self) -> float:
        """The iteration's loss (a collective the first time: read it at the same iterations on every rank)."""
        return self.pending_loss.value()

    @property
    def nan(self) -> bool:
        """Counted as a nan iteration: a non-finite loss, or inf/NaN gradients without fp16 scaling."""
        return self.nan_grads or not math.isfinite(self.loss)


def forward_backward(tr: Trainer) -> float:
    """Forward and backward over this rank's microbatches of the next iteration; returns the global-batch mean loss.

    Afterwards every ``main_grad`` holds the gradient of the mean loss over the whole global batch (reduced over
    data-parallel ranks, sequence-parallel parts summed over the tensor-parallel group).
    """
    return forward_backward_pending(tr).value()


def forward_backward_pending(tr: Trainer) -> PendingLoss:
    """``forward_backward`` with the loss's reductions started, not waited for."""
    if tr.pipeline is not None:  # pp > 1: the plan runs the microbatches (megatron.pipeline.trainer_hooks)
        return pipeline_forward_backward(tr)
    run, ctx = tr.run, tr.ctx
    batches = train_microbatches(tr)  # this iteration's m (ramp-up: m follows the global batch size)
    m = len(batches)
    tr.model.train()
    tr.reducer.zero_grad()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    scale = tr.optimizer.loss_scale  # 1 for bf16/fp32: loss * 1 / m is exactly loss / m
    for k, batch in enumerate(batches):
        tr.reducer.prepare_microbatch(is_last=k == m - 1)
        loss = microbatch_loss(tr.model, batch)
        (loss * scale / m).backward()
        total += loss.detach().double()
    tr.reducer.finish()
    if run.parallel.sequence_parallel or run.model.qk_layernorm:  # grads that are partial sums over tp
        allreduce_sequence_parallel_grads(tr.model.parameters(), ctx)
    return PendingLoss.of_context(total, m, ctx)


def optimizer_step(tr: Trainer) -> list[SettledStep]:
    """The optimizer step of the iteration just run (``tr.iteration`` not yet advanced); returns the steps whose
    outcome became final, already applied to the LR schedule and the counters (``settle``).

    Synchronised: unscale, check, clip and apply the update rule with the scheduled rate -- one settled step.
    Post-validated: first settle what the plan validated during this iteration (the previous step: the LR schedule
    must advance before this step reads its rate), then step from local statistics; the outcome settles later.
    A skipped step (inf/NaN gradients) leaves parameters, optimizer state and LR schedule unchanged.
    """
    pv = tr.post_validation
    if pv is None:
        lr = tr.scheduler.current_lr
        outcome = tr.optimizer.step(lr)
        return settle(tr, [SettledStep(tr.iteration + 1, lr, outcome.stats, outcome.skipped)])
    settled = settle(tr, pv.take_settled())
    pv.step(tr.scheduler.current_lr, tr.iteration + 1)
    return settled


def settle(tr: Trainer, steps: list[SettledStep]) -> list[SettledStep]:
    """Apply final step outcomes: LR schedule (advances only on an applied step, as in Megatron), skip counter,
    the inf/NaN check, listeners."""
    overflow_expected = tr.optimizer.scaler.dynamic
    for st in steps:
        # fp16 with dynamic scaling expects occasional overflow (the scaler handles it); otherwise it is a fault.
        if st.skipped and tr.run.precision.check_for_nan_in_loss_and_grad and not overflow_expected:
            raise RunAbortedError(
                f"inf/NaN in the gradients at iteration {st.iteration} (--check-for-nan-in-loss-and-grad); "
                "lower --lr or resume from an earlier checkpoint"
            )
        if st.skipped:
            tr.skipped_iterations += 1
        else:
            tr.scheduler.step(tr.run.lr_increment(st.iteration))
        for listener in tr.step_listeners:
            listener(tr, st)
    return steps


def settle_pending_step(tr: Trainer) -> list[SettledStep]:
    """Post-validation: validate the last step now (before an evaluation, a checkpoint, the end of the run)."""
    if tr.post_validation is None:
        return []
    tr.post_validation.flush()
    return settle(tr, tr.post_validation.take_settled())


def train_step(tr: Trainer, *, read_stats: bool = True) -> StepResult:
    """One iteration: ``forward_backward`` then ``optimizer_step``; advances ``tr.iteration``.  The loss stays
    pending (``tr.pending_results``) until ``settle_losses``.  ``read_stats``: whether this iteration's optional
    statistics (``--log-num-zeros-in-grad``, a collective) are computed -- the training loop asks for them only at
    the iterations that log or write scalars, the same on every rank."""
    pending = forward_backward_pending(tr)
    scale = tr.optimizer.loss_scale  # the scale this iteration's gradients carry (post-validation set it in the plan)
    precision = tr.run.precision
    if precision.check_for_nan_in_loss_and_grad and not math.isfinite(loss := pending.value()):
        raise RunAbortedError(
            f"the loss is {loss} at iteration {tr.iteration + 1} (--check-for-nan-in-loss-and-grad); "
            "lower --lr, raise --clip-grad strictness or resume from an earlier checkpoint"
        )
    zeros = num_zeros_in_grad(tr) if read_stats and tr.run.logging.log_num_zeros_in_grad else None
    lr = tr.scheduler.current_lr
    settled = optimizer_step(tr)
    if tr.post_validation is not None:
        lr = tr.scheduler.current_lr  # the rate this iteration's step was taken with (after the settled ones)
    tr.iteration += 1
    skipped = any(st.skipped for st in settled)
    nan_grads = skipped and not tr.optimizer.scaler.dynamic
    tr.nan_iterations += int(nan_grads)
    stats = settled[-1].stats if settled else None
    res = StepResult(pending, lr, stats, skipped, loss_scale=scale, nan_grads=nan_grads, num_zeros_in_grad=zeros)
    tr.pending_results.append(res)
    return res


def settle_losses(tr: Trainer) -> list[StepResult]:
    """Read back every pending iteration loss (in order): ``tr.losses`` and the nan count follow.  Collective over
    the pipeline and data-parallel groups: call it at the same iterations on every rank."""
    done, tr.pending_results = tr.pending_results, []
    for res, loss in zip(done, resolve_losses(r.pending_loss for r in done)):
        tr.losses.append(loss)
        tr.nan_iterations += int(not res.nan_grads and not math.isfinite(loss))
    return done
