"""apex and Transformer Engine at the selection point, tested with fake modules that record their calls.

Neither library can be installed here.  The fakes implement only what our adapters call, with the documented
signatures: apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, d_output, d_weight)``, and TE's
``Linear``/``LayerNormLinear``/``LayerNormMLP`` with ``delay_wgrad_compute`` (the backward keeps each weight-gradient
GEMM in a FIFO, ``backward_dw()`` pops the oldest) and ``fuse_wgrad_accumulation`` (into ``main_grad``; biases to
``.grad``).  The fake TE layers compute what the local layer computes, so a TE model must match the local one.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.config.errors import ConfigError
from megatron.config.kernels import KernelConfig
from megatron.kernels.select import KernelSelection, apply_kernels, resolve_kernels
from megatron.kernels.triton_runtime import triton_importable
from megatron.kernels.vendor import version_tuple
from megatron.model import GPTConfig, GPTStage
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ fake modules
class _DelayedLinearFn(torch.autograd.Function):
    """y = x W^T + b; backward returns grad x only and queues (x, grad y) for the owner's backward_dw."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, slot):
        ctx.save_for_backward(x, weight)
        ctx.owner, ctx.slot = owner, slot
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        ctx.owner.pending_gemms.append((ctx.slot, x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])))
        return gy.matmul(weight), None, None, None, None


class _FakeTEModule(torch.nn.Module):
    calls: list = []  # (class name, method) of every backward_dw, shared by all fakes of one test

    def __init__(self, *, bias, params_dtype, device, delay_wgrad_compute, fuse_wgrad_accumulation, **norm):
        super().__init__()
        assert delay_wgrad_compute and fuse_wgrad_accumulation
        self.dtype, self.device_, self.use_bias = params_dtype, device, bias
        self.eps, self.normalization = norm.get("eps"), norm.get("normalization")
        self.pending_gemms: list = []
        self.fifo: deque = deque()

    def _param(self, *shape):
        return torch.nn.Parameter(torch.zeros(*shape, dtype=self.dtype, device=self.device_))

    def _norm(self, x):
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.layer_norm_weight, self.layer_norm_bias, self.eps)

    def _linear(self, x, slot):
        weight, bias = getattr(self, f"{slot}weight"), getattr(self, f"{slot}bias", None)
        return _DelayedLinearFn.apply(x, weight, bias if self.use_bias else None, self, slot)

    def forward(self, x):
        out = self._compute(x)
        if out.requires_grad:  # one FIFO entry per backward: all of this module's GEMMs
            out.register_hook(lambda g: self.pending_gemms.clear())
        return out

    def _grad_done(self):
        pass

    def backward_dw(self):
        _FakeTEModule.calls.append((type(self).__name__, "backward_dw"))
        for slot, x, gy in self.fifo.popleft():
            weight = getattr(self, f"{slot}weight")
            weight.main_grad.add_(gy.t().float() @ x.float())  # fuse_wgrad_accumulation
            if self.use_bias:
                bias = getattr(self, f"{slot}bias")
                bias.grad = gy.sum(0) if bias.grad is None else bias.grad + gy.sum(0)  # TE: bias to .grad


def _queue_after_backward(module, x):
    """Moves the GEMMs of one backward into one FIFO entry once that backward reached the module's input."""
    if not x.requires_grad:
        return x

    def hook(g):
        module.fifo.append(list(module.pending_gemms))
        module.pending_gemms.clear()

    x.register_hook(hook)
    return x


class FakeLinear(_FakeTEModule):
    def __init__(self, in_features, out_features, **kw):
        super().__init__(**kw)
        self.weight = self._param(out_features, in_features)
        self.bias = self._param(out_features) if self.use_bias else None

    def forward(self, x):
        x = _queue_after_backward(self, x.view_as(x))
        return self._linear(x, "")


class FakeLayerNormLinear(FakeLinear):
    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, **kw)
        self.layer_norm_weight = self._param(in_features)
        self.layer_norm_bias = self._param(in_features) if self.normalization == "LayerNorm" else None

    def forward(self, x):
        x = _queue_after_backward(self, x.view_as(x))
        return self._linear(self._norm(x), "")


