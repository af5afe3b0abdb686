"""Index builders for the GPT and blended datasets: C++ (`megatron.data._helpers_cpp`, built by setup.py) when it
was compiled, NumPy otherwise. Both give identical arrays (tests compare them); the NumPy versions are the
reference.

- `build_sample_index(sizes, doc_index, seq_length, num_samples)`: row j is (position in `doc_index`, token offset
  in that sequence) of token j * seq_length of the stream sizes[doc_index[0]], sizes[doc_index[1]], ...; sample j
  is the seq_length + 1 tokens from row j (they overlap the next sample by one token, so every token after the
  first is a prediction target exactly once).
- `build_blending_indices(weights, size)`: sample i of a blend comes from dataset `dataset_index[i]`, where it is
  sample `dataset_sample_index[i]`; each step picks the dataset lagging its share weights[d] * (i + 1) the most.
"""

from __future__ import annotations

import numpy as np

try:
    from megatron.data import _helpers_cpp as _cpp
except ImportError:  # no compiler at install time: the NumPy reference is used
    _cpp = None

HAVE_CPP = _cpp is not None


def _check_sample_args(sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int) -> int:
    if seq_length <= 0:
        raise ValueError(f"{seq_length=} must be > 0")
    if num_samples < 0:
        raise ValueError(f"{num_samples=} must be >= 0")
    if doc_index.size and (doc_index.min() < 0 or doc_index.max() >= sizes.size):
        raise ValueError(f"doc_index holds ids outside [0, {sizes.size}) (sizes has {sizes.size} entries)")
    total = int(sizes[doc_index].sum(dtype=np.int64)) if doc_index.size else 0
    if total < num_samples * seq_length + 1:
        raise ValueError(
            f"the token stream has {total} tokens, fewer than {num_samples=} * {seq_length=} + 1 = "
            f"{num_samples * seq_length + 1}"
        )
    return total


def build_sample_index_numpy(sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_index = np.ascontiguousarray(doc_index)
    _check_sample_args(sizes, doc_index, seq_length, num_samples)
    ends = np.cumsum(sizes[doc_index], dtype=np.int64)  # stream offset one past each sequence
    targets = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, targets, side="right")  # first sequence that ends after the target token
    starts = ends[pos] - sizes[doc_index[pos]]
    return np.stack([pos.astype(np.int64), targets - starts], axis=1)


def build_sample_index(
    sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int, *, use_cpp: bool | None = None
) -> np.ndarray:
    """int64 [num_samples + 1, 2] sample index (see the module docstring); C++ when available unless use_cpp=False."""
    if use_cpp is None:
        use_cpp = HAVE_CPP
    if not use_cpp:
        return build_sample_index_numpy(sizes, doc_index, seq_length, num_samples)
    if _cpp is None:
        raise ValueError("use_cpp=True but megatron.data._helpers_cpp is not built; reinstall with a C++ compiler")
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_index = np.ascontiguousarray(doc_index)
    if doc_index.dtype not in (np.int32, np.int64):
        doc_index = doc_index.astype(np.int64)
    if seq_length <= 0 or num_samples < 0:
        _check_sample_args(sizes, doc_index, seq_length, num_samples)
    try:
        return _cpp.build_sample_index(sizes, doc_index, int(seq_length), int(num_samples))
    except (ValueError, IndexError):  # re-check in Python for the one-line message
        _check_sample_args(sizes, doc_index, seq_length, num_samples)
        raise


def _normalised_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights {list(np.atleast_1d(w))} must be non-negative, finite and not all zero")
    if w.size > 32767:
        raise ValueError(f"a blend of {w.size} datasets is more than the 32767 supported")
    return w / w.sum()


def build_blending_indices_numpy(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    w = _normalised_weights(weights)
    if size < 0:
        raise ValueError(f"{size=} must be >= 0")
    k = w.size
    wl = w.tolist()
    counts = [0] * k
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):  # same arithmetic, order and tie-breaking as the C++ loop
        target = float(i + 1)
        best = 0
        best_err = wl[0] * target - counts[0]
        for d in range(1, k):
            err = wl[d] * target - counts[d]
            if err > best_err:
                best_err, best = err, d
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_blending_indices(weights, size: int, *, use_cpp: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]); weights are normalised to sum to 1."""
    if use_cpp is None:
        use_cpp = HAVE_CPP
    if not use_cpp:
        return build_blending_indices_numpy(weights, size)
    if _cpp is None:
        raise ValueError("use_cpp=True but megatron.data._helpers_cpp is not built; reinstall with a C++ compiler")
    w = _normalised_weights(weights)
    if size < 0:
        raise ValueError(f"{size=} must be >= 0")
    return _cpp.build_blending_indices(w, int(size))


def gather_samples(
    tokens: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    doc_index: np.ndarray,
    starts: np.ndarray,
    sample_tokens: int,
    *,
    use_cpp: bool | None = None,
) -> np.ndarray:
    """int64 [len(starts), sample_tokens]: row b holds `sample_tokens` tokens of the stream doc_index[...] starting at
    starts[b] = (position in doc_index, token offset); `offsets`/`lengths` locate each sequence in `tokens`."""
    starts = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1, 2)
    if use_cpp is None:
        use_cpp = HAVE_CPP and tokens.dtype in (np.uint16, np.int32)
    if use_cpp:
        return _cpp.gather_samples(
            tokens,
            np.ascontiguousarray(offsets, dtype=np.int64),
            np.ascontiguousarray(lengths, dtype=np.int32),
            np.ascontiguousarray(doc_index, dtype=np.int64),
            starts,
            int(sample_tokens),
        )
    out = np.empty((starts.shape[0], sample_tokens), dtype=np.int64)
    for b, (pos, off) in enumerate(starts.tolist()):
        filled = 0
        while filled < sample_tokens:
            seq = int(doc_index[pos])
            take = min(int(lengths[seq]) - off, sample_tokens - filled)
            if take > 0:
                begin = int(offsets[seq]) + off
                out[b, filled : filled + take] = tokens[begin : begin + take]
                filled += take
            pos += 1
            off = 0
    return out


def sample_reader(
    tokens: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    doc_index: np.ndarray,
    sample_index: np.ndarray,
    shuffle_index: np.ndarray,
    sample_tokens: int,
    *,
    use_cpp: bool | None = None,
):
    """A C++ `SampleReader` over a GPT dataset's arrays (`.get(k)`, `.get_batch(ks)`), or None without the helpers
    (or with use_cpp=False); callers then read samples in Python. Arrays are kept by reference, not copied (except
    an offsets/lengths array of another dtype)."""
    if use_cpp is None:
        use_cpp = HAVE_CPP
    if not use_cpp or _cpp is None or tokens.dtype.kind not in "iu" or doc_index.dtype not in (np.int32, np.int64):
        return None
    return _cpp.SampleReader(
        np.ascontiguousarray(tokens),
        np.ascontiguousarray(offsets, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int32),
        np.ascontiguousarray(doc_index),
        np.ascontiguousarray(sample_index, dtype=np.int64),
        np.ascontiguousarray(shuffle_index, dtype=np.int64),
        int(sample_tokens),
    )
