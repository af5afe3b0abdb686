"""GPT samples, splits, epochs, caching and blending; C++ and NumPy index builders give identical arrays."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.blended_dataset import BlendedDataset, build_gpt_datasets, parse_data_path
from megatron.data.gpt_dataset import GPTDataset, parse_split, split_document_ranges
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

needs_cpp = pytest.mark.skipif(not helpers.HAVE_CPP, reason="megatron.data._helpers_cpp not built")


def write_positional(prefix: str, lengths: list[int]) -> IndexedDataset:
    """A dataset whose token values are their global positions, so every token says where it came from."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        pos = 0
        for n in lengths:
            w.add_document(np.arange(pos, pos + n, dtype=np.int32))
            pos += n
    return IndexedDataset(prefix)


@pytest.fixture
def positional(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, size=120).tolist()  # includes empty documents
    return write_positional(str(tmp_path / "pos"), lengths)


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 12345])
def test_split_ranges_cover_every_document_once(n):
    ranges = split_document_ranges(n, "969,30,1")
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))
    assert all(abs((e - b) - f * n) <= 2 for (b, e), f in zip(ranges, (0.969, 0.030, 0.001)))
    if n >= 3:
        assert all(e > b for b, e in ranges)  # a split with a positive weight is never empty


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_every_token_is_a_target_exactly_once_per_epoch(tmp_path, positional, seq_length):
    ds = positional
    ranges = split_document_ranges(ds.num_documents, "8,2,0")
    b, e = ranges[0]
    probe = GPTDataset(
        ds,
        split_name="train",
        document_range=(b, e),
        seq_length=seq_length,
        seed=5,
        num_samples=1,
        cache_dir=str(tmp_path / "c"),
    )
    spe = probe.samples_per_epoch
    gds = GPTDataset(
        ds,
        split_name="train",
        document_range=(b, e),
        seq_length=seq_length,
        seed=5,
        num_samples=3 * spe,
        cache_dir=str(tmp_path / "c"),
    )
    first, last = int(ds.document_indices[b]), int(ds.document_indices[e])
    split_tokens = set(
        ds.tokens[
            int(ds.token_offsets[first]) : int(ds.token_offsets[last - 1] + ds.sequence_lengths[last - 1])
        ].tolist()
    )
    orders = []
    for epoch in range(3):
        targets = []
        for k in range(epoch * spe, (epoch + 1) * spe):
            t = gds.tokens(k)
            assert t.shape == (seq_length + 1,) and t.dtype == np.int64
            targets += t[1:].tolist()
        assert len(targets) == len(set(targets))  # no token is a target twice
        order = gds.document_index[epoch * gds.num_sequences : (epoch + 1) * gds.num_sequences]
        stream = np.concatenate([ds[int(s)] for s in order]).tolist()
        assert sorted(stream) == sorted(split_tokens)  # the epoch holds every token of the split once
        untargeted = split_tokens - set(targets)
        assert untargeted == {stream[0], *stream[1 + spe * seq_length :]}  # the first token and a short tail
        assert len(stream) - 1 - spe * seq_length < seq_length
        orders.append(order.tolist())
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch


def test_samples_depend_only_on_seed_and_index(tmp_path, positional):
    kw = dict(split_name="train", document_range=(0, 100), seq_length=16, cache_dir=str(tmp_path / "c"))
    short = GPTDataset(positional, seed=1, num_samples=50, **kw)
    long = GPTDataset(positional, seed=1, num_samples=700, **kw)  # more epochs, a different cache entry
    assert long.num_epochs > short.num_epochs
    for k in range(50):
        np.testing.assert_array_equal(short.tokens(k), long.tokens(k))
    other = GPTDataset(positional, seed=2, num_samples=50, **kw)
    assert any(not np.array_equal(short.tokens(k), other.tokens(k)) for k in range(50))
    sample = short[3]
    assert sample["tokens"].tolist() == short.tokens(3)[:-1].tolist()
    assert sample["labels"].tolist() == short.tokens(3)[1:].tolist()
    with pytest.raises(IndexError):
        short.tokens(50)


