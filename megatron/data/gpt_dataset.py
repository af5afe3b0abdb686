"""GPT training samples from an indexed dataset: document-level train/valid/test splits, samples of seq_length + 1
tokens that run across document boundaries, reshuffled every epoch.

How sample k is found (all arrays built once and cached next to the data, see index_cache.py):

    epoch e = k // samples_per_epoch
    document index   the split's documents in the order of a permutation drawn from (seed, e), expanded into
                     their sequences; the epoch's token stream is those sequences back to back
    sample index     row j = (position in the document index, token offset) of token j * seq_length of the
                     stream (helpers.build_sample_index); sample j is the seq_length + 1 tokens from row j
    shuffle index    k -> row, a permutation of the epoch's samples drawn from (seed, e)

An epoch of T tokens holds (T - 1) // seq_length samples; consecutive samples share one token (the last target of
one is the first input of the next), so every token but the epoch's first is a prediction target exactly once, except
a tail shorter than seq_length that the epoch drops. Samples never cross epochs, and nothing depends on how many
samples were requested: sample k is a function of (data, split, seq_length, seed, k) alone, so every parallel layout,
batch size or training length sees the same sample for the same global index.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np

from megatron.data import helpers
from megatron.data.index_cache import IndexCache, dataset_fingerprint, default_cache_dir
from megatron.data.indexed_dataset import IndexedDataset

log = logging.getLogger("megatron.data")

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """'969,30,1' (or '98/2/0', '1', [0.9, 0.1]) -> normalised (train, valid, test) fractions."""
    text = split if isinstance(split, str) else ",".join(str(x) for x in split)
    try:
        parts = [float(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--split {text!r} must be up to three comma-separated numbers, e.g. 969,30,1") from None
    if not parts or len(parts) > 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {text!r} must be 1 to 3 non-negative numbers with a positive sum, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return (parts[0] / total, parts[1] / total, parts[2] / total)


def split_document_ranges(num_documents: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [begin, end) document ranges of train, valid and test.

    Boundaries are round(cumulative fraction * n); then a split with a positive weight that rounded to no documents
    takes one from the largest split (so '969,30,1' over 500 documents still gives a 1-document test split).
    """
    fractions = parse_split(split)
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(min(num_documents, int(round(acc * num_documents))))
    bounds[-1] = num_documents
    sizes = [bounds[i + 1] - bounds[i] for i in range(3)]
    for i in range(3):
        if fractions[i] > 0 and sizes[i] == 0:
            donor = max(range(3), key=lambda j: sizes[j])
            if sizes[donor] > 1:
                sizes[donor] -= 1
                sizes[i] += 1
    begins = [0, sizes[0], sizes[0] + sizes[1]]
    return [(begins[i], begins[i] + sizes[i]) for i in range(3)]


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, stream])))


def _epoch_sequence_order(document_indices: np.ndarray, begin: int, end: int, rng: np.random.Generator) -> np.ndarray:
    """The sequences of documents [begin, end) in the order of a random permutation of the documents."""
    docs = rng.permutation(end - begin) + begin
    first = document_indices[docs]
    counts = document_indices[docs + 1] - first
    if np.all(counts == 1):
        return first
    out_start = np.cumsum(counts) - counts
    return np.repeat(first - out_start, counts) + np.arange(int(counts.sum()), dtype=np.int64)


