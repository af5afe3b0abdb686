"""The one place that chooses between torch, the fused Triton kernels, apex and Transformer Engine.

``resolve_kernels(config, model, on_cuda=...)`` turns ``--kernels`` and the fusion flags into a ``KernelSelection``
while the flags are parsed, so a request that cannot be served (``--kernels triton`` without Triton, a shape a kernel
does not support) is a ``ConfigError`` -- one line, exit 2 -- before any process group exists.
``apply_kernels(model, selection)`` then points the layers' kernel hooks at the chosen kernels:

- the linears' ``wgrad_fn``: ``weight_grad.accumulate_weight_grad`` (off: ``--no-gradient-accumulation-fusion``);
- the norms' ``kernel``: ``norms.triton_layer_norm`` / ``norms.triton_rms_norm``;
- ``MLP.activation_kernel``: ``activations.triton_bias_gelu`` / ``triton_bias_swiglu`` (off:
  ``--no-bias-gelu-fusion`` / ``--no-bias-swiglu-fusion``); with ``--openai-gelu`` the GeLU kernel computes the
  tanh approximation (``triton_bias_gelu_tanh``); ``--squared-relu`` has no fused kernel and stays on torch;
- ``GPTStage.cross_entropy_kernel``: ``cross_entropy.fused_vocab_parallel_cross_entropy`` (on:
  ``--cross-entropy-loss-fusion``).

apex and Transformer Engine (``megatron.kernels.vendor`` detects them without importing; neither is a dependency):

- the W kernel is apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` (``apex_weight_grad``) with
  ``--kernels auto`` on CUDA when that extension is installed (a cuBLAS GEMM with fp32 accumulation, in place);
  ``--kernels triton`` keeps the Triton kernel, ``--no-gradient-accumulation-fusion`` and ``--kernels torch`` neither;
- ``--transformer-impl transformer_engine`` replaces the decoder layers by Transformer Engine's (>= 2.3, CUDA,
  tp = 1; ``transformer_engine``), whose delayed weight gradients run at W; without TE it is one line, exit 2.

Model files never import a kernel module; the torch path of every hook is the layer's own code, unchanged, so
``--kernels torch`` (and ``auto`` without CUDA) is bit-identical to a build without this package.

Norm weight gradients stay in B (``NORM_WEIGHT_GRAD_IN_W``, both ``False``).  The norm kernels can defer them to W
(``defer_weight_grad``), but that holds each norm's input and output gradient (2 x ``[tokens, h]`` per norm, 4 per
layer) from B until W, while a layer's W work otherwise holds less than its F did by only about one ``[tokens, h]``:
a microbatch then holds more after B than after F, and ZB-H1, ZB-H2 and ZB-auto exceed the peak they
state.  ``tests/test_kernels_norm_memory.py`` measures the holdings of first, middle and last GPT stages (LayerNorm
with GeLU, RMSNorm with SwiGLU) and simulates every registered schedule's peak with them: with the norms' weight
gradients in B every stated bound holds; deferred, LayerNorm and RMSNorm both break ZB-H1's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron.config.errors import ConfigError
from megatron.config.kernels import KernelConfig
from megatron.kernels.triton_runtime import interpreter_problem, triton_importable
from megatron.kernels.vendor import apex_weight_grad_available, transformer_engine_problem, transformer_engine_version
from megatron.model.config import GPTConfig

NORM_WEIGHT_GRAD_IN_W = {"LayerNorm": False, "RMSNorm": False}  # deferring breaks stated bounds (above)
MAX_NORM_HIDDEN = 16384  # = megatron.kernels.norms.MAX_HIDDEN (one row per tile); kept here to check without Triton


@dataclass(frozen=True)
class KernelSelection:
    """What runs each fused operation of one run, and why (``describe()`` is the start-up line)."""

    backend: str = "torch"  # "torch" | "triton"
    reason: str = "--kernels torch"
    interpreted: bool = False  # Triton's interpreter (no CUDA)
    weight_grad: bool = False
    norms: bool = False
    norm_kind: str = "LayerNorm"  # the model's --normalization
    bias_gelu: bool = False
    gelu_approximate: str = "none"  # the model's GeLU: "none" (erf) or "tanh" (--openai-gelu)
    bias_swiglu: bool = False
    cross_entropy: bool = False
    torch_notes: tuple[str, ...] = ()  # operations left on torch with the backend Triton, each with its reason
    weight_grad_impl: str = "torch"  # "torch" | "triton" | "apex": who computes W's grad_y^T @ x into main_grad
    transformer_impl: str = "local"  # "local" | "transformer_engine"
    transformer_engine_version: str | None = None

    def describe(self) -> str:
        return self._describe_fused() + self._describe_vendor()

    def _describe_vendor(self) -> str:
        parts = []
        if self.weight_grad_impl == "apex":
            parts.append("W kernel: apex wgrad_gemm_accum_fp32 (fp32 into main_grad)")
        if self.transformer_impl == "transformer_engine":
            te = f"Transformer Engine {self.transformer_engine_version}"
            parts.append(f"layers: {te} (delay_wgrad_compute; W runs backward_dw)")
        return "".join(f"; {p}" for p in parts)

    def _describe_fused(self) -> str:
        if self.backend == "torch":
            return f"torch ({self.reason})"
        mode = "Triton interpreter on CPU" if self.interpreted else "compiled for CUDA"
        fused = [
            name
            for name, on in (
                ("W kernel (fp32 into main_grad)", self.weight_grad and self.weight_grad_impl == "triton"),
                (
                    f"{self.norm_kind} (weight grads in {'W' if NORM_WEIGHT_GRAD_IN_W[self.norm_kind] else 'B'})",
                    self.norms,
                ),
                ("bias-GeLU" + (" (tanh)" if self.gelu_approximate == "tanh" else ""), self.bias_gelu),
                ("bias-SwiGLU", self.bias_swiglu),
                ("cross-entropy (vocab-chunked)", self.cross_entropy),
            )
            if on
        ]
        rest = f"; torch: {', '.join(self.torch_notes)}" if self.torch_notes else ""
        return f"triton, {mode} ({self.reason}): {', '.join(fused) or 'nothing'}{rest}"


def resolve_kernels(
    config: KernelConfig, model: GPTConfig, *, on_cuda: bool | None = None, tp_size: int = 1
) -> KernelSelection:
    """The selection for ``config`` on this machine (``on_cuda``: default ``torch.cuda.is_available()``); raises
    ``ConfigError`` (one line with the fix) for what this machine or layout cannot serve."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    te_version = _check_transformer_engine(config, on_cuda=on_cuda, tp_size=tp_size)
    if te_version is not None:
        _check_transformer_engine_model(model)
    selection = _resolve_fused(config, model, on_cuda=on_cuda)
    wgrad = "triton" if selection.backend == "triton" and selection.weight_grad else "torch"
    if config.kernels == "auto" and on_cuda and config.gradient_accumulation_fusion and apex_weight_grad_available():
        wgrad = "apex"
    return replace(
        selection,
        weight_grad_impl=wgrad,
        transformer_impl=config.transformer_impl,
        transformer_engine_version=te_version,
    )


