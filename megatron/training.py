"""The training run: ``pretrain`` sets up the ranks, then loops over iterations with logging, validation,
checkpoints and exits (what ``pretrain_gpt.py`` calls).

The parts, each in its own module:

- ``megatron.training_setup``: the ``Trainer`` of one rank from a ``RunConfig`` (model or pipeline stages,
  optimizer, data);
- ``megatron.training_step``: one iteration (forward/backward over the microbatches, the optimizer step and
  settling its outcome);
- ``megatron.evaluation``: the validation loss;
- ``megatron.microbatches``: which samples each microbatch holds, and the mean loss over data-parallel ranks;
- ``megatron.checkpointing``: ``--save``/``--load``.

Mixed precision: with ``--bf16``/``--fp16`` the model runs in half precision; its gradients accumulate into the fp32
``main_grad`` buffers and the loss is multiplied by the loss scale before backward. ``--use-distributed-optimizer``
reduce-scatters the buffers instead and shards the main parameters (``megatron.optimizer.distributed``).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch

from megatron.any_rank_flag import AnyRankFlag
from megatron.arguments import RunConfig
from megatron.checkpoint_files import check_writable
from megatron.checkpointing import checkpoint_layer_split, load_checkpoint, save_checkpoint
from megatron.config.errors import ConfigError
from megatron.evaluation import evaluate
from megatron.garbage_collection import ManualGC
from megatron.parallel.context import ParallelContext
from megatron.peer_failure import PeerFailedRunError, peer_failure_line, stage_labels
from megatron.pipeline.layer_split import MeasuredSplit
from megatron.pipeline.post_validated_step import SettledStep
from megatron.pipeline.resplit import resplit
from megatron.pipeline.trainer_hooks import (
    attach_replanner,
    context_layout,
    pipeline_summary,
    write_pipeline_trace,
)
from megatron.profiling import ProfileWindow
from megatron.signal_handler import ExitSignalHandler
from megatron.trainer_state import Trainer
from megatron.training_log import IterationStats, TrainingLogger, model_flops_per_iteration
from megatron.training_metrics import memory_stats
from megatron.training_setup import setup
from megatron.training_step import StepResult, settle_losses, settle_pending_step, train_step
from zb_pipeline import comm
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory
from zb_pipeline.runtime.replanner import ReplanError


@dataclass(frozen=True)
class TrainSummary:
    iterations: int
    losses: tuple[float, ...]
    final_loss: float
    tokens_per_s: float
    validation_losses: tuple[tuple[int, float], ...]


def params_per_stage(tr: Trainer) -> list[int]:
    """Parameter count of each pipeline stage, summed over its tensor-parallel ranks (one data-parallel replica):
    one all-reduce over the world, staged on its device by the communication layer."""
    local = sum(p.numel() for p in tr.optimizer.params)
    counts = [0] * tr.ctx.pp_size
    counts[tr.ctx.pp_rank] = local if tr.ctx.dp_rank == 0 else 0
    if tr.ctx.is_distributed:
        counts = comm.all_reduce_values(counts, dtype=torch.int64)
    return counts


def pretrain(run: RunConfig, *, stream: TextIO | None = None, scalar_sink: Any = None) -> TrainSummary:
    """Run the whole training job described by ``run`` on the ranks launched by torchrun (or one process).

    ``scalar_sink``: also send the TensorBoard scalars to this object's ``add_scalar(name, value, step)``."""
    start_time = time.time()  # --exit-duration-in-mins counts from here
    if run.checkpoint.save:  # before any collective: every rank fails alike
        check_writable(run.checkpoint.save)
    if run.checkpoint.load and not Path(run.checkpoint.load).is_dir():
        raise ConfigError(f"--load {run.checkpoint.load} does not exist; pass the directory you saved to with --save")
    run = checkpoint_layer_split(run)  # --pipeline-layer-split auto resumes with the split the checkpoint recorded
    ctx = ParallelContext.initialize(
        tp=run.parallel.tp_size,
        pp=run.parallel.pp_size,
        timeout=timedelta(seconds=run.parallel.distributed_timeout_s),
        **context_layout(run),
    )
    if ctx.device.type == "cpu":  # activations churn through malloc every microbatch: keep freed memory mapped
        keep_freed_host_memory()
    try:
        return _pretrain(run, ctx, stream, scalar_sink, start_time)
    except comm.PeerFailedError as err:  # a dead or stopped peer: this rank's one line, with each rank's stage
        labels = stage_labels(ctx.layout, **context_layout(run))
        line = peer_failure_line(
            err, labels=labels, first_rank=ctx.rank == 0, timeout_s=run.parallel.distributed_timeout_s
        )
        raise PeerFailedRunError(line) from err
    except ReplanError as err:  # the window's measured costs leave no plan (e.g. the limit is proved impossible)
        raise ConfigError(str(err)) from None
    finally:
        ctx.shutdown()