class GPTDataset:
    """Samples of one split of one indexed dataset; `tokens(k)` -> int64 [seq_length + 1]; `ds[k]` -> a batch dict."""

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        split_name: str,
        document_range: tuple[int, int],
        seq_length: int,
        seed: int,
        num_samples: int,
        cache_dir: str | None = None,
        use_cpp: bool | None = None,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"{seq_length=} must be >= 1")
        if num_samples < 0:
            raise ValueError(f"{num_samples=} must be >= 0")
        begin, end = document_range
        if not 0 <= begin <= end <= indexed.num_documents:
            raise ValueError(f"document range {document_range} outside [0, {indexed.num_documents}]")
        self.indexed = indexed
        self.split_name = split_name
        self.document_range = (begin, end)
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples
        docs = indexed.document_indices
        first_seq, last_seq = int(docs[begin]), int(docs[end])
        self.num_sequences = last_seq - first_seq
        self.tokens_per_epoch = int(indexed.sequence_lengths[first_seq:last_seq].sum(dtype=np.int64))
        self.samples_per_epoch = max(0, (self.tokens_per_epoch - 1) // seq_length)
        if num_samples > 0 and self.samples_per_epoch == 0:
            raise ValueError(
                f"the {split_name} split of {indexed.prefix!r} (documents [{begin}, {end})) has "
                f"{self.tokens_per_epoch} tokens, fewer than seq_length + 1 = {seq_length + 1}: "
                "use more data, a shorter --seq-length or a different --split"
            )
        self.num_epochs = math.ceil(num_samples / self.samples_per_epoch) if num_samples else 0
        description = {
            "kind": "GPTDataset",
            "data": os.path.basename(indexed.prefix),
            "fingerprint": dataset_fingerprint(indexed.prefix),
            "split": split_name,
            "document_range": [begin, end],
            "seq_length": seq_length,
            "seed": seed,
            "num_epochs": self.num_epochs,
        }
        cache = IndexCache(cache_dir or default_cache_dir(indexed.prefix))
        stem = f"{os.path.basename(indexed.prefix)}-{split_name}-gpt"
        t0 = time.perf_counter()
        arrays, cached = cache.load_or_build(
            stem, description, ("document_index", "sample_index", "shuffle_index"), lambda: self._build(use_cpp)
        )
        log.info(
            "%s %s split of %s: %d documents, %d tokens/epoch, %d samples/epoch, %d epochs; index %s in %.2fs",
            "loaded" if cached else "built",
            split_name,
            indexed.prefix,
            end - begin,
            self.tokens_per_epoch,
            self.samples_per_epoch,
            self.num_epochs,
            "loaded" if cached else "built",
            time.perf_counter() - t0,
        )
        # plain ndarray views (np.memmap indexing is slow)
        self.document_index = arrays["document_index"].view(np.ndarray)
        self.sample_index = arrays["sample_index"].view(np.ndarray)
        self.shuffle_index = arrays["shuffle_index"].view(np.ndarray)
        self._lengths = indexed.sequence_lengths
        self._offsets = indexed.token_offsets
        self._tokens = indexed.tokens
        self._doc_index64: np.ndarray | None = None
        # one C++ call per sample (~2 us) instead of the Python loop below (~20-80 us); identical samples (tests)
        self._reader = helpers.sample_reader(
            self._tokens, self._offsets, self._lengths, self.document_index, self.sample_index, self.shuffle_index,
            seq_length + 1, use_cpp=use_cpp,
        )  # fmt: skip

    def _build(self, use_cpp: bool | None) -> dict[str, np.ndarray]:
        begin, end = self.document_range
        epochs, spe, n_seq = self.num_epochs, self.samples_per_epoch, self.num_sequences
        doc_dtype = np.int32 if epochs * n_seq < 2**31 else np.int64
        document_index = np.empty(epochs * n_seq, dtype=doc_dtype)
        sample_index = np.empty((epochs * (spe + 1), 2), dtype=np.int64)
        shuffle_index = np.empty(epochs * spe, dtype=np.int64)
        sizes = np.ascontiguousarray(self.indexed.sequence_lengths, dtype=np.int32)
        for e in range(epochs):
            order = _epoch_sequence_order(self.indexed.document_indices, begin, end, _rng(self.seed, e, 0))
            document_index[e * n_seq : (e + 1) * n_seq] = order
            rows = helpers.build_sample_index(sizes, order, self.seq_length, spe, use_cpp=use_cpp)
            rows[:, 0] += e * n_seq
            sample_index[e * (spe + 1) : (e + 1) * (spe + 1)] = rows
            shuffle_index[e * spe : (e + 1) * spe] = _rng(self.seed, e, 1).permutation(spe) + e * (spe + 1)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, k: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample k (inputs are [:-1], labels [1:])."""
        if not 0 <= k < self.num_samples:
            raise IndexError(
                f"sample {k} out of range for the {self.num_samples} samples of the {self.split_name} split"
            )
        if self._reader is not None:
            return self._reader.get(k)
        return self._tokens_python(k)

    def _tokens_python(self, k: int) -> np.ndarray:
        """`tokens(k)` without the C++ helpers (the reference the C++ reader is tested against)."""
        row = int(self.shuffle_index[k])
        pos, off = int(self.sample_index[row, 0]), int(self.sample_index[row, 1])
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled = 0
        doc_index, lengths, offsets, toks = self.document_index, self._lengths, self._offsets, self._tokens
        while True:
            seq = int(doc_index[pos])
            take = min(int(lengths[seq]) - off, need - filled)
            if take > 0:
                start = int(offsets[seq]) + off
                out[filled : filled + take] = toks[start : start + take]
                filled += take
                if filled == need:
                    return out
            pos += 1
            off = 0

    def tokens_batch(self, ks) -> np.ndarray:
        """int64 [len(ks), seq_length + 1]: samples ks at once (one C++ call when the helpers are built)."""
        ks = np.asarray(ks, dtype=np.int64)
        if ks.size and (ks.min() < 0 or ks.max() >= self.num_samples):
            raise IndexError(f"sample indices must lie in [0, {self.num_samples}) for the {self.split_name} split")
        if self._doc_index64 is None:
            self._doc_index64 = self.document_index.astype(np.int64)
        starts = self.sample_index[self.shuffle_index[ks]]
        return helpers.gather_samples(
            self._tokens, self._offsets, self._lengths, self._doc_index64, starts, self.seq_length + 1
        )

    def __getitem__(self, k: int) -> dict:
        return sample_dict(self.tokens(k))

    def __repr__(self) -> str:
        if not hasattr(self, "num_epochs"):
            return "GPTDataset(<not built>)"
        return (
            f"GPTDataset({self.indexed.prefix!r}, {self.split_name}, documents {self.document_range}, "
            f"{self.num_samples} samples of {self.seq_length} tokens, {self.num_epochs} epochs)"
        )


def sample_dict(tokens: np.ndarray) -> dict:
    """Megatron's GPT sample: tokens, labels (shifted by one) and loss_mask (ones), in host memory
    (``megatron.microbatches.load_microbatch`` moves the batch to the run's device).  Positions ``0..s-1`` and the
    causal mask are implicit; EOD-derived ones come from ``megatron.data.document_masks``."""
    return {k: v[0] for k, v in batch_dict(np.asarray(tokens)[None]).items()}


def batch_dict(tokens: np.ndarray) -> dict:
    """``sample_dict`` of every row of int64 ``tokens`` ``[b, seq_length + 1]``, collated (``sample_dict`` is the
    one-row case): the same batch as stacking the samples' dicts, built as three tensors instead of three per sample
    (``megatron.microbatches.load_microbatch``); the copies are NumPy's (a torch call costs more than copying a
    microbatch)."""
    import torch

    tokens = np.asarray(tokens, dtype=np.int64)
    b, n = tokens.shape[0], tokens.shape[1] - 1
    return {
        "tokens": torch.from_numpy(tokens[:, :-1].copy()),
        "labels": torch.from_numpy(tokens[:, 1:].copy()),
        "loss_mask": torch.ones(b, n, dtype=torch.float32, device="cpu"),
    }
