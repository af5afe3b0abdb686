"""The kernels inside the layers: weight gradients through the deferrable store (B then W), the GPT model with every
Triton kernel against the torch path, and tensor parallelism (tp = 2 on gloo: the W kernel in column- and row-parallel
linears, the chunked cross-entropy over a vocabulary-parallel output).

Tolerances (fixed before measuring): the model-level comparisons in fp32 hold losses to a relative 1e-5 and every
gradient to ``assert_close(rtol=1e-4, atol=1e-6)`` (many kernels in sequence, each rounding differently from torch in
the last bits); the deferred-versus-immediate comparisons run the same kernels on the same tensors, so they are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from model_configs import TINY

from megatron.config.kernels import KernelConfig
from megatron.kernels.select import KernelSelection, apply_kernels, resolve_kernels
from megatron.kernels.triton_runtime import interpreter_problem
from megatron.model import GPTConfig, build_gpt_model
from megatron.model.mlp import MLP
from megatron.model.norms import LayerNorm, RMSNorm
from megatron.parallel.tensor_parallel import TPContext, is_tensor_parallel, merge_shards
from zb_pipeline.runtime.deferrable_linear import DeferrableLinear
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store
from zb_pipeline.testing.harness import run_multiprocess

# Never import triton directly: Triton must see TRITON_INTERPRET (set by megatron.kernels) before its first import.
pytestmark = [
    pytest.mark.skipif(interpreter_problem() is not None, reason=f"no Triton interpreter: {interpreter_problem()}"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter on CPU tensors (no CUDA)"),
]

torch.set_num_threads(1)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False)
TRITON_ALL = KernelConfig(kernels="triton", cross_entropy_loss_fusion=True)


def _triton(cfg: GPTConfig) -> KernelSelection:
    return resolve_kernels(TRITON_ALL, cfg, on_cuda=False)


def test_deferrable_linear_w_kernel_through_the_store() -> None:
    """bf16 activations, fp32 main_grad: W (queued in B, run later) adds grad_y^T @ x in fp32; without main_grad the
    torch path runs and wgrad_fn is not called."""
    from megatron.kernels.weight_grad import accumulate_weight_grad, weight_grad_reference

    torch.manual_seed(0)
    lin = DeferrableLinear(40, 24, dtype=torch.bfloat16)
    lin.wgrad_fn = accumulate_weight_grad
    lin.weight.main_grad = torch.zeros(24, 40)
    lin.bias.main_grad = torch.zeros(24)
    store = WeightGradStore()
    bind_weight_grad_store(lin, store)
    x = torch.randn(2, 16, 40, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 16, 24, dtype=torch.bfloat16)
    with store.defer(0, 0):
        lin(x).backward(dy)
    assert torch.all(lin.weight.main_grad == 0) and store.pending() == {(0, 0): 1}
    store.run(0, 0)
    want = torch.zeros(24, 40)
    weight_grad_reference(want, dy.reshape(-1, 24), x.detach().reshape(-1, 40))
    torch.testing.assert_close(lin.weight.main_grad, want, rtol=1e-5, atol=1e-5)
    assert x.grad is not None and lin.weight.grad is None

    plain = DeferrableLinear(40, 24)
    plain.wgrad_fn = lambda *a: pytest.fail("wgrad_fn without a main_grad")
    plain(torch.randn(3, 40)).sum().backward()
    assert plain.weight.grad is not None


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_weight_grads_in_b_or_deferred_to_w(kind: str) -> None:
    """Not deferring (the selection's choice): weight grads reach autograd in B.  Deferring: nothing lands in B,
    W accumulates the same values into main_grad (fp32)."""
    from megatron.kernels.norms import triton_layer_norm, triton_rms_norm

    torch.manual_seed(1)
    norm = (LayerNorm if kind == "LayerNorm" else RMSNorm)(32)
    norm.kernel = triton_layer_norm if kind == "LayerNorm" else triton_rms_norm
    x, dy = torch.randn(16, 2, 32, requires_grad=True), torch.randn(16, 2, 32)
    norm(x).backward(dy)
    immediate = {n: p.grad.clone() for n, p in norm.named_parameters()}
    dx = x.grad.clone()
    norm.zero_grad(set_to_none=True)
    x.grad = None

    norm.defer_weight_grad = True
    for p in norm.parameters():
        p.main_grad = torch.zeros(p.shape)
    store = WeightGradStore()
    bind_weight_grad_store(norm, store)
    with store.defer(0, 0):
        norm(x).backward(dy)
    assert torch.equal(x.grad, dx) and all(torch.all(p.main_grad == 0) for p in norm.parameters())
    store.run(0, 0)
    for n, p in norm.named_parameters():
        assert p.grad is None and torch.equal(p.main_grad, immediate[n]), n


@pytest.mark.parametrize("activation", ["gelu", "openai_gelu", "swiglu"])
def test_fused_bias_activation_defers_the_bias_grad(activation: str) -> None:
    cfg = GPTConfig(**TINY, **({} if activation == "gelu" else {activation: True}))
    mlps = [MLP(cfg, tp=TPContext()) for _ in range(2)]
    mlps[1].load_state_dict(mlps[0].state_dict())
    for p in mlps[0].parameters():
        torch.nn.init.normal_(p, std=0.1)
    mlps[1].load_state_dict(mlps[0].state_dict())
    apply_kernels(mlps[1], _triton(cfg))
    assert mlps[1].activation_kernel is not None and mlps[1].linear_fc1.wgrad_fn is not None
    kernel = {"gelu": "triton_bias_gelu", "openai_gelu": "triton_bias_gelu_tanh", "swiglu": "triton_bias_swiglu"}
    assert mlps[1].activation_kernel.__name__ == kernel[activation]
    x = torch.randn(16, 2, cfg.hidden_size)
    dy = torch.randn(16, 2, cfg.hidden_size)
    grads = []
    for mlp in mlps:
        for p in mlp.parameters():
            p.main_grad = torch.zeros(p.shape)
        store = WeightGradStore()
        bind_weight_grad_store(mlp, store)
        with store.defer(0, 0):
            mlp(x).backward(dy)
        assert torch.all(mlp.linear_fc1.bias.main_grad == 0)  # the bias gradient is W work, fused or not
        store.run(0, 0)
        grads.append({n: p.main_grad for n, p in mlp.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_gpt_with_every_triton_kernel_matches_torch(variant: str) -> None:
    """Whole model, B then W through a store: loss and every gradient (main_grad plus what autograd left)."""
    cfg = GPTConfig(**{**TINY, "num_layers": 2, **(LLAMA if variant == "llama" else {})})
    gen = torch.Generator().manual_seed(4)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen) for _ in range(2))
    results = []
    for selection in (KernelSelection(), _triton(cfg)):
        model = build_gpt_model(cfg, seed=5)
        apply_kernels(model, selection)
        for p in model.parameters():
            p.main_grad = torch.zeros(p.shape)
        store = WeightGradStore()
        bind_weight_grad_store(model, store)
        loss = model(tokens, labels).mean()
        with store.defer(0, 0):
            loss.backward()
        store.run(0, 0)
        grads = {n: p.main_grad + (0 if p.grad is None else p.grad) for n, p in model.named_parameters()}
        results.append((loss.item(), grads))
    (loss_torch, g_torch), (loss_triton, g_triton) = results
    assert abs(loss_triton - loss_torch) <= 1e-5 * abs(loss_torch)
    for n in g_torch:
        torch.testing.assert_close(g_triton[n], g_torch[n], rtol=1e-4, atol=1e-6, msg=n)


def test_torch_selection_sets_no_hook() -> None:
    model = build_gpt_model(GPTConfig(**TINY), seed=1)
    apply_kernels(model, KernelSelection())
    for m in model.modules():
        for hook in ("wgrad_fn", "kernel", "activation_kernel", "cross_entropy_kernel"):
            assert getattr(m, hook, None) is None, (type(m).__name__, hook)


def _tp_worker(rank: int, world_size: int) -> dict:
    """tp = 2 with every Triton kernel (including the cross-entropy over vocab-parallel logits) against tp = 1 torch,
    both built from the same seed on this rank; returns the mismatches (empty: all within tolerance)."""
    tp = TPContext(world_size, rank, dist.group.WORLD)
    mismatches = []
    for name, kw in (("gpt", {}), ("llama", LLAMA)):
        cfg = GPTConfig(**{**TINY, **kw})
        gen = torch.Generator().manual_seed(6)
        tokens, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen) for _ in range(2))
        per_layout = []
        for layout, selection in ((TPContext(), KernelSelection()), (tp, _triton(cfg))):
            model = build_gpt_model(cfg, tp=layout, seed=7)
            apply_kernels(model, selection)
            for p in model.parameters():
                p.main_grad = torch.zeros(p.shape)
            loss = model(tokens, labels).mean()
            loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                g = p.main_grad + (0 if p.grad is None else p.grad)
                if layout.tp_size > 1 and is_tensor_parallel(p):
                    parts = [torch.empty_like(g) for _ in range(layout.tp_size)]
                    dist.all_gather(parts, g.contiguous(), group=layout.tp_group)
                    g = merge_shards(parts, dim=p.partition_dim, stride=p.partition_stride)
                grads[n] = g
            per_layout.append((loss.item(), grads))
        (loss_ref, g_ref), (loss_tp, g_tp) = per_layout
        if abs(loss_tp - loss_ref) > 1e-5 * abs(loss_ref):
            mismatches.append(f"{name} loss {loss_tp} vs {loss_ref}")
        for n in g_ref:
            rows = min(g_tp[n].shape[0], g_ref[n].shape[0])  # vocabulary tables are padded per tp size
            if not torch.allclose(g_tp[n][:rows], g_ref[n][:rows], rtol=1e-4, atol=1e-6):
                mismatches.append(f"{name} {n}: max diff {(g_tp[n] - g_ref[n]).abs().max().item():.2e}")
    return {"mismatches": mismatches}


def test_tensor_parallel_triton_kernels_match_tp1_torch() -> None:
    for result in run_multiprocess(_tp_worker, 2, timeout_s=180):
        assert result["mismatches"] == []
