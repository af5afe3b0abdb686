"""The training loop: microbatches -> fp32 main gradients -> data-parallel reduction -> clipping -> AdamW.

One iteration on every rank::

    zero the main_grad buffers
    for each of the m microbatches of this data-parallel rank:
        loss_k = masked mean of the per-token loss of microbatch k
        backward(loss_k / m)          # gradients accumulate in fp32 param.main_grad; the reducer launches a bucket's
                                      # data-parallel all-reduce as soon as every gradient in it is final
    wait for the reducer (main_grad = mean over the whole global batch); sum sequence-parallel grads over tp
    optimizer step (megatron.optimizer.main_params): unscale (fp16), one reduction of grad norm + inf/NaN over every
    model-parallel rank, skip on inf/NaN (fp16: the loss scaler backs off), clip, AdamW on fp32 main params, copy
    them into the (bf16/fp16/fp32) model; the LR schedule advances only when the step was applied (as in Megatron)

Mixed precision: with ``--bf16``/``--fp16`` the model runs in half precision; its gradients accumulate into the fp32
``main_grad`` buffers and the loss is multiplied by the loss scale before backward. ``--use-distributed-optimizer``
reduce-scatters the buffers instead and shards the main parameters (``megatron.optimizer.distributed``).

Samples: iteration ``it`` (1-based) uses global indices ``(it-1)*G .. it*G-1`` of the training split; microbatch
``k`` of data-parallel rank ``r`` holds ``(it-1)*G + k*b*dp + r*b + j`` for ``j < b`` (Megatron's sampler), so dp = 2
and gradient accumulation over the same global batch see the same samples and the same mean loss.

``setup`` builds the per-rank state from a ``RunConfig`` and a ``ParallelContext``; ``forward_backward``,
``optimizer_step`` and ``train_step`` are public so tests can compare gradients and parameters between layouts;
``pretrain`` is the whole run with logging (what ``pretrain_gpt.py`` calls).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from megatron.arguments import RunConfig, pad_vocab_size
from megatron.checkpoint_files import check_writable
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.config.errors import ConfigError, RunAbortedError
from megatron.data.mock_data import MockGPTDataset, collate
from megatron.garbage_collection import ManualGC
from megatron.model import GPTConfig, build_gpt_model
from megatron.optimizer import DistributedOptimizer, GradStats, LRScheduler, MainParamOptimizer
from megatron.parallel.context import ParallelContext
from megatron.parallel.data_parallel import DataParallelReducer
from megatron.parallel.tensor_parallel.partitioning import allreduce_sequence_parallel_grads
from megatron.pipeline.post_validated_step import PostValidatedStep, SettledStep
from megatron.pipeline.trainer_hooks import (
    attach_reducer,
    attach_replanner,
    build_trainer_pipeline,
    context_layout,
    pipeline_evaluate,
    pipeline_forward_backward,
    pipeline_summary,
    replan_after_iteration,
    write_pipeline_trace,
)
from megatron.signal_handler import ExitSignalHandler
from megatron.training_log import IterationStats, TrainingLogger, model_flops_per_iteration
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory


@dataclass
class Trainer:
    """Mutable state of one run on one rank."""

    run: RunConfig
    ctx: ParallelContext
    model_config: GPTConfig
    model: torch.nn.Module
    reducer: DataParallelReducer
    optimizer: MainParamOptimizer
    scheduler: LRScheduler
    train_data: Any
    valid_data: Any | None
    iteration: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    losses: list[float] = field(default_factory=list)
    pipeline: Any = None  # megatron.pipeline.GPTPipeline when pp > 1 (then ``model`` is this rank's stages)
    replanner: Any = None  # the plan re-planned from profiled costs (megatron.pipeline.trainer_hooks.attach_replanner)
    # --enable-optimizer-post-validation with pp > 1 (megatron.pipeline.post_validated_step.PostValidatedStep)
    post_validation: Any = None
    # Called with (trainer, SettledStep) once a step's outcome is final, in iteration order (tests record state).
    step_listeners: list[Callable[[Trainer, SettledStep], None]] = field(default_factory=list)

    @property
    def consumed_train_samples(self) -> int:
        return self.iteration * self.run.global_batch_size


@dataclass(frozen=True)
class StepResult:
    loss: float
    learning_rate: float
    grad_stats: GradStats | None  # of the step settled in this call (None: none settled, post-validation's 1st)
    skipped: bool  # a step settled in this call was skipped (post-validation: the previous iteration's step)
    loss_scale: float = 1.0
    nan: bool = False  # counted as a nan iteration (non-finite loss, or inf/NaN gradients without fp16 scaling)


@dataclass(frozen=True)
class TrainSummary:
    iterations: int
    losses: tuple[float, ...]
    final_loss: float
    tokens_per_s: float
    validation_losses: tuple[tuple[int, float], ...]


# ------------------------------------------------------------------------------------------------------ set-up
def resolve_vocab(run: RunConfig) -> RunConfig:
    """Fill in the vocabulary size from the tokenizer when the flags did not give one (real data)."""
    if run.model.vocab_size:
        return run
    from megatron.tokenizer.build import build_tokenizer

    try:
        tokenizer = build_tokenizer(run.data)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot build the tokenizer: {str(err).splitlines()[0]}") from None
    vocab = int(tokenizer.vocab_size)
    padded = pad_vocab_size(vocab, run.model.make_vocab_size_divisible_by, run.parallel.tp_size)
    model = dataclasses.replace(run.model, vocab_size=vocab, padded_vocab_size=padded)
    data = dataclasses.replace(run.data, vocab_size=vocab)
    return dataclasses.replace(run, model=model, data=data)


def build_datasets(run: RunConfig, ctx: ParallelContext) -> tuple[Any, Any | None]:
    """(train, valid) datasets: mock tokens, or DATA's indexed GPT datasets for ``--data-path``.

    Hook for the default corpus: ``tools/make_train.py`` prepares it and passes ``--data-path``; nothing here changes.
    """
    t, seq = run.training, run.model.seq_length
    train_samples = t.train_iters * run.global_batch_size
    evals = t.train_iters // t.eval_interval + 1
    valid_samples = evals * t.eval_iters * run.global_batch_size
    if run.data.mock_data:
        common = dict(seed=t.seed, seq_length=seq, vocab_size=run.model.vocab_size)
        train = MockGPTDataset(split="train", num_samples=train_samples, **common)
        valid = MockGPTDataset(split="valid", num_samples=valid_samples, **common) if t.eval_iters > 0 else None
        return train, valid
    from megatron.data.blended_dataset import build_gpt_datasets

    def build() -> tuple[Any, ...]:
        return build_gpt_datasets(
            list(run.data.data_path),
            split=run.data.split,
            seq_length=seq,
            seed=t.seed,
            num_samples=(train_samples, valid_samples if t.eval_iters > 0 else 0, 0),
            vocab_size=run.model.vocab_size,
        )

    def attempt() -> tuple[tuple[Any, ...] | None, str | None]:
        try:
            return build(), None
        except (OSError, ValueError) as err:
            return None, f"cannot open --data-path {' '.join(run.data.data_path)}: {str(err).splitlines()[0]}"

    # Rank 0 builds (and caches) the sample indices first and tells the others whether that worked, so a bad path
    # fails on every rank at once instead of leaving them waiting in a barrier.
    datasets, error = attempt() if ctx.rank == 0 or not ctx.is_distributed else (None, None)
    if ctx.is_distributed:
        message = [error]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
        if error is None and ctx.rank != 0:
            datasets, error = attempt()
    if error is not None or datasets is None:
        raise ConfigError(error or "building the datasets failed")
    return datasets[0], datasets[1]


def setup(run: RunConfig, ctx: ParallelContext, *, train_data: Any = None, valid_data: Any = None) -> Trainer:
    """Build model, reducer, optimizer, schedule and data for this rank (``--load`` is applied by the caller)."""
    run = resolve_vocab(run)
    seed = run.training.seed
    torch.manual_seed(seed + 100 * ctx.pp_rank)  # dropout; parameters come from (seed, global name)
    model_config = GPTConfig.from_object(run.model)
    pipeline = build_trainer_pipeline(run, ctx, model_config) if ctx.pp_size > 1 else None
    if pipeline is not None:
        model = pipeline.model  # this rank's stages (PipelineModel), already on the device in params_dtype
    else:
        model = build_gpt_model(model_config, tp=ctx, sequence_parallel=run.parallel.sequence_parallel, seed=seed)
        model = model.to(device=ctx.device, dtype=run.precision.params_dtype)
    optimizer = build_optimizer(run, ctx, model)
    reducer = optimizer.reducer
    post_validation = None
    if pipeline is not None:
        attach_reducer(pipeline, reducer)
        pipeline.loss_scale_fn = lambda: optimizer.loss_scale  # read when each loss is computed
        if run.pipeline.optimizer_post_validation:
            post_validation = PostValidatedStep(pipeline, optimizer, ctx)
    scheduler = LRScheduler(run.lr_schedule, train_iters=run.training.train_iters)
    if train_data is None:
        train_data, valid_data = build_datasets(run, ctx)
    return Trainer(
        run=run,
        ctx=ctx,
        model_config=model_config,
        model=model,
        reducer=reducer,
        optimizer=optimizer,
        scheduler=scheduler,
        train_data=train_data,
        valid_data=valid_data,
        pipeline=pipeline,
        post_validation=post_validation,
    )


def build_optimizer(run: RunConfig, ctx: ParallelContext, model: torch.nn.Module) -> MainParamOptimizer:
    """The reducer (all-reduce, or reduce-scatter for the distributed optimizer) and the optimizer over it."""
    sharded = run.optimizer.use_distributed_optimizer
    reducer = DataParallelReducer(model, ctx, reduce_op="reduce_scatter" if sharded else "all_reduce")
    named = [(model.global_name(n), p) for n, p in model.named_parameters()]
    if sharded:
        # Each element's gradient lives on one data-parallel rank: statistics reduce over tp x dp, then the pipeline.
        optimizer: MainParamOptimizer = DistributedOptimizer(
            named,
            run.optimizer,
            run.precision,
            reducer=reducer,
            tp_rank=ctx.tp_rank,
            stage_group=ctx.stage_group,
            pp_group=ctx.pp_group,
        )
    else:
        optimizer = MainParamOptimizer(
            named, run.optimizer, run.precision, tp_rank=ctx.tp_rank, stage_group=ctx.tp_group, pp_group=ctx.pp_group
        )
    optimizer.reducer = reducer
    return optimizer


# ----------------------------------------------------------------------------------------------------- one step
def microbatch_indices(run: RunConfig, dp_rank: int, base: int, k: int) -> list[int]:
    """Global sample indices of microbatch ``k`` of ``dp_rank`` in the global batch that starts at ``base``."""
    b = run.training.micro_batch_size
    start = base + k * b * run.dp_size + dp_rank * b
    return list(range(start, start + b))


def _load(dataset: Any, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    batch = collate([dataset[i] for i in indices])
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _microbatch_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    per_token = model(batch["tokens"], labels=batch["labels"])  # [b, s] fp32
    mask = batch["loss_mask"]
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _mean_over_dp(total: torch.Tensor, count: int, ctx: ParallelContext) -> float:
    """Average a sum of per-microbatch losses over every microbatch of every data-parallel rank."""
    if ctx.dp_group is not None:
        dist.all_reduce(total, group=ctx.dp_group)
    return float(total) / (count * ctx.dp_size)


def forward_backward(tr: Trainer) -> float:
    """Forward and backward over this rank's microbatches of the next iteration; returns the global-batch mean loss.

    Afterwards every ``main_grad`` holds the gradient of the mean loss over the whole global batch (reduced over
    data-parallel ranks, sequence-parallel parts summed over the tensor-parallel group).
    """
    if tr.pipeline is not None:  # pp > 1: the plan runs the microbatches (megatron.pipeline.trainer_hooks)
        return pipeline_forward_backward(tr)
    run, ctx = tr.run, tr.ctx
    m = run.num_microbatches
    base = tr.iteration * run.global_batch_size
    tr.model.train()
    tr.reducer.zero_grad()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    scale = tr.optimizer.loss_scale  # 1 for bf16/fp32: loss * 1 / m is exactly loss / m
    for k in range(m):
        batch = _load(tr.train_data, microbatch_indices(run, ctx.dp_rank, base, k), ctx.device)
        tr.reducer.prepare_microbatch(is_last=k == m - 1)
        loss = _microbatch_loss(tr.model, batch)
        (loss * scale / m).backward()
        total += loss.detach().double()
    tr.reducer.finish()
    if run.parallel.sequence_parallel:
        allreduce_sequence_parallel_grads(tr.model.parameters(), ctx)
    return _mean_over_dp(total, m, ctx)


def optimizer_step(tr: Trainer) -> list[SettledStep]:
    """The optimizer step of the iteration just run (``tr.iteration`` not yet advanced); returns the steps whose
    outcome became final, already applied to the LR schedule and the counters (``settle``).

    Synchronised: unscale, check, clip and apply AdamW with the scheduled rate -- one settled step.  Post-validated:
    first settle what the plan validated during this iteration (the previous step: the LR schedule must advance
    before this step reads its rate), then step from local statistics; the outcome settles later.
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
            tr.scheduler.step()
        for listener in tr.step_listeners:
            listener(tr, st)
    return steps


