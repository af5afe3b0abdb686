"""Detecting apex and Transformer Engine, the optional vendor libraries the selection point may choose.

Nothing here imports a library to ask whether it is installed (``importlib.util.find_spec``); ``megatron.kernels``
modules import them only once ``megatron.kernels.select`` has chosen them.  Neither library is a dependency of this
project, and neither has run with it: the adapters are tested against fake modules that record their calls
(``tests/test_kernels_vendor.py``).

- apex: its CUDA extension ``fused_weight_gradient_mlp_cuda`` (built with ``--cuda_ext``) holds
  ``wgrad_gemm_accum_fp32(input, d_output, d_weight)``, a cuBLAS GEMM accumulating ``d_output^T @ input`` into the
  fp32 ``d_weight`` in place: the same operation as our Triton W kernel (``megatron.kernels.apex_weight_grad``).
- Transformer Engine: ``transformer_engine.pytorch``'s ``Linear``, ``LayerNormLinear`` and ``LayerNormMLP`` with
  ``delay_wgrad_compute=True`` keep their weight-gradient GEMMs until ``module.backward_dw()`` is called; that
  argument exists from TE 2.3 (``TE_MIN_VERSION``), which is what ``--transformer-impl transformer_engine`` requires
  (``megatron.kernels.transformer_engine``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

APEX_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"
TE_MIN_VERSION = (2, 3)
TE_INSTALL = 'pip install --no-build-isolation "transformer_engine[pytorch]>=2.3"'


def _installed(name: str) -> bool:
    if name in sys.modules:  # also a module put there by a test
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def apex_weight_grad_available() -> bool:
    """Whether apex's fused weight-gradient extension can be imported (found, not imported)."""
    return _installed(APEX_WGRAD_MODULE)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.3.0+abc"`` -> ``(2, 3, 0)`` (leading digits of each dot-separated part)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def transformer_engine_version() -> str | None:
    """The installed Transformer Engine's version, or ``None`` if it is not installed (imports it to ask)."""
    if not _installed("transformer_engine"):
        return None
    module = importlib.import_module("transformer_engine")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("transformer_engine")
        except importlib.metadata.PackageNotFoundError:
            version = "0"
    return str(version)


def transformer_engine_problem() -> str | None:
    """Why ``--transformer-impl transformer_engine`` cannot run here (with the fix), or ``None``."""
    version = transformer_engine_version()
    need = ".".join(map(str, TE_MIN_VERSION))
    if version is None:
        return (
            f"--transformer-impl transformer_engine needs Transformer Engine >= {need}, which is not installed; "
            f"{TE_INSTALL}, or use --transformer-impl local"
        )
    if version_tuple(version)[:2] < TE_MIN_VERSION:
        return (
            f"--transformer-impl transformer_engine needs Transformer Engine >= {need} (delay_wgrad_compute, "
            f"backward_dw), but {version} is installed; {TE_INSTALL}, or use --transformer-impl local"
        )
    return None