class FakeLayerNormMLP(_FakeTEModule):
    def __init__(self, hidden_size, ffn_hidden_size, *, activation, **kw):
        super().__init__(**kw)
        self.activation = activation
        self.layer_norm_weight = self._param(hidden_size)
        self.layer_norm_bias = self._param(hidden_size) if self.normalization == "LayerNorm" else None
        fc1 = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.fc1_weight, self.fc2_weight = self._param(fc1, hidden_size), self._param(hidden_size, ffn_hidden_size)
        self.fc1_bias = self._param(fc1) if self.use_bias else None
        self.fc2_bias = self._param(hidden_size) if self.use_bias else None

    def forward(self, x):
        x = _queue_after_backward(self, x.view_as(x))
        y = self._linear(self._norm(x), "fc1_")
        if self.activation == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return self._linear(y, "fc2_")


def _fake_te_module(version: str = "2.4.0") -> types.ModuleType:
    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.Linear, te.pytorch.LayerNormLinear = FakeLinear, FakeLayerNormLinear
    te.pytorch.LayerNormMLP = FakeLayerNormMLP
    return te


def _fake_te(monkeypatch, version="2.4.0"):
    te = _fake_te_module(version)
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(_FakeTEModule, "calls", [])
    return te


def _fake_apex(monkeypatch):
    calls = []

    def wgrad_gemm_accum_fp32(inp, d_output, d_weight):
        assert inp.is_contiguous() and d_output.is_contiguous() and d_weight.dtype == torch.float32
        calls.append((tuple(inp.shape), tuple(d_output.shape), tuple(d_weight.shape)))
        d_weight.add_(d_output.t().float() @ inp.float())

    ext = types.ModuleType("fused_weight_gradient_mlp_cuda")
    ext.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", ext)
    return calls


def _model(**kw) -> GPTConfig:
    return GPTConfig(**{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64,
                        "seq_length": 8, "attention_dropout": 0.0, "hidden_dropout": 0.0, **kw})  # fmt: skip


# TE parameter -> local parameter within a layer
TE_TO_LOCAL = {
    "qkv.inner.weight": "self_attention.linear_qkv.weight",
    "qkv.inner.bias": "self_attention.linear_qkv.bias",
    "qkv.inner.layer_norm_weight": "input_layernorm.weight",
    "qkv.inner.layer_norm_bias": "input_layernorm.bias",
    "proj.inner.weight": "self_attention.linear_proj.weight",
    "proj.inner.bias": "self_attention.linear_proj.bias",
    "mlp.inner.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.inner.layer_norm_bias": "pre_mlp_layernorm.bias",
    "mlp.inner.fc1_weight": "mlp.linear_fc1.weight",
    "mlp.inner.fc1_bias": "mlp.linear_fc1.bias",
    "mlp.inner.fc2_weight": "mlp.linear_fc2.weight",
    "mlp.inner.fc2_bias": "mlp.linear_fc2.bias",
}


def _local_name(name: str) -> str:
    """``layers.3.mlp.inner.fc1_weight`` -> ``layers.3.mlp.linear_fc1.weight`` (other names unchanged)."""
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in TE_TO_LOCAL:
        return f"layers.{parts[1]}.{TE_TO_LOCAL[parts[2]]}"
    return name


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.main_grad if getattr(p, "zb_deferrable", False) else p.grad


def _stage(cfg):
    torch.manual_seed(0)
    stage = GPTStage(cfg, layer_range=range(cfg.num_layers), pre_process=False, post_process=False, seed=7)
    for p in stage.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return stage


# ----------------------------------------------------------------------------------------------- selection
def test_transformer_engine_refused_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed, whatever this machine has
    te = KernelConfig(transformer_impl="transformer_engine")
    with pytest.raises(ConfigError, match=r"needs Transformer Engine >= 2\.3, which is not installed; pip install"):
        resolve_kernels(te, _model(), on_cuda=True)
    _fake_te(monkeypatch, version="2.2.1")
    with pytest.raises(ConfigError, match=r"but 2\.2\.1 is installed"):
        resolve_kernels(te, _model(), on_cuda=True)
    _fake_te(monkeypatch)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        resolve_kernels(te, _model(), on_cuda=False)
    with pytest.raises(ConfigError, match="tensor-model-parallel-size 1 here, not 2"):
        resolve_kernels(te, _model(), on_cuda=True, tp_size=2)
    assert version_tuple("2.10.0+cu12") == (2, 10, 0) and version_tuple("2.3.0.dev0") == (2, 3, 0)


