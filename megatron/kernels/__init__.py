"""Fused operations: Triton kernels beside their torch references, chosen at one selection point.

- ``select``: ``--kernels {auto,torch,triton}`` and Megatron's fusion flags -> ``KernelSelection`` (at flag parsing,
  exit 2 on what cannot be served) -> ``apply_kernels(model, selection)`` sets the layers' kernel hooks;
- ``triton_runtime``: importing Triton (its interpreter on a machine without CUDA) and the bf16 ``UPCAST`` switch;
- ``weight_grad``: the W kernel, ``main_grad += grad_y^T @ x`` accumulated in fp32 in place;
- ``norms``: LayerNorm / RMSNorm with the backward split into B (input gradient) and W (weight gradients);
- ``activations``: bias + GeLU, bias + SwiGLU;
- ``cross_entropy``: vocabulary-parallel cross-entropy, chunked over the vocabulary;
- ``vendor``: is apex's fused weight-gradient extension / Transformer Engine (>= 2.3) installed (without importing);
- ``apex_weight_grad``: the W kernel from apex; ``transformer_engine``: decoder layers from TE, W = ``backward_dw``.

The kernel modules import Triton when they are imported; only ``select.apply_kernels`` imports them, so a run on
the torch path never needs Triton (nor apex, nor TE).  Docs: ``docs/gpu.md`` (Kernels).
"""