def test_index_cache_is_reused_and_rebuilt_when_inputs_change(tmp_path, monkeypatch):
    prefix = str(tmp_path / "d")
    ds = write_positional(prefix, [30] * 40)
    cache = str(tmp_path / "cache")
    kw = dict(split_name="train", document_range=(0, 40), seq_length=8, num_samples=200, cache_dir=cache)
    a = GPTDataset(ds, seed=3, **kw)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not [f for f in files if f.endswith(".tmp")]

    def boom(*args, **kwargs):
        raise AssertionError("index rebuilt although a matching cache exists")

    monkeypatch.setattr(helpers, "build_sample_index", boom)
    b = GPTDataset(ds, seed=3, **kw)  # loaded, not rebuilt
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    monkeypatch.undo()
    GPTDataset(ds, seed=4, **kw)  # another seed: another entry
    assert len(os.listdir(cache)) == 8
    ds2 = write_positional(prefix, [31] * 40)  # the data changed under the same name: rebuilt
    c = GPTDataset(ds2, seed=3, **kw)
    assert len(os.listdir(cache)) == 12
    assert c.tokens_per_epoch == 31 * 40


def test_default_cache_sits_next_to_the_data(tmp_path):
    ds = write_positional(str(tmp_path / "d"), [10] * 10)
    GPTDataset(ds, split_name="train", document_range=(0, 10), seq_length=4, seed=0, num_samples=5)
    assert len(os.listdir(tmp_path / "cache")) == 4


def test_too_small_split_and_vocab_mismatch_are_clear_errors(tmp_path):
    prefix = str(tmp_path / "d")
    write_positional(prefix, [5] * 10)
    with pytest.raises(ValueError, match="valid split .* fewer than seq_length"):
        build_gpt_datasets(
            prefix, split="9,1,0", seq_length=8, seed=0, num_samples=(2, 2, 0), cache_dir=str(tmp_path / "c")
        )
    with pytest.raises(ValueError, match="holds token id 49 but the tokenizer's vocab size is 40"):
        build_gpt_datasets(prefix, split="1", seq_length=4, seed=0, num_samples=(2, 0, 0), vocab_size=40)
    train, valid, test = build_gpt_datasets(
        prefix, split="1", seq_length=4, seed=0, num_samples=(2, 0, 0), vocab_size=50
    )
    assert len(train) == 2 and valid is None and test is None


def test_parse_data_path():
    assert parse_data_path("0.3 a 0.7 b.bin") == [(0.3, "a"), (0.7, "b")]
    assert parse_data_path(["x", "y.idx"]) == [(None, "x"), (None, "y")]
    for bad in ([], ["0.3", "a", "b"], ["0.5", "a", "c", "d"], ["-1", "a"]):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)


def test_blended_datasets_follow_the_weights(tmp_path):
    a = str(tmp_path / "a")
    b = str(tmp_path / "b")
    write_positional(a, [50] * 60)
    with IndexedDatasetWriter(b, np.int32) as w:  # tokens of b start at 10**6, to tell the datasets apart
        for i in range(40):
            w.add_document(np.arange(10**6 + i * 20, 10**6 + (i + 1) * 20, dtype=np.int32))
    train, valid, _ = build_gpt_datasets(
        ["0.3", a, "0.7", b],
        split="9,1,0",
        seq_length=16,
        seed=0,
        num_samples=(500, 30, 0),
        cache_dir=str(tmp_path / "c"),
    )
    assert isinstance(train, BlendedDataset) and len(train) == 500 and len(valid) == 30
    from_b = [bool(train.tokens(k)[0] >= 10**6) for k in range(500)]
    assert from_b == (train.dataset_index == 1).tolist()
    batch = train.tokens_batch(np.arange(0, 500, 7))
    assert all(np.array_equal(row, train.tokens(k)) for row, k in zip(batch, range(0, 500, 7)))
    counts = np.cumsum(np.asarray(from_b))
    n = np.arange(1, 501)
    assert np.all(np.abs(counts - 0.7 * n) <= 1.0)
    # without weights: proportional to tokens (60*50 vs 40*20 in the full split)
    train2, _, _ = build_gpt_datasets(
        [a, b], split="1", seq_length=16, seed=0, num_samples=(380, 0, 0), cache_dir=str(tmp_path / "c")
    )
    assert abs(int(np.sum(train2.dataset_index == 1)) - 380 * 800 / 3800) <= 1


