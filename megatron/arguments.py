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

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import MOCK_DATA_VOCAB_SIZE, NO_DATA_MESSAGE, DataConfig
from megatron.config.errors import ConfigError, require
from megatron.config.kernels import KernelConfig
from megatron.config.logging_config import LoggingConfig
from megatron.config.lr_schedule import LRScheduleConfig
from megatron.config.model_sizes import load_model_config
from megatron.config.optimizer import OptimizerConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.precision import PrecisionConfig
from megatron.config.training import TrainingConfig
from megatron.flag_table import KNOWN_IGNORED_FLAGS, FlagTable, build_parser
from megatron.kernels.select import KernelSelection, resolve_kernels
from megatron.model.config import GPTConfig, padded_vocab_size
from megatron.pipeline.layer_split import auto_layer_split
from megatron.pipeline.layout import PipelineLayout, pipeline_layout
from megatron.pipeline.schedule_flags import ScheduleConfig


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
    pipeline: ScheduleConfig = field(default_factory=ScheduleConfig)  # the pipeline schedule (used when pp > 1)
    pipeline_layout: PipelineLayout | None = None  # pp > 1: the plan and each virtual stage's layers
    kernels: KernelSelection = field(default_factory=KernelSelection)  # torch or Triton, per fused op

    @property
    def padded_vocab_size(self) -> int:
        """The embedding rows of this run (the vocabulary padded for its tensor-parallel size; 0 while unknown)."""
        m = self.model
        return padded_vocab_size(
            m.vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel_size=self.parallel.tp_size
        )

    def ignored_flag_warnings(self) -> list[str]:
        return [f"warning: {f} is ignored here ({KNOWN_IGNORED_FLAGS[f][1]})" for f in self.ignored_flags]


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
    vocab = v["vocab_size"]
    if vocab is None:
        require(
            v["mock_data"] or v["tokenizer_type"] is not None,
            "--vocab-size is required without a tokenizer; pass --vocab-size N or --tokenizer-type",
        )
        vocab = MOCK_DATA_VOCAB_SIZE if v["mock_data"] else 0  # 0: filled in from the tokenizer (resolve_vocab)
    fields = {f.name: v[f.name] for f in dataclasses.fields(GPTConfig) if f.name in v}
    model = GPTConfig(
        **{
            **fields,
            "vocab_size": vocab,
            "num_query_groups": v["num_query_groups"] if v["group_query_attention"] else None,  # None: = heads
        }
    )
    model.check_tensor_parallel(tp)
    return model


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
        distributed_timeout_s=timeout_s,
    )


def _training_config(v: dict[str, Any]) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=v["micro_batch_size"],
        global_batch_size=v["global_batch_size"],
        train_iters=v["train_iters"],
        eval_interval=v["eval_interval"],
        eval_iters=v["eval_iters"],
        exit_interval=v["exit_interval"],
        seed=v["seed"],
        manual_gc=v["manual_gc"],
        manual_gc_interval=v["manual_gc_interval"],
        manual_gc_eval=v["manual_gc_eval"],
    )


def _optimizer_configs(v: dict[str, Any]) -> tuple[LRScheduleConfig, OptimizerConfig, PrecisionConfig]:
    lr_schedule = LRScheduleConfig(
        lr=v["lr"],
        min_lr=v["min_lr"],
        decay_style=v["lr_decay_style"],
        warmup_iters=v["lr_warmup_iters"],
        decay_iters=v["lr_decay_iters"],
    )
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
    return lr_schedule, optimizer, precision


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
        vocab_size=model.vocab_size or None,
        num_workers=v["num_workers"],
    )
    checkpoint = CheckpointConfig(
        save=v["save"],
        load=v["load"],
        save_interval=v["save_interval"],
        no_load_optim=v["no_load_optim"],
        no_load_rng=v["no_load_rng"],
        finetune=v["finetune"],
        exit_signal_handler=v["exit_signal_handler"],
    )
    logging = LoggingConfig(
        log_interval=v["log_interval"],
        tensorboard_dir=v["tensorboard_dir"],
        wandb_project=v["wandb_project"],
        wandb_exp_name=v["wandb_exp_name"],
    )
    return data, checkpoint, logging


def apply_layer_split(run: RunConfig) -> RunConfig:
    """``run`` with ``--pipeline-layer-split auto``'s split in its pipeline layout once the vocabulary is known
    (the head's cost is vocabulary-wide); unchanged for an even or explicit split, pp = 1, or a split already
    planned.  Called at the end of ``parse_run_config`` and again by ``training_setup.resolve_vocab``."""
    layout = run.pipeline_layout
    if layout is None or run.parallel.layer_split != "auto" or layout.split != "even":
        return run
    require(
        run.pipeline.num_layers_per_virtual_stage is None,
        "--pipeline-layer-split auto chooses each virtual stage's layers: drop --num-layers-per-virtual-pipeline-stage "
        "(the schedule's default chunks apply) or the auto split",
    )
    if not run.model.vocab_size:
        return run
    layout = auto_layer_split(
        layout,
        run.model,
        schedule=run.pipeline.schedule,
        schedule_file=run.pipeline.schedule_file,
        padded_vocab_size=run.padded_vocab_size,
        micro_batch_size=run.training.micro_batch_size,
        num_microbatches=run.num_microbatches,
        bytes_per_element=2 if run.precision.name in ("bf16", "fp16") else 4,
    )
    return dataclasses.replace(run, pipeline_layout=layout)


def _auto_split(parallel: ParallelConfig) -> bool:
    first, last = parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers
    return parallel.layer_split == "auto" and first is None and last is None


def parse_run_config(argv: Sequence[str], *, world_size: int = 1) -> RunConfig:
    """Parse and validate the flags of one run on ``world_size`` ranks; raises ``ConfigError`` on bad input."""
    v, ignored = parse_flags(argv)
    require(v["train_iters"] is not None, "--train-iters is required (how many iterations to train)")
    require(v["lr"] is not None, "--lr is required (the peak learning rate)")
    require(v["mock_data"] or bool(v["data_path"]), NO_DATA_MESSAGE)
    parallel = _parallel_config(v)
    dp = parallel.data_parallel_size(world_size)
    model = model_config_from_flags(v, parallel.tp_size)
    if parallel.sequence_parallel:
        model.check_sequence_parallel(parallel.tp_size)
    # --kernels triton / --transformer-impl transformer_engine it cannot serve: exit 2 here
    kernels = resolve_kernels(KernelConfig.from_flags(v), model, tp_size=parallel.tp_size)
    training = _training_config(v)
    num_microbatches = training.num_microbatches(dp)
    lr_schedule, optimizer, precision = _optimizer_configs(v)
    data, checkpoint, logging = _io_configs(v, model)
    pipeline = ScheduleConfig.from_flags(v)
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
        global_batch_size=training.resolved_global_batch_size(dp),
        ignored_flags=ignored,
        pipeline=pipeline,
        pipeline_layout=layout,
        kernels=kernels,
    )
    return apply_layer_split(run)  # --pipeline-layer-split auto (once the vocabulary is known: else resolve_vocab)