def settle_pending_step(tr: Trainer) -> list[SettledStep]:
    """Post-validation: validate the last step now (before an evaluation, a checkpoint, the end of the run)."""
    if tr.post_validation is None:
        return []
    tr.post_validation.flush()
    return settle(tr, tr.post_validation.take_settled())


def train_step(tr: Trainer) -> StepResult:
    loss = forward_backward(tr)
    scale = tr.optimizer.loss_scale  # the scale this iteration's gradients carry (post-validation set it in the plan)
    precision = tr.run.precision
    if precision.check_for_nan_in_loss_and_grad and not math.isfinite(loss):
        raise RunAbortedError(
            f"the loss is {loss} at iteration {tr.iteration + 1} (--check-for-nan-in-loss-and-grad); "
            "lower --lr, raise --clip-grad strictness or resume from an earlier checkpoint"
        )
    lr = tr.scheduler.current_lr
    settled = optimizer_step(tr)
    if tr.post_validation is not None:
        lr = tr.scheduler.current_lr  # the rate this iteration's step was taken with (after the settled ones)
    tr.iteration += 1
    tr.losses.append(loss)
    skipped = any(st.skipped for st in settled)
    nan = not math.isfinite(loss) or (skipped and not tr.optimizer.scaler.dynamic)
    tr.nan_iterations += int(nan)
    stats = settled[-1].stats if settled else None
    return StepResult(loss=loss, learning_rate=lr, grad_stats=stats, skipped=skipped, loss_scale=scale, nan=nan)