def test_blending_prefixes_are_within_one_sample_of_exact():
    rng = np.random.default_rng(1)
    for _ in range(30):
        k = int(rng.integers(1, 7))
        w = rng.random(k) + 0.01
        w /= w.sum()
        di, dsi = helpers.build_blending_indices(w, 3000)
        onehot = np.eye(k, dtype=np.int64)[di]
        counts = np.cumsum(onehot, axis=0)
        exact = np.arange(1, 3001)[:, None] * w[None, :]
        assert np.all(np.abs(counts - exact) <= 1.0)
        for d in range(k):  # each dataset's samples are used in order 0, 1, 2, ...
            assert dsi[di == d].tolist() == list(range(int((di == d).sum())))


@needs_cpp
def test_cpp_and_numpy_sample_index_are_identical():
    rng = np.random.default_rng(2)
    for trial in range(40):
        n = int(rng.integers(1, 400))
        sizes = rng.integers(0, int(rng.choice([3, 50, 5000])), size=n).astype(np.int32)
        order = rng.permutation(n).astype(np.int32 if trial % 2 else np.int64)
        total = int(sizes.sum())
        if total < 2:
            continue
        for seq in (1, 3, 17, 1024):
            num = (total - 1) // seq
            if num == 0:
                continue
            cpp = helpers.build_sample_index(sizes, order, seq, num, use_cpp=True)
            ref = helpers.build_sample_index(sizes, order, seq, num, use_cpp=False)
            assert cpp.dtype == ref.dtype == np.int64
            np.testing.assert_array_equal(cpp, ref)
    with pytest.raises(ValueError, match="fewer than"):
        helpers.build_sample_index(np.array([3], np.int32), np.array([0]), 4, 1, use_cpp=True)


@needs_cpp
def test_cpp_and_numpy_blending_are_identical():
    rng = np.random.default_rng(3)
    for _ in range(20):
        w = rng.random(int(rng.integers(1, 9)))
        w[rng.random(w.size) < 0.2] = 0.0
        if w.sum() == 0:
            w[0] = 1.0
        a = helpers.build_blending_indices(w, 2000, use_cpp=True)
        b = helpers.build_blending_indices(w, 2000, use_cpp=False)
        assert a[0].dtype == b[0].dtype and a[1].dtype == b[1].dtype
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="weights"):
        helpers.build_blending_indices([0.0, 0.0], 5)


@needs_cpp
def test_gpt_dataset_arrays_identical_with_cpp_and_numpy(tmp_path, positional):
    kw = dict(split_name="train", document_range=(0, 100), seq_length=9, seed=7, num_samples=400)
    a = GPTDataset(positional, cache_dir=str(tmp_path / "a"), use_cpp=True, **kw)
    b = GPTDataset(positional, cache_dir=str(tmp_path / "b"), use_cpp=False, **kw)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("use_cpp", [False, pytest.param(True, marks=needs_cpp)])
def test_batched_reads_equal_single_reads(tmp_path, use_cpp, monkeypatch):
    prefix = str(tmp_path / "u16")
    rng = np.random.default_rng(4)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(80):
            w.add_document(rng.integers(0, 60000, size=int(rng.integers(0, 70))))
    ds = IndexedDataset(prefix)
    gds = GPTDataset(ds, split_name="train", document_range=(0, 80), seq_length=33, seed=1, num_samples=300,
                     cache_dir=str(tmp_path / "c"))  # fmt: skip
    real = helpers.gather_samples
    monkeypatch.setattr(helpers, "gather_samples", lambda *a, **k: real(*a, **{**k, "use_cpp": use_cpp}))
    ks = rng.integers(0, 300, size=200)
    batch = gds.tokens_batch(ks)
    assert batch.shape == (200, 34) and batch.dtype == np.int64
    for row, k in zip(batch, ks.tolist()):
        np.testing.assert_array_equal(row, gds.tokens(k))
    with pytest.raises(IndexError):
        gds.tokens_batch([300])
