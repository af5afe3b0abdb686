"""Compile every Triton kernel for a CUDA architecture, on any machine: ``python -m megatron.kernels.compile_check``.

The interpreter runs the kernels' arithmetic on CPU but not Triton's compiler (layouts, ``tl.dot`` shapes and dtypes,
what a ``tl.constexpr`` branch leaves to compile); this check lowers each kernel, in the specializations the trainer
launches on a GPU (bf16 and fp32 operands, each compile-time switch), through Triton's whole pipeline to PTX and a
cubin for ``--arch`` (default sm_90), which needs no GPU: Triton ships its own ``ptxas``.  It prints one line per
kernel and exits 1 if any fails.  ``tests/test_kernels_compile.py`` runs it with the installed Triton (3.1 is the oldest
supported: the one a CUDA torch 2.5 pins).

It must run in a fresh process with ``TRITON_INTERPRET=0`` (``megatron.kernels.triton_runtime`` then leaves Triton
compiling even without CUDA); ``main`` sets that up by re-running itself when needed.  Triton's ``ASTSource``
changed shape between 3.1 and 3.2 (signature keyed by index or by name); both are handled.
"""

# ruff: noqa: N803

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

# (kernel module, kernel name, argument types or constexpr values, what it is).  Pointers "*bf16"/"*fp32"/"*i64",
# scalars "i32"/"fp32"; anything else is a constexpr value.
_BF16, _F32, _I64 = "*bf16", "*fp32", "*i64"
_NORM_FWD = dict(x_ptr=_BF16, w_ptr=_BF16, b_ptr=_BF16, y_ptr=_BF16, mean_ptr=_F32, rstd_ptr=_F32, N="i32",
                 H="i32", stride_x="i32", stride_y="i32", eps="fp32", ROWS=4, BLOCK_H=1024)  # fmt: skip
_NORM_DX = dict(x_ptr=_BF16, w_ptr=_BF16, dy_ptr=_BF16, dx_ptr=_BF16, mean_ptr=_F32, rstd_ptr=_F32, N="i32",
                H="i32", stride_x="i32", stride_dy="i32", stride_dx="i32", ROWS=4, BLOCK_H=1024)  # fmt: skip
_NORM_DW = dict(x_ptr=_BF16, dy_ptr=_BF16, mean_ptr=_F32, rstd_ptr=_F32, dw_ptr=_F32, db_ptr=_F32, N="i32",
                H="i32", rows_per_group="i32", stride_x="i32", stride_dy="i32", ROWS=32, BLOCK_H=256)  # fmt: skip
_ACT = dict(y_ptr=_BF16, b_ptr=_BF16, dout_ptr=_BF16, out_ptr=_BF16, N="i32", F="i32", stride_y="i32",
            stride_out="i32", ROWS=2, BLOCK_F=1024)  # fmt: skip
_W = dict(gy_ptr=_BF16, x_ptr=_BF16, g_ptr=_F32, N="i32", O="i32", I="i32", stride_gy_n="i32", stride_gy_o="i32",
          stride_x_n="i32", stride_x_i="i32", stride_g_o="i32", stride_g_i="i32", BLOCK_O=128, BLOCK_I=128,
          BLOCK_N=32)  # fmt: skip
_CE = dict(logits_ptr=_BF16, target_ptr=_I64, N="i32", V="i32", valid="i32", stride_n="i32", ROWS=1, BLOCK_V=4096)

_NORMS = (("LayerNorm", False), ("RMSNorm", True))  # (label, RMS); LayerNorm has a bias, RMSNorm none
_ACTS = (  # (forward label, backward label, constexpr switches)
    ("bias-GeLU", "bias-GeLU backward", dict(HAS_BIAS=True, SWIGLU=False, TANH=False)),
    ("bias-GeLU (tanh, --openai-gelu)", "bias-GeLU (tanh) backward", dict(HAS_BIAS=True, SWIGLU=False, TANH=True)),
    ("SwiGLU", "SwiGLU backward", dict(HAS_BIAS=False, SWIGLU=True, TANH=False)),
)