def _check_transformer_engine(config: KernelConfig, *, on_cuda: bool, tp_size: int) -> str | None:
    """TE's version when ``--transformer-impl transformer_engine`` can run here, ``None`` for ``local``."""
    if config.transformer_impl != "transformer_engine":
        return None
    problem = transformer_engine_problem()
    if problem is not None:
        raise ConfigError(problem)
    if not on_cuda:
        raise ConfigError(
            "--transformer-impl transformer_engine needs a CUDA GPU (Transformer Engine's kernels); "
            "use --transformer-impl local"
        )
    if tp_size > 1:
        raise ConfigError(
            f"--transformer-impl transformer_engine supports --tensor-model-parallel-size 1 here, not {tp_size} "
            "(TE's tensor parallelism would bypass zb_pipeline.comm); use tp 1 or --transformer-impl local"
        )
    return transformer_engine_version()


def _check_transformer_engine_model(model: GPTConfig) -> None:
    """Model variants the Transformer Engine layers here do not build: one line, exit 2."""
    unsupported = [
        flag
        for flag, on in (
            ("--qk-layernorm", model.qk_layernorm),
            ("--apply-layernorm-1p", model.apply_layernorm_1p),
            ("--squared-relu", model.squared_relu),
            ("--fp32-residual-connection", model.fp32_residual_connection),
        )
        if on
    ]
    if unsupported:
        raise ConfigError(
            f"--transformer-impl transformer_engine does not build {', '.join(unsupported)} here; "
            "use --transformer-impl local"
        )


