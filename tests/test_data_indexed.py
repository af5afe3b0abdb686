"""Megatron's .bin/.idx format: interoperability with an independent writer/reader written here from the format's
description, O(1) reads, and clear errors for truncated, corrupted or mismatched files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter

# --- an independent minimal implementation of the format (struct-based, no shared code) -------------------------
# .idx: b"MMIDIDX\0\0", u64 version=1, u8 dtype code, u64 #sequences, u64 #doc-index entries,
#       i32 lengths[S], i64 byte pointers[S], i64 doc_index[D];  .bin: raw tokens.
CODES = {np.dtype("uint8"): 1, np.dtype("int16"): 3, np.dtype("int32"): 4, np.dtype("int64"): 5, np.dtype("uint16"): 8}


def independent_write(prefix: str, docs: list[list[int]], dtype: str) -> None:
    dt = np.dtype(dtype)
    pointers, pos = [], 0
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            pointers.append(pos)
            for t in d:
                f.write(
                    struct.pack("<" + {"uint8": "B", "int16": "h", "int32": "i", "int64": "q", "uint16": "H"}[dtype], t)
                )
            pos += len(d) * dt.itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dt]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        for d in docs:
            f.write(struct.pack("<i", len(d)))
        for p in pointers:
            f.write(struct.pack("<q", p))
        for i in range(len(docs) + 1):
            f.write(struct.pack("<q", i))


def independent_read(prefix: str) -> list[list[int]]:
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        assert struct.unpack("<Q", f.read(8))[0] == 1
        code = struct.unpack("<B", f.read(1))[0]
        n, d = struct.unpack("<QQ", f.read(16))
        lengths = struct.unpack(f"<{n}i", f.read(4 * n))
        pointers = struct.unpack(f"<{n}q", f.read(8 * n))
        doc_index = struct.unpack(f"<{d}q", f.read(8 * d))
        assert f.read() == b""
    fmt, size = {1: ("B", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 8: ("H", 2)}[code]
    assert doc_index[0] == 0 and doc_index[-1] == n
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    return [list(struct.unpack(f"<{ln}{fmt}", data[p : p + ln * size])) for ln, p in zip(lengths, pointers)]


def random_docs(seed: int, n: int, vmax: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vmax, size=int(rng.integers(0, 50))).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype, vmax", [("uint16", 65535), ("int32", 2**31 - 1), ("uint8", 255), ("int64", 2**40)])
def test_independent_writer_is_read_by_ours(tmp_path, dtype, vmax):
    docs = random_docs(1, 60, vmax)
    prefix = str(tmp_path / "theirs")
    independent_write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype) and len(ds) == 60 and ds.num_documents == 60
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
        assert ds.document(i).tolist() == d
    assert ds.num_tokens == sum(map(len, docs))
    assert ds.get(3, offset=2, length=3).tolist() == docs[3][2:5]


@pytest.mark.parametrize("dtype, vmax", [("uint16", 65535), ("int32", 2**31 - 1)])
def test_ours_is_read_by_independent_reader_and_bytes_match(tmp_path, dtype, vmax):
    docs = random_docs(2, 80, vmax)
    with IndexedDatasetWriter(str(tmp_path / "ours"), dtype) as w:
        for d in docs[:40]:
            w.add_document(d)
        flat = np.array([t for d in docs[40:] for t in d], dtype=dtype)
        w.add_sequences(flat, [len(d) for d in docs[40:]])
    assert independent_read(str(tmp_path / "ours")) == docs
    independent_write(str(tmp_path / "theirs"), docs, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("ours" + ext)).read_bytes() == (tmp_path / ("theirs" + ext)).read_bytes()


def test_multi_sentence_documents(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "s"), "uint16") as w:
        w.add_document([1, 2, 3, 4, 5], sentence_lengths=[2, 3])
        w.add_document([6], sentence_lengths=[1])
    ds = IndexedDataset(str(tmp_path / "s.bin"))  # a .bin/.idx suffix names the same pair
    assert len(ds) == 3 and ds.num_documents == 2
    assert ds.document(0).tolist() == [1, 2, 3, 4, 5] and ds[1].tolist() == [3, 4, 5]


def test_empty_dataset_and_writer_abort(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "e"), "uint16"):
        pass
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_tokens == 0
    with pytest.raises(RuntimeError), IndexedDatasetWriter(str(tmp_path / "x"), "uint16") as w:
        w.add_document([1, 2])
        raise RuntimeError("boom")
    assert not os.path.exists(tmp_path / "x.bin") and not os.path.exists(tmp_path / "x.idx")
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with (
        pytest.raises(ValueError, match="do not fit dtype uint16"),
        IndexedDatasetWriter(str(tmp_path / "w"), "uint16") as w,
    ):
        w.add_document([70000])


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    independent_write(prefix, random_docs(3, 20, 1000), "uint16")
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_files(tmp_path, good):
    with pytest.raises(IndexedDatasetError, match="does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))
    os.remove(good + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"data file .* does not exist"):
        IndexedDataset(good)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: _patch(p + ".idx", 0, b"XXIDIDX"), "magic"),
        (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 7)), "version 7"),
        (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 99)), "unknown dtype code 99"),
        (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 4)), "different dtypes"),  # int32 instead of uint16
        (lambda p: _patch(p + ".idx", 18, struct.pack("<Q", 10**6)), "truncated or corrupted"),
        (lambda p: os.truncate(p + ".idx", 20), "shorter than the 34-byte header"),
        (lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), "truncated or corrupted"),
        (lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 2), "truncated .bin"),
        (lambda p: _patch(p + ".idx", 34 + 4 * 20 + 8 * 5, struct.pack("<q", 3)), "pointer of sequence 5"),
        (lambda p: _patch(p + ".idx", 34, struct.pack("<i", -5)), "negative sequence length"),
        (lambda p: _patch(p + ".idx", 34 + 12 * 20, struct.pack("<q", 1)), "document index"),
    ],
)
def test_damaged_files_give_one_clear_error(good, damage, match):
    damage(good)
    with pytest.raises(IndexedDatasetError, match=match) as info:
        IndexedDataset(good)
    assert "\n" not in str(info.value)


def test_out_of_range_read(good):
    ds = IndexedDataset(good)
    with pytest.raises(IndexError, match="out of range"):
        ds[20]
    assert ds[-1].tolist() == ds[19].tolist()