KERNELS: list[tuple[str, str, dict[str, Any], str]] = [
    ("weight_grad", "weight_grad_kernel", {**_W, "UPCAST": False, "IEEE": False}, "W kernel, bf16"),
    (
        "weight_grad",
        "weight_grad_kernel",
        {**_W, "gy_ptr": _F32, "x_ptr": _F32, "UPCAST": False, "IEEE": True},
        "W kernel, fp32 (ieee)",
    ),
    *[("norms", "norm_forward_kernel", {**_NORM_FWD, "RMS": r, "HAS_BIAS": not r}, f"{n} forward") for n, r in _NORMS],
    *[("norms", "norm_input_grad_kernel", {**_NORM_DX, "RMS": r}, f"{n} input grad (B)") for n, r in _NORMS],
    *[
        ("norms", "norm_weight_grad_kernel", {**_NORM_DW, "RMS": r, "HAS_BIAS": not r}, f"{n} weight grad")
        for n, r in _NORMS
    ],
    *[
        ("activations", "bias_act_kernel", {**_ACT, **switches, "BACKWARD": backward}, label)
        for forward_label, backward_label, switches in _ACTS
        for backward, label in ((False, forward_label), (True, backward_label))
    ],
    (
        "cross_entropy",
        "softmax_stats_kernel",
        {**_CE, "max_ptr": _F32, "sum_ptr": _F32, "tlogit_ptr": _F32},
        "cross-entropy statistics",
    ),
    (
        "cross_entropy",
        "cross_entropy_grad_kernel",
        {**_CE, "lse_ptr": _F32, "dloss_ptr": _F32, "grad_ptr": _BF16, "stride_grad": "i32"},
        "cross-entropy gradient",
    ),
]


def _is_type(v: Any) -> bool:
    return isinstance(v, str) and (v.startswith("*") or v in ("i32", "i64", "fp32"))


def _source(triton: Any, fn: Any, args: dict[str, Any]) -> Any:
    names = list(fn.arg_names)
    missing = set(names) ^ set(args)
    if missing:
        raise ValueError(f"{fn.__name__}: arguments {sorted(missing)} do not match the kernel's")
    args = {n: args[n] for n in names}  # in the kernel's order (Triton 3.1 reads the signature positionally)
    ast_source = triton.compiler.ASTSource
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 1):
        signature = {names.index(n): v for n, v in args.items() if _is_type(v)}
        constants = {names.index(n): v for n, v in args.items() if not _is_type(v)}
        return ast_source(fn=fn, signature=signature, constants=constants)
    signature = {n: (v if _is_type(v) else "constexpr") for n, v in args.items()}
    constexprs = {(names.index(n),): v for n, v in args.items() if not _is_type(v)}
    return ast_source(fn=fn, signature=signature, constexprs=constexprs)


QUICK = (
    "W kernel, bf16",
    "LayerNorm forward",
    "LayerNorm input grad (B)",
    "RMSNorm weight grad",
    "bias-GeLU backward",
    "SwiGLU",
    "cross-entropy statistics",
    "cross-entropy gradient",
)  # each kernel function once


def compile_all(arch: int, *, quick: bool = False) -> list[str]:
    """Compile every entry of ``KERNELS`` (``quick``: those in ``QUICK``) for ``sm_<arch>``; returns the failures
    (one line each) and prints a line per kernel."""
    import importlib

    from megatron.kernels.triton_runtime import import_triton

    triton, _ = import_triton()
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for module, name, args, what in KERNELS:
        if quick and what not in QUICK:
            continue
        fn = getattr(importlib.import_module(f"megatron.kernels.{module}"), name)
        start = time.perf_counter()
        try:
            out = triton.compile(_source(triton, fn, args), target=target, options={"num_warps": 4})
            ok = "cubin" in out.asm
            line = f"ok    {what:<28} {name} ({time.perf_counter() - start:.1f} s)"
        except Exception as err:  # report every kernel, not only the first failure
            ok, line = False, f"FAIL  {what:<28} {name}: {str(err).strip().splitlines()[-1][:200]}"
        print(line, flush=True)
        if not ok:
            failures.append(line)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.kernels.compile_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80 or 90 (default 90)")
    parser.add_argument("--quick", action="store_true", help="each kernel function in one specialization only")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "0" or "triton" in sys.modules:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
        cmd = [sys.executable, "-m", "megatron.kernels.compile_check", "--arch", str(args.arch)]
        return subprocess.run(cmd + (["--quick"] if args.quick else []), env=env).returncode
    import triton

    print(f"triton {triton.__version__}: compiling for sm_{args.arch}", flush=True)
    return 1 if compile_all(args.arch, quick=args.quick) else 0


if __name__ == "__main__":
    sys.exit(main())