def _pretrain(
    run: RunConfig, ctx: ParallelContext, stream: TextIO | None, scalar_sink: Any, start_time: float
) -> TrainSummary:
    tr = setup(run, ctx)
    run, t, ckpt = tr.run, tr.run.training, tr.run.checkpoint
    logger = TrainingLogger(run.logging, rank=ctx.rank, stream=stream, scalar_sink=scalar_sink)
    flops_per_iter = _model_flops(run)  # at the final global batch size (ramp-up: scaled per iteration)
    _startup_summary(tr, logger, flops_per_iter)
    if ckpt.load:
        load_checkpoint(tr, log=logger.print)
    signals = ExitSignalHandler() if ckpt.exit_signal_handler else nullcontext()
    collector = ManualGC(t.manual_gc_interval, t.manual_gc_eval) if t.manual_gc else None
    if collector is not None:
        collector.start()
    window = ProfileWindow(run.profiling, rank=ctx.rank, log=logger.print)
    try:
        with signals:
            summary, tr = _train_loop(
                tr, logger, flops_per_iter, signals, collector, profile=window, start_time=start_time
            )
    finally:
        window.stop()
        if tr.train_loader is not None:  # --num-workers: its worker processes end with the loop
            tr.train_loader.close()
        if collector is not None:
            collector.stop()
    write_pipeline_trace(tr, logger.print)
    logger.close()
    return summary


def _model_flops(run: RunConfig) -> float:
    return model_flops_per_iteration(
        run.model, padded_vocab_size=run.padded_vocab_size, global_batch_size=run.global_batch_size
    )


def _startup_summary(tr: Trainer, logger: TrainingLogger, flops_per_iter: float) -> None:
    run, ctx, t = tr.run, tr.ctx, tr.run.training
    layout = {
        "world": ctx.world_size,
        "tp": ctx.tp_size,
        "pp": ctx.pp_size,
        "dp": ctx.dp_size,
        "sequence-parallel": run.parallel.sequence_parallel,
        "micro-batch": t.micro_batch_size,
        "global-batch": run.global_batch_size,
        "microbatches/rank": run.num_microbatches,
        "backend": ctx.backend or "none",
        "device": str(ctx.device),
    }
    data = "mock (seeded Markov chain)" if run.data.mock_data else " ".join(run.data.data_path)
    logger.startup_summary(
        layout=layout,
        params_per_stage=params_per_stage(tr),
        model_config=tr.model_config,
        extra={
            "data": data,
            "train iterations": t.train_iters,
            **_ramp_summary(run),
            "model FLOPs per iteration": f"{flops_per_iter:.3e}",
            "precision": run.precision.name
            + (", distributed optimizer" if run.optimizer.use_distributed_optimizer else ""),
            "kernels": run.kernels.describe(),
            **pipeline_summary(run, tr.pipeline),
            **_post_validation_summary(tr),
            **run.recompute.summary(),
        },
    )


def _ramp_summary(run: RunConfig) -> dict[str, str]:
    b = run.batch_schedule
    if b is None or not b.ramp:
        return {}
    counts = ", ".join(str(m) for m in b.microbatch_counts())
    return {
        "batch-size ramp-up": f"{b.ramp[0]} -> {b.final} over {len(b.ramp)} iterations "
        f"({b.consumed_before(len(b.ramp))} samples); microbatches/rank: {counts}"
    }


def _post_validation_summary(tr: Trainer) -> dict[str, str]:
    if not tr.run.pipeline.optimizer_post_validation:
        return {}
    if tr.post_validation is None:
        return {"optimizer post-validation": "off: one pipeline stage has no cross-stage synchronisation to remove"}
    return {"optimizer post-validation": "on (steps without waiting for the other stages; exact rollback)"}


def _save(tr: Trainer, logger: TrainingLogger) -> None:
    settle_pending_step(tr)  # a checkpoint holds validated weights only
    settle_losses(tr)  # and the nan count of every iteration it covers
    save_checkpoint(tr, log=logger.print)


