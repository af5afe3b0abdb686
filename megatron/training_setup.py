"""Building one rank's ``Trainer`` from a ``RunConfig``: vocabulary, model (or pipeline stages), optimizer, data.

``setup`` is what ``megatron.training.pretrain`` calls once the parallel context exists (``--load`` is applied by
the caller); tests call it directly to compare layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron.arguments import RunConfig, apply_layer_split, lr_schedule_length
from megatron.config.errors import ConfigError
from megatron.data.document_masks import DocumentMaskedDataset, tokenizer_given
from megatron.data.loader import CyclicOrder
from megatron.data.mock_data import MockGPTDataset
from megatron.kernels.select import apply_kernels
from megatron.model import build_gpt_model
from megatron.model.recompute import apply_recompute
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
    """(train, valid) datasets: mock tokens, or DATA's indexed GPT datasets for ``--data-path`` (split by
    ``--split``) or ``--train-data-path`` / ``--valid-data-path`` (each used whole); ``--dataloader-type cyclic``
    wraps them in a seeded order per pass.

    Hook for the default corpus: ``tools/make_train.py`` prepares it and passes ``--data-path``; nothing here changes.
    """
    train, valid = _build_datasets(run, ctx)
    if run.data.dataloader_type == "cyclic":
        train = CyclicOrder(train, seed=run.training.seed)
        valid = CyclicOrder(valid, seed=run.training.seed + 1) if valid is not None else None
    return train, valid


def _build_datasets(run: RunConfig, ctx: ParallelContext) -> tuple[Any, Any | None]:
    t, seq, d = run.training, run.model.seq_length, run.data
    train_samples = run.batches.consumed_before(t.train_iters)
    evals = t.train_iters // t.eval_interval + 1
    valid_samples = evals * t.eval_iters * run.global_batch_size if t.eval_iters > 0 else 0
    if d.mock_data:
        common = dict(seed=t.seed, seq_length=seq, vocab_size=run.model.vocab_size)
        train = MockGPTDataset(split="train", num_samples=train_samples, **common)
        valid = MockGPTDataset(split="valid", num_samples=valid_samples, **common) if valid_samples else None
        return train, valid
    from megatron.data.blended_dataset import build_gpt_datasets

    def build_one(paths: tuple[str, ...], split: str, counts: tuple[int, int, int]) -> tuple[Any, ...]:
        return build_gpt_datasets(
            list(paths),
            split=split,
            seq_length=seq,
            seed=t.seed,
            num_samples=counts,
            vocab_size=run.model.vocab_size,
            cache_dir=d.data_cache_path,
        )

    def build() -> tuple[Any, ...]:
        if d.data_path:
            return build_one(d.data_path, d.split, (train_samples, valid_samples, 0))[:2]
        train = build_one(d.train_data_path, "1,0,0", (train_samples, 0, 0))[0]  # per-split paths: used whole
        valid = build_one(d.valid_data_path, "0,1,0", (0, valid_samples, 0))[1] if d.valid_data_path else None
        return train, valid

    paths = " ".join(d.data_path or d.train_data_path + d.valid_data_path)

    def attempt() -> tuple[tuple[Any, ...] | None, str | None]:
        try:
            return build(), None
        except (OSError, ValueError) as err:
            return None, f"cannot open the data {paths}: {str(err).splitlines()[0]}"

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
    apply_recompute(model, run.recompute, ctx)  # --recompute-*: the units recomputed at B (nothing by default)
    optimizer = build_optimizer(run, ctx, model)
    reducer = optimizer.reducer
    post_validation = None
    if pipeline is not None:
        attach_reducer(pipeline, reducer)
        pipeline.loss_scale_fn = lambda: optimizer.loss_scale  # read when each loss is computed
        if run.pipeline.optimizer_post_validation:
            post_validation = PostValidatedStep(pipeline, optimizer, ctx)
    lr_length = lr_schedule_length(run.training, run.lr_schedule, run.batch_schedule, run.global_batch_size)
    scheduler = LRScheduler(run.lr_schedule, train_iters=lr_length)
    if train_data is None:
        train_data, valid_data = build_datasets(run, ctx)
    train_data, valid_data = document_masked(run, train_data), document_masked(run, valid_data)
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


def eod_token(run: RunConfig) -> int | None:
    """The tokenizer's end-of-document id (``None`` without a tokenizer: --mock-data alone has no EOD token)."""
    d = run.data
    names = dict(vocab_file=d.vocab_file, merge_file=d.merge_file, tokenizer_model=d.tokenizer_model)
    if not tokenizer_given(d.tokenizer_type, vocab_size=d.vocab_size, **names):
        return None
    from megatron.tokenizer.build import build_tokenizer

    try:
        return int(build_tokenizer(run.data).eod)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"cannot build the tokenizer for its end-of-document id: {str(err).splitlines()[0]}"
        ) from None


def document_masked(run: RunConfig, dataset: Any) -> Any:
    """``dataset`` with --eod-mask-loss / --reset-position-ids / --reset-attention-mask applied to its samples."""
    if dataset is None or not run.documents.active:
        return dataset
    eod = eod_token(run)
    if eod is None:  # warned at flag parsing: nothing to mask
        return dataset
    return DocumentMaskedDataset(dataset, eod=eod, config=run.documents)


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
