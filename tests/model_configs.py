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


def pipeline_config(num_layers: int, *, tied: bool) -> GPTConfig:
    """The pipeline runtime tests' GPT: ``TINY`` at its smallest per stage (one layer per virtual stage, 2 heads),
    embeddings tied to the output layer or not."""
    return tiny_config(
        num_layers=num_layers,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=61,
        seq_length=6,
        untie_embeddings_and_output_weights=not tied,
    )