def _evaluate_collected(tr: Trainer, collector: ManualGC | None) -> float:
    """``evaluate``, with --manual-gc's full collections before and after it."""
    if collector is not None:
        collector.around_evaluation()
    loss = evaluate(tr)
    if collector is not None:
        collector.around_evaluation()
    return loss


def _count_skipped(steps: list[SettledStep]) -> int:
    return sum(st.skipped for st in steps)


@dataclass
class _LogWindow:
    """The iterations since the last log line (their losses are read back when the line is written)."""

    results: list[StepResult] = field(default_factory=list)
    skipped: int = 0
    samples: int = 0
    start: float = field(default_factory=time.time)

    def add(self, res: StepResult, samples: int) -> None:
        self.results.append(res)
        self.skipped += int(res.skipped)
        self.samples += samples

    def stats(self, tr: Trainer, res: StepResult, grad_norm: float | None, flops: float) -> IterationStats:
        """The log line's numbers (after ``settle_losses``, so reading the losses issues no collective)."""
        run = tr.run
        iters = len(self.results)
        loss = sum(r.loss for r in self.results if math.isfinite(r.loss))
        nan = sum(r.nan for r in self.results)
        elapsed = (time.time() - self.start) / iters
        samples = self.samples / iters  # per iteration (ramp-up: the window's mean global batch)
        tokens = samples * run.model.seq_length
        flops = flops * samples / run.global_batch_size
        good = iters - nan - (self.skipped if tr.optimizer.scaler.dynamic else 0)
        return IterationStats(
            iteration=tr.iteration,
            train_iters=tr.run.training.train_iters,
            consumed_samples=tr.consumed_train_samples,
            elapsed_s_per_iter=elapsed,
            learning_rate=res.learning_rate,
            global_batch_size=run.global_batch_size_at(tr.iteration - 1),
            lm_loss=loss / good if good else float("nan"),
            grad_norm=grad_norm,
            loss_scale=res.loss_scale,
            skipped_iterations=self.skipped,
            nan_iterations=nan,
            tokens_per_s=tokens / elapsed,
            model_tflops=flops / elapsed / 1e12,
            world_size=tr.ctx.world_size,
            post_validation=tr.post_validation.summary() if tr.post_validation is not None else None,
            extra=_extra_fields(tr, res),
        )


def _extra_fields(tr: Trainer, res: StepResult) -> tuple[tuple[str, str], ...]:
    """Log-line fields of --log-num-zeros-in-grad and --log-memory-to-tensorboard."""
    out: list[tuple[str, str]] = []
    if res.num_zeros_in_grad is not None:
        out.append(("num zeros", f"{res.num_zeros_in_grad:d}"))
    if tr.run.logging.log_memory_to_tensorboard:
        out += [(k, f"{v:d}") for k, v in memory_stats(tr.ctx.device).items()]
    return tuple(out)


def _scalars(tr: Trainer, res: StepResult) -> dict[str, float]:
    """The TensorBoard / W&B scalars of the iteration just run (Megatron's names)."""
    out = {
        "lm loss": res.loss,
        "learning-rate": res.learning_rate,
        "batch-size": float(tr.run.global_batch_size_at(tr.iteration - 1)),
        "loss-scale": res.loss_scale,
    }
    if res.grad_stats is not None:
        out["grad-norm"] = res.grad_stats.norm
    if res.num_zeros_in_grad is not None:
        out["num-zeros"] = float(res.num_zeros_in_grad)
    if tr.run.logging.log_memory_to_tensorboard:
        out.update({k: float(v) for k, v in memory_stats(tr.ctx.device).items()})
    return out


