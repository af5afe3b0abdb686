"""``GPTConfig``: the architecture of the GPT decoder, validated where it is defined.

Field names are Megatron's flag names (``--num-query-groups`` -> ``num_query_groups``), so a parsed flag set maps
onto it one to one (``GPTConfig.from_object(model_args)``).  Optional sizes are resolved as Megatron does:
``num_query_groups`` = heads (plain multi-head attention), ``kv_channels`` = hidden / heads, ``ffn_hidden_size`` =
4 x hidden (for SwiGLU 2/3 of that, rounded down to a multiple of 64), ``max_position_embeddings`` = seq length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.config.errors import ConfigError, require

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"--{_flag(name)}={value} must be a positive integer")
        h, heads = self.hidden_size, self.num_attention_heads
        if self.kv_channels is None:
            require(h % heads == 0, f"--hidden-size={h} must be divisible by --num-attention-heads={heads}")
            object.__setattr__(self, "kv_channels", h // heads)
        groups = heads if self.num_query_groups is None else self.num_query_groups
        object.__setattr__(self, "num_query_groups", groups)
        require(
            groups >= 1 and heads % groups == 0,
            f"--num-attention-heads={heads} must be divisible by --num-query-groups={groups}",
        )
        if self.ffn_hidden_size is None:
            ffn = 4 * h if not self.swiglu else max(64, (int(4 * h * 2 / 3) // 64) * 64)
            object.__setattr__(self, "ffn_hidden_size", ffn)
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
        require(
            self.seq_length <= self.max_position_embeddings,
            f"--seq-length={self.seq_length} exceeds --max-position-embeddings={self.max_position_embeddings}; "
            "raise --max-position-embeddings or shorten --seq-length",
        )
        require(
            self.position_embedding_type != "rope" or self.kv_channels % 2 == 0,
            f"rotary embeddings need an even head size, got kv_channels={self.kv_channels}",
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

    # -- derived sizes -------------------------------------------------------------------------------------------
    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def qkv_projection_size(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """The embedding rows: ``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ``ConfigError`` unless the model splits over ``tp_size`` tensor-parallel ranks."""
        heads, groups = self.num_attention_heads, self.num_query_groups
        require(
            heads % tp_size == 0,
            f"--num-attention-heads={heads} must be divisible by --tensor-model-parallel-size={tp_size}",
        )
        require(
            groups % tp_size == 0,
            f"--num-query-groups={groups} must be divisible by --tensor-model-parallel-size={tp_size}",
        )
        require(
            self.ffn_hidden_size % tp_size == 0,
            f"--ffn-hidden-size={self.ffn_hidden_size} must be divisible by --tensor-model-parallel-size={tp_size}",
        )

    def check_sequence_parallel(self, tp_size: int, micro_seq_length: int | None = None) -> None:
        s = self.seq_length if micro_seq_length is None else micro_seq_length
        require(
            s % tp_size == 0,
            f"--seq-length={s} must be divisible by --tensor-model-parallel-size={tp_size} for --sequence-parallel",
        )

    @classmethod
    def from_object(cls, obj: Any) -> GPTConfig:
        """Build from any object (or mapping) holding the same field names, e.g. the parsed ``ModelArgs``."""
        get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
        values = {}
        for f in dataclasses.fields(cls):
            if isinstance(obj, dict) and f.name not in obj:
                continue
            if not isinstance(obj, dict) and not hasattr(obj, f.name):
                continue
            values[f.name] = get(f.name)
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"incomplete model config: {exc}") from None


def _flag(name: str) -> str:
    return name.replace("_", "-")