@torch.no_grad()
def evaluate(tr: Trainer) -> float:
    """Mean validation loss over ``--eval-iters`` global batches (continuing through the validation split)."""
    if tr.pipeline is not None:
        return pipeline_evaluate(tr)
    run, ctx = tr.run, tr.ctx
    m = run.num_microbatches
    tr.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for _ in range(run.training.eval_iters):
        base = tr.consumed_valid_samples
        for k in range(m):
            batch = _load(tr.valid_data, microbatch_indices(run, ctx.dp_rank, base, k), ctx.device)
            total += _microbatch_loss(tr.model, batch).double()
        tr.consumed_valid_samples += run.global_batch_size
    tr.model.train()
    return _mean_over_dp(total, m * run.training.eval_iters, ctx)


# ------------------------------------------------------------------------------------------------------ the run
def params_per_stage(tr: Trainer) -> list[int]:
    """Parameter count of each pipeline stage, summed over its tensor-parallel ranks (one data-parallel replica)."""
    local = sum(p.numel() for p in tr.optimizer.params)
    counts = torch.zeros(tr.ctx.pp_size, dtype=torch.int64)
    counts[tr.ctx.pp_rank] = local if tr.ctx.dp_rank == 0 else 0
    if tr.ctx.is_distributed:
        dist.all_reduce(counts)
    return counts.tolist()


