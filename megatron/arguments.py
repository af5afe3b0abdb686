"""Megatron-compatible command-line flags, resolved into the per-component configs of one run.

``parse_run_config(argv, world_size=...)`` is the only entry: it parses Megatron's flag names with Megatron's
meanings (the flag table: ``megatron.flag_table``), merges a named size or YAML model config (``--model-config``),
derives what Megatron derives (ffn size, data-parallel size, microbatches) and returns a frozen ``RunConfig``.
There is no global ``args``.

Precedence, lowest first: flag defaults < ``--model-config`` (named size or YAML) < flags on the command line.

Bad input raises ``ConfigError`` (a ``ValueError``) with one line naming the problem and the fix; argparse's own
errors (unknown flag, bad value) are turned into the same error instead of printing usage and exiting.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.batch_schedule import BatchSizeSchedule, iterations_for_samples, ramp_up_sizes
from megatron.checkpoint_args import apply_checkpoint_args
from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import MOCK_DATA_VOCAB_SIZE, NO_DATA_MESSAGE, DataConfig
from megatron.config.documents import DocumentMaskConfig
from megatron.config.errors import ConfigError, require
from megatron.config.kernels import KernelConfig
from megatron.config.logging_config import LoggingConfig
from megatron.config.lr_schedule import LRScheduleConfig
from megatron.config.model_sizes import load_model_config
from megatron.config.optimizer import OptimizerConfig
from megatron.config.overrides import override_warnings
from megatron.config.parallel import ParallelConfig
from megatron.config.precision import PrecisionConfig
from megatron.config.profiling import ProfilingConfig
from megatron.config.recompute import RecomputeConfig
from megatron.config.training import TrainingConfig
from megatron.data.document_masks import tokenizer_given
from megatron.flag_table import KNOWN_IGNORED_FLAGS, FlagTable, build_parser
from megatron.kernels.select import KernelSelection, resolve_kernels
from megatron.model.config import GPTConfig, padded_vocab_size
from megatron.pipeline.layer_split import auto_layer_split, memory_limit_bytes, wants_auto_split
from megatron.pipeline.layout import PipelineLayout, pipeline_layout
from megatron.pipeline.schedule_flags import ScheduleConfig
from megatron.tokenizer.build import model_vocab_size


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs, one frozen config per component."""

    model: GPTConfig  # vocab_size 0 until the tokenizer is known (real data without --vocab-size)
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    lr_schedule: LRScheduleConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    world_size: int
    dp_size: int
    num_microbatches: int
    global_batch_size: int
    ignored_flags: tuple[str, ...] = ()
    overridden_flags: tuple[str, ...] = ()  # warning lines: flags another flag overrides (megatron.config.overrides)
    pipeline: ScheduleConfig = field(default_factory=ScheduleConfig)  # the pipeline schedule (used when pp > 1)
    pipeline_layout: PipelineLayout | None = None  # pp > 1: the plan and each virtual stage's layers
    kernels: KernelSelection = field(default_factory=KernelSelection)  # torch or Triton, per fused op
    documents: DocumentMaskConfig = field(default_factory=DocumentMaskConfig)  # EOD loss mask / position / attention
    model_flag_notes: tuple[str, ...] = ()  # one warning line each: model/data-variant flags that cannot apply here
    batch_schedule: BatchSizeSchedule | None = None  # per-iteration global batch size (None: constant)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    warnings: tuple[str, ...] = ()  # one line each, printed by rank 0 at start-up

    def global_batch_size_at(self, iteration: int) -> int:
        """Global batch size of the iteration after ``iteration`` completed ones (ramp-up aware)."""
        return self.batches.global_batch_size(iteration)

    def num_microbatches_at(self, iteration: int) -> int:
        return self.batches.num_microbatches(iteration)

    @property
    def batches(self) -> BatchSizeSchedule:
        if self.batch_schedule is not None:
            return self.batch_schedule
        return BatchSizeSchedule(
            final=self.global_batch_size, per_microbatch=self.training.micro_batch_size * self.dp_size
        )

    def lr_increment(self, iteration: int) -> int:
        """How far the LR schedule advances for the step of 1-based ``iteration``: its global batch size when the
        schedule counts samples, else one."""
        return self.global_batch_size_at(iteration - 1) if self.lr_schedule.sample_based else 1

    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)  # --recompute-* (activation recomputation)

    @property
    def padded_vocab_size(self) -> int:
        """The embedding rows of this run (the vocabulary padded for its tensor-parallel size; 0 while unknown)."""
        m = self.model
        return padded_vocab_size(
            m.vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel_size=self.parallel.tp_size
        )

    def ignored_flag_warnings(self) -> list[str]:
        lines = [f"warning: {f} is ignored here ({KNOWN_IGNORED_FLAGS[f][1]})" for f in self.ignored_flags]
        notes = [f"warning: {note}" for note in self.model_flag_notes]
        return lines + list(self.overridden_flags) + list(self.warnings) + notes


