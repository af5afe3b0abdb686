"""Megatron's memory-mapped indexed dataset: a `.bin` file of token ids and an `.idx` file describing it.

The `.bin` file is every sequence's tokens back to back, in one dtype, with no header. The `.idx` file, all
integers little-endian, is:

    offset 0   9 bytes   magic b"MMIDIDX\\x00\\x00"
           9   uint64    format version (1)
          17   uint8     dtype code of the .bin tokens (DTYPE_CODES)
          18   uint64    S = number of sequences
          26   uint64    D = number of document-index entries (documents + 1)
          34   int32[S]  tokens in each sequence
               int64[S]  byte offset of each sequence in .bin
               int64[D]  document index: document d is sequences [doc[d], doc[d+1]); doc[0] = 0, doc[-1] = S
               int8[S]   (optional, multimodal files only) a mode per sequence

Preprocessed GPT data has one sequence per document. Opening checks the magic, version, dtype code and that every
size agrees with the file lengths, so a truncated, corrupted or mismatched pair fails with one clear line instead of
an error deep inside NumPy. Reads are O(1): a slice of a memory-mapped view of `.bin`.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def token_dtype_for(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits (vocab below 65500), int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def normalise_prefix(path: str | os.PathLike) -> str:
    """`x`, `x.bin` and `x.idx` all name the dataset with prefix `x`."""
    path = os.fspath(path)
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


class IndexedDatasetError(ValueError):
    """An `.idx`/`.bin` pair that cannot be read; the message names the file and the problem."""


class IndexedDatasetWriter:
    """Streams sequences into `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`.

    Both files are written under temporary names and renamed at the end, so a crash never leaves a pair that looks
    complete. Memory holds only the per-sequence lengths.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16) -> None:
        self.prefix = normalise_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code; use one of {list(CODE_OF_DTYPE)}")
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._tmp_bin = data_file_path(self.prefix) + f".tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb", buffering=1 << 22)
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[int] = []  # sequence count at the end of each document
        self._num_sequences = 0
        self._done = False

    def add_sequences(self, flat_tokens: np.ndarray, lengths: Iterable[int], *, one_document_each: bool = True) -> None:
        """Append sequences given as one flat array plus their lengths (the fast path for preprocessing)."""
        flat = np.asarray(flat_tokens)
        lens = np.asarray(lengths, dtype=np.int64)
        if int(lens.sum()) != flat.size:
            raise ValueError(f"lengths sum to {int(lens.sum())} but {flat.size} tokens were given")
        if lens.size and lens.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence is longer than 2**31 - 1 tokens, which the .idx format cannot describe")
        self._write_tokens(flat)
        self._lengths.append(lens.astype(np.int32))
        first = self._num_sequences
        self._num_sequences += lens.size
        if one_document_each:
            self._doc_ends.extend(range(first + 1, self._num_sequences + 1))

    def add_document(self, tokens: Iterable[int] | np.ndarray, sentence_lengths: Iterable[int] | None = None) -> None:
        """Append one document (one sequence, or several with `sentence_lengths`)."""
        arr = np.asarray(tokens)
        lens = [arr.size] if sentence_lengths is None else list(sentence_lengths)
        self.add_sequences(arr, lens, one_document_each=False)
        self._doc_ends.append(self._num_sequences)

    def _write_tokens(self, flat: np.ndarray) -> None:
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())
            info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
            if info is not None and (lo < info.min or hi > info.max):
                raise ValueError(f"token ids in [{lo}, {hi}] do not fit dtype {self.dtype}; use a wider dtype")
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())

    def finalize(self) -> None:
        """Close `.bin` and write `.idx` (both atomically renamed into place)."""
        if self._done:
            return
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_index = np.asarray([0, *self._doc_ends], dtype=np.int64)
        tmp_idx = index_file_path(self.prefix) + f".tmp{os.getpid()}"
        with open(tmp_idx, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", doc_index.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_index.astype("<i8").tobytes())
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(tmp_idx, index_file_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Drop the partial output."""
        if not self._done:
            self._bin.close()
            if os.path.exists(self._tmp_bin):
                os.remove(self._tmp_bin)
            self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _read_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, mmap.mmap]:
    """Parse and validate an .idx file; returns (dtype, lengths, pointers, doc_index, modes, mmap)."""
    if not os.path.isfile(idx_path):
        raise IndexedDatasetError(f"index file {idx_path!r} does not exist (pass the prefix without .bin/.idx)")
    size = os.path.getsize(idx_path)
    if size < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{idx_path!r} is {size} bytes, shorter than the {HEADER_SIZE}-byte header: truncated"
        )
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_SIZE)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{idx_path!r} does not start with the MMIDIDX magic: not a Megatron memory-mapped index (or corrupted)"
        )
    (version,) = struct.unpack_from("<Q", header, 9)
    if version != INDEX_VERSION:
        raise IndexedDatasetError(f"{idx_path!r} has index format version {version}; only {INDEX_VERSION} is supported")
    (code,) = struct.unpack_from("<B", header, 17)
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{idx_path!r} has unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    num_seq, num_doc = struct.unpack_from("<QQ", header, 18)
    base = HEADER_SIZE + 4 * num_seq + 8 * num_seq + 8 * num_doc
    if size not in (base, base + num_seq):
        raise IndexedDatasetError(
            f"{idx_path!r} is {size} bytes but its header ({num_seq} sequences, {num_doc} document entries) "
            f"needs {base}: truncated or corrupted"
        )
    off = HEADER_SIZE
    lengths = np.frombuffer(mm, dtype="<i4", count=num_seq, offset=off)
    off += 4 * num_seq
    pointers = np.frombuffer(mm, dtype="<i8", count=num_seq, offset=off)
    off += 8 * num_seq
    doc_index = np.frombuffer(mm, dtype="<i8", count=num_doc, offset=off)
    off += 8 * num_doc
    modes = np.frombuffer(mm, dtype=np.int8, count=num_seq, offset=off) if size == base + num_seq else None
    return np.dtype(DTYPE_CODES[code]), lengths, pointers, doc_index, modes, mm


class IndexedDataset:
    """Read-only view of a `{prefix}.bin`/`{prefix}.idx` pair; `ds[i]` is sequence i (a NumPy view, O(1))."""

    def __init__(self, prefix: str | os.PathLike, *, validate: bool = True) -> None:
        self.prefix = normalise_prefix(prefix)
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        (
            self.dtype,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
            self.sequence_modes,
            self._idx_mm,
        ) = _read_index(idx_path)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"data file {bin_path!r} does not exist (its index {idx_path!r} does)")
        self.bin_size = os.path.getsize(bin_path)
        if validate:
            self._validate(idx_path, bin_path)
        itemsize = self.dtype.itemsize
        self.token_offsets = self.sequence_pointers // itemsize  # int64 token offset of each sequence
        if self.bin_size:
            with open(bin_path, "rb") as f:
                self._bin_mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.tokens = np.frombuffer(self._bin_mm, dtype=self.dtype, count=self.bin_size // itemsize)
        else:  # an empty file cannot be memory-mapped
            self._bin_mm = None
            self.tokens = np.zeros(0, dtype=self.dtype)

    def _validate(self, idx_path: str, bin_path: str) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = self.dtype.itemsize
        n = lengths.size
        if docs.size == 0 or docs[0] != 0 or docs[-1] != n or (docs.size > 1 and np.any(np.diff(docs) < 0)):
            raise IndexedDatasetError(
                f"{idx_path!r}: the document index must rise from 0 to the sequence count {n}: corrupted"
            )
        if n and lengths.min() < 0:
            raise IndexedDatasetError(f"{idx_path!r}: negative sequence length: corrupted")
        total = int(lengths.sum(dtype=np.int64))
        if total * itemsize != self.bin_size:
            raise IndexedDatasetError(
                f"{bin_path!r} is {self.bin_size} bytes but {idx_path!r} describes {total} tokens of {self.dtype} "
                f"({total * itemsize} bytes): truncated .bin, or a .bin/.idx pair written with different dtypes"
            )
        if n:
            expected = np.zeros(n, dtype=np.int64)
            np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
            if not np.array_equal(expected * itemsize, pointers):
                bad = int(np.argmax(expected * itemsize != pointers))
                raise IndexedDatasetError(
                    f"{idx_path!r}: pointer of sequence {bad} is {int(pointers[bad])}, expected "
                    f"{int(expected[bad]) * itemsize} from the lengths: corrupted"
                )

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix!r}")
        i %= n
        start = int(self.token_offsets[i])
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        seq = self[i]
        return seq[offset:] if length is None else seq[offset : offset + length]

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences are contiguous in .bin)."""
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return self.tokens[:0]
        start = int(self.token_offsets[first])
        end = int(self.token_offsets[last - 1]) + int(self.sequence_lengths[last - 1])
        return self.tokens[start:end]

    def max_token_id(self) -> int:
        """Largest token id in `.bin` (one pass over the file)."""
        if self.tokens.size == 0:
            return -1
        step = 1 << 26
        return max(int(self.tokens[i : i + step].max()) for i in range(0, self.tokens.size, step))

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, {len(self)} sequences, {self.num_tokens} tokens of {self.dtype})"