def _train_loop(
    tr: Trainer,
    logger: TrainingLogger,
    flops_per_iter: float,
    signals: object,
    collector: ManualGC | None = None,
    *,
    profile: ProfileWindow,
    start_time: float,
) -> tuple[TrainSummary, Trainer]:
    """The iterations; returns the summary and the trainer they ended with (a re-split replaces it)."""
    run, t, ckpt = tr.run, tr.run.training, tr.run.checkpoint
    # step_ms reads this loop's ``tr``: the trainer in force, also after a re-split replaced it
    tr.replanner = attach_replanner(tr.pipeline, run, tr.ctx, logger.print, step_ms=lambda: tr.optimizer.last_step_ms)
    validation: list[tuple[int, float]] = []
    window = _LogWindow()
    run_start = time.time()
    last_grad_norm: float | None = None
    saved_at = tr.iteration if ckpt.load else -1
    time_flag = AnyRankFlag()  # --exit-duration-in-mins
    start_consumed = tr.consumed_train_samples
    # the same answer on every rank (the loss's read-back is collective); without a scalar sink nothing is read
    writes_scalars = bool(run.logging.tensorboard_dir or run.logging.wandb_project or logger.has_scalar_sink)
    while tr.iteration < t.train_iters:
        profile.before_iteration(tr.iteration)
        nxt = tr.iteration + 1
        scalars_next = writes_scalars and nxt % run.logging.tensorboard_log_interval == 0
        logs = _logs_at(tr, nxt)  # a log line follows this iteration: read once, used before and after its step
        res = train_step(tr, read_stats=scalars_next or logs)
        profile.after_iteration(tr.iteration)
        if collector is not None:
            collector.after_iteration(tr.iteration)
        window.add(res, run.global_batch_size_at(tr.iteration - 1))
        if res.grad_stats is not None:
            last_grad_norm = res.grad_stats.norm
        it = tr.iteration  # == nxt
        if scalars_next:
            settle_losses(tr)  # the scalars read the loss: reduced at these iterations on every rank
            logger.iteration_scalars(it, _scalars(tr, res))
        if logs:
            settle_losses(tr)  # the window's losses, reduced over the pipeline and data parallel (deferred_loss)
            logger.iteration(window.stats(tr, res, last_grad_norm, flops_per_iter))
            window = _LogWindow()
        if _evaluates_at(tr, it):
            window.skipped += _count_skipped(settle_pending_step(tr))
            loss = _evaluate_collected(tr, collector)
            validation.append((it, loss))
            logger.validation(it, loss)
            window.start = time.time()  # validation time is not iteration time
        decision = _split_decision(tr)
        if decision is not None:  # before a checkpoint of this iteration, which records the new split
            window.skipped += _count_skipped(settle_pending_step(tr))
            tr = _resplit(tr, decision, logger)
            window.start = time.time()  # moving the layers is not iteration time
        saved_at, stop = _save_or_exit(tr, logger, signals, saved_at, start_time, time_flag, logs=logs)
        if stop:
            break
    else:
        if ckpt.save and tr.iteration > 0 and saved_at != tr.iteration:
            _save(tr, logger)
    settle_pending_step(tr)
    settle_losses(tr)
    wall = time.time() - run_start
    if _evaluates(tr) and (not validation or validation[-1][0] != tr.iteration):
        loss = _evaluate_collected(tr, collector)
        validation.append((tr.iteration, loss))
        logger.validation(tr.iteration, loss)
    tokens = (tr.consumed_train_samples - start_consumed) * run.model.seq_length
    tokens_per_s = tokens / wall if wall > 0 else 0.0
    return _final_summary(tr, logger, validation, collector, tokens_per_s), tr


def _logs_at(tr: Trainer, it: int) -> bool:
    """Whether a log line follows iteration ``it`` (every ``--log-interval``, and the last)."""
    return it % tr.run.logging.log_interval == 0 or it >= tr.run.training.train_iters


def _evaluates(tr: Trainer) -> bool:
    return tr.valid_data is not None and tr.run.training.eval_iters > 0


def _evaluates_at(tr: Trainer, it: int) -> bool:
    """Whether an evaluation follows iteration ``it`` (every ``--eval-interval``)."""
    return _evaluates(tr) and it % tr.run.training.eval_interval == 0


def _split_decision(tr: Trainer) -> MeasuredSplit | None:
    """The profiling window's measured layer split when it differs from the current one (every rank holds the same
    decision: it is planned from the agreed profile)."""
    decision = getattr(tr.replanner, "agreed", None)
    if not isinstance(decision, MeasuredSplit) or not decision.changes:
        return None
    layout, recompute = tr.run.pipeline_layout, tr.run.recompute
    if tuple(decision.plan.layers) != layout.layers_per_stage:
        return decision
    changes = recompute.auto and tuple(decision.plan.recompute) != recompute.choices(layout.layer_ranges)
    return decision if changes else None


