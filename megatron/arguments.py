"""Megatron-compatible command-line flags, resolved into the per-component configs of one run.

``parse_run_config(argv, world_size=...)`` is the only entry: it parses Megatron's flag names with Megatron's
meanings, merges a named size or YAML model config (``--model-config``), derives what Megatron derives (ffn size,
padded vocabulary, data-parallel size, microbatches) and returns a frozen ``RunConfig``. There is no global ``args``.

Precedence, lowest first: flag defaults < ``--model-config`` (named size or YAML) < flags on the command line.

Bad input raises ``ConfigError`` (a ``ValueError``) with one line naming the problem and the fix; argparse's own
errors (unknown flag, bad value) are turned into the same error instead of printing usage and exiting.

Flags of Megatron-LM that do not apply here are accepted with a one-line warning each (``KNOWN_IGNORED_FLAGS``),
so existing launch scripts run unchanged; any other unknown flag is an error.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import NO_DATA_MESSAGE, DataConfig
from megatron.config.errors import ConfigError, require
from megatron.config.logging_config import LoggingConfig
from megatron.config.lr_schedule import LR_DECAY_STYLES, LRScheduleConfig
from megatron.config.model_sizes import available_sizes, load_model_config
from megatron.config.optimizer import OptimizerConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.precision import PrecisionConfig
from megatron.config.training import TrainingConfig
from megatron.pipeline.schedule_flags import ScheduleConfig, schedule_flag_specs

# Megatron-LM flags accepted for compatibility but without effect here: flag -> (takes a value?, why it is ignored).
KNOWN_IGNORED_FLAGS: dict[str, tuple[bool, str]] = {
    "--use-mcore-models": (False, "there is one model implementation"),
    "--use-legacy-models": (False, "there is one model implementation"),
    "--transformer-impl": (True, "there is one transformer implementation"),
    "--use-flash-attn": (False, "attention always goes through scaled_dot_product_attention"),
    "--no-masked-softmax-fusion": (False, "no fused kernels; softmax is inside scaled_dot_product_attention"),
    "--masked-softmax-fusion": (False, "no fused kernels; softmax is inside scaled_dot_product_attention"),
    "--no-bias-gelu-fusion": (False, "no fused bias-gelu kernel"),
    "--bias-gelu-fusion": (False, "no fused bias-gelu kernel"),
    "--no-bias-swiglu-fusion": (False, "no fused bias-swiglu kernel"),
    "--no-bias-dropout-fusion": (False, "no fused bias-dropout kernel"),
    "--no-rope-fusion": (False, "no fused rope kernel"),
    "--no-persist-layer-norm": (False, "no persistent layer-norm kernel"),
    "--no-gradient-accumulation-fusion": (False, "weight gradients always accumulate into fp32 main_grad"),
    "--attention-softmax-in-fp32": (False, "scaled_dot_product_attention chooses its own softmax precision"),
    "--apply-query-key-layer-scaling": (False, "attention is scaled by 1/sqrt(head dim) only"),
    "--accumulate-allreduce-grads-in-fp32": (False, "gradients are always reduced in fp32 main-gradient buffers"),
    "--overlap-grad-reduce": (False, "the data-parallel reducer always overlaps bucket reductions with backward"),
    "--no-async-tensor-model-parallel-allreduce": (False, "tensor-parallel collectives are not made asynchronous"),
    "--use-cpu-initialization": (False, "parameters are always initialised from the seed and global name"),
    "--distributed-backend": (True, "the backend is chosen automatically (nccl on GPU, gloo on CPU)"),
    "--log-throughput": (False, "tokens/s and TFLOP/s are always logged"),
    "--timing-log-level": (True, "no per-region timers"),
    "--log-timers-to-tensorboard": (False, "no per-region timers"),
    "--log-params-norm": (False, "not implemented"),
    "--ckpt-format": (True, "checkpoints are always per-rank torch files with a verified manifest"),
    "--use-dist-ckpt": (False, "checkpoints are always per-rank torch files with a verified manifest"),
}


class _IgnoredFlag(argparse.Action):
    """Records that an ignored flag was given, so the caller can warn once per flag."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None):
        seen = list(getattr(namespace, "_ignored_flags", []))
        if option not in seen:
            seen.append(option)
        namespace._ignored_flags = seen


