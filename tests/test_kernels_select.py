"""``--kernels`` and Megatron's fusion flags -> one ``KernelSelection``; what cannot be served exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.arguments import parse_run_config
from megatron.config.errors import ConfigError
from megatron.config.kernels import KernelConfig
from megatron.flag_table import KNOWN_IGNORED_FLAGS
from megatron.kernels.select import MAX_NORM_HIDDEN, KernelSelection, resolve_kernels
from megatron.kernels.triton_runtime import interpreter_problem, triton_importable
from megatron.model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


TINY = ["--model-config", "gpt-tiny", "--mock-data", "--train-iters", "2", "--lr", "1e-3"]
needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not installed (the [kernels] extra)")
needs_interpreter = pytest.mark.skipif(
    not _cuda() and interpreter_problem() is not None, reason=f"no Triton interpreter: {interpreter_problem()}"
)


def _model(**kw) -> GPTConfig:
    return GPTConfig(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100,
                        "seq_length": 16, **kw})  # fmt: skip


def test_default_is_torch_without_cuda_and_the_fusion_flags_are_no_longer_ignored() -> None:
    run = parse_run_config(TINY)
    if not _cuda():
        assert run.kernels == KernelSelection(reason=run.kernels.reason)
        assert run.kernels.describe() == (
            "torch (--kernels auto without CUDA; --kernels triton runs Triton's interpreter)"
        )
    moved = [
        "--no-gradient-accumulation-fusion",
        "--no-bias-gelu-fusion",
        "--bias-gelu-fusion",
        "--no-bias-swiglu-fusion",
    ]
    assert not set(moved) & set(KNOWN_IGNORED_FLAGS)
    run = parse_run_config([*TINY, "--kernels", "torch", *moved, "--cross-entropy-loss-fusion"])
    assert run.ignored_flags == () and run.kernels.describe() == "torch (--kernels torch)"


@needs_interpreter
def test_triton_selection_follows_the_fusion_flags() -> None:
    run = parse_run_config([*TINY, "--kernels", "triton", "--no-gradient-accumulation-fusion"])
    k = run.kernels
    assert (k.backend, k.interpreted or _cuda(), k.weight_grad, k.norms, k.bias_gelu, k.cross_entropy) == (
        "triton", True, False, True, True, False
    )  # fmt: skip
    assert k.describe().endswith(
        "LayerNorm (weight grads in B), bias-GeLU; torch: weight gradients (--no-gradient-accumulation-fusion), "
        "cross-entropy (no --cross-entropy-loss-fusion)"
    )
    swiglu = resolve_kernels(
        KernelConfig(kernels="triton", bias_swiglu_fusion=False, cross_entropy_loss_fusion=True),
        _model(swiglu=True, normalization="RMSNorm"),
        on_cuda=False,
    )
    assert (swiglu.bias_gelu, swiglu.bias_swiglu, swiglu.cross_entropy, swiglu.weight_grad) == (
        False,
        False,
        True,
        True,
    )
    assert swiglu.describe() == (
        "triton, Triton interpreter on CPU (--kernels triton): W kernel (fp32 into main_grad), RMSNorm (weight grads "
        "in B), cross-entropy (vocab-chunked); torch: SwiGLU (--no-bias-swiglu-fusion)"
    )
    on_gpu = resolve_kernels(KernelConfig(), _model(), on_cuda=True)
    assert on_gpu.backend == "triton" and not on_gpu.interpreted and on_gpu.reason == "--kernels auto on CUDA"
    assert on_gpu.describe().startswith("triton, compiled for CUDA (--kernels auto on CUDA): W kernel")


@needs_triton
def test_a_shape_the_norm_kernel_cannot_serve() -> None:
    wide = _model(hidden_size=2 * MAX_NORM_HIDDEN, num_attention_heads=64)
    with pytest.raises(ConfigError, match=f"at most {MAX_NORM_HIDDEN} columns.*use --kernels torch"):
        resolve_kernels(KernelConfig(kernels="triton"), wide, on_cuda=True)
    auto = resolve_kernels(KernelConfig(), wide, on_cuda=True)  # auto falls back to torch for that op and says so
    assert not auto.norms and f"LayerNorm (hidden size {2 * MAX_NORM_HIDDEN} > {MAX_NORM_HIDDEN})" in auto.describe()
    from megatron.kernels.norms import MAX_HIDDEN

    assert MAX_HIDDEN == MAX_NORM_HIDDEN


def test_auto_on_cuda_without_triton_stays_on_torch(monkeypatch) -> None:
    import megatron.kernels.select as select

    monkeypatch.setattr(select, "triton_importable", lambda: False)
    k = resolve_kernels(KernelConfig(), _model(), on_cuda=True)
    assert k.backend == "torch" and k.describe() == "torch (--kernels auto on CUDA, but triton is not installed)"
    with pytest.raises(ConfigError, match=r"--kernels triton needs the triton package.*or use --kernels torch"):
        resolve_kernels(KernelConfig(kernels="triton"), _model(), on_cuda=True)


def test_an_interpreter_that_cannot_run_the_kernels_is_refused_at_start(monkeypatch) -> None:
    import importlib.metadata

    import megatron.kernels.select as select

    monkeypatch.setattr(select, "triton_importable", lambda: True)
    monkeypatch.setattr("megatron.kernels.triton_runtime.triton_importable", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.1.0")
    monkeypatch.setattr("numpy.__version__", "2.1.0")
    with pytest.raises(ConfigError, match=r"interpreter, but Triton 3.1.0's interpreter .*pip install \"triton>=3.7"):
        resolve_kernels(KernelConfig(kernels="triton"), _model(), on_cuda=False)
    assert resolve_kernels(KernelConfig(kernels="triton"), _model(), on_cuda=True).backend == "triton"


# Each case runs pretrain_gpt.main in a forked child (its own exit code and stderr); "no-triton" hides the package.
_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {root!r})
    import torch
    torch.set_num_threads(1)
    import pretrain_gpt
    out = {{}}
    for name, argv in json.loads(sys.argv[1]).items():
        err_path = os.path.join({tmp!r}, name + ".err")
        pid = os.fork()
        if pid == 0:
            if name == "no-triton":
                sys.modules["triton"] = None  # find_spec and import both fail, as when it is not installed
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            try:
                code = pretrain_gpt.main(argv)
            except BaseException as e:
                print(repr(e), file=sys.stderr)
                code = 1
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out[name] = [os.waitstatus_to_exitcode(status), open(err_path).read()]
    print(json.dumps(out))
    """
)
BAD = {
    "no-triton": ([*TINY, "--kernels", "triton"], "--kernels triton needs the triton package"),
    "too-wide": (
        [*TINY, "--kernels", "triton", "--hidden-size", "20480", "--num-attention-heads", "32"],
        "the Triton LayerNorm kernel normalises a row in one tile of at most 16384 columns",
    ),
    "bad-choice": ([*TINY, "--kernels", "cuda"], "argument --kernels: invalid choice: 'cuda'"),
}


@needs_interpreter
def test_bad_kernel_requests_exit_2_with_one_line(tmp_path) -> None:
    cases = {name: argv for name, (argv, _) in BAD.items()}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER.format(root=str(ROOT), tmp=str(tmp_path)), json.dumps(cases)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, phrase) in BAD.items():
        code, err = results[name]
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (name, err)
        assert lines[0].startswith("pretrain_gpt.py: error: ") and phrase in lines[0], (name, lines[0])
