"""Every Triton kernel compiles for CUDA (to PTX and a cubin, with Triton's own ptxas), here, without a GPU.

The interpreter tests check the kernels' arithmetic; this checks what only the compiler sees (``tl.dot`` shapes and
dtypes, layouts, the branches each ``tl.constexpr`` switch leaves).  ``make test`` compiles each kernel function once
for sm_90 (a few seconds); the slow test compiles every specialization for sm_80 and sm_90.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.kernels.compile_check import KERNELS, QUICK
from megatron.kernels.triton_runtime import triton_importable

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed (the [kernels] extra)")


def _compile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron.kernels.compile_check", *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_each_kernel_compiles_for_sm90() -> None:
    proc = _compile("--arch", "90", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("\nok ") == len(QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["80", "90"])
def test_every_specialization_compiles(arch: str) -> None:
    proc = _compile("--arch", arch)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("\nok ") == len(KERNELS)