class _OneLineParser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` (one line) instead of printing usage and calling ``sys.exit``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see `pretrain_gpt.py --help`")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_positive_int.__name__ = "positive int"


@dataclass
class _FlagTable:
    """Flags registered with ``default=SUPPRESS`` so only explicit ones reach the namespace; defaults kept here."""

    parser: _OneLineParser
    defaults: dict[str, Any] = field(default_factory=dict)
    types: dict[str, Callable[[str], Any] | None] = field(default_factory=dict)
    choices: dict[str, Sequence[Any] | None] = field(default_factory=dict)

    def add(
        self,
        group: argparse._ArgumentGroup,
        flag: str,
        *,
        type: Callable[[str], Any] | None = None,
        default: Any = None,
        help: str,
        choices: Sequence[Any] | None = None,
        switch: bool = False,
        dest: str | None = None,
        nargs: str | None = None,
        store_false: bool = False,
    ) -> None:
        dest = dest or flag.lstrip("-").replace("-", "_")
        shown = f" (default: {default})" if default is not None and not switch else ""
        if switch:
            action = "store_false" if store_false else "store_true"
            group.add_argument(flag, dest=dest, action=action, default=argparse.SUPPRESS, help=help)
            self.defaults[dest] = store_false
            self.types[dest] = bool
        else:
            group.add_argument(
                flag,
                dest=dest,
                type=type,
                default=argparse.SUPPRESS,
                help=help + shown,
                choices=choices,
                nargs=nargs,
            )
            self.defaults[dest] = default
            self.types[dest] = type
        self.choices[dest] = choices


def build_parser() -> tuple[_OneLineParser, _FlagTable]:
    """The argparse parser for ``pretrain_gpt.py`` and the table of defaults and types behind it."""
    parser = _OneLineParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model (Megatron-LM flags) with tensor, data and zero-bubble pipeline parallelism.",
        allow_abbrev=False,
    )
    t = _FlagTable(parser)
    pi, fl = _positive_int, float

    g = parser.add_argument_group("model")
    g.add_argument(
        "--model-config",
        default=None,
        help=f"named size ({', '.join(available_sizes())}) or a YAML file of model flags; explicit flags override it",
    )
    t.add(g, "--num-layers", type=pi, default=None, help="transformer layers")
    t.add(g, "--hidden-size", type=pi, default=None, help="transformer hidden size")
    t.add(g, "--num-attention-heads", type=pi, default=None, help="attention heads")
    t.add(g, "--group-query-attention", switch=True, help="use grouped-query attention (see --num-query-groups)")
    t.add(g, "--num-query-groups", type=pi, default=1, help="key/value groups with --group-query-attention")
    t.add(
        g,
        "--ffn-hidden-size",
        type=pi,
        default=None,
        help="MLP hidden size (default 4*hidden, or ~8/3*hidden with --swiglu)",
    )
    t.add(g, "--kv-channels", type=pi, default=None, help="per-head dimension (default hidden/heads)")
    t.add(g, "--seq-length", type=pi, default=None, help="tokens per sample")
    t.add(g, "--max-position-embeddings", type=pi, default=None, help="position table size (default --seq-length)")
    t.add(
        g, "--make-vocab-size-divisible-by", type=pi, default=128, help="pad the vocabulary to a multiple of this x tp"
    )
    t.add(
        g,
        "--vocab-size",
        type=pi,
        default=None,
        help="vocabulary size (mock data / null tokenizer; default 1024 with --mock-data)",
    )
    t.add(g, "--untie-embeddings-and-output-weights", switch=True, help="separate output-layer weights")
    t.add(
        g,
        "--position-embedding-type",
        default="learned_absolute",
        choices=("learned_absolute", "rope"),
        help="position embedding",
    )
    t.add(g, "--rotary-base", type=pi, default=10000, help="RoPE base")
    t.add(g, "--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"), help="normalisation layer")
    t.add(g, "--norm-epsilon", type=fl, default=1e-5, help="epsilon of the normalisation layers")
    t.add(g, "--swiglu", switch=True, help="SwiGLU MLP instead of GeLU")
    t.add(
        g, "--disable-bias-linear", switch=True, store_false=True, dest="add_bias_linear", help="no biases in linears"
    )
    t.add(g, "--attention-dropout", type=fl, default=0.1, help="dropout on attention probabilities")
    t.add(g, "--hidden-dropout", type=fl, default=0.1, help="dropout on hidden states")
    t.add(g, "--init-method-std", type=fl, default=0.02, help="std of the normal weight initialisation")

    g = parser.add_argument_group("training")
    t.add(g, "--micro-batch-size", type=pi, default=1, help="samples per microbatch per data-parallel rank")
    t.add(g, "--global-batch-size", type=pi, default=None, help="samples per iteration (default micro x dp)")
    t.add(g, "--train-iters", type=pi, default=None, help="iterations to train (required)")
    t.add(g, "--eval-interval", type=pi, default=1000, help="iterations between validations")
    t.add(g, "--eval-iters", type=int, default=100, help="validation iterations (0 disables validation)")
    t.add(g, "--exit-interval", type=pi, default=None, help="exit after the iteration that is a multiple of this")
    t.add(g, "--seed", type=int, default=1234, help="seed of initialisation, dropout and mock data")
    t.add(
        g,
        "--manual-gc",
        switch=True,
        help="Python's garbage collector only at iteration boundaries (young generations after each iteration), "
        "not whenever it triggers mid-pipeline on one rank",
    )
    t.add(
        g,
        "--manual-gc-interval",
        type=int,
        default=0,
        help="--manual-gc: full collection every N iterations (0: never)",
    )
    t.add(
        g,
        "--no-manual-gc-eval",
        switch=True,
        store_false=True,
        dest="manual_gc_eval",
        help="--manual-gc: no full collection before and after each evaluation",
    )

    g = parser.add_argument_group("optimizer and learning rate")
    t.add(g, "--lr", type=fl, default=None, help="peak learning rate (required)")
    t.add(g, "--min-lr", type=fl, default=0.0, help="learning rate at the end of decay")
    t.add(g, "--lr-decay-style", default="linear", choices=LR_DECAY_STYLES, help="decay after warmup")
    t.add(g, "--lr-warmup-iters", type=int, default=0, help="linear warmup iterations")
    t.add(g, "--lr-decay-iters", type=pi, default=None, help="iterations of decay (default --train-iters)")
    t.add(g, "--weight-decay", type=fl, default=0.01, help="AdamW decoupled weight decay (not on biases/norms)")
    t.add(g, "--clip-grad", type=fl, default=1.0, help="global grad-norm clip (0 disables)")
    t.add(g, "--adam-beta1", type=fl, default=0.9, help="Adam beta1")
    t.add(g, "--adam-beta2", type=fl, default=0.999, help="Adam beta2")
    t.add(g, "--adam-eps", type=fl, default=1e-8, help="Adam epsilon")

    g = parser.add_argument_group("parallelism")
    t.add(g, "--tensor-model-parallel-size", type=pi, default=1, help="tensor-parallel size")
    t.add(g, "--pipeline-model-parallel-size", type=pi, default=1, help="pipeline-parallel size")
    t.add(g, "--sequence-parallel", switch=True, help="sequence parallelism in norms/dropout (needs tp > 1)")
    t.add(g, "--decoder-first-pipeline-num-layers", type=pi, default=None, help="layers on the first stage")
    t.add(g, "--decoder-last-pipeline-num-layers", type=pi, default=None, help="layers on the last stage")
    t.add(g, "--allow-padding-num-layers", switch=True, help="allow stages with fewer layers when they do not split")
    t.add(g, "--distributed-timeout-minutes", type=fl, default=10.0, help="timeout of every collective")
    t.add(
        g, "--distributed-timeout-seconds", type=fl, default=None, help="timeout in seconds (tests); overrides minutes"
    )

    g = parser.add_argument_group("data")
    t.add(g, "--data-path", nargs="*", default=None, help="dataset prefix, or weight prefix weight prefix ... to blend")
    t.add(g, "--split", default="969, 30, 1", help="train/valid/test proportions")
    t.add(g, "--mock-data", switch=True, help="synthetic learnable tokens (seeded Markov chain); no dataset needed")
    t.add(g, "--tokenizer-type", default=None, help="tokenizer (e.g. GPT2BPETokenizer, HuggingFaceTokenizer)")
    t.add(g, "--vocab-file", default=None, help="tokenizer vocabulary file")
    t.add(g, "--merge-file", default=None, help="BPE merges file")
    t.add(g, "--tokenizer-model", default=None, help="tokenizer model file or name")
    t.add(g, "--num-workers", type=int, default=0, help="data-loader worker processes")

    g = parser.add_argument_group("checkpointing")
    t.add(g, "--save", default=None, help="directory to save checkpoints to")
    t.add(g, "--load", default=None, help="directory to load a checkpoint from")
    t.add(g, "--save-interval", type=pi, default=None, help="iterations between checkpoints")
    t.add(g, "--no-load-optim", switch=True, help="do not restore optimizer, loss scaler and LR schedule")
    t.add(g, "--no-load-rng", switch=True, help="do not restore the RNG states")
    t.add(g, "--finetune", switch=True, help="load model weights only and start at iteration 0")
    t.add(g, "--exit-signal-handler", switch=True, help="on SIGTERM save at the end of the iteration and exit")

    g = parser.add_argument_group("mixed precision")
    t.add(g, "--bf16", switch=True, help="bfloat16 model with fp32 main parameters and gradients")
    t.add(g, "--fp16", switch=True, help="float16 model with fp32 main parameters/gradients and loss scaling")
    t.add(g, "--loss-scale", type=fl, default=None, help="fixed fp16 loss scale (default: dynamic)")
    t.add(g, "--initial-loss-scale", type=fl, default=2.0**32, help="first dynamic loss scale")
    t.add(g, "--min-loss-scale", type=fl, default=1.0, help="smallest dynamic loss scale")
    t.add(g, "--loss-scale-window", type=pi, default=1000, help="clean iterations before the scale doubles")
    t.add(g, "--hysteresis", type=pi, default=2, help="overflowing iterations before the scale halves")
    t.add(
        g,
        "--check-for-nan-in-loss-and-grad",
        switch=True,
        help="stop the run on a NaN/inf loss or (bf16/fp32) gradient instead of skipping the step",
    )
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        default=argparse.SUPPRESS,
        help="skip (count) NaN/inf iterations instead of stopping (the default)",
    )
    t.add(g, "--use-distributed-optimizer", switch=True, help="shard main params and Adam states over dp (ZeRO-1)")

    g = parser.add_argument_group("logging")
    t.add(g, "--log-interval", type=pi, default=100, help="iterations between log lines")
    t.add(g, "--tensorboard-dir", default=None, help="write TensorBoard scalars here (if tensorboard is installed)")
    t.add(g, "--wandb-project", default=None, help="log to this Weights & Biases project (if wandb is installed)")
    t.add(g, "--wandb-exp-name", default=None, help="Weights & Biases run name")

    g = parser.add_argument_group("pipeline schedule (megatron.pipeline.schedule_flags: flags and fork-flag mapping)")
    for flag, spec in schedule_flag_specs():
        t.add(g, flag, **spec)

    g = parser.add_argument_group("ignored Megatron-LM flags (accepted with a warning)")
    for flag, (takes_value, _why) in KNOWN_IGNORED_FLAGS.items():
        g.add_argument(
            flag,
            action=_IgnoredFlag,
            nargs=None if takes_value else 0,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    return parser, t


@dataclass(frozen=True)
class ModelArgs:
    """Model settings resolved from flags, before mapping onto the model package's config class."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int  # 0 until the tokenizer is known (real data without --vocab-size)
    padded_vocab_size: int
    make_vocab_size_divisible_by: int
    untie_embeddings_and_output_weights: bool
    position_embedding_type: str
    rotary_base: int
    normalization: str
    norm_epsilon: float
    swiglu: bool
    add_bias_linear: bool
    attention_dropout: float
    hidden_dropout: float
    init_method_std: float


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs, one frozen config per component."""

    model: ModelArgs
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

    def ignored_flag_warnings(self) -> list[str]:
        return [f"warning: {f} is ignored here ({KNOWN_IGNORED_FLAGS[f][1]})" for f in self.ignored_flags]


def _coerce_model_value(table: _FlagTable, dest: str, value: Any, source: str) -> Any:
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
        for dest, value in load_model_config(model_config).items():
            values[dest] = _coerce_model_value(table, dest, value, f"--model-config {model_config}")
    values.update(explicit)
    return values, ignored


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default MLP width with SwiGLU: 2/3 of 4h, rounded down to a multiple of 64 (at least 64)."""
    return max(64, int((4 * hidden_size * 2 / 3) / 64) * 64)


def _build_model_args(v: dict[str, Any], tp: int) -> ModelArgs:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        require(
            v[flag] is not None,
            f"--{flag.replace('_', '-')} is required (or pick a size with --model-config, e.g. gpt-tiny)",
        )
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    groups = v["num_query_groups"] if v["group_query_attention"] else heads
    require(
        heads % tp == 0,
        f"--num-attention-heads={heads} is not divisible by --tensor-model-parallel-size={tp}; "
        "use a head count that is a multiple of tp or a smaller tp",
    )
    require(
        heads % groups == 0,
        f"--num-attention-heads={heads} is not divisible by --num-query-groups={groups}; pick a divisor of the heads",
    )
    require(
        groups % tp == 0,
        f"--num-query-groups={groups} is not divisible by --tensor-model-parallel-size={tp}; "
        "use a multiple of tp query groups or a smaller tp",
    )
    kv = v["kv_channels"]
    if kv is None:
        require(
            hidden % heads == 0,
            f"--hidden-size={hidden} is not divisible by --num-attention-heads={heads}; "
            "pick a multiple of the heads or set --kv-channels",
        )
        kv = hidden // heads
    ffn = v["ffn_hidden_size"]
    if ffn is None:
        ffn = swiglu_ffn_size(hidden) if v["swiglu"] else 4 * hidden
    require(
        ffn % tp == 0,
        f"--ffn-hidden-size={ffn} is not divisible by --tensor-model-parallel-size={tp}; pick a multiple of tp",
    )
    seq = v["seq_length"]
    max_pos = v["max_position_embeddings"] if v["max_position_embeddings"] is not None else seq
    require(
        seq <= max_pos,
        f"--seq-length={seq} is larger than --max-position-embeddings={max_pos}; "
        f"raise --max-position-embeddings to at least {seq} or shorten --seq-length",
    )
    for flag in ("attention_dropout", "hidden_dropout"):
        require(0.0 <= v[flag] < 1.0, f"--{flag.replace('_', '-')}={v[flag]} must be in [0, 1)")
    require(v["init_method_std"] > 0, f"--init-method-std={v['init_method_std']} must be > 0")
    vocab = v["vocab_size"]
    if vocab is None:
        require(
            v["mock_data"] or v["tokenizer_type"] is not None,
            "--vocab-size is required without a tokenizer; pass --vocab-size N or --tokenizer-type",
        )
        vocab = 1024 if v["mock_data"] else 0  # 0: filled in from the tokenizer by the data pipeline
    multiple = v["make_vocab_size_divisible_by"] * tp
    padded = -(-vocab // multiple) * multiple if vocab else 0
    return ModelArgs(
        num_layers=v["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        kv_channels=kv,
        seq_length=seq,
        max_position_embeddings=max_pos,
        vocab_size=vocab,
        padded_vocab_size=padded,
        make_vocab_size_divisible_by=v["make_vocab_size_divisible_by"],
        untie_embeddings_and_output_weights=v["untie_embeddings_and_output_weights"],
        position_embedding_type=v["position_embedding_type"],
        rotary_base=v["rotary_base"],
        normalization=v["normalization"],
        norm_epsilon=v["norm_epsilon"],
        swiglu=v["swiglu"],
        add_bias_linear=v["add_bias_linear"],
        attention_dropout=v["attention_dropout"],
        hidden_dropout=v["hidden_dropout"],
        init_method_std=v["init_method_std"],
    )


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def parse_run_config(argv: Sequence[str], *, world_size: int = 1) -> RunConfig:
    """Parse and validate the flags of one run on ``world_size`` ranks; raises ``ConfigError`` on bad input."""
    v, ignored = parse_flags(argv)
    require(v["train_iters"] is not None, "--train-iters is required (how many iterations to train)")
    require(v["lr"] is not None, "--lr is required (the peak learning rate)")
    require(v["mock_data"] or bool(v["data_path"]), NO_DATA_MESSAGE)
    tp, pp = v["tensor_model_parallel_size"], v["pipeline_model_parallel_size"]
    timeout_s = v["distributed_timeout_seconds"]
    if timeout_s is None:
        timeout_s = v["distributed_timeout_minutes"] * 60.0
    parallel = ParallelConfig(
        tp_size=tp,
        pp_size=pp,
        sequence_parallel=v["sequence_parallel"] and tp > 1,  # Megatron turns it off when tp == 1
        decoder_first_pipeline_num_layers=v["decoder_first_pipeline_num_layers"],
        decoder_last_pipeline_num_layers=v["decoder_last_pipeline_num_layers"],
        allow_padding_num_layers=v["allow_padding_num_layers"],
        distributed_timeout_s=timeout_s,
    )
    dp = parallel.data_parallel_size(world_size)
    model = _build_model_args(v, tp)
    require(
        not parallel.sequence_parallel or model.seq_length % tp == 0,
        f"--seq-length={model.seq_length} is not divisible by --tensor-model-parallel-size={tp}, which "
        "--sequence-parallel needs; pick a multiple of tp or drop --sequence-parallel",
    )
    parallel.layers_per_stage(model.num_layers)
    training = TrainingConfig(
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
    num_microbatches = training.num_microbatches(dp)
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
    pipeline = ScheduleConfig.from_flags(v)
    if pp > 1:  # generate the plan once now: a shape it cannot serve exits 2 before any rank communicates
        pipeline.check_shape(
            pp=pp,
            num_microbatches=num_microbatches,
            num_layers=model.num_layers,
            first_stage_layers=parallel.decoder_first_pipeline_num_layers,
            last_stage_layers=parallel.decoder_last_pipeline_num_layers,
            allow_padding=parallel.allow_padding_num_layers,
        )
    return RunConfig(
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
    )
