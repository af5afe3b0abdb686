"""Keep freed host memory in the process, so a CPU pipeline does not page-fault its activations in every iteration.

PyTorch's CPU tensors come from the C library's ``malloc``.  glibc serves a large block (above its mmap
threshold, which grows on its own up to 32 MiB) with a fresh ``mmap`` and unmaps it on ``free``, and gives the top
of the heap back to the kernel once more than the trim threshold is free there.  A pipeline frees and re-allocates
the same activation sizes every microbatch, so memory goes back and comes again: every re-use page-faults fresh
zeroed pages.  The more activations a schedule holds at once, the more it churns -- on the 2-core benchmark
machine (``tools/bench_pipeline.py --quick --parts real --schedules zb-h2 gpipe --host-malloc default``, pp = 2,
m = 4) GPipe took 1,110 / 418 minor faults per iteration on its two ranks, ZB-H2 8 / 353, 1F1B 6 / 2; with the
thresholds raised (the default there) every schedule stays in single or low double digits.

``keep_freed_host_memory`` raises both thresholds (``mallopt``), so freed blocks stay in the heap for the next
microbatch.  The price: a process keeps its peak heap size until it exits -- which a training job reaches in its
first iteration anyway.  glibc only; elsewhere it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc caps M_MMAP_THRESHOLD at HEAP_MAX / 2 = 32 MiB on 64-bit
DEFAULT_TRIM_THRESHOLD = 2**30


def keep_freed_host_memory(
    *, mmap_threshold: int = _MAX_MMAP_THRESHOLD, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> bool:
    """Serve blocks up to ``mmap_threshold`` bytes from the heap and keep up to ``trim_threshold`` free bytes at its
    top.  Returns True when glibc accepted both settings, False where there is no glibc ``mallopt``."""
    if not (0 < mmap_threshold <= _MAX_MMAP_THRESHOLD):
        raise ValueError(f"mmap_threshold {mmap_threshold} must be in (0, {_MAX_MMAP_THRESHOLD}] bytes")
    if trim_threshold <= 0:
        raise ValueError(f"trim_threshold {trim_threshold} must be > 0 bytes")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim = min(trim_threshold, 2**31 - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))
