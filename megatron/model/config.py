"""``GPTConfig``: the architecture of the GPT decoder, validated where it is defined.

This is the one model config: the trainer's flags map onto it one to one (field names are Megatron's flag names,
``--num-query-groups`` -> ``num_query_groups``) and the model flags take their defaults from its fields
(``megatron.flag_table``).  Optional sizes are resolved as Megatron does: ``num_query_groups`` = heads (plain
multi-head attention), ``kv_channels`` = hidden / heads, ``ffn_hidden_size`` = 4 x hidden (for SwiGLU
``swiglu_ffn_size``), ``max_position_embeddings`` = seq length.

Variants with Megatron's meaning: ``position_embedding_type`` "none" (no position information; Megatron's
``--no-position-embedding`` without RoPE), ``rotary_percent`` (RoPE on the first fraction of each head's channels),
``qk_layernorm`` (a norm over each query and key head), ``apply_layernorm_1p`` (norm weights stored as ``gamma - 1``),
``squared_relu`` (``relu(x)^2`` MLP activation), ``openai_gelu`` (the tanh approximation of GeLU, GPT-2's
``gelu_new``), ``fp32_residual_connection`` (the residual stream in fp32 under
bf16/fp16 parameters).

``vocab_size`` = 0 means "not known yet": a run with a tokenizer and no ``--vocab-size`` learns it from the tokenizer
before the model is built (``megatron.training_setup.resolve_vocab``); building a model needs it
(``padded_vocab_size`` refuses 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.config.errors import ConfigError, require

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# Megatron's --attention-backend choices; attention here is always scaled_dot_product_attention (not a model field)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def padded_vocab_size(vocab_size: int, *, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """Megatron's embedding rows: ``vocab_size`` rounded up to a multiple of ``divisible_by * tensor_parallel_size``
    (so every tensor-parallel rank holds an equal, aligned slice of the vocabulary)."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default MLP width with SwiGLU: 2/3 of 4h, rounded down to a multiple of 64 (at least 64)."""
    return max(64, int((4 * hidden_size * 2 / 3) / 64) * 64)


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    max_position_embeddings: int | None = None
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    rotary_percent: float = 1.0
    qk_layernorm: bool = False
    apply_layernorm_1p: bool = False
    squared_relu: bool = False
    openai_gelu: bool = False
    fp32_residual_connection: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"--{_flag(name)}={value} must be a positive integer")
        require(
            isinstance(self.vocab_size, int) and self.vocab_size >= 0,
            f"--vocab-size={self.vocab_size} must be a positive integer (0: taken from the tokenizer)",
        )
        h, heads = self.hidden_size, self.num_attention_heads
        groups = heads if self.num_query_groups is None else self.num_query_groups
        object.__setattr__(self, "num_query_groups", groups)
        require(
            groups >= 1 and heads % groups == 0,
            f"--num-attention-heads={heads} is not divisible by --num-query-groups={groups}; "
            "pick a divisor of the heads",
        )
        if self.kv_channels is None:
            require(
                h % heads == 0,
                f"--hidden-size={h} is not divisible by --num-attention-heads={heads}; "
                "pick a multiple of the heads or set --kv-channels",
            )
            object.__setattr__(self, "kv_channels", h // heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", swiglu_ffn_size(h) if self.swiglu else 4 * h)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        require(self.ffn_hidden_size >= 1, f"--ffn-hidden-size={self.ffn_hidden_size} must be >= 1")
        require(self.kv_channels >= 1, f"--kv-channels={self.kv_channels} must be >= 1")
        require(
            self.position_embedding_type in POSITION_EMBEDDING_TYPES,
            f"--position-embedding-type={self.position_embedding_type!r} must be one of {POSITION_EMBEDDING_TYPES}",
        )
        require(
            self.normalization in NORMALIZATIONS,
            f"--normalization={self.normalization!r} must be one of {NORMALIZATIONS}",
        )
        seq, max_pos = self.seq_length, self.max_position_embeddings
        require(
            seq <= max_pos,
            f"--seq-length={seq} is larger than --max-position-embeddings={max_pos}; "
            f"raise --max-position-embeddings to at least {seq} or shorten --seq-length",
        )
        require(
            self.position_embedding_type != "rope" or self.kv_channels % 2 == 0,
            f"rotary embeddings need an even head size, got kv_channels={self.kv_channels}",
        )
        require(
            0.0 < self.rotary_percent <= 1.0,
            f"--rotary-percent={self.rotary_percent} must be in (0, 1]",
        )
        rot = self.rotary_dim
        require(
            self.position_embedding_type != "rope" or (rot >= 2 and rot % 2 == 0),
            f"--rotary-percent={self.rotary_percent} of kv_channels={self.kv_channels} gives {rot} rotary channels; "
            "pick a percent that gives an even number >= 2",
        )
        require(
            not (self.swiglu and self.squared_relu),
            "--swiglu and --squared-relu each choose the MLP activation; pass one of them",
        )
        require(
            not (self.openai_gelu and (self.swiglu or self.squared_relu)),
            "--openai-gelu chooses the GeLU's form, but --swiglu/--squared-relu replace the GeLU; drop one of them",
        )
        for name in ("attention_dropout", "hidden_dropout"):
            p = getattr(self, name)
            require(0.0 <= p < 1.0, f"--{_flag(name)}={p} must be in [0, 1)")
        require(self.init_method_std > 0, f"--init-method-std={self.init_method_std} must be > 0")
        require(self.norm_epsilon > 0, f"--norm-epsilon={self.norm_epsilon} must be > 0")
        require(
            self.make_vocab_size_divisible_by >= 1,
            f"--make-vocab-size-divisible-by={self.make_vocab_size_divisible_by} must be >= 1",
        )

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (the model flags' defaults; ``None`` for a required field)."""
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        return None if f.default is dataclasses.MISSING else f.default

    # -- derived sizes -------------------------------------------------------------------------------------------
    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def gelu_mlp(self) -> bool:
        """The MLP's activation is a GeLU: erf, or tanh with ``--openai-gelu`` (not SwiGLU, not squared ReLU)."""
        return not (self.swiglu or self.squared_relu)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (Megatron: ``int(kv_channels * rotary_percent)``)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def qkv_projection_size(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """The embedding rows: ``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        require(
            self.vocab_size >= 1,
            "the vocabulary size is not known yet; pass --vocab-size N or a tokenizer (--tokenizer-type)",
        )
        return padded_vocab_size(
            self.vocab_size, divisible_by=self.make_vocab_size_divisible_by, tensor_parallel_size=tp_size
        )

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ``ConfigError`` unless the model splits over ``tp_size`` tensor-parallel ranks."""
        heads, groups, ffn = self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size
        require(
            heads % tp_size == 0,
            f"--num-attention-heads={heads} is not divisible by --tensor-model-parallel-size={tp_size}; "
            "use a head count that is a multiple of tp or a smaller tp",
        )
        require(
            groups % tp_size == 0,
            f"--num-query-groups={groups} is not divisible by --tensor-model-parallel-size={tp_size}; "
            "use a multiple of tp query groups or a smaller tp",
        )
        require(
            ffn % tp_size == 0,
            f"--ffn-hidden-size={ffn} is not divisible by --tensor-model-parallel-size={tp_size}; "
            "pick a multiple of tp",
        )

    def check_sequence_parallel(self, tp_size: int, micro_seq_length: int | None = None) -> None:
        s = self.seq_length if micro_seq_length is None else micro_seq_length
        require(
            s % tp_size == 0,
            f"--seq-length={s} is not divisible by --tensor-model-parallel-size={tp_size}, which "
            "--sequence-parallel needs; pick a multiple of tp or drop --sequence-parallel",
        )

    @classmethod
    def from_object(cls, obj: Any) -> GPTConfig:
        """Build from any object (or mapping) holding the same field names, e.g. a checkpoint's ``model_args``;
        names that are not fields (``padded_vocab_size``) are ignored."""
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(obj, dict):
            values = {n: obj[n] for n in names if n in obj}
        else:
            values = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"incomplete model config: {exc}") from None


def model_flags(config: GPTConfig) -> list[str]:
    """The trainer flags that build ``config`` (fields left at their defaults are not named)."""
    base = GPTConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        vocab_size=config.vocab_size,
        seq_length=config.seq_length,
        kv_channels=config.kv_channels if config.hidden_size % config.num_attention_heads else None,
        swiglu=config.swiglu,
    )
    flags: list[str] = []
    required = ["num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"]
    if config.hidden_size % config.num_attention_heads:
        required.append("kv_channels")  # no default then
    for f in dataclasses.fields(GPTConfig):
        value = getattr(config, f.name)
        default = GPTConfig.default(f.name) if isinstance(value, bool) else getattr(base, f.name)
        if value == default and f.name not in required:
            continue
        if f.name == "num_query_groups":
            flags += ["--group-query-attention", f"--num-query-groups={value}"]
        elif f.name == "add_bias_linear":
            flags.append("--disable-bias-linear")
        elif isinstance(value, bool):
            flags.append(f"--{_flag(f.name)}")
        else:
            flags.append(f"--{_flag(f.name)}={value}")
    return flags


def _flag(name: str) -> str:
    return name.replace("_", "-")