def pretrain(run: RunConfig, *, stream: TextIO | None = None) -> TrainSummary:
    """Run the whole training job described by ``run`` on the ranks launched by torchrun (or one process)."""
    if run.checkpoint.save:  # before any collective: every rank fails alike
        check_writable(run.checkpoint.save)
    if run.checkpoint.load and not Path(run.checkpoint.load).is_dir():
        raise ConfigError(f"--load {run.checkpoint.load} does not exist; pass the directory you saved to with --save")
    ctx = ParallelContext.initialize(
        tp=run.parallel.tp_size,
        pp=run.parallel.pp_size,
        timeout=timedelta(seconds=run.parallel.distributed_timeout_s),
        **context_layout(run),
    )
    if ctx.device.type == "cpu":  # activations churn through malloc every microbatch: keep freed memory mapped
        keep_freed_host_memory()
    try:
        return _pretrain(run, ctx, stream)
    finally:
        ctx.shutdown()


def _pretrain(run: RunConfig, ctx: ParallelContext, stream: TextIO | None) -> TrainSummary:
    tr = setup(run, ctx)
    run = tr.run
    t = run.training
    logger = TrainingLogger(run.logging, rank=ctx.rank, stream=stream)
    tokens_per_iter = run.global_batch_size * run.model.seq_length
    flops_per_iter = model_flops_per_iteration(
        num_layers=run.model.num_layers,
        hidden_size=run.model.hidden_size,
        num_attention_heads=run.model.num_attention_heads,
        num_query_groups=run.model.num_query_groups,
        kv_channels=run.model.kv_channels,
        ffn_hidden_size=run.model.ffn_hidden_size,
        swiglu=run.model.swiglu,
        seq_length=run.model.seq_length,
        padded_vocab_size=run.model.padded_vocab_size,
        global_batch_size=run.global_batch_size,
    )
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
            "model FLOPs per iteration": f"{flops_per_iter:.3e}",
            "precision": run.precision.name
            + (", distributed optimizer" if run.optimizer.use_distributed_optimizer else ""),
            **pipeline_summary(run, tr.pipeline),
            **_post_validation_summary(tr),
        },
    )
    ckpt = run.checkpoint
    if ckpt.load:
        load_checkpoint(tr, log=logger.print)
    tr.replanner = attach_replanner(tr.pipeline, run, tr.ctx, logger.print)
    signals = ExitSignalHandler() if ckpt.exit_signal_handler else nullcontext()
    collector = ManualGC(t.manual_gc_interval, t.manual_gc_eval) if t.manual_gc else None
    if collector is not None:
        collector.start()
    try:
        with signals:
            summary = _train_loop(tr, logger, tokens_per_iter, flops_per_iter, signals, collector)
    finally:
        if collector is not None:
            collector.stop()
    write_pipeline_trace(tr, logger.print)
    logger.close()
    return summary


