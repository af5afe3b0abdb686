"""Text generation from a checkpoint: the model merged to one process (any tp x pp), sampling, a KV cache.

    model, tokenizer = load_for_generation("ckpt", device="cpu")
    ids = generate(model, tokenizer.tokenize("Hello"), SamplingConfig(max_new_tokens=20, temperature=0))

Decoding feeds the prompt once, then one token at a time against the cached keys and values
(``megatron.model.kv_cache``); ``use_cache=False`` recomputes the whole sequence each step instead (the reference
the tests hold the cache to).

Sampling: the logits of the ids that may be drawn (the real vocabulary, never the padding rows, nor ids the
tokenizer cannot decode when the model's vocabulary is larger) are divided by the temperature, then cut to the
top-k, then to the top-p (the smallest set of most likely tokens whose probability reaches p), and one id is drawn
from a generator seeded by ``seed``; temperature 0 is greedy (argmax).  Generation stops after ``max_new_tokens``
or at the tokenizer's end-of-document id (``eod``), which is kept in the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.checkpoint_repartition import open_checkpoint, read_full_state
from megatron.config.errors import ConfigError, require
from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTStage, build_gpt_model
from megatron.model.kv_cache import KVCache
from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.recorded import recorded_tokenizer


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 1234

    def __post_init__(self) -> None:
        require(self.max_new_tokens >= 0, f"--max-new-tokens={self.max_new_tokens} must be >= 0")
        require(self.temperature >= 0, f"--temperature={self.temperature} must be >= 0 (0: greedy)")
        require(self.top_k >= 0, f"--top-k={self.top_k} must be >= 0 (0: off)")
        require(0 < self.top_p <= 1, f"--top-p={self.top_p} must be in (0, 1] (1: off)")


def load_for_generation(
    load: str | Path, *, iteration: int | None = None, device: str | torch.device = "cpu"
) -> tuple[GPTStage, MegatronTokenizer]:
    """The checkpoint's model as one module in eval mode (shards merged) and the tokenizer it records."""
    directory, manifest, common = open_checkpoint(load, iteration)
    tokenizer = recorded_tokenizer(directory, common, manifest)  # first: a missing tokenizer is a one-line error
    config = GPTConfig.from_object(common["model_args"])
    full, _, _, _ = read_full_state(directory, manifest, common, optimizer=False)
    return model_from_state(config, full, device=device), tokenizer


def model_from_state(
    config: GPTConfig, full: dict[str, torch.Tensor], *, device: str | torch.device = "cpu"
) -> GPTStage:
    """A whole model (tp = 1, eval mode) holding ``full`` (global names, vocabulary unpadded), in its dtype."""
    model = build_gpt_model(config)
    padded = config.padded_vocab_size(1)
    state = {}
    for name, tensor in model.state_dict().items():
        value = full[name]
        if value.shape[0] < padded and tensor.shape[0] == padded:  # the vocabulary tables
            value = torch.cat([value, value.new_zeros((padded - value.shape[0], *value.shape[1:]))])
        state[name] = value
    dtype = full["embedding.word_embeddings.weight"].dtype
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def next_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token id from the last position's logits ``[V]`` (real vocabulary only)."""
    if config.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / config.temperature
    if config.top_k:
        kth = torch.topk(logits, min(config.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p  # mass before it already reaches p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: GPTStage,
    prompt_ids: list[int],
    config: SamplingConfig,
    *,
    eod: int | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """The generated ids after ``prompt_ids`` (at most ``max_new_tokens``; ends at ``eod``, included), drawn from
    the first ``vocab_size`` ids (default: the model's vocabulary; pass the tokenizer's when it is smaller)."""
    mc = model.config
    vocab = mc.vocab_size if vocab_size is None else min(vocab_size, mc.vocab_size)
    if not prompt_ids:
        raise ConfigError("the prompt is empty after tokenization; pass a non-empty --prompt")
    total = len(prompt_ids) + config.max_new_tokens
    if total > mc.max_position_embeddings:
        raise ConfigError(
            f"the prompt ({len(prompt_ids)} tokens) plus --max-new-tokens {config.max_new_tokens} is longer than "
            f"the model's {mc.max_position_embeddings} positions; shorten the prompt or generate fewer tokens"
        )
    bad = [i for i in prompt_ids if not 0 <= i < mc.vocab_size]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {mc.vocab_size})")
    device = next(model.parameters()).device
    generator = None
    if config.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    cache = KVCache(total) if use_cache else None
    sequence = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, s]
    feed = sequence
    out: list[int] = []
    for _ in range(config.max_new_tokens):
        logits = model(feed, kv_cache=cache) if use_cache else model(sequence)  # [s, 1, V_padded]
        token = next_token(logits[-1, 0, :vocab], config, generator)
        out.append(token)
        if token == eod:
            break
        feed = torch.tensor([[token]], dtype=torch.long, device=device)
        if not use_cache:  # the cache holds the earlier tokens' keys and values
            sequence = torch.cat([sequence, feed], dim=1)
    return out
