"""Importing Triton for our kernels, compiled for CUDA or run by Triton's interpreter on CPU.

Triton decides between compiling and interpreting when a function is *decorated* (``@triton.jit`` reads
``TRITON_INTERPRET`` then), and Triton's own ``@jit`` helpers (``tl.sum``, ...) are decorated when ``triton`` is
first imported.  So the choice is made here, once, before that: on a machine without CUDA, ``import_triton()`` sets
``TRITON_INTERPRET=1`` and only then imports ``triton``; the kernel modules get ``triton`` through it, and their
kernels run on CPU tensors through NumPy.  Code that only asks whether Triton is there (the selection, the tests) uses
``triton_importable()``, which does not import it, and ``import_triton`` refuses to go on if something imported
``triton`` first.  On a CUDA machine nothing is set and the kernels compile (a test wanting the interpreter there sets
``TRITON_INTERPRET=1`` in the environment before starting).  No other module of the project imports Triton or reads
the variable, so the setting changes nothing outside ``megatron.kernels`` (torch.compile on CPU generates C++).

The interpreter computes fp32 and fp16 arithmetic, but bf16 only as casts (its NumPy arrays have no bf16 type).
Kernels that do arithmetic in the operands' own dtype (the weight-gradient kernel's ``tl.dot``) take a compile-time
``UPCAST`` switch, ``upcast_operands(dtype)``: True only when interpreting bf16, and then they cast operands to fp32
right after loading (results are cast back to the output's dtype when stored).  The row-wise kernels (norms,
activations, cross-entropy) compute in fp32 after every load on all devices, as they would on a GPU anyway.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run our kernels here, or ``None``.  Interpreters before Triton 3.7 turn a
    kernel's runtime loop bound into a one-element array that NumPy 2 refuses to use as an index (every kernel with a
    loop over tokens or vocabulary fails); checked from the installed versions, without importing Triton."""
    if not triton_importable():
        return "triton is not installed"
    import numpy

    triton_version = importlib.metadata.version("triton")
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy.__version__) >= (2, 0):
        return (
            f"Triton {triton_version}'s interpreter cannot run these kernels with NumPy {numpy.__version__}; "
            'pip install "triton>=3.7,<4" (or NumPy < 2) for the CPU interpreter'
        )
    return None


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def interpreting() -> bool:
    """Whether Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


@functools.cache
def import_triton() -> tuple[ModuleType, ModuleType]:
    """``(triton, triton.language)``; without CUDA, first switches Triton to its interpreter (module docstring)
    unless ``TRITON_INTERPRET`` is set already (``0``: compile only, as ``megatron.kernels.compile_check`` does)."""
    if INTERPRET_ENV not in os.environ and not torch.cuda.is_available():
        if "triton" in sys.modules:  # its own @jit helpers (tl.sum, ...) were already built for compiling
            raise RuntimeError(
                "triton was imported before megatron.kernels could switch it to its interpreter (no CUDA here); "
                f"set {INTERPRET_ENV}=1 in the environment, or import the kernels before anything imports triton"
            )
        os.environ[INTERPRET_ENV] = "1"
    import triton
    import triton.language as tl

    return triton, tl


def upcast_operands(dtype: torch.dtype) -> bool:
    """The ``UPCAST`` switch of kernels that compute in their operands' dtype: bf16 under the interpreter."""
    return dtype == torch.bfloat16 and interpreting()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_size(n: int, *, lo: int, hi: int) -> int:
    """A power of two covering ``n``, clamped to ``[lo, hi]``."""
    return max(lo, min(hi, next_power_of_2(n)))


def rows_per_program(num_rows: int, row_block: int, *, budget: int = 8192) -> int:
    """Rows one program of a row-wise kernel handles: a tile of at most ``budget`` elements on a GPU (occupancy);
    under the interpreter as many as fit, since each program instance costs about a millisecond there."""
    limit = 1 << 16 if interpreting() else budget
    return block_size(num_rows, lo=1, hi=max(1, limit // row_block))