def _coerce_model_value(table: FlagTable, dest: str, value: Any, source: str) -> Any:
    """Check a value from a model config against the flag's type and choices."""
    flag = "--" + dest.replace("_", "-")
    typ = table.types.get(dest)
    if typ is bool:
        require(isinstance(value, bool), f"{source}: {dest} must be true or false, got {value!r}")
        return value
    if value is None:
        return None
    try:
        value = typ(str(value)) if typ is not None else str(value)
    except (ValueError, argparse.ArgumentTypeError):
        raise ConfigError(f"{source}: {dest}={value!r} is not a valid value for {flag}") from None
    choices = table.choices.get(dest)
    require(choices is None or value in choices, f"{source}: {dest}={value!r} must be one of {choices}")
    return value


def parse_flags(argv: Sequence[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Resolved flag values (defaults < model config < explicit flags) and the ignored flags that were given."""
    parser, table = build_parser()
    ns = parser.parse_args(list(argv))
    explicit = {k: v for k, v in vars(ns).items() if not k.startswith("_")}
    ignored = tuple(getattr(ns, "_ignored_flags", ()))
    model_config = explicit.pop("model_config", None)
    values = dict(table.defaults)
    if model_config is not None:
        for dest, value in load_model_config(model_config, allowed=table.model_keys).items():
            values[dest] = _coerce_model_value(table, dest, value, f"--model-config {model_config}")
    values.update(explicit)
    return values, ignored


def model_config_from_flags(v: dict[str, Any], tp: int) -> GPTConfig:
    """The ``GPTConfig`` the model flags describe, checked to split over ``tp`` tensor-parallel ranks."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        require(
            v[flag] is not None,
            f"--{flag.replace('_', '-')} is required (or pick a size with --model-config, e.g. gpt-tiny)",
        )
    require(
        v["vocab_size"] is not None or v["mock_data"] or v["tokenizer_type"] is not None,
        "--vocab-size is required without a tokenizer; pass --vocab-size N or --tokenizer-type",
    )
    vocab = _flag_vocab_size(v)
    if vocab:  # NullTokenizer adds its end-of-document id; 0: filled in from the tokenizer (resolve_vocab)
        vocab = model_vocab_size(v["tokenizer_type"], vocab)
    fields = {f.name: v[f.name] for f in dataclasses.fields(GPTConfig) if f.name in v}
    model = GPTConfig(
        **{
            **fields,
            "vocab_size": vocab,
            "num_query_groups": v["num_query_groups"] if v["group_query_attention"] else None,  # None: = heads
            "position_embedding_type": position_embedding_type(v),
        }
    )
    model.check_tensor_parallel(tp)
    return model


def _flag_vocab_size(v: dict[str, Any]) -> int:
    """--vocab-size, or the mock-data default without it (0: real data, the tokenizer tells)."""
    if v["vocab_size"] is not None:
        return v["vocab_size"]
    return MOCK_DATA_VOCAB_SIZE if v["mock_data"] else 0


def position_embedding_type(v: dict[str, Any]) -> str:
    """--position-embedding-type after Megatron's legacy aliases: --use-rotary-position-embeddings is rope;
    --no-position-embedding drops the learned table (no position information unless rope)."""
    kind = "rope" if v["use_rotary_position_embeddings"] else v["position_embedding_type"]
    if not v["add_position_embedding"] and kind == "learned_absolute":
        kind = "none"
    return kind


def _document_config(v: dict[str, Any]) -> tuple[DocumentMaskConfig, list[str]]:
    """--eod-mask-loss / --reset-position-ids / --reset-attention-mask, and the warning when nothing can apply."""
    documents = DocumentMaskConfig(
        eod_mask_loss=v["eod_mask_loss"],
        reset_position_ids=v["reset_position_ids"],
        reset_attention_mask=v["reset_attention_mask"],
    )
    notes = []
    names = ("vocab_file", "merge_file", "tokenizer_model", "vocab_size")
    if documents.active and not tokenizer_given(v["tokenizer_type"], **{k: v[k] for k in names}):
        flags = " / ".join(documents.flags())
        require(
            v["mock_data"],
            f"{flags} needs the tokenizer's end-of-document id; pass --tokenizer-type and its files",
        )
        notes.append(
            f"{flags} has no effect: --mock-data without a tokenizer (--tokenizer-type and its files) has no "
            "end-of-document token"
        )
    backend = v["attention_backend"]
    if backend in ("flash", "fused", "unfused"):
        notes.append(
            f"--attention-backend {backend} is not applied: attention runs through torch's "
            "scaled_dot_product_attention, which chooses its kernel itself (results do not depend on this flag)"
        )
    return documents, notes


def _parallel_config(v: dict[str, Any]) -> ParallelConfig:
    tp = v["tensor_model_parallel_size"]
    timeout_s = v["distributed_timeout_seconds"]
    if timeout_s is None:
        timeout_s = v["distributed_timeout_minutes"] * 60.0
    return ParallelConfig(
        tp_size=tp,
        pp_size=v["pipeline_model_parallel_size"],
        sequence_parallel=v["sequence_parallel"] and tp > 1,  # Megatron turns it off when tp == 1
        decoder_first_pipeline_num_layers=v["decoder_first_pipeline_num_layers"],
        decoder_last_pipeline_num_layers=v["decoder_last_pipeline_num_layers"],
        allow_padding_num_layers=v["allow_padding_num_layers"],
        layer_split=v["pipeline_layer_split"],
        memory_limit_gb=v["pipeline_memory_limit_gb"],
        distributed_timeout_s=timeout_s,
    )


def _training_config(v: dict[str, Any], train_iters: int) -> TrainingConfig:
    ramp = v["rampup_batch_size"]
    return TrainingConfig(
        micro_batch_size=v["micro_batch_size"],
        global_batch_size=v["global_batch_size"],
        train_iters=train_iters,
        eval_interval=v["eval_interval"],
        eval_iters=v["eval_iters"],
        exit_interval=v["exit_interval"],
        seed=v["seed"],
        manual_gc=v["manual_gc"],
        manual_gc_interval=v["manual_gc_interval"],
        manual_gc_eval=v["manual_gc_eval"],
        train_samples=v["train_samples"],
        rampup_batch_size=tuple(ramp) if ramp is not None else None,
        exit_duration_in_mins=v["exit_duration_in_mins"],
    )


def _check_run_length_flags(v: dict[str, Any]) -> None:
    """Megatron's rule: iteration-based (``--train-iters``) or sample-based (``--train-samples``), never mixed."""
    iters, samples = v["train_iters"], v["train_samples"]
    require(
        iters is None or samples is None,
        "--train-iters and --train-samples are alternatives (iterations or samples); pass one",
    )
    require(
        iters is not None or samples is not None, "--train-iters or --train-samples is required (how long to train)"
    )
    if samples is not None:
        for flag, bad in (
            ("--lr-decay-iters", v["lr_decay_iters"] is not None),
            ("--lr-warmup-iters", v["lr_warmup_iters"]),
        ):
            require(
                not bad,
                f"{flag} counts iterations but --train-samples counts samples; use {flag.replace('iters', 'samples')}",
            )
    else:
        for flag, bad in (
            ("--lr-decay-samples", v["lr_decay_samples"] is not None),
            ("--lr-warmup-samples", v["lr_warmup_samples"]),
        ):
            require(
                not bad,
                f"{flag} counts samples but --train-iters counts iterations; "
                f"use {flag.replace('samples', 'iters')} or --train-samples",
            )


def _batch_schedule(v: dict[str, Any], dp: int, final: int) -> tuple[BatchSizeSchedule | None, int]:
    """The ramp-up (None without ``--rampup-batch-size``) and the number of iterations of the run."""
    per_microbatch = v["micro_batch_size"] * dp
    schedule = None
    if v["rampup_batch_size"] is not None:
        start, incr, samples = v["rampup_batch_size"]
        ramp = ramp_up_sizes(start, incr, samples, final=final, per_microbatch=per_microbatch)
        schedule = BatchSizeSchedule(final=final, per_microbatch=per_microbatch, ramp=ramp)
    if v["train_iters"] is not None:
        return schedule, v["train_iters"]
    counting = schedule or BatchSizeSchedule(final=final, per_microbatch=per_microbatch)
    iters = iterations_for_samples(counting, v["train_samples"])
    require(
        iters >= 1,
        f"--train-samples={v['train_samples']} is less than one global batch ({counting.global_batch_size(0)})",
    )
    return schedule, iters


def _lr_schedule_config(v: dict[str, Any], *, ramped: bool, global_batch_size: int) -> LRScheduleConfig:
    """Iteration-based, or sample-based with --train-samples.  A ramp-up with --train-iters (as Megatron's GPT-3
    example passes it) counts samples too: the iteration spans become spans of final global batches."""
    sample_based = v["train_samples"] is not None or ramped
    warmup_samples, decay_samples = v["lr_warmup_samples"], v["lr_decay_samples"]
    warmup_iters, decay_iters = v["lr_warmup_iters"], v["lr_decay_iters"]
    if sample_based and v["train_samples"] is None:
        warmup_samples = warmup_iters * global_batch_size
        decay_samples = (decay_iters or v["train_iters"]) * global_batch_size
        warmup_iters, decay_iters = 0, None
    return LRScheduleConfig(
        lr=v["lr"],
        min_lr=v["min_lr"],
        decay_style=v["lr_decay_style"],
        warmup_iters=warmup_iters,
        decay_iters=decay_iters,
        warmup_init=v["lr_warmup_init"],
        warmup_fraction=v["lr_warmup_fraction"],
        sample_based=sample_based,
        warmup_samples=warmup_samples,
        decay_samples=decay_samples,
    )


def _warmup_warning(lr: LRScheduleConfig, *, total: int, per_iteration: int) -> list[str]:
    """A warm-up that was asked for but spans less than one iteration would be silently gone: say so."""
    warmup, _ = lr.warmup_and_decay(total)
    iterations = warmup / per_iteration
    if 0 < iterations < 1:
        return [
            f"warning: the LR warm-up spans {iterations:.3g} iterations (less than one): the first update runs at "
            f"--lr-warmup-init={lr.warmup_init} and the next ones at the decayed rate; lengthen the warm-up to keep it"
        ]
    return []


def _optimizer_configs(v: dict[str, Any]) -> tuple[OptimizerConfig, PrecisionConfig]:
    optimizer = OptimizerConfig(
        weight_decay=v["weight_decay"],
        adam_beta1=v["adam_beta1"],
        adam_beta2=v["adam_beta2"],
        adam_eps=v["adam_eps"],
        clip_grad=v["clip_grad"],
        use_distributed_optimizer=v["use_distributed_optimizer"],
        optimizer=v["optimizer"],
        sgd_momentum=v["sgd_momentum"],
    )
    precision = PrecisionConfig(
        bf16=v["bf16"],
        fp16=v["fp16"],
        loss_scale=v["loss_scale"],
        initial_loss_scale=v["initial_loss_scale"],
        min_loss_scale=v["min_loss_scale"],
        loss_scale_window=v["loss_scale_window"],
        hysteresis=v["hysteresis"],
        check_for_nan_in_loss_and_grad=v["check_for_nan_in_loss_and_grad"],
    )
    return optimizer, precision


def _io_configs(v: dict[str, Any], model: GPTConfig) -> tuple[DataConfig, CheckpointConfig, LoggingConfig]:
    data = DataConfig(
        data_path=tuple(v["data_path"] or ()),
        split=v["split"],
        mock_data=v["mock_data"],
        seq_length=model.seq_length,
        tokenizer_type=v["tokenizer_type"],
        vocab_file=v["vocab_file"],
        merge_file=v["merge_file"],
        tokenizer_model=v["tokenizer_model"],
        vocab_size=_flag_vocab_size(v) or None,  # the flag's N (NullTokenizer's ids); the model's is model.vocab_size
        num_workers=v["num_workers"],
        data_cache_path=v["data_cache_path"],
        train_data_path=tuple(v["train_data_path"] or ()),
        valid_data_path=tuple(v["valid_data_path"] or ()),
        dataloader_type=v["dataloader_type"],
    )
    checkpoint = CheckpointConfig(
        save=v["save"],
        load=v["load"],
        save_interval=v["save_interval"],
        no_load_optim=v["no_load_optim"],
        no_load_rng=v["no_load_rng"],
        finetune=v["finetune"],
        exit_signal_handler=v["exit_signal_handler"],
        no_save_optim=v["no_save_optim"],
        no_save_rng=v["no_save_rng"],
        use_checkpoint_args=v["use_checkpoint_args"],
    )
    logging = LoggingConfig(
        log_interval=v["log_interval"],
        tensorboard_dir=v["tensorboard_dir"],
        wandb_project=v["wandb_project"],
        wandb_exp_name=v["wandb_exp_name"],
        tensorboard_log_interval=v["tensorboard_log_interval"],
        log_num_zeros_in_grad=v["log_num_zeros_in_grad"],
        log_memory_to_tensorboard=v["log_memory_to_tensorboard"],
    )
    return data, checkpoint, logging


def _profiling_config(v: dict[str, Any]) -> ProfilingConfig:
    return ProfilingConfig(
        profile=v["profile"],
        use_pytorch_profiler=v["use_pytorch_profiler"],
        step_start=v["profile_step_start"],
        step_end=v["profile_step_end"],
        ranks=tuple(v["profile_ranks"]),
        trace_dir=v["tensorboard_dir"] or "profiles",
    )


def _recompute_config(
    v: dict[str, Any], parallel: ParallelConfig, model: GPTConfig, layout: PipelineLayout | None
) -> RecomputeConfig:
    """The ``--recompute-*`` flags, checked against tp, sequence parallelism and every (virtual) stage's layers."""
    recompute = RecomputeConfig.from_flags(v)
    require(
        not recompute.auto or (layout is not None and _auto_split(parallel)),
        "--recompute-granularity auto is the stage planner's choice: it needs --pipeline-layer-split auto "
        "(pp > 1, no --decoder-first/last-pipeline-num-layers); or give full or selective",
    )
    stage_layers = (model.num_layers,) if layout is None else tuple(len(r) for r in layout.layer_ranges)
    recompute.check(
        tp=parallel.tp_size,
        sequence_parallel=parallel.sequence_parallel,
        stage_layers=stage_layers,
        transformer_impl=v.get("transformer_impl", "local"),
    )
    return recompute


def apply_layer_split(run: RunConfig) -> RunConfig:
    """``run`` with ``--pipeline-layer-split auto``'s split in its pipeline layout once the vocabulary is known
    (the head's cost is vocabulary-wide); unchanged for an even or explicit split, pp = 1, or a split already
    planned.  Called at the end of ``parse_run_config`` and again by ``training_setup.resolve_vocab``."""
    layout = run.pipeline_layout
    if (
        not wants_auto_split(layout, run.parallel, run.pipeline.num_layers_per_virtual_stage)
        or not run.model.vocab_size
    ):
        return run
    bytes_per_element = 2 if run.precision.name in ("bf16", "fp16") else 4
    on_cuda = torch.cuda.is_available()  # the stages run on the GPU when there is one (NCCL, parallel.context)
    layout = auto_layer_split(
        layout,
        run.model,
        schedule=run.pipeline.schedule,
        schedule_file=run.pipeline.schedule_file,
        padded_vocab_size=run.padded_vocab_size,
        micro_batch_size=run.training.micro_batch_size,
        num_microbatches=run.num_microbatches,
        bytes_per_element=bytes_per_element,
        recompute=run.recompute,  # an explicit one is planned in force (layer_split.planner_costs)
        mem_limit=memory_limit_bytes(run.parallel),
        on_cuda=on_cuda,
    )
    recompute = run.recompute
    if recompute.auto:  # --recompute-granularity auto: the planner's choice per virtual stage
        recompute = recompute.planned(layout.layer_ranges, layout.split_plan.recompute)
    return dataclasses.replace(run, pipeline_layout=layout, recompute=recompute)


def _auto_split(parallel: ParallelConfig) -> bool:
    first, last = parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers
    return parallel.layer_split == "auto" and first is None and last is None


def parse_run_config(argv: Sequence[str], *, world_size: int = 1) -> RunConfig:
    """Parse and validate the flags of one run on ``world_size`` ranks; raises ``ConfigError`` on bad input."""
    v, ignored = parse_flags(argv)
    _check_run_length_flags(v)
    require(v["lr"] is not None, "--lr is required (the peak learning rate)")
    require(v["mock_data"] or bool(v["data_path"]) or bool(v["train_data_path"]), NO_DATA_MESSAGE)
    warnings: list[str] = []
    if v["use_checkpoint_args"]:
        require(
            v["load"] is not None, "--use-checkpoint-args needs --load DIR (the checkpoint whose model flags to use)"
        )
        warnings += apply_checkpoint_args(v, v["load"])
    parallel = _parallel_config(v)
    overridden = override_warnings(v, tp_size=parallel.tp_size)  # --data-path with --mock-data: an error
    dp = parallel.data_parallel_size(world_size)
    model = model_config_from_flags(v, parallel.tp_size)
    if parallel.sequence_parallel:
        model.check_sequence_parallel(parallel.tp_size)
    # --kernels triton / --transformer-impl transformer_engine it cannot serve: exit 2 here
    kernels = resolve_kernels(KernelConfig.from_flags(v), model, tp_size=parallel.tp_size)
    length_probe = _training_config(v, 1)  # batch sizes checked before the run length is derived from them
    final_gbs = length_probe.resolved_global_batch_size(dp)
    num_microbatches = length_probe.num_microbatches(dp)
    batch_schedule, train_iters = _batch_schedule(v, dp, final_gbs)
    training = _training_config(v, train_iters)
    lr_schedule = _lr_schedule_config(v, ramped=batch_schedule is not None, global_batch_size=final_gbs)
    lr_total = lr_schedule_length(training, lr_schedule, batch_schedule, final_gbs)
    warnings += _warmup_warning(lr_schedule, total=lr_total, per_iteration=final_gbs if lr_schedule.sample_based else 1)
    optimizer, precision = _optimizer_configs(v)
    data, checkpoint, logging = _io_configs(v, model)
    if checkpoint.save_interval is not None and checkpoint.save is None:
        warnings.append(f"warning: --save-interval {checkpoint.save_interval} without --save: no checkpoint is written")
    pipeline = ScheduleConfig.from_flags(v)
    documents, model_flag_notes = _document_config(v)
    layout = None
    if parallel.pp_size > 1:  # the plan and the layer split, once: a shape they cannot serve exits 2 before any talk
        layout = pipeline_layout(
            pipeline,
            pp=parallel.pp_size,
            num_microbatches=num_microbatches,
            num_layers=model.num_layers,
            first_stage_layers=parallel.decoder_first_pipeline_num_layers,
            last_stage_layers=parallel.decoder_last_pipeline_num_layers,
            # auto: the even split is a placeholder until the planner's (apply_layer_split), so it may be uneven
            allow_padding=parallel.allow_padding_num_layers or _auto_split(parallel),
        )
        if batch_schedule is not None:  # every microbatch count of the ramp must have a plan (cached by the registry)
            require(
                pipeline.schedule_file is None,
                "--rampup-batch-size changes the microbatch count; a --schedule-file plan has one count: drop one",
            )
            for m in batch_schedule.microbatch_counts():
                pipeline.build_schedule(
                    pp=parallel.pp_size, num_microbatches=m, num_layers=model.num_layers, source=layout.plans
                )
    recompute = _recompute_config(v, parallel, model, layout)
    run = RunConfig(
        model=model,
        parallel=parallel,
        training=training,
        optimizer=optimizer,
        precision=precision,
        lr_schedule=lr_schedule,
        data=data,
        checkpoint=checkpoint,
        logging=logging,
        world_size=world_size,
        dp_size=dp,
        num_microbatches=num_microbatches,
        global_batch_size=final_gbs,
        ignored_flags=ignored,
        overridden_flags=overridden,
        pipeline=pipeline,
        pipeline_layout=layout,
        kernels=kernels,
        documents=documents,
        model_flag_notes=tuple(model_flag_notes),
        batch_schedule=batch_schedule,
        profiling=_profiling_config(v),
        warnings=tuple(warnings),
        recompute=recompute,
    )
    return apply_layer_split(run)  # --pipeline-layer-split auto (once the vocabulary is known: else resolve_vocab)


def lr_schedule_length(
    training: TrainingConfig, lr: LRScheduleConfig, batches: BatchSizeSchedule | None, global_batch_size: int
) -> int:
    """The run's length in the LR schedule's unit: iterations, or samples (``--train-samples``, or what the ramp-up
    and ``--train-iters`` iterations consume in full global batches, as Megatron counts its decay span)."""
    if not lr.sample_based:
        return training.train_iters
    if training.train_samples is not None:
        return training.train_samples
    return training.train_iters * global_batch_size
