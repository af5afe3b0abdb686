"""The tiny GPT configurations the model tests share (CPU-sized, dropout off, GQA on)."""

from megatron.model import GPTConfig

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    seq_length=16,
    make_vocab_size_divisible_by=8,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def tiny_config(**overrides) -> GPTConfig:
    """``TINY`` with ``overrides`` applied."""
    return GPTConfig(**{**TINY, **overrides})


# The pipeline runtime tests' GPT: one layer per virtual stage, as small as a stage can be.
PIPELINE = dict(
    hidden_size=16,
    num_attention_heads=2,
    vocab_size=61,
    seq_length=6,
    make_vocab_size_divisible_by=8,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def pipeline_config(num_layers: int, *, tied: bool) -> GPTConfig:
    """``PIPELINE`` with ``num_layers`` layers, embeddings tied to the output layer or not."""
    return GPTConfig(num_layers=num_layers, untie_embeddings_and_output_weights=not tied, **PIPELINE)
