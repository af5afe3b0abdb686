"""The training loop: microbatches -> fp32 main gradients -> data-parallel reduction -> clipping -> AdamW.

One iteration on every rank::

    zero the main_grad buffers
    for each of the m microbatches of this data-parallel rank:
        loss_k = masked mean of the per-token loss of microbatch k
        backward(loss_k / m)          # gradients accumulate in fp32 param.main_grad; the reducer launches a bucket's
                                      # data-parallel all-reduce as soon as every gradient in it is final
    wait for the reducer (main_grad = mean over the whole global batch); sum sequence-parallel grads over tp
    global grad norm over every model-parallel rank, clip, AdamW step with the scheduled learning rate

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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist

from megatron.arguments import RunConfig, pad_vocab_size
from megatron.config.errors import ConfigError
from megatron.data.mock_data import MockGPTDataset, collate
from megatron.model import GPTConfig, build_gpt_model
from megatron.optimizer import AdamW, GradStats, LRScheduler, clip_grads
from megatron.parallel.context import ParallelContext
from megatron.parallel.data_parallel import DataParallelReducer
from megatron.parallel.tensor_parallel.partitioning import allreduce_sequence_parallel_grads
from megatron.training_log import IterationStats, TrainingLogger, model_flops_per_iteration


@dataclass
class Trainer:
    """Mutable state of one run on one rank."""

    run: RunConfig
    ctx: ParallelContext
    model_config: GPTConfig
    model: torch.nn.Module
    reducer: DataParallelReducer
    optimizer: AdamW
    scheduler: LRScheduler
    train_data: Any
    valid_data: Any | None
    iteration: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    losses: list[float] = field(default_factory=list)

    @property
    def consumed_train_samples(self) -> int:
        return self.iteration * self.run.global_batch_size


@dataclass(frozen=True)
class StepResult:
    loss: float
    learning_rate: float
    grad_stats: GradStats
    skipped: bool


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
    """Build model, reducer, optimizer, schedule and data for this rank."""
    if run.checkpoint.save or run.checkpoint.load:
        raise ConfigError("--save/--load: checkpointing is not available in this trainer yet; remove those flags")
    run = resolve_vocab(run)
    seed = run.training.seed
    torch.manual_seed(seed + 100 * ctx.pp_rank)  # dropout; parameters come from (seed, global name)
    model_config = GPTConfig.from_object(run.model)
    model = build_gpt_model(model_config, tp=ctx, sequence_parallel=run.parallel.sequence_parallel, seed=seed)
    model = model.to(ctx.device)
    reducer = DataParallelReducer(model, ctx)
    optimizer = AdamW(model.named_parameters(), run.optimizer)
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
    )


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
    run, ctx = tr.run, tr.ctx
    m = run.num_microbatches
    base = tr.iteration * run.global_batch_size
    tr.model.train()
    tr.reducer.zero_grad()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for k in range(m):
        batch = _load(tr.train_data, microbatch_indices(run, ctx.dp_rank, base, k), ctx.device)
        tr.reducer.prepare_microbatch(is_last=k == m - 1)
        loss = _microbatch_loss(tr.model, batch)
        (loss / m).backward()
        total += loss.detach().double()
    tr.reducer.finish()
    if run.parallel.sequence_parallel:
        allreduce_sequence_parallel_grads(tr.model.parameters(), ctx)
    return _mean_over_dp(total, m, ctx)


def optimizer_step(tr: Trainer) -> tuple[float, GradStats, bool]:
    """Clip by the global norm and apply AdamW with the scheduled rate; returns (lr, grad stats, skipped)."""
    lr = tr.scheduler.current_lr
    params = tr.optimizer.params
    stats = clip_grads(params, tr.run.optimizer.clip_grad, tp_rank=tr.ctx.tp_rank, mp_group=tr.ctx.mp_group)
    skipped = stats.found_nonfinite
    if not skipped:
        tr.optimizer.step(lr)
    tr.scheduler.step()
    return lr, stats, skipped


def train_step(tr: Trainer) -> StepResult:
    loss = forward_backward(tr)
    lr, stats, skipped = optimizer_step(tr)
    tr.iteration += 1
    tr.losses.append(loss)
    if skipped:
        tr.skipped_iterations += 1
    if skipped or not math.isfinite(loss):
        tr.nan_iterations += 1
    return StepResult(loss=loss, learning_rate=lr, grad_stats=stats, skipped=skipped)


@torch.no_grad()
def evaluate(tr: Trainer) -> float:
    """Mean validation loss over ``--eval-iters`` global batches (continuing through the validation split)."""
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
    if run.checkpoint.save or run.checkpoint.load:  # before any collective: every rank fails alike
        raise ConfigError("--save/--load: checkpointing is not available in this trainer yet; remove those flags")
    ctx = ParallelContext.initialize(
        tp=run.parallel.tp_size,
        pp=run.parallel.pp_size,
        timeout=timedelta(seconds=run.parallel.distributed_timeout_s),
    )
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
        extra={"data": data, "train iterations": t.train_iters, "model FLOPs per iteration": f"{flops_per_iter:.3e}"},
    )

    validation: list[tuple[int, float]] = []
    window_loss, window_iters, window_start = 0.0, 0, time.time()
    window_skipped = window_nan = 0
    run_start = time.time()
    last_grad_norm: float | None = None
    while tr.iteration < t.train_iters:
        res = train_step(tr)
        window_loss += res.loss if math.isfinite(res.loss) else 0.0
        window_iters += 1
        window_skipped += int(res.skipped)
        window_nan += int(res.skipped or not math.isfinite(res.loss))
        last_grad_norm = res.grad_stats.norm
        it = tr.iteration
        if it % run.logging.log_interval == 0 or it == t.train_iters:
            elapsed = (time.time() - window_start) / window_iters
            good = window_iters - window_nan
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
                    loss_scale=1.0,
                    skipped_iterations=window_skipped,
                    nan_iterations=window_nan,
                    tokens_per_s=tokens_per_iter / elapsed,
                    model_tflops=flops_per_iter / elapsed / 1e12,
                    world_size=ctx.world_size,
                )
            )
            window_loss, window_iters, window_start = 0.0, 0, time.time()
            window_skipped = window_nan = 0
        if tr.valid_data is not None and t.eval_iters > 0 and it % t.eval_interval == 0:
            loss = evaluate(tr)
            validation.append((it, loss))
            logger.validation(it, loss)
            window_start = time.time()  # validation time is not iteration time
        if t.exit_interval is not None and it % t.exit_interval == 0:
            logger.print(f"exiting program at iteration {it} (--exit-interval {t.exit_interval})")
            break
    wall = time.time() - run_start
    if tr.valid_data is not None and t.eval_iters > 0 and (not validation or validation[-1][0] != tr.iteration):
        loss = evaluate(tr)
        validation.append((tr.iteration, loss))
        logger.validation(tr.iteration, loss)
    tail = tr.losses[-min(len(tr.losses), max(1, run.logging.log_interval)) :]
    final_loss = sum(tail) / len(tail)
    tokens_per_s = tokens_per_iter * tr.iteration / wall if wall > 0 else 0.0
    extra = {
        "first lm loss": f"{tr.losses[0]:.6E}",
        "skipped iterations": tr.skipped_iterations,
        "nan iterations": tr.nan_iterations,
    }
    if validation:
        extra["final validation loss"] = f"{validation[-1][1]:.6E}"
    logger.final_summary(iterations=tr.iteration, final_loss=final_loss, tokens_per_s=tokens_per_s, extra=extra)
    logger.close()
    return TrainSummary(
        iterations=tr.iteration,
        losses=tuple(tr.losses),
        final_loss=final_loss,
        tokens_per_s=tokens_per_s,
        validation_losses=tuple(validation),
    )
