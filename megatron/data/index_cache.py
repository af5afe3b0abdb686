"""A cache of index arrays (document, sample, shuffle and blending indices) stored as .npy files next to the data.

An entry is named by a hash of everything its arrays depend on (the dataset's `.idx` content and size of `.bin`, the
split, sequence length, seed, epochs, ...). Arrays are written to temporary files and renamed into place, then a
small JSON description is renamed in last: an entry counts as present only when its description exists and equals
the expected one, so a crash mid-write or a concurrent builder never yields a half-written entry (several ranks may
build the same entry at once; the content is deterministic, so the last rename wins harmlessly).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("megatron.data")

CACHE_FORMAT = 1
_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def dataset_fingerprint(prefix: str) -> str:
    """SHA-256 of the `.idx` file plus the `.bin` size: changes whenever the data is regenerated differently."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    st = os.stat(idx)
    key = (os.path.abspath(idx), st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        with open(idx, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        h.update(str(os.path.getsize(bin_)).encode())
        _FINGERPRINTS[key] = h.hexdigest()
    return _FINGERPRINTS[key]


def default_cache_dir(prefix: str) -> str:
    """`<data dir>/cache`, or a per-user cache when the data directory is read-only."""
    here = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    try:
        os.makedirs(here, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=here, prefix=".probe", delete=True)
        probe.close()
        return here
    except OSError:
        fallback = os.path.join(os.path.expanduser("~"), ".cache", "zb-megatron", "data-index")
        log.warning("data directory of %s is not writable; caching index arrays in %s", prefix, fallback)
        os.makedirs(fallback, exist_ok=True)
        return fallback


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class IndexCache:
    """`load_or_build(description, names, build)` -> dict of arrays, loaded (memory-mapped) when cached."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        os.makedirs(cache_dir, exist_ok=True)

    def _paths(self, stem: str, key: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
        base = os.path.join(self.cache_dir, f"{stem}-{key[:16]}")
        return base + ".json", {n: f"{base}-{n}.npy" for n in names}

    def load_or_build(
        self,
        stem: str,
        description: dict[str, Any],
        names: tuple[str, ...],
        build: Callable[[], dict[str, np.ndarray]],
    ) -> tuple[dict[str, np.ndarray], bool]:
        """Arrays `names` for `description`; returns (arrays, loaded_from_cache)."""
        description = {"cache_format": CACHE_FORMAT, **description}
        text = json.dumps(description, sort_keys=True, indent=1)
        key = hashlib.sha256(text.encode()).hexdigest()
        desc_path, paths = self._paths(stem, key, names)
        if os.path.isfile(desc_path):
            try:
                with open(desc_path) as f:
                    same = f.read() == text
                if same:
                    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}, True
            except (OSError, ValueError) as exc:  # unreadable entry: rebuild it
                log.warning("index cache entry %s unreadable (%s); rebuilding", desc_path, exc)
        arrays = build()
        for n, p in paths.items():
            arr = np.ascontiguousarray(arrays[n])
            _atomic_write(p, lambda tmp, arr=arr: _save_npy(tmp, arr))
        _atomic_write(desc_path, lambda tmp: _save_text(tmp, text))
        return arrays, False


def _save_npy(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


def _save_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
