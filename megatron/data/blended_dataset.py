"""Blends of GPT datasets (`--data-path 0.3 a 0.7 b`) and `build_gpt_datasets`, the entry point the trainer calls.

A blend of size N draws sample i from dataset `dataset_index[i]` (its sample `dataset_sample_index[i]`), chosen
greedily so that every prefix of the blend is within one sample of the exact weights (helpers.build_blending_indices).
The greedy sequence does not depend on N, so with the GPT datasets' own guarantee a blended sample too is a function
of the seed and its global index alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from megatron.data import helpers
from megatron.data.gpt_dataset import SPLIT_NAMES, GPTDataset, sample_dict, split_document_ranges
from megatron.data.index_cache import IndexCache, dataset_fingerprint, default_cache_dir
from megatron.data.indexed_dataset import IndexedDataset, normalise_prefix

log = logging.getLogger("megatron.data")


def parse_data_path(data_path: str | Sequence[str]) -> list[tuple[float | None, str]]:
    """['0.3', 'a', '0.7', 'b'] -> [(0.3, 'a'), (0.7, 'b')]; ['a', 'b'] -> [(None, 'a'), (None, 'b')]."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ValueError(
            "--data-path is empty: pass a dataset prefix (e.g. data/out_text_document) or weight/prefix pairs"
        )

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not any(is_number(s) for s in items):
        return [(None, normalise_prefix(s)) for s in items]
    if len(items) % 2 or not all(is_number(items[i]) for i in range(0, len(items), 2)):
        raise ValueError(f"--data-path {' '.join(items)!r} must be prefixes, or weight prefix pairs like '0.3 a 0.7 b'")
    pairs = [(float(items[i]), normalise_prefix(items[i + 1])) for i in range(0, len(items), 2)]
    if any(w < 0 for w, _ in pairs) or sum(w for w, _ in pairs) <= 0:
        raise ValueError(f"--data-path weights {[w for w, _ in pairs]} must be non-negative with a positive sum")
    return pairs


class BlendedDataset:
    """Samples drawn from several datasets in proportion to `weights`; `tokens(k)` and `ds[k]` like GPTDataset."""

    def __init__(
        self,
        datasets: Sequence[GPTDataset],
        weights: Sequence[float],
        size: int,
        *,
        dataset_index: np.ndarray | None = None,
        dataset_sample_index: np.ndarray | None = None,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.size = size
        if dataset_index is None or dataset_sample_index is None:
            dataset_index, dataset_sample_index = helpers.build_blending_indices(self.weights, size)
        self.dataset_index = np.asarray(dataset_index).view(np.ndarray)
        self.dataset_sample_index = np.asarray(dataset_sample_index).view(np.ndarray)
        for d, ds in enumerate(self.datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(ds):
                raise ValueError(f"blend needs {needed} samples of dataset {d} but it was built with {len(ds)}")

    @property
    def seq_length(self) -> int:
        return self.datasets[0].seq_length

    def __len__(self) -> int:
        return self.size

    def tokens(self, k: int) -> np.ndarray:
        if not 0 <= k < self.size:
            raise IndexError(f"sample {k} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[k])].tokens(int(self.dataset_sample_index[k]))

    def tokens_batch(self, ks) -> np.ndarray:
        """int64 [len(ks), seq_length + 1]: samples ks at once."""
        ks = np.asarray(ks, dtype=np.int64)
        if ks.size and (ks.min() < 0 or ks.max() >= self.size):
            raise IndexError(f"sample indices must lie in [0, {self.size}) for a blend of {self.size} samples")
        out = np.empty((ks.size, self.seq_length + 1), dtype=np.int64)
        which = self.dataset_index[ks]
        for d in np.unique(which).tolist():
            mask = which == d
            out[mask] = self.datasets[d].tokens_batch(self.dataset_sample_index[ks[mask]])
        return out

    def __getitem__(self, k: int) -> dict:
        return sample_dict(self.tokens(k))

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3f}*{os.path.basename(d.indexed.prefix)}" for w, d in zip(self.weights, self.datasets))
        return f"BlendedDataset({parts}; {self.size} samples)"


def check_vocab(indexed: IndexedDataset, vocab_size: int, cache_dir: str | None) -> None:
    """Raise if the dataset holds ids the tokenizer cannot (a dataset preprocessed with another tokenizer)."""
    cache = IndexCache(cache_dir or default_cache_dir(indexed.prefix))
    desc = {"kind": "token-stats", "fingerprint": dataset_fingerprint(indexed.prefix)}
    stem = f"{os.path.basename(indexed.prefix)}-stats"
    arrays, _ = cache.load_or_build(
        stem, desc, ("max_token",), lambda: {"max_token": np.array([indexed.max_token_id()])}
    )
    max_token = int(arrays["max_token"][0])
    if max_token >= vocab_size:
        raise ValueError(
            f"dataset {indexed.prefix!r} holds token id {max_token} but the tokenizer's vocab size is {vocab_size}: "
            "it was preprocessed with a different tokenizer; pass the same --tokenizer-type/--vocab-file/... as "
            "tools/preprocess_data.py used"
        )


def build_gpt_datasets(
    data_path: str | Sequence[str],
    *,
    split: str = "969,30,1",
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    vocab_size: int | None = None,
    cache_dir: str | None = None,
    use_cpp: bool | None = None,
) -> tuple[GPTDataset | BlendedDataset | None, ...]:
    """(train, valid, test) datasets for `--data-path` and `--split`; a split with 0 samples requested is None.

    `num_samples` = (train, valid, test) sample counts. Without weights in --data-path, datasets are blended in
    proportion to their token counts. With `vocab_size`, every dataset's largest token id is checked against it.
    """
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"{num_samples=} must be three non-negative counts (train, valid, test)")
    blend = parse_data_path(data_path)
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    if vocab_size is not None:
        for ds in indexed:
            check_vocab(ds, vocab_size, cache_dir)
    ranges = [split_document_ranges(ds.num_documents, split) for ds in indexed]
    out: list[GPTDataset | BlendedDataset | None] = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s])
        split_ranges = [r[s] for r in ranges]
        if n == 0:
            out.append(None)
        elif len(indexed) == 1:
            out.append(
                GPTDataset(
                    indexed[0],
                    split_name=name,
                    document_range=split_ranges[0],
                    seq_length=seq_length,
                    seed=seed,
                    num_samples=n,
                    cache_dir=cache_dir,
                    use_cpp=use_cpp,
                )
            )
        else:
            weights = _blend_weights([w for w, _ in blend], indexed, split_ranges, name)
            out.append(
                _build_blended_split(
                    indexed,
                    split_ranges,
                    weights,
                    split_name=name,
                    num_samples=n,
                    seq_length=seq_length,
                    seed=seed,
                    cache_dir=cache_dir,
                    use_cpp=use_cpp,
                )
            )
    log.info("datasets for %s: %s", " ".join(p for _, p in blend), out)
    return tuple(out)