def _resplit(tr: Trainer, decision: MeasuredSplit, logger: TrainingLogger) -> Trainer:
    """Move the layers to ``decision``'s split, and under ``--recompute-granularity auto`` give the stages its
    recompute choice, at this iteration boundary (collective)."""
    began, old = time.time(), tr.run.pipeline_layout.layers_per_stage
    rec = tr.run.recompute.choices(tr.run.pipeline_layout.layer_ranges) if tr.run.recompute.auto else None
    new = resplit(tr, decision.plan.layers, decision=decision)
    what = f"layers per stage {list(old)} -> {list(decision.plan.layers)}"
    if rec is not None:
        what += f", recompute per stage {', '.join(rec)} -> {', '.join(decision.plan.recompute)}"
    logger.print(f"re-split after iteration {new.iteration}: {what} ({time.time() - began:.2f} s)")
    return new


def _time_is_up(tr: Trainer, start_time: float, flag: AnyRankFlag, *, wait: bool) -> bool:
    """``--exit-duration-in-mins``: whether any rank's clock has passed it (an any-rank flag, so every rank stops
    after the same iteration; reduced without a wait except where the run synchronises anyway)."""
    limit = tr.run.training.exit_duration_in_mins
    if limit is None:
        return False
    late = (time.time() - start_time) / 60.0 > limit
    return flag.check(late, distributed=tr.ctx.is_distributed, wait=wait, timeout=tr.ctx.timeout)


def _save_or_exit(
    tr: Trainer,
    logger: TrainingLogger,
    signals: object,
    saved_at: int,
    start_time: float,
    time_flag: AnyRankFlag,
    *,
    logs: bool,
) -> tuple[int, bool]:
    """After iteration ``tr.iteration``: the interval checkpoint, then SIGTERM, ``--exit-duration-in-mins`` and
    ``--exit-interval`` (each saves first unless that iteration is saved already).  ``logs``: a log line followed
    the iteration (``_logs_at``).  Returns (the last saved iteration, stop the loop?)."""
    ckpt, t, it = tr.run.checkpoint, tr.run.training, tr.iteration
    if ckpt.save and ckpt.save_interval and it % ckpt.save_interval == 0:
        _save(tr, logger)
        saved_at = it
    # The signal and time flags are reduced without a wait (answered one iteration later) except where the run
    # synchronises anyway: a log line, an evaluation, a checkpoint, an exit.
    wait = (
        logs or saved_at == it or (t.exit_interval is not None and it % t.exit_interval == 0) or _evaluates_at(tr, it)
    )
    if isinstance(signals, ExitSignalHandler) and signals.should_exit(
        distributed=tr.ctx.is_distributed, wait=wait, timeout=tr.ctx.timeout
    ):
        if saved_at != it:
            _save(tr, logger)
            saved_at = it
        logger.print(f"exiting program after receiving SIGTERM, at iteration {it}")
        return saved_at, True
    if _time_is_up(tr, start_time, time_flag, wait=wait):
        if ckpt.save and saved_at != it:
            _save(tr, logger)
            saved_at = it
        logger.print(
            f"exiting program after {t.exit_duration_in_mins} minutes (--exit-duration-in-mins), at iteration {it}"
        )
        return saved_at, True
    if t.exit_interval is not None and it % t.exit_interval == 0:
        if ckpt.save and saved_at != it:
            _save(tr, logger)
            saved_at = it
        logger.print(f"exiting program at iteration {it} (--exit-interval {t.exit_interval})")
        return saved_at, True
    return saved_at, False


def _final_summary(
    tr: Trainer,
    logger: TrainingLogger,
    validation: list[tuple[int, float]],
    collector: ManualGC | None,
    tokens_per_s: float,
) -> TrainSummary:
    log_interval = tr.run.logging.log_interval
    tail = [x for x in tr.losses[-min(len(tr.losses), max(1, log_interval)) :] if math.isfinite(x)]
    final_loss = sum(tail) / len(tail) if tail else float("nan")
    extra = {
        "first lm loss": f"{tr.losses[0]:.6E}" if tr.losses else "n/a",
        "skipped iterations": tr.skipped_iterations,
        "nan iterations": tr.nan_iterations,
    }
    if validation:
        extra["final validation loss"] = f"{validation[-1][1]:.6E}"
    if collector is not None:
        extra["manual gc"] = f"{collector.collections} collections, {collector.seconds * 1e3:.1f} ms"
    logger.final_summary(iterations=tr.iteration, final_loss=final_loss, tokens_per_s=tokens_per_s, extra=extra)
    return TrainSummary(
        iterations=tr.iteration,
        losses=tuple(tr.losses),
        final_loss=final_loss,
        tokens_per_s=tokens_per_s,
        validation_losses=tuple(validation),
    )
