"""The flag table of ``pretrain_gpt.py``: every Megatron-LM flag it accepts, with type, default and help.

``build_parser()`` returns the argparse parser and a ``FlagTable`` holding each flag's default, type and choices.
Flags are registered with ``default=SUPPRESS``, so the parsed namespace holds only what the command line gave and
``megatron.arguments`` can layer defaults < ``--model-config`` < explicit flags.  Model flags take their defaults
from ``GPTConfig`` (the one model config); ``--optimizer`` takes its choices from the optimizer registry.

Flags of Megatron-LM that do not apply here are accepted with a one-line warning each (``KNOWN_IGNORED_FLAGS``),
so existing launch scripts run unchanged; any other unknown flag is an error.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron.config.data import MOCK_DATA_VOCAB_SIZE
from megatron.config.errors import ConfigError
from megatron.config.kernels import KERNEL_BACKENDS, TRANSFORMER_IMPLS
from megatron.config.lr_schedule import LR_DECAY_STYLES
from megatron.config.model_sizes import available_sizes
from megatron.config.recompute import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS
from megatron.model.config import ATTENTION_BACKENDS, NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTConfig
from megatron.optimizer.registry import optimizer_names
from megatron.pipeline.schedule_flags import schedule_flag_specs

# Megatron-LM flags accepted for compatibility but without effect here: flag -> (takes a value?, why it is ignored).
KNOWN_IGNORED_FLAGS: dict[str, tuple[bool, str]] = {
    "--use-mcore-models": (False, "there is one model implementation"),
    "--use-legacy-models": (False, "there is one model implementation"),
    "--use-flash-attn": (False, "attention always goes through scaled_dot_product_attention"),
    "--no-masked-softmax-fusion": (False, "no fused kernels; softmax is inside scaled_dot_product_attention"),
    "--masked-softmax-fusion": (False, "no fused kernels; softmax is inside scaled_dot_product_attention"),
    "--no-bias-dropout-fusion": (False, "no fused bias-dropout kernel"),
    "--no-rope-fusion": (False, "no fused rope kernel"),
    "--no-persist-layer-norm": (False, "no persistent layer-norm kernel"),
    "--attention-softmax-in-fp32": (False, "scaled_dot_product_attention chooses its own softmax precision"),
    "--apply-query-key-layer-scaling": (False, "attention is scaled by 1/sqrt(head dim) only"),
    "--no-create-attention-mask-in-dataloader": (
        False,
        "--reset-attention-mask's mask is built from document ids on the device either way",
    ),
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
    # launch-script flags that cannot change results here (timers, overlap knobs, logging extras, loader threads)
    "--DDP-impl": (True, "there is one data-parallel implementation (megatron.parallel.data_parallel)"),
    "--no-barrier-with-level-1-timing": (False, "no per-region timers"),
    "--barrier-with-L1-time": (False, "no per-region timers"),
    "--timing-log-option": (True, "no per-region timers"),
    "--no-overlap-p2p-communication": (False, "P2P runs in the plan's order; overlap never changes values"),
    "--overlap-p2p-communication": (False, "P2P runs in the plan's order; overlap never changes values"),
    "--log-validation-ppl-to-tensorboard": (False, "the validation perplexity is always logged"),
    "--log-world-size-to-tensorboard": (False, "the world size is in the start-up summary"),
    "--log-batch-size-to-tensorboard": (False, "the global batch size is in every log line"),
    "--log-loss-scale-to-tensorboard": (False, "the loss scale is in every log line"),
    "--no-log-loss-scale-to-tensorboard": (False, "the loss scale is in every log line"),
    "--empty-unused-memory-level": (True, "the caching allocator is not emptied between iterations"),
    "--num-dataset-builder-threads": (True, "dataset indices are built by one process and cached"),
    "--no-mmap-bin-files": (False, "indexed datasets are always memory-mapped (same tokens)"),
    "--test-data-path": (True, "no test-split evaluation runs here (the test split is never read)"),
}


class IgnoredFlagAction(argparse.Action):
    """Records that an ignored flag was given (in ``namespace._ignored_flags``), so the caller can warn once."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None):
        seen = list(getattr(namespace, "_ignored_flags", []))
        if option not in seen:
            seen.append(option)
        namespace._ignored_flags = seen


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` (one line) instead of printing usage and calling ``sys.exit``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see `pretrain_gpt.py --help`")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


positive_int.__name__ = "positive int"  # argparse names the type in its message: "invalid positive int value"


@dataclass
class FlagTable:
    """Flags registered with ``default=SUPPRESS`` so only explicit ones reach the namespace; defaults kept here."""

    parser: OneLineParser
    defaults: dict[str, Any] = field(default_factory=dict)
    types: dict[str, Callable[[str], Any] | None] = field(default_factory=dict)
    choices: dict[str, Sequence[Any] | None] = field(default_factory=dict)
    model_keys: frozenset[str] = frozenset()  # the model flags' destinations: what a --model-config may set

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
        nargs: str | int | None = None,
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

    def add_default_spelling(self, group: argparse._ArgumentGroup, flag: str, *, dest: str, help: str) -> None:
        """Another switch for the registered switch ``dest`` that sets it to its default (Megatron's spelling)."""
        action = "store_true" if self.defaults[dest] else "store_false"
        group.add_argument(flag, dest=dest, action=action, default=argparse.SUPPRESS, help=help)

    def add_model_flag(self, group: argparse._ArgumentGroup, flag: str, **kwargs: Any) -> None:
        """A flag of a ``GPTConfig`` field: its default is the field's (a switch's is checked against it)."""
        dest = kwargs.get("dest") or flag.lstrip("-").replace("-", "_")
        default = GPTConfig.default(dest)
        if kwargs.get("switch"):
            if default != kwargs.get("store_false", False):
                raise AssertionError(f"{flag}: the switch's default must be GPTConfig.{dest}={default!r}")
            self.add(group, flag, **kwargs)
        else:
            self.add(group, flag, default=default, **kwargs)


def build_parser() -> tuple[OneLineParser, FlagTable]:
    """The argparse parser for ``pretrain_gpt.py`` and the table of defaults and types behind it."""
    parser = OneLineParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model (Megatron-LM flags) with tensor, data and zero-bubble pipeline parallelism.",
        allow_abbrev=False,
    )
    table = FlagTable(parser)
    _model_flags(table)
    _document_flags(table)
    _training_flags(table)
    _optimizer_flags(table)
    _parallel_flags(table)
    _data_flags(table)
    _checkpoint_flags(table)
    _precision_flags(table)
    _kernel_flags(table)
    _recompute_flags(table)
    _logging_flags(table)
    _compat_training_flags(table)
    _compat_io_flags(table)
    g = parser.add_argument_group("pipeline schedule (megatron.pipeline.schedule_flags: flags and fork-flag mapping)")
    for flag, spec in schedule_flag_specs():
        table.add(g, flag, **spec)
    g = parser.add_argument_group("ignored Megatron-LM flags (accepted with a warning)")
    for flag, (takes_value, _why) in KNOWN_IGNORED_FLAGS.items():
        g.add_argument(
            flag,
            action=IgnoredFlagAction,
            nargs=None if takes_value else 0,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    return parser, table


def _model_flags(t: FlagTable) -> None:
    pi, fl = positive_int, float
    g = t.parser.add_argument_group("model")
    g.add_argument(
        "--model-config",
        default=None,
        help=f"named size ({', '.join(available_sizes())}) or a YAML file of model flags; explicit flags override it",
    )
    before = set(t.defaults)
    m = t.add_model_flag
    m(g, "--num-layers", type=pi, help="transformer layers")
    m(g, "--hidden-size", type=pi, help="transformer hidden size")
    m(g, "--num-attention-heads", type=pi, help="attention heads")
    t.add(g, "--group-query-attention", switch=True, help="use grouped-query attention (see --num-query-groups)")
    # Megatron's flag default (1: multi-query) applies with --group-query-attention; without it groups = heads.
    t.add(g, "--num-query-groups", type=pi, default=1, help="key/value groups with --group-query-attention")
    m(g, "--ffn-hidden-size", type=pi, help="MLP hidden size (default 4*hidden, or ~8/3*hidden with --swiglu)")
    m(g, "--kv-channels", type=pi, help="per-head dimension (default hidden/heads)")
    m(g, "--seq-length", type=pi, help="tokens per sample")
    m(g, "--max-position-embeddings", type=pi, help="position table size (default --seq-length)")
    m(g, "--make-vocab-size-divisible-by", type=pi, help="pad the vocabulary to a multiple of this x tp")
    # Required unless --mock-data or a tokenizer gives it: the flag has no model default.
    t.add(
        g,
        "--vocab-size",
        type=pi,
        default=None,
        help=f"vocabulary size (mock data, default {MOCK_DATA_VOCAB_SIZE}; NullTokenizer: N ids + EOD id N)",
    )
    m(g, "--untie-embeddings-and-output-weights", switch=True, help="separate output-layer weights")
    m(g, "--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, help="position embedding")
    m(g, "--rotary-base", type=pi, help="RoPE base")
    m(g, "--normalization", choices=NORMALIZATIONS, help="normalisation layer")
    m(g, "--norm-epsilon", type=fl, help="epsilon of the normalisation layers")
    m(g, "--swiglu", switch=True, help="SwiGLU MLP instead of GeLU")
    m(g, "--disable-bias-linear", switch=True, store_false=True, dest="add_bias_linear", help="no biases in linears")
    m(g, "--attention-dropout", type=fl, help="dropout on attention probabilities")
    m(g, "--hidden-dropout", type=fl, help="dropout on hidden states")
    m(g, "--init-method-std", type=fl, help="std of the normal weight initialisation")
    _model_variant_flags(t, g)
    t.model_keys = frozenset(set(t.defaults) - before)
    t.add(
        g,
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="Megatron's attention implementation choice; attention here is always torch's "
        "scaled_dot_product_attention (which picks its own kernel), so results do not depend on it",
    )


def _model_variant_flags(t: FlagTable, g: argparse._ArgumentGroup) -> None:
    """Position-embedding, norm, activation and residual-precision variants (GPTConfig fields, or aliases)."""
    m = t.add_model_flag
    t.add(
        g,
        "--use-rotary-position-embeddings",
        switch=True,
        help="= --position-embedding-type rope (Megatron's legacy flag)",
    )
    t.add(
        g,
        "--no-position-embedding",
        switch=True,
        store_false=True,
        dest="add_position_embedding",
        help="no learned position embedding (= --position-embedding-type none unless rope)",
    )
    m(g, "--rotary-percent", type=float, help="share of each head's channels that RoPE rotates")
    m(g, "--qk-layernorm", switch=True, help="normalise each query and key head (--normalization) before RoPE")
    m(
        g,
        "--apply-layernorm-1p",
        switch=True,
        help="norm weights stored as gamma - 1 (zero-centred): y = norm(x) * (1 + w)",
    )
    m(g, "--squared-relu", switch=True, help="relu(x)^2 MLP activation instead of GeLU")
    m(
        g,
        "--openai-gelu",
        switch=True,
        help="GeLU's tanh approximation (OpenAI's GPT-2 'gelu_new') instead of the exact erf GeLU",
    )
    m(
        g,
        "--fp32-residual-connection",
        switch=True,
        help="keep the residual stream (and pipeline boundary tensors) in fp32 under --bf16/--fp16",
    )


def _document_flags(t: FlagTable) -> None:
    g = t.parser.add_argument_group("data: end-of-document variants (megatron.data.document_masks; need a tokenizer)")
    t.add(g, "--eod-mask-loss", switch=True, help="no loss where the input token is the end-of-document token")
    t.add(g, "--reset-position-ids", switch=True, help="position ids restart at 0 after each end-of-document token")
    t.add(
        g,
        "--reset-attention-mask",
        switch=True,
        help="no attention across an end-of-document token within a sample (block-diagonal causal mask)",
    )


def _training_flags(t: FlagTable) -> None:
    pi = positive_int
    g = t.parser.add_argument_group("training")
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


def _optimizer_flags(t: FlagTable) -> None:
    pi, fl = positive_int, float
    g = t.parser.add_argument_group("optimizer and learning rate")
    t.add(
        g,
        "--optimizer",
        default="adam",
        choices=optimizer_names(),
        help="update rule (adam: AdamW with --adam-*; sgd: SGD with --sgd-momentum)",
    )
    t.add(g, "--lr", type=fl, default=None, help="peak learning rate (required)")
    t.add(g, "--min-lr", type=fl, default=0.0, help="learning rate at the end of decay")
    t.add(g, "--lr-decay-style", default="linear", choices=LR_DECAY_STYLES, help="decay after warmup")
    t.add(g, "--lr-warmup-iters", type=int, default=0, help="linear warmup iterations")
    t.add(g, "--lr-decay-iters", type=pi, default=None, help="iterations of decay (default --train-iters)")
    t.add(
        g,
        "--weight-decay",
        type=fl,
        default=0.01,
        help="weight decay, not on biases/norms (adam: decoupled, as AdamW; sgd: L2 added to the gradient)",
    )
    t.add(g, "--clip-grad", type=fl, default=1.0, help="global grad-norm clip (0 disables)")
    t.add(g, "--adam-beta1", type=fl, default=0.9, help="Adam beta1")
    t.add(g, "--adam-beta2", type=fl, default=0.999, help="Adam beta2")
    t.add(g, "--adam-eps", type=fl, default=1e-8, help="Adam epsilon")
    t.add(g, "--sgd-momentum", type=fl, default=0.9, help="SGD momentum (--optimizer sgd)")


def _parallel_flags(t: FlagTable) -> None:
    pi, fl = positive_int, float
    g = t.parser.add_argument_group("parallelism")
    t.add(g, "--tensor-model-parallel-size", type=pi, default=1, help="tensor-parallel size")
    t.add(g, "--pipeline-model-parallel-size", type=pi, default=1, help="pipeline-parallel size")
    t.add(g, "--sequence-parallel", switch=True, help="sequence parallelism in norms/dropout (needs tp > 1)")
    t.add(g, "--decoder-first-pipeline-num-layers", type=pi, default=None, help="layers on the first stage")
    t.add(g, "--decoder-last-pipeline-num-layers", type=pi, default=None, help="layers on the last stage")
    t.add(
        g,
        "--pipeline-layer-split",
        default="even",
        choices=("even", "auto"),
        help="layers per stage: Megatron's even split, or auto (the stage planner balances the embedding and the "
        "output head; --decoder-first/last-pipeline-num-layers win when given)",
    )
    t.add(
        g,
        "--pipeline-memory-limit-gb",
        type=fl,
        default=None,
        help="with --pipeline-layer-split auto: each rank's activation memory (GiB; the analytic model at start-up, "
        "the measured memory at a profiling window's end) the planned split and --recompute-granularity auto's "
        "choice must fit",
    )
    t.add(g, "--allow-padding-num-layers", switch=True, help="allow stages with fewer layers when they do not split")
    t.add(g, "--distributed-timeout-minutes", type=fl, default=10.0, help="timeout of every collective")
    t.add(
        g, "--distributed-timeout-seconds", type=fl, default=None, help="timeout in seconds (tests); overrides minutes"
    )


def _data_flags(t: FlagTable) -> None:
    g = t.parser.add_argument_group("data")
    t.add(g, "--data-path", nargs="*", default=None, help="dataset prefix, or weight prefix weight prefix ... to blend")
    t.add(g, "--split", default="969, 30, 1", help="train/valid/test proportions")
    t.add(g, "--mock-data", switch=True, help="synthetic learnable tokens (seeded Markov chain); no dataset needed")
    t.add(
        g,
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        help="tokenizer (GPT2BPETokenizer needs --vocab-file and --merge-file; not built with --mock-data or "
        "--vocab-size)",
    )
    t.add(g, "--vocab-file", default=None, help="tokenizer vocabulary file")
    t.add(g, "--merge-file", default=None, help="BPE merges file")
    t.add(g, "--tokenizer-model", default=None, help="tokenizer model file or name")
    t.add(
        g,
        "--num-workers",
        type=int,
        default=0,
        help="worker processes of the training DataLoader (Megatron's default is 2; 0 here: no extra processes)",
    )


def _checkpoint_flags(t: FlagTable) -> None:
    g = t.parser.add_argument_group("checkpointing")
    t.add(g, "--save", default=None, help="directory to save checkpoints to")
    t.add(g, "--load", default=None, help="directory to load a checkpoint from")
    t.add(g, "--save-interval", type=positive_int, default=None, help="iterations between checkpoints")
    t.add(g, "--no-load-optim", switch=True, help="do not restore optimizer, loss scaler and LR schedule")
    t.add(g, "--no-load-rng", switch=True, help="do not restore the RNG states")
    t.add(g, "--finetune", switch=True, help="load model weights only and start at iteration 0")
    t.add(g, "--exit-signal-handler", switch=True, help="on SIGTERM save at the end of the iteration and exit")


def _precision_flags(t: FlagTable) -> None:
    pi, fl = positive_int, float
    g = t.parser.add_argument_group("mixed precision")
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
    t.add_default_spelling(
        g,
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        help="skip (count) NaN/inf iterations instead of stopping (the default)",
    )
    t.add(
        g,
        "--use-distributed-optimizer",
        switch=True,
        help="shard main params and optimizer states over dp (ZeRO-1)",
    )


def _kernel_flags(t: FlagTable) -> None:
    g = t.parser.add_argument_group("fused kernels (megatron.kernels; --kernels triton needs the [kernels] extra)")
    t.add(
        g,
        "--kernels",
        default="auto",
        choices=KERNEL_BACKENDS,
        help="fused ops: auto = Triton on CUDA, torch elsewhere; triton without CUDA runs Triton's interpreter (tests)",
    )
    t.add(
        g,
        "--no-gradient-accumulation-fusion",
        switch=True,
        store_false=True,
        dest="gradient_accumulation_fusion",
        help="Triton: W with torch's GEMM (a half-precision temporary) instead of the fp32-accumulating W kernel",
    )
    t.add(
        g,
        "--no-bias-gelu-fusion",
        switch=True,
        store_false=True,
        dest="bias_gelu_fusion",
        help="Triton: bias add and GeLU with torch instead of the fused kernel",
    )
    t.add_default_spelling(g, "--bias-gelu-fusion", dest="bias_gelu_fusion", help="the default")
    t.add(
        g,
        "--no-bias-swiglu-fusion",
        switch=True,
        store_false=True,
        dest="bias_swiglu_fusion",
        help="Triton: bias add and SwiGLU with torch instead of the fused kernel",
    )
    t.add(
        g,
        "--cross-entropy-loss-fusion",
        switch=True,
        help="Triton: the vocabulary-chunked cross-entropy kernel (never an fp32 [tokens, vocab] softmax)",
    )
    t.add(
        g,
        "--transformer-impl",
        default="local",
        choices=TRANSFORMER_IMPLS,
        help="transformer_engine: decoder layers from Transformer Engine >= 2.3 (CUDA, tp 1), W runs its backward_dw",
    )


def _recompute_flags(t: FlagTable) -> None:
    g = t.parser.add_argument_group("activation recomputation (megatron.config.recompute; docs/recompute.md)")
    t.add(g, "--recompute-activations", switch=True, help="recompute the core attention at B (= granularity selective)")
    t.add(
        g,
        "--recompute-granularity",
        default=None,
        choices=RECOMPUTE_GRANULARITIES,
        help="full: whole layers (see --recompute-method, --recompute-num-layers); selective: the core attention; "
        "auto: the stage planner's choice per stage (with --pipeline-layer-split auto)",
    )
    t.add(
        g,
        "--recompute-method",
        default=None,
        choices=RECOMPUTE_METHODS,
        help="full: uniform = every run of N layers of a stage; block = the first N layers of each stage",
    )
    t.add(g, "--recompute-num-layers", type=positive_int, default=None, help="N of --recompute-method")
    t.add(
        g,
        "--distribute-saved-activations",
        switch=True,
        help="full recompute with tp > 1: each tensor-parallel rank keeps 1/tp of a recomputed run's input",
    )


def _logging_flags(t: FlagTable) -> None:
    g = t.parser.add_argument_group("logging")
    t.add(g, "--log-interval", type=positive_int, default=100, help="iterations between log lines")
    t.add(g, "--tensorboard-dir", default=None, help="write TensorBoard scalars here (if tensorboard is installed)")
    t.add(g, "--wandb-project", default=None, help="log to this Weights & Biases project (if wandb is installed)")
    t.add(g, "--wandb-exp-name", default=None, help="Weights & Biases run name")


def _compat_training_flags(t: FlagTable) -> None:
    """Megatron's sample-based training, LR warmup variants, batch-size ramp-up, time-based exit, profiling."""
    pi, fl = positive_int, float
    g = t.parser.add_argument_group("sample-based training, ramp-up, time-based exit (Megatron's meanings)")
    t.add(g, "--train-samples", type=pi, default=None, help="samples to train (instead of --train-iters)")
    t.add(g, "--lr-decay-samples", type=pi, default=None, help="samples of LR decay (default --train-samples)")
    t.add(g, "--lr-warmup-samples", type=int, default=0, help="samples of linear LR warmup (with --train-samples)")
    t.add(g, "--lr-warmup-fraction", type=fl, default=None, help="warm up over this fraction of the decay span")
    t.add(g, "--lr-warmup-init", type=fl, default=0.0, help="learning rate the warmup starts from")
    t.add(
        g,
        "--rampup-batch-size",
        type=int,
        nargs=3,
        default=None,
        help="START INCR SAMPLES: global batch size from START up by INCR over SAMPLES samples",
    )
    t.add(g, "--exit-duration-in-mins", type=fl, default=None, help="save (with --save) and exit after this long")
    g = t.parser.add_argument_group("profiling (Megatron's --profile window)")
    t.add(g, "--profile", switch=True, help="profile iterations [--profile-step-start, --profile-step-end)")
    t.add(g, "--use-pytorch-profiler", switch=True, help="--profile with torch.profiler (else a CUDA profiler range)")
    t.add(g, "--profile-step-start", type=int, default=10, help="first profiled iteration (0-based)")
    t.add(g, "--profile-step-end", type=int, default=12, help="profiling stops before this iteration")
    t.add(g, "--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that profile")


def _compat_io_flags(t: FlagTable) -> None:
    """Megatron's per-split data paths, data loader, checkpoint contents and logging extras."""
    g = t.parser.add_argument_group("data paths per split, data loader (Megatron's meanings)")
    t.add(g, "--train-data-path", nargs="*", default=None, help="training blend, used whole (instead of --data-path)")
    t.add(g, "--valid-data-path", nargs="*", default=None, help="validation blend, used whole")
    t.add(g, "--data-cache-path", default=None, help="directory of the dataset index caches (default: next to data)")
    t.add(g, "--dataloader-type", default="single", choices=("single", "cyclic"), help="sample order")
    g = t.parser.add_argument_group("checkpoint contents")
    t.add(g, "--no-save-optim", switch=True, help="checkpoints without optimizer state")
    t.add(g, "--no-save-rng", switch=True, help="checkpoints without RNG states")
    t.add(g, "--use-checkpoint-args", switch=True, help="take the model flags from the --load checkpoint")
    g = t.parser.add_argument_group("logging extras")
    t.add(g, "--tensorboard-log-interval", type=positive_int, default=1, help="iterations between scalar writes")
    t.add(g, "--log-num-zeros-in-grad", switch=True, help="count zero gradient entries (log line: num zeros)")
    t.add(g, "--log-memory-to-tensorboard", switch=True, help="memory use in the log line and scalars")
