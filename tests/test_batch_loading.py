"""Loading a microbatch gives the same batches as before the fast paths: the mock data's Markov walk equals the
per-token NumPy loop it replaced, and ``load_microbatch``'s collation from token rows (datasets with ``tokens_batch``)
equals collating the per-sample dicts, for mock, indexed and blended data and the wrappers that keep the
per-sample path.  Exact equality (same values, dtypes, shapes, contiguous) -- nothing here rounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.config.documents import DocumentMaskConfig
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.document_masks import DocumentMaskedDataset
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron.data.loader import CyclicOrder
from megatron.data.mock_data import MarkovChain, MockGPTDataset, collate
from megatron.microbatches import load_microbatch


def _loop_walk(chain: MarkovChain, seed: int, split: int, index: int, length: int) -> np.ndarray:
    """The walk as it was written before (the reference): one NumPy scalar lookup per token."""
    rng = np.random.Generator(np.random.Philox(key=[seed, (split << 48) | index]))
    start = int(rng.integers(chain.vocab_size))
    choices = np.searchsorted(chain.cumulative, rng.random(length - 1), side="right")
    choices = np.minimum(choices, chain.successors.shape[1] - 1)
    out = np.empty(length, dtype=np.int64)
    out[0] = start
    tok = start
    for i, c in enumerate(choices.tolist(), start=1):
        tok = int(chain.successors[tok, c])
        out[i] = tok
    return out


@pytest.mark.parametrize("vocab,seed", [(1024, 1234), (50257, 7), (4, 3)])
def test_mock_walk_equals_the_numpy_loop(vocab: int, seed: int) -> None:
    chain = MarkovChain.from_seed(seed, vocab)
    for split in range(3):
        for index, length in [(0, 129), (1, 2), (12345, 65), (2**40 + 3, 1)]:
            got = chain.sample(seed, split, index, length)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, _loop_walk(chain, seed, split, index, length))


def _indexed(tmp_path) -> GPTDataset:
    prefix = str(tmp_path / "u16")
    rng = np.random.default_rng(5)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(60):
            w.add_document(rng.integers(0, 4096, size=int(rng.integers(1, 90))))
    return GPTDataset(IndexedDataset(prefix), split_name="train", document_range=(0, 60), seq_length=32, seed=3,
                      num_samples=200, cache_dir=str(tmp_path / "cache"))  # fmt: skip


def _assert_same_batch(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].is_contiguous() and torch.equal(a[k], b[k]), k


def test_load_microbatch_equals_collating_the_samples(tmp_path) -> None:
    gpt = _indexed(tmp_path)
    mock = MockGPTDataset(seed=1234, seq_length=32, vocab_size=1024, num_samples=200)
    datasets = {
        "mock": mock,
        "indexed": gpt,
        "blended": BlendedDataset([gpt, mock], [0.3, 0.7], 150),
        "masked": DocumentMaskedDataset(
            mock, eod=5, config=DocumentMaskConfig(reset_position_ids=True, eod_mask_loss=True)
        ),
        "cyclic": CyclicOrder(gpt, seed=1),
    }
    for name, ds in datasets.items():
        for indices in ([0, 1], [7, 3, 99], [149]):
            got = load_microbatch(ds, indices, torch.device("cpu"))
            _assert_same_batch(got, collate([ds[i] for i in indices]))
        assert got["tokens"].shape == (1, 32), name
    with pytest.raises(IndexError):
        load_microbatch(gpt, [200], torch.device("cpu"))
