"""Building one rank's ``Trainer`` from a ``RunConfig``: vocabulary, model (or pipeline stages), optimizer, data.

``setup`` is what ``megatron.training.pretrain`` calls once the parallel context exists (``--load`` is applied by
the caller); tests call it directly to compare layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron.arguments import RunConfig, apply_layer_split
from megatron.config.errors import ConfigError
from megatron.data.mock_data import MockGPTDataset
from megatron.kernels.select import apply_kernels
from megatron.model import build_gpt_model
from megatron.optimizer import DistributedOptimizer, LRScheduler, MainParamOptimizer
from megatron.parallel.context import ParallelContext
from megatron.parallel.data_parallel import DataParallelReducer
from megatron.pipeline.post_validated_step import PostValidatedStep
from megatron.pipeline.trainer_hooks import attach_reducer, build_trainer_pipeline
from megatron.trainer_state import Trainer
from zb_pipeline import comm


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
    model = dataclasses.replace(run.model, vocab_size=vocab)
    data = dataclasses.replace(run.data, vocab_size=vocab)
    return apply_layer_split(dataclasses.replace(run, model=model, data=data))  # auto split needs the vocabulary


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
        comm.broadcast_object_list(message, src=0)
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
    model_config = run.model
    pipeline = build_trainer_pipeline(run, ctx, model_config) if ctx.pp_size > 1 else None
    if pipeline is not None:
        model = pipeline.model  # this rank's stages (PipelineModel), already on the device in params_dtype
    else:
        model = build_gpt_model(model_config, tp=ctx, sequence_parallel=run.parallel.sequence_parallel, seed=seed)
        model = model.to(device=ctx.device, dtype=run.precision.params_dtype)
    apply_kernels(model, run.kernels)  # --kernels: the fused ops' hooks (nothing for torch)
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