def _blend_weights(
    given: Sequence[float | None],
    indexed: Sequence[IndexedDataset],
    split_ranges: Sequence[tuple[int, int]],
    split_name: str,
) -> list[float]:
    """The blend's normalised weights for one split: `given`, or (without weights in --data-path) each dataset's
    token count in its document range of that split."""
    weights = list(given)
    if weights[0] is None:  # proportional to the tokens of each dataset's split
        weights = []
        for ds, (b, e) in zip(indexed, split_ranges):
            first, last = int(ds.document_indices[b]), int(ds.document_indices[e])
            weights.append(float(ds.sequence_lengths[first:last].sum(dtype=np.int64)))
        if sum(weights) == 0:
            raise ValueError(f"the {split_name} split of every dataset in --data-path is empty; adjust --split")
    return [w / sum(weights) for w in weights]


def _blending_indices(
    indexed: Sequence[IndexedDataset],
    weights: list[float],
    size: int,
    split_name: str,
    *,
    cache_dir: str | None,
    use_cpp: bool | None,
) -> dict[str, np.ndarray]:
    """`dataset_index` and `dataset_sample_index` of a blend of `size` samples, from the cache or built."""
    cache = IndexCache(cache_dir or default_cache_dir(indexed[0].prefix))
    desc = {"kind": "blend", "weights": weights, "size": size}
    arrays, _ = cache.load_or_build(
        f"blend-{split_name}",
        desc,
        ("dataset_index", "dataset_sample_index"),
        lambda: dict(
            zip(
                ("dataset_index", "dataset_sample_index"),
                helpers.build_blending_indices(weights, size, use_cpp=use_cpp),
            )
        ),
    )
    return arrays


def _build_blended_split(
    indexed: Sequence[IndexedDataset],
    split_ranges: Sequence[tuple[int, int]],
    weights: list[float],
    *,
    split_name: str,
    num_samples: int,
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    use_cpp: bool | None,
) -> BlendedDataset:
    """One split's blend: each member a GPTDataset of exactly the samples the blend draws from it."""
    arrays = _blending_indices(indexed, weights, num_samples, split_name, cache_dir=cache_dir, use_cpp=use_cpp)
    counts = np.bincount(np.asarray(arrays["dataset_index"]), minlength=len(indexed))
    parts = []
    for d, ds in enumerate(indexed):
        if counts[d] == 0:  # weight too small to draw from in this many samples: never read
            parts.append(_EmptySplit(ds, split_name, seq_length))
            continue
        parts.append(
            GPTDataset(
                ds,
                split_name=split_name,
                document_range=split_ranges[d],
                seq_length=seq_length,
                seed=seed,
                num_samples=int(counts[d]),
                cache_dir=cache_dir,
                use_cpp=use_cpp,
            )
        )
    return BlendedDataset(
        parts,
        weights,
        num_samples,
        dataset_index=arrays["dataset_index"],
        dataset_sample_index=arrays["dataset_sample_index"],
    )


class _EmptySplit:
    """Stand-in for a blend member no sample is drawn from."""

    def __init__(self, indexed: IndexedDataset, split_name: str, seq_length: int) -> None:
        self.indexed, self.split_name, self.seq_length = indexed, split_name, seq_length

    def __len__(self) -> int:
        return 0

    def tokens(self, k: int) -> np.ndarray:
        raise IndexError(f"no samples are drawn from {self.indexed.prefix!r} in the {self.split_name} split")
