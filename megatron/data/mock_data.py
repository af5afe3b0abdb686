"""``--mock-data``: synthetic token sequences that depend only on the seed and the global sample index.

Each sample is a walk of a sparse random Markov chain over the vocabulary: the chain (drawn once from the seed)
gives every token ``branching`` possible successors with fixed, skewed probabilities. A model that learns the
bigram table drives the loss from ``ln(vocab)`` (about 6.9 nats for 1024 tokens) towards the chain's entropy rate
(about 1.2 nats for the default 4 successors), so the loss visibly falls within tens of iterations, and a longer
run can keep improving by learning the whole table. Sample ``i`` of a split is drawn from its own counter-based
random stream keyed by ``(seed, split, i)``, so any data-parallel layout, microbatch size or restart sees exactly the
same tokens for the same global sample index.

Samples follow Megatron's GPT dataset: ``tokens`` (inputs), ``labels`` (inputs shifted by one) and ``loss_mask``
(all ones here); positions ``0..s-1`` and the causal mask are implicit (EOD-derived ones:
``megatron.data.document_masks``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SPLITS = ("train", "valid", "test")
_DEFAULT_PROBS = (0.55, 0.25, 0.12, 0.08)


@dataclass(frozen=True)
class MarkovChain:
    """A sparse transition table: ``successors[t]`` are the tokens that may follow ``t``, with ``probs``."""

    successors: np.ndarray  # [vocab, branching] int64
    cumulative: np.ndarray  # [branching] float64, cumulative successor probabilities (last = 1)

    @property
    def vocab_size(self) -> int:
        return int(self.successors.shape[0])

    def entropy_rate(self) -> float:
        """Entropy (nats per token) of the next token given the current one, ignoring repeated successors.

        An upper bound on the best achievable loss (repeats only lower it)."""
        probs = np.diff(self.cumulative, prepend=0.0)
        return float(-(probs * np.log(probs)).sum())

    @classmethod
    def from_seed(cls, seed: int, vocab_size: int, probs: Sequence[float] = _DEFAULT_PROBS) -> MarkovChain:
        if vocab_size < len(probs):
            raise ValueError(f"{vocab_size=} must be >= the number of successors per token ({len(probs)})")
        p = np.asarray(probs, dtype=np.float64)
        if np.any(p <= 0) or not math.isclose(float(p.sum()), 1.0, rel_tol=1e-9):
            raise ValueError(f"successor probabilities {tuple(probs)} must be positive and sum to 1")
        rng = np.random.Generator(np.random.Philox(key=[seed, 0x6D6F636B]))  # "mock"
        # Successors drawn independently (a rare repeat just merges two branches); O(vocab) memory for any vocab.
        successors = rng.integers(0, vocab_size, size=(vocab_size, len(p)), dtype=np.int64)
        return cls(successors=successors, cumulative=np.cumsum(p))

    @functools.cached_property
    def _successor_lists(self) -> list[list[int]]:
        """``successors`` as Python lists: the walk's one lookup per token is a list index, not a NumPy scalar
        lookup (several times slower)."""
        return self.successors.tolist()

    def sample(self, seed: int, split: int, index: int, length: int) -> np.ndarray:
        """``length`` tokens of sample ``index`` of ``split``: a walk starting from a uniformly drawn token."""
        rng = np.random.Generator(np.random.Philox(key=[seed, (split << 48) | index]))
        start = int(rng.integers(self.vocab_size))
        choices = np.searchsorted(self.cumulative, rng.random(length - 1), side="right")
        choices = np.minimum(choices, self.successors.shape[1] - 1)
        succ = self._successor_lists
        walk = [start]
        tok = start
        for c in choices.tolist():
            tok = succ[tok][c]
            walk.append(tok)
        return np.array(walk, dtype=np.int64)


class MockGPTDataset:
    """Deterministic synthetic GPT samples for one split; ``dataset[i]`` is sample ``i`` (any non-negative index)."""

    def __init__(self, *, seed: int, seq_length: int, vocab_size: int, split: str = "train", num_samples: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"{split=} must be one of {SPLITS}")
        if seq_length < 1:
            raise ValueError(f"{seq_length=} must be >= 1")
        self.seed = seed
        self.seq_length = seq_length
        self.split = split
        self.num_samples = num_samples
        self.chain = MarkovChain.from_seed(seed, vocab_size)

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, index: int) -> np.ndarray:
        """``seq_length + 1`` tokens of sample ``index`` (inputs and the shifted labels together)."""
        if index < 0:
            raise IndexError(f"sample index {index} must be >= 0")
        return self.chain.sample(self.seed, SPLITS.index(self.split), index, self.seq_length + 1)

    def tokens_batch(self, indices: Sequence[int]) -> np.ndarray:
        """int64 ``[len(indices), seq_length + 1]``: ``tokens`` of each sample, stacked (as ``GPTDataset``'s)."""
        return np.stack([self.tokens(int(i)) for i in indices])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One sample in host memory, like every dataset here (``megatron.microbatches.load_microbatch`` moves the
        collated batch to the run's device)."""
        toks = torch.from_numpy(self.tokens(index))
        return {
            "tokens": toks[:-1].clone(),
            "labels": toks[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32, device="cpu"),
        }


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into a batch dict with a leading batch dimension."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