def test_transformer_engine_selected(monkeypatch):
    _fake_te(monkeypatch)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", None)
    sel = resolve_kernels(KernelConfig(kernels="torch", transformer_impl="transformer_engine"), _model(), on_cuda=True)
    assert sel.transformer_impl == "transformer_engine" and sel.transformer_engine_version == "2.4.0"
    assert sel.describe() == (
        "torch (--kernels torch); layers: Transformer Engine 2.4.0 (delay_wgrad_compute; W runs backward_dw)"
    )


def test_transformer_engine_without_te_exits_2_in_one_line():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    code = "import sys; sys.modules['transformer_engine'] = None; sys.argv[0] = 'pretrain_gpt.py'; "
    code += "import runpy; runpy.run_path('pretrain_gpt.py', run_name='__main__')"
    args = ["--model-config", "gpt-tiny", "--mock-data", "--train-iters", "1", "--lr", "1e-3"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, "--transformer-impl", "transformer_engine"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Transformer Engine >= 2.3, which is not installed" in lines[0], proc.stderr


def test_apex_weight_grad_selection(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", None)
    auto = KernelConfig()
    assert resolve_kernels(auto, _model(), on_cuda=False).weight_grad_impl == "torch"
    _fake_apex(monkeypatch)
    assert resolve_kernels(auto, _model(), on_cuda=False).weight_grad_impl == "torch"  # apex needs CUDA
    if triton_importable():
        assert resolve_kernels(KernelConfig(kernels="triton"), _model(), on_cuda=True).weight_grad_impl == "triton"
    sel = resolve_kernels(auto, _model(), on_cuda=True)
    assert sel.weight_grad_impl == "apex" and "W kernel: apex wgrad_gemm_accum_fp32" in sel.describe()
    assert "W kernel (fp32" not in sel.describe()
    off = KernelConfig(gradient_accumulation_fusion=False)
    assert resolve_kernels(off, _model(), on_cuda=True).weight_grad_impl == "torch"
    assert resolve_kernels(KernelConfig(kernels="torch"), _model(), on_cuda=True).weight_grad_impl == "torch"


# ------------------------------------------------------------------------------------------------ adapters
def test_apex_weight_grad_runs_in_w(monkeypatch):
    calls = _fake_apex(monkeypatch)
    cfg = _model()
    ref, stage = _stage(cfg), _stage(cfg)
    apply_kernels(stage, KernelSelection(weight_grad_impl="apex"))
    store = WeightGradStore()
    bind_weight_grad_store(stage, store)
    x, dy = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    ref(x).backward(dy)
    with store.defer(0, 0):
        stage(x).backward(dy)
    assert calls == []  # B: nothing yet
    store.run(0, 0)
    assert len(calls) == 4 * cfg.num_layers and calls[0] == ((16, 4 * 32), (16, 32), (32, 4 * 32))  # fc2 first
    for (name, p), q in zip(ref.named_parameters(), stage.parameters()):
        torch.testing.assert_close(q.main_grad, p.main_grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("normalization, swiglu", [("LayerNorm", False), ("RMSNorm", True)])
def test_transformer_engine_layers_defer_backward_dw_to_w(monkeypatch, normalization, swiglu):
    _fake_te(monkeypatch)
    cfg = _model(normalization=normalization, swiglu=swiglu, num_query_groups=2)
    ref, stage = _stage(cfg), _stage(cfg)
    apply_kernels(stage, KernelSelection(transformer_impl="transformer_engine"))
    assert [type(m).__name__ for m in stage.layers] == ["TELayer"] * cfg.num_layers
    for p in stage.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    store = WeightGradStore()
    bind_weight_grad_store(stage, store)
    landed = []
    from zb_pipeline.runtime.deferrable_linear import register_grad_accumulated_hook

    for p in stage.parameters():
        if getattr(p, "zb_deferrable", False):
            register_grad_accumulated_hook(p, lambda q: landed.append(q))
    x, dy = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    y_ref, y = ref(x), stage(x)
    if swiglu:  # the local GeLU is exact, TE's the tanh approximation
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    ref(x).backward(dy)
    for mb in (0, 1):
        with store.defer(0, mb):
            stage(x).backward(dy)
    assert _FakeTEModule.calls == [] and store.pending() == {(0, 0): 3 * cfg.num_layers, (0, 1): 3 * cfg.num_layers}
    assert all(float(p.main_grad.abs().sum()) == 0 for p in stage.parameters() if getattr(p, "zb_deferrable", 0))
    store.run(0, 0)
    names = [n for n, _ in _FakeTEModule.calls]
    assert names == ["FakeLayerNormMLP", "FakeLinear", "FakeLayerNormLinear"] * cfg.num_layers  # backward order
    store.run(0, 1)
    assert len(landed) == 2 * sum(1 for p in stage.parameters() if getattr(p, "zb_deferrable", False))
    if not swiglu:
        return
    local = dict(ref.named_parameters())
    for name, p in stage.named_parameters():
        got, want = _grad(p), _grad(local[_local_name(name)])
        torch.testing.assert_close(got, 2 * want, rtol=1e-4, atol=1e-5, msg=name)  # two microbatches


def test_transformer_engine_w_out_of_b_order_is_refused(monkeypatch):
    _fake_te(monkeypatch)
    stage = _stage(_model(num_layers=1))
    apply_kernels(stage, KernelSelection(transformer_impl="transformer_engine"))
    for p in stage.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    store = WeightGradStore()
    bind_weight_grad_store(stage, store)
    x = torch.randn(8, 2, 32)
    for mb in (0, 1):
        with store.defer(0, mb):
            stage(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"oldest pending weight gradient .* \(0, 0\), but W of \(0, 1\)"):
        store.run(0, 1)


def test_transformer_engine_without_a_store_runs_backward_dw_at_once(monkeypatch):
    _fake_te(monkeypatch)
    stage = _stage(_model(num_layers=1))
    apply_kernels(stage, KernelSelection(transformer_impl="transformer_engine"))
    for p in stage.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)  # the trainer's reducer adds them after apply_kernels
    stage(torch.randn(8, 2, 32)).sum().backward()
    assert len(_FakeTEModule.calls) == 3
    assert all(float(p.main_grad.abs().sum()) > 0 for p in stage.parameters() if getattr(p, "zb_deferrable", False))


def _te_pipeline_rank(rank: int, world_size: int, schedule: str) -> dict:
    """Local and TE (fake) GPT stages through the pipeline runtime on gloo: losses and gradients by global name."""
    from datetime import timedelta

    from model_configs import pipeline_config

    from megatron.parallel.context import ParallelContext
    from megatron.pipeline import ScheduleConfig, build_gpt_pipeline

    torch.set_num_threads(1)
    te = _fake_te_module()
    sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = te, te.pytorch
    cfg = ScheduleConfig(schedule=schedule, p2p_check=True)
    chunks = cfg.chunks(num_layers=4, pp=world_size)
    placement = "v" if schedule == "zb-v" else "loop"
    ctx = ParallelContext.initialize(pp=world_size, timeout=timedelta(seconds=30), chunks=chunks, placement=placement)
    model = dataclasses.replace(pipeline_config(4, tied=False), swiglu=True)
    batches = []
    for k in range(3):
        t = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(500 + k))
        batches.append(
            {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "loss_mask": torch.ones(2, 6)}
        )
    out = {}
    for impl in ("local", "transformer_engine"):
        pipe = build_gpt_pipeline(ctx, model, cfg, num_microbatches=3, micro_batch_size=2, seed=11)
        for stage in pipe.stages.values():
            apply_kernels(stage, KernelSelection(transformer_impl=impl))
            for p in stage.parameters():
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        total = pipe.forward_backward(batches)
        grads = {}
        for stage in pipe.stages.values():
            for n, p in stage.named_parameters():
                grads[_local_name(stage.global_name(n))] = _grad(p).clone().numpy()
        out[impl] = {"total": total.item(), "grads": grads}
    out["backward_dw_calls"] = len(_FakeTEModule.calls)
    return out


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_transformer_engine_layers_in_a_zero_bubble_pipeline(schedule):
    """W runs TE's backward_dw in the runtime's W actions, in B's order per module, and the gradients are the local
    layers' (ZB-H1: one chunk per rank; ZB-V: two, W interleaved across them)."""
    from zb_pipeline.testing import run_multiprocess

    results = run_multiprocess(_te_pipeline_rank, 2, args=(schedule,), timeout_s=120)
    for r in results:
        assert r["transformer_engine"]["total"] == pytest.approx(r["local"]["total"], rel=1e-6)
        assert r["backward_dw_calls"] == 3 * 2 * 3  # 3 TE modules x 2 layers per rank x 3 microbatches
        assert set(r["transformer_engine"]["grads"]) == set(r["local"]["grads"])
        for name, want in r["local"]["grads"].items():
            got = r["transformer_engine"]["grads"][name]
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-4, atol=1e-6, msg=name)
