"""Checkpoint files on disk: atomic directories, a verified manifest, code-free loading, fault injection.

Layout of one checkpoint (``iter_0000010/`` under ``--save``)::

    common.pt                    iteration, data position, LR schedule, loss scaler, counters, model + layout config
    model_tp00_pp000.pt          weights of one (tp, pp) position, keyed by global parameter name, + split metadata
    optim_tp00_pp000_dp000.pt    optimizer pieces (fp32 main params, Adam moments) of one data-parallel shard
    rng_rank00000.pt             Python, NumPy and torch RNG states of one rank
    tokenizer/                   the tokenizer's files (vocab.json + merges.txt, tokenizer.json or tokenizer.model)
    manifest.json                size and sha256 of every file above (written last)

and ``latest_checkpointed_iteration.txt`` next to the ``iter_*`` directories names the newest complete one.

Atomicity: every rank writes into ``iter_0000010.tmp``; rank 0 writes the manifest, renames the directory to its
final name and only then replaces the tracker (write a temporary file, ``os.replace``). A crash at any point leaves
the tracker naming the previous, complete checkpoint.  Stale ``iter_*.tmp`` directories (crashed saves, of any
iteration) are removed by the next successful save, once its tracker is in place (``remove_stale_tmp``).

Safety: files are read with ``torch.load(weights_only=True)`` (tensors and plain containers only; a pickled object
that would run code is refused) after their size and sha256 match the manifest, which is JSON.

Fault injection (tests): ``ZB_CKPT_FAIL_AFTER_FILES=k`` makes a save crash (``SimulatedCrashError``, nothing cleaned
up, as if the process died) after this process wrote ``k`` files of that save; ``ZB_CKPT_ENOSPC=k`` raises
``OSError(ENOSPC)`` instead. ``ZB_CKPT_FAULT_ITERATION=n`` limits the switches to the save of iteration ``n`` and
``ZB_CKPT_FAULT_RANK=r`` to one rank.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron.config.errors import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
_TMP_NAME = re.compile(r"iter_\d{7,}\.tmp")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class SimulatedCrashError(RuntimeError):
    """Raised by the fault-injection switch to stand in for a process killed in the middle of a save."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def tmp_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}.tmp"


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def optim_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:03d}.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


COMMON = "common.pt"


# ------------------------------------------------------------------------------------------------ fault switches
class _FaultInjector:
    """Counts the files this process wrote and fires the switches from the environment."""

    def __init__(self) -> None:
        self.written = 0
        self.iteration: int | None = None

    def start_save(self, iteration: int) -> None:
        self.written = 0
        self.iteration = iteration

    def before_write(self, rank: int, path: Path) -> None:
        only = os.environ.get("ZB_CKPT_FAULT_RANK")
        if only is not None and int(only) != rank:
            return
        at = os.environ.get("ZB_CKPT_FAULT_ITERATION")
        if at is not None and int(at) != self.iteration:
            return
        crash_after = os.environ.get("ZB_CKPT_FAIL_AFTER_FILES")
        if crash_after is not None and self.written >= int(crash_after):
            raise SimulatedCrashError(f"fault injection: save crashed after {self.written} files (before {path.name})")
        enospc_after = os.environ.get("ZB_CKPT_ENOSPC")
        if enospc_after is not None and self.written >= int(enospc_after):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


FAULTS = _FaultInjector()


# ----------------------------------------------------------------------------------------------------- writing
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_tensor_file(path: Path, obj: Any, *, rank: int = 0) -> dict[str, Any]:
    """``torch.save`` ``obj`` (tensors and plain data) to ``path``, fsync it; returns its manifest entry."""
    FAULTS.before_write(rank, path)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    FAULTS.written += 1
    return file_entry(path)


