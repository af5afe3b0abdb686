"""--mock-data: tokens depend only on (seed, split, sample index) and follow a learnable Markov chain."""

import math

import numpy as np
import pytest
import torch

from megatron.data.mock_data import MarkovChain, MockGPTDataset, collate


def _ds(seed=7, split="train", seq=64, vocab=256):
    return MockGPTDataset(seed=seed, seq_length=seq, vocab_size=vocab, split=split, num_samples=1000)


def test_sample_depends_only_on_seed_and_index():
    a, b = _ds(), _ds()
    order = [5, 0, 999, 3, 5]
    got_a = [a[i]["tokens"] for i in order]
    got_b = [b[i]["tokens"] for i in reversed(order)][::-1]
    for x, y in zip(got_a, got_b):
        assert torch.equal(x, y)
    assert torch.equal(got_a[0], got_a[4])
    assert not torch.equal(a[0]["tokens"], a[1]["tokens"])
    assert not torch.equal(a[0]["tokens"], _ds(seed=8)[0]["tokens"])
    assert not torch.equal(a[0]["tokens"], _ds(split="valid")[0]["tokens"])


def test_sample_fields_match_gpt_dataset_layout():
    ds = _ds(seq=32, vocab=100)
    s = ds[11]
    full = torch.from_numpy(ds.tokens(11))
    assert full.shape == (33,)
    assert torch.equal(s["tokens"], full[:-1]) and torch.equal(s["labels"], full[1:])
    assert s["tokens"].dtype == torch.int64 and int(full.min()) >= 0 and int(full.max()) < 100
    assert torch.equal(s["loss_mask"], torch.ones(32)) and set(s) == {"tokens", "labels", "loss_mask"}
    batch = collate([ds[i] for i in range(4)])
    assert batch["tokens"].shape == (4, 32) and batch["labels"].shape == (4, 32)


def test_every_transition_follows_the_chain_and_is_far_from_uniform():
    ds = _ds(seq=128, vocab=512)
    succ = ds.chain.successors
    counts: dict[tuple[int, int], int] = {}
    for i in range(40):
        toks = ds.tokens(i)
        for a, b in zip(toks[:-1].tolist(), toks[1:].tolist()):
            assert b in succ[a], f"transition {a}->{b} is not in the chain"
            counts[(a, b)] = counts.get((a, b), 0) + 1
    # The learnable structure: the best achievable loss is far below the uniform ln(vocab).
    assert ds.chain.entropy_rate() < 0.25 * math.log(512)


def test_successor_probabilities_are_respected():
    chain = MarkovChain.from_seed(3, 64)
    toks = chain.sample(3, 0, 0, 20001)
    picks = []
    for a, b in zip(toks[:-1], toks[1:]):
        row = chain.successors[a]
        if len(set(row.tolist())) == len(row):  # skip rows with a repeated successor
            picks.append(int(np.nonzero(row == b)[0][0]))
    freq = np.bincount(picks, minlength=4) / len(picks)
    assert np.allclose(freq, np.diff(chain.cumulative, prepend=0.0), atol=0.02)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="split"):
        MockGPTDataset(seed=1, seq_length=8, vocab_size=16, split="dev", num_samples=1)
    with pytest.raises(ValueError, match="vocab_size"):
        MarkovChain.from_seed(1, 2)
    with pytest.raises(IndexError):
        _ds().tokens(-1)