def _post_validation_summary(tr: Trainer) -> dict[str, str]:
    if not tr.run.pipeline.optimizer_post_validation:
        return {}
    if tr.post_validation is None:
        return {"optimizer post-validation": "off: one pipeline stage has no cross-stage synchronisation to remove"}
    return {"optimizer post-validation": "on (steps without waiting for the other stages; exact rollback)"}


def _save(tr: Trainer, logger: TrainingLogger) -> None:
    settle_pending_step(tr)  # a checkpoint holds validated weights only
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


def _train_loop(
    tr: Trainer,
    logger: TrainingLogger,
    tokens_per_iter: int,
    flops_per_iter: float,
    signals: object,
    collector: ManualGC | None = None,
) -> TrainSummary:
    run, ctx, t, ckpt = tr.run, tr.ctx, tr.run.training, tr.run.checkpoint

    validation: list[tuple[int, float]] = []
    window_loss, window_iters, window_start = 0.0, 0, time.time()
    window_skipped = window_nan = 0
    run_start = time.time()
    last_grad_norm: float | None = None
    saved_at = tr.iteration if ckpt.load else -1
    start_iteration = tr.iteration
    while tr.iteration < t.train_iters:
        res = train_step(tr)
        replan_after_iteration(tr.pipeline, tr.replanner, tr.iteration - 1)
        if collector is not None:
            collector.after_iteration(tr.iteration)
        window_loss += res.loss if math.isfinite(res.loss) else 0.0
        window_iters += 1
        window_skipped += int(res.skipped)
        window_nan += int(res.nan)
        if res.grad_stats is not None:
            last_grad_norm = res.grad_stats.norm
        it = tr.iteration
        if it % run.logging.log_interval == 0 or it == t.train_iters:
            elapsed = (time.time() - window_start) / window_iters
            good = window_iters - window_nan - (window_skipped if tr.optimizer.scaler.dynamic else 0)
            logger.iteration(
                IterationStats(
                    iteration=it,
                    train_iters=t.train_iters,
                    consumed_samples=tr.consumed_train_samples,
                    elapsed_s_per_iter=elapsed,
                    learning_rate=res.learning_rate,
                    global_batch_size=run.global_batch_size,
                    lm_loss=window_loss / good if good else float("nan"),
                    grad_norm=last_grad_norm,
                    loss_scale=res.loss_scale,
                    skipped_iterations=window_skipped,
                    nan_iterations=window_nan,
                    tokens_per_s=tokens_per_iter / elapsed,
                    model_tflops=flops_per_iter / elapsed / 1e12,
                    world_size=ctx.world_size,
                    post_validation=tr.post_validation.summary() if tr.post_validation is not None else None,
                )
            )
            window_loss, window_iters, window_start = 0.0, 0, time.time()
            window_skipped = window_nan = 0
        if tr.valid_data is not None and t.eval_iters > 0 and it % t.eval_interval == 0:
            window_skipped += _count_skipped(settle_pending_step(tr))
            loss = _evaluate_collected(tr, collector)
            validation.append((it, loss))
            logger.validation(it, loss)
            window_start = time.time()  # validation time is not iteration time
        if ckpt.save and ckpt.save_interval and it % ckpt.save_interval == 0:
            _save(tr, logger)
            saved_at = it
        if isinstance(signals, ExitSignalHandler) and signals.should_exit(distributed=ctx.is_distributed):
            if saved_at != it:
                _save(tr, logger)
                saved_at = it
            logger.print(f"exiting program after receiving SIGTERM, at iteration {it}")
            break
        if t.exit_interval is not None and it % t.exit_interval == 0:
            if ckpt.save and saved_at != it:
                _save(tr, logger)
                saved_at = it
            logger.print(f"exiting program at iteration {it} (--exit-interval {t.exit_interval})")
            break
    else:
        if ckpt.save and tr.iteration > 0 and saved_at != tr.iteration:
            _save(tr, logger)
    settle_pending_step(tr)
    wall = time.time() - run_start
    if tr.valid_data is not None and t.eval_iters > 0 and (not validation or validation[-1][0] != tr.iteration):
        loss = _evaluate_collected(tr, collector)
        validation.append((tr.iteration, loss))
        logger.validation(tr.iteration, loss)
    tail = [x for x in tr.losses[-min(len(tr.losses), max(1, run.logging.log_interval)) :] if math.isfinite(x)]
    final_loss = sum(tail) / len(tail) if tail else float("nan")
    tokens_per_s = tokens_per_iter * (tr.iteration - start_iteration) / wall if wall > 0 else 0.0
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