def copy_file(source: str | Path, path: Path, *, rank: int = 0) -> dict[str, Any]:
    """Copy ``source`` byte for byte to ``path`` (parent directories made), fsync it; returns its manifest entry."""
    FAULTS.before_write(rank, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(path, "wb") as f:
        shutil.copyfileobj(src, f)
        f.flush()
        os.fsync(f.fileno())
    FAULTS.written += 1
    return file_entry(path)


def file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def prepare_tmp(root: str | Path, iteration: int) -> Path:
    """(Rank 0) an empty ``iter_XXXXXXX.tmp`` directory, removing a stale one left by a crashed save."""
    tmp = tmp_dir(root, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: str | Path, iteration: int, entries: dict[str, dict[str, Any]], *, rank: int = 0) -> Path:
    """(Rank 0) write the manifest, rename the directory into place, then point the tracker at it."""
    root = Path(root)
    tmp = tmp_dir(root, iteration)
    manifest = {"format": FORMAT_VERSION, "iteration": iteration, "files": dict(sorted(entries.items()))}
    FAULTS.before_write(rank, tmp / MANIFEST)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    FAULTS.written += 1
    _fsync_dir(tmp)
    final = iteration_dir(root, iteration)
    if final.exists():  # re-saving the same iteration: move the old one aside first, drop it after the swap
        old = root / f"{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    FAULTS.before_write(rank, root / TRACKER)
    tracker_tmp = root / f"{TRACKER}.tmp"
    with open(tracker_tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, root / TRACKER)
    FAULTS.written += 1
    _fsync_dir(root)
    remove_stale_tmp(root)
    return final


def remove_tmp(root: str | Path, iteration: int) -> None:
    shutil.rmtree(tmp_dir(root, iteration), ignore_errors=True)


def remove_stale_tmp(root: str | Path) -> list[Path]:
    """(Rank 0, after a commit) remove every ``iter_XXXXXXX.tmp`` directory under ``root``: each is a save that
    crashed before its commit, whatever its iteration (the one just committed was renamed away).  Returns them."""
    stale = sorted(p for p in Path(root).glob("iter_*.tmp") if _TMP_NAME.fullmatch(p.name) and p.is_dir())
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def check_writable(root: str | Path) -> None:
    """Raise ``ConfigError`` unless ``--save`` can be created and written."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"--save {root} is not writable ({err.strerror or err}); pass a directory you can write to"
        ) from None


# ----------------------------------------------------------------------------------------------------- reading
def read_tracker(root: str | Path) -> int | None:
    """The iteration the tracker names; ``None`` when ``root`` holds no checkpoint yet. Bad input -> ConfigError."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"--load {root} does not exist; pass the directory you saved to with --save")
    tracker = root / TRACKER
    if not tracker.is_file():
        if any(root.glob("iter_*")):
            raise ConfigError(
                f"--load {root} has iter_* directories but no {TRACKER}; write the iteration to load into it"
            )
        return None
    text = tracker.read_text().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise ConfigError(f"{tracker} holds {text[:40]!r}, not an iteration number; fix or remove it") from None
    if not iteration_dir(root, iteration).is_dir():
        raise ConfigError(
            f"{tracker} points at iteration {iteration} but {iteration_dir(root, iteration)} does not exist; "
            "restore that directory or write an existing iteration into the tracker"
        )
    return iteration


def read_latest_common(root: str | Path) -> dict[str, Any] | None:
    """The verified ``common.pt`` of the tracker's iteration under ``root`` (``None``: no checkpoint there yet)."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    directory = iteration_dir(root, iteration)
    return verified_load(directory, COMMON, read_manifest(directory))


def read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"checkpoint {directory} has no valid {MANIFEST} ({err}); it is incomplete or damaged"
        ) from None
    return files


def verified_load(directory: Path, name: str, manifest: dict[str, dict[str, Any]]) -> Any:
    """Load ``directory/name`` after checking it against the manifest; never unpickles code."""
    return safe_torch_load(verified_path(directory, name, manifest))


def verified_path(directory: Path, name: str, manifest: dict[str, dict[str, Any]]) -> Path:
    """``directory/name`` after checking its size and sha256 against the manifest (``ConfigError`` if they differ)."""
    path = directory / name
    entry = manifest.get(name)
    if entry is None:
        raise ConfigError(f"checkpoint {directory} has no {name} in its manifest; it was written by another layout")
    if not path.is_file():
        raise ConfigError(f"checkpoint file {path} is missing; restore it or load an earlier iteration")
    size = path.stat().st_size
    if size != entry.get("size"):
        raise ConfigError(
            f"checkpoint file {path} is damaged: {size} bytes, the manifest says {entry.get('size')}; "
            "restore it or load an earlier iteration"
        )
    if file_entry(path)["sha256"] != entry.get("sha256"):
        raise ConfigError(
            f"checkpoint file {path} is damaged: its sha256 does not match the manifest; "
            "restore it or load an earlier iteration"
        )
    return path


def safe_torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with a one-line ``ConfigError`` for anything that is not plain data."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"refusing checkpoint file {path}: it is not plain tensors and data ({first[:160]})"
        ) from None