def _resolve_fused(config: KernelConfig, model: GPTConfig, *, on_cuda: bool) -> KernelSelection:
    """``--kernels`` and the fusion flags: torch or Triton per operation."""
    if config.kernels == "torch":
        return KernelSelection(reason="--kernels torch")
    if config.kernels == "auto" and not on_cuda:
        return KernelSelection(reason="--kernels auto without CUDA; --kernels triton runs Triton's interpreter")
    explicit = config.kernels == "triton"
    if not triton_importable():
        if explicit:
            raise ConfigError(
                "--kernels triton needs the triton package, which is not installed; "
                'pip install "zb-megatron[kernels]" (or "triton>=3.1,<4"), or use --kernels torch'
            )
        return KernelSelection(reason="--kernels auto on CUDA, but triton is not installed")
    problem = None if on_cuda else interpreter_problem()
    if problem is not None:  # only --kernels triton reaches here without CUDA
        raise ConfigError(f"--kernels triton without CUDA runs Triton's interpreter, but {problem}")
    notes = []
    norms = model.hidden_size <= MAX_NORM_HIDDEN
    if model.fp32_residual_connection:  # the Triton norms take one dtype; fp32 input with bf16/fp16 weights: torch
        norms = False
        notes.append(f"{model.normalization} (--fp32-residual-connection)")
    elif not norms:
        problem = (
            f"the Triton {model.normalization} kernel normalises a row in one tile of at most {MAX_NORM_HIDDEN} "
            f"columns, but --hidden-size is {model.hidden_size}"
        )
        if explicit:
            raise ConfigError(f"--kernels triton: {problem}; use --kernels torch")
        notes.append(f"{model.normalization} (hidden size {model.hidden_size} > {MAX_NORM_HIDDEN})")
    is_gelu = model.gelu_mlp  # erf or tanh (--openai-gelu): the kernel has both
    gelu = is_gelu and config.bias_gelu_fusion
    swiglu = model.swiglu and config.bias_swiglu_fusion
    if is_gelu and not config.bias_gelu_fusion:
        notes.append("GeLU (--no-bias-gelu-fusion)")
    if model.squared_relu:
        notes.append("squared ReLU (no fused kernel)")
    if model.swiglu and not config.bias_swiglu_fusion:
        notes.append("SwiGLU (--no-bias-swiglu-fusion)")
    if not config.gradient_accumulation_fusion:
        notes.append("weight gradients (--no-gradient-accumulation-fusion)")
    if not config.cross_entropy_loss_fusion:
        notes.append("cross-entropy (no --cross-entropy-loss-fusion)")
    return KernelSelection(
        backend="triton",
        reason="--kernels triton" if explicit else "--kernels auto on CUDA",
        interpreted=not on_cuda,
        weight_grad=config.gradient_accumulation_fusion,
        norms=norms,
        norm_kind=model.normalization,
        bias_gelu=gelu,
        gelu_approximate="tanh" if model.openai_gelu else "none",
        bias_swiglu=swiglu,
        cross_entropy=config.cross_entropy_loss_fusion,
        torch_notes=tuple(notes),
    )


def apply_kernels(model: torch.nn.Module, selection: KernelSelection) -> None:
    """Point the kernel hooks of every layer in ``model`` at the selected kernels (nothing for torch).

    Call it once, after building the model and before the first forward; the layers' weight-gradient stores may
    already be bound (the norms read theirs at every forward).  With ``--transformer-impl transformer_engine`` the
    decoder layers are replaced first (their stores carried over), so the Triton hooks below reach only the
    embedding, the final norm, the head and the loss."""
    if selection.transformer_impl == "transformer_engine":
        from megatron.kernels.transformer_engine import use_transformer_engine
        from megatron.model.gpt import GPTStage

        for stage in [m for m in model.modules() if isinstance(m, GPTStage)]:
            use_transformer_engine(stage, stage.config)
    if selection.weight_grad_impl == "apex":
        from megatron.kernels.apex_weight_grad import apex_accumulate_weight_grad

        for module in model.modules():
            if hasattr(module, "wgrad_fn"):
                module.wgrad_fn = apex_accumulate_weight_grad
    if selection.backend != "triton":
        return
    from megatron.kernels.activations import triton_bias_gelu, triton_bias_gelu_tanh, triton_bias_swiglu
    from megatron.kernels.cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.kernels.norms import triton_layer_norm, triton_rms_norm
    from megatron.kernels.weight_grad import accumulate_weight_grad
    from megatron.model.gpt import GPTStage
    from megatron.model.mlp import MLP
    from megatron.model.norms import LayerNorm, RMSNorm
    from zb_pipeline.runtime.deferrable_linear import mark_deferrable

    for module in model.modules():
        if selection.weight_grad_impl == "triton" and hasattr(module, "wgrad_fn"):
            module.wgrad_fn = accumulate_weight_grad
        if selection.norms and isinstance(module, (LayerNorm, RMSNorm)):
            kind = "LayerNorm" if isinstance(module, LayerNorm) else "RMSNorm"
            module.kernel = triton_layer_norm if kind == "LayerNorm" else triton_rms_norm
            module.defer_weight_grad = NORM_WEIGHT_GRAD_IN_W[kind]
            if module.defer_weight_grad:
                for p in module.parameters(recurse=False):
                    mark_deferrable(p)
        if isinstance(module, MLP):
            if module.swiglu and selection.bias_swiglu:
                module.activation_kernel = triton_bias_swiglu
            elif selection.bias_gelu and module.is_gelu:
                tanh = module.gelu_approximate == "tanh"
                module.activation_kernel = triton_bias_gelu_tanh if tanh else triton_bias_gelu
        if selection.cross_entropy and isinstance(module, GPTStage):
            module.cross_entropy_kernel = fused_vocab_parallel_cross_entropy
