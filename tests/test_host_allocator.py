"""keep_freed_host_memory: activation-sized blocks come from the heap and stay there when freed.

Read from glibc's own accounting (``mallinfo2``), not timed: in a fresh process, four 8 MiB tensors are served by
``mmap`` under glibc's defaults (each free unmaps them, each re-allocation page-faults them in again) and from the
heap once the thresholds are raised.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from zb_pipeline.runtime.host_allocator import keep_freed_host_memory

_PROBE = """
import ctypes, sys, torch
from zb_pipeline.runtime.host_allocator import keep_freed_host_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keep")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
applied = keep_freed_host_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblkhd
held = [torch.ones(2**21) for _ in range(4)]  # 4 x 8 MiB
mapped = libc.mallinfo2().hblkhd - before
del held
print(applied, mapped / 2**20)
"""


def _mmapped_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    applied, mib = out.stdout.split()
    return applied, float(mib)


def _has_mallinfo2() -> bool:
    try:
        return platform.system() == "Linux" and hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_activation_sized_blocks_come_from_the_heap() -> None:
    applied, kept = _mmapped_mib("keep")
    _, default = _mmapped_mib("default")
    assert applied == "True"
    assert default >= 32  # glibc's defaults: every 8 MiB block is its own mapping
    assert kept < 1  # raised thresholds: none of them is


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="mmap_threshold"):
        keep_freed_host_memory(mmap_threshold=64 * 2**20)
    with pytest.raises(ValueError, match="trim_threshold"):
        keep_freed_host_memory(trim_threshold=0)
