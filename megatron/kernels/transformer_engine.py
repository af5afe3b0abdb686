"""``--transformer-impl transformer_engine``: decoder layers built from Transformer Engine, W running TE's wgrad.

Each ``TransformerLayer`` of a built model is replaced (``use_transformer_engine``) by a ``TELayer`` holding

    input norm + QKV   te.pytorch.LayerNormLinear(h, qkv, normalization=LayerNorm|RMSNorm)
    attention core     megatron.model.attention.attend (the same SDPA code as the local layer)
    output projection  te.pytorch.Linear(nq * d, h)
    MLP norm + MLP     te.pytorch.LayerNormMLP(h, ffn, activation=gelu|swiglu)

all built with ``delay_wgrad_compute=True`` (TE >= 2.3): their backward computes the input (and norm) gradients and
keeps the weight-gradient GEMMs in a per-module FIFO until ``module.backward_dw()`` runs them, accumulating into the
fp32 ``main_grad`` (``fuse_wgrad_accumulation=True``).  ``DelayedWeightGrad`` wraps each TE module so that this
becomes our W action: when the module's backward has finished inside ``WeightGradStore.defer(chunk, microbatch)``
(the B action), it submits a closure calling ``backward_dw()`` to the store, which runs it at W like every
deferrable linear's work.  Outside ``defer`` (no store, a non-split backward) it calls ``backward_dw()`` at once.

TE pops the *oldest* pending wgrad of a module, so W must run in B's order per module; every schedule registered
here does that per chunk, and a W out of that order raises instead of computing the wrong microbatch's gradient.

The layers are initialised from the local layers they replace (their weights are copied), so a run starts from the
same parameters whichever implementation builds it.  Limits (each refused at flag parsing by ``select``):
tensor-parallel size 1 only (TE's own tensor parallelism needs its communication groups, which bypass
``zb_pipeline.comm``); checkpoints name the TE modules' parameters, so they do not load into a local model or back.
TE's GeLU is the tanh approximation, the local layer's is exact.  This adapter has been run only against the fake
modules of ``tests/test_kernels_vendor.py``, never against the real Transformer Engine.
"""

from __future__ import annotations

import importlib
from collections import deque

import torch

from megatron.model.attention import attend
from megatron.model.config import GPTConfig
from megatron.model.transformer_layer import TransformerLayer
from zb_pipeline.runtime.deferrable_linear import accumulate_grad, mark_deferrable, notify_grad_accumulated
from zb_pipeline.runtime.weight_grad_store import WeightGradKey, WeightGradStore


class _AfterBackward(torch.autograd.Function):
    """Identity on ``x`` whose backward runs ``owner.backward_finished()``.  It sits on the TE module's input, so
    autograd reaches it once the module's own backward is done; ``anchor`` (a parameter of the module) keeps it in
    the graph when ``x`` needs no gradient."""

    @staticmethod
    def forward(ctx, x, anchor, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.backward_finished()
        return grad, None, None


class DelayedWeightGrad(torch.nn.Module):
    """A TE module built with ``delay_wgrad_compute=True`` whose ``backward_dw()`` runs at our W action.

    A deferrable layer (``weight_grad_store`` attribute, bound by ``bind_weight_grad_store``).  The parameters TE
    fills in ``backward_dw`` (weights and biases; not the norm's, which get their gradient in B through autograd)
    are marked ``zb_deferrable``; after ``backward_dw`` a gradient TE left in ``.grad`` is moved into ``main_grad``
    and the accumulation hooks (the data-parallel reducer's) are called."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.weight_grad_store: WeightGradStore | None = None
        self._pending: deque[WeightGradKey] = deque()  # keys whose wgrad sits in TE's FIFO, oldest first
        self.wgrad_params = [
            p for name, p in inner.named_parameters(recurse=False) if not name.startswith("layer_norm")
        ]
        for p in self.wgrad_params:
            mark_deferrable(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(_AfterBackward.apply(x, self.wgrad_params[0], self))

    def backward_finished(self) -> None:
        store = self.weight_grad_store
        if store is None or not store.deferring:
            self.run_backward_dw()
            return
        key = store.active_key
        self._pending.append(key)
        store.submit(lambda: self._run_for(key))

    def _run_for(self, key: WeightGradKey) -> None:
        oldest = self._pending.popleft() if self._pending else None
        if oldest != key:
            raise RuntimeError(
                f"Transformer Engine's backward_dw computes the oldest pending weight gradient (chunk, microbatch) "
                f"{oldest}, but W of {key} runs now; this schedule runs W out of B's order, which "
                "--transformer-impl transformer_engine cannot serve (use --transformer-impl local)"
            )
        self.run_backward_dw()

    def run_backward_dw(self) -> None:
        self.inner.backward_dw()
        for p in self.wgrad_params:
            grad = p.grad
            if grad is not None and getattr(p, "main_grad", None) is not None:
                p.grad = None
                accumulate_grad(p, grad)  # into main_grad, then the hooks
            else:
                notify_grad_accumulated(p)  # TE accumulated into main_grad itself (or left .grad, no main_grad)


def te_pytorch():
    """``transformer_engine.pytorch`` (imported only when chosen)."""
    return importlib.import_module("transformer_engine.pytorch")


class TELayer(torch.nn.Module):
    """One pre-norm decoder layer from TE modules; the same computation as ``TransformerLayer`` (tp = 1)."""

    def __init__(self, config: GPTConfig, *, layer_number: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        te = te_pytorch()
        self.layer_number = layer_number
        self.groups, self.heads_per_group = (
            config.num_query_groups,
            config.num_attention_heads // config.num_query_groups,
        )
        self.head_dim, self.dropout_p = config.kv_channels, config.attention_dropout
        h, bias = config.hidden_size, config.add_bias_linear
        common = dict(
            bias=bias, params_dtype=dtype, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=True
        )
        norm = dict(eps=config.norm_epsilon, normalization=config.normalization)
        self.qkv = DelayedWeightGrad(te.LayerNormLinear(h, config.qkv_projection_size, **norm, **common))
        self.proj = DelayedWeightGrad(te.Linear(config.query_projection_size, h, **common))
        activation = "swiglu" if config.swiglu else "gelu"
        self.mlp = DelayedWeightGrad(
            te.LayerNormMLP(h, config.ffn_hidden_size, activation=activation, **norm, **common)
        )
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [s, b, h]; same shape out
        out = attend(
            self.qkv(x),
            groups=self.groups,
            heads_per_group=self.heads_per_group,
            head_dim=self.head_dim,
            rotary=rotary,
            dropout_p=self.dropout_p if self.training else 0.0,
            attention_mask=attention_mask,
        )  # [s, b, nq * d]
        x = x + self.dropout(self.proj(out))
        return x + self.dropout(self.mlp(x))

    @torch.no_grad()
    def copy_from(self, local: TransformerLayer) -> None:
        """Take the local layer's parameters (same layout: QKV group by group, SwiGLU's ``[gate; up]``)."""
        att, mlp = local.self_attention, local.mlp
        pairs = [
            (self.qkv.inner, "layer_norm_weight", local.input_layernorm.weight),
            (self.qkv.inner, "layer_norm_bias", getattr(local.input_layernorm, "bias", None)),
            (self.qkv.inner, "weight", att.linear_qkv.weight),
            (self.qkv.inner, "bias", att.linear_qkv.bias),
            (self.proj.inner, "weight", att.linear_proj.weight),
            (self.proj.inner, "bias", att.linear_proj.bias),
            (self.mlp.inner, "layer_norm_weight", local.pre_mlp_layernorm.weight),
            (self.mlp.inner, "layer_norm_bias", getattr(local.pre_mlp_layernorm, "bias", None)),
            (self.mlp.inner, "fc1_weight", mlp.linear_fc1.weight),
            (self.mlp.inner, "fc1_bias", mlp.linear_fc1.bias),
            (self.mlp.inner, "fc2_weight", mlp.linear_fc2.weight),
            (self.mlp.inner, "fc2_bias", mlp.linear_fc2.bias),
        ]
        for module, name, source in pairs:
            target = getattr(module, name, None)
            if source is None or target is None or target.numel() == 0:
                continue
            if target.shape != source.shape:
                raise ValueError(f"TE {type(module).__name__}.{name} is {tuple(target.shape)}, local {source.shape}")
            target.copy_(source)


def use_transformer_engine(model: torch.nn.Module, config: GPTConfig) -> int:
    """Replace every ``TransformerLayer`` in ``model`` by a ``TELayer`` with its parameters (device and dtype of
    the local layer), bound to the same weight-gradient store.  Returns the number of layers replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, TransformerLayer):
                continue
            weight = child.self_attention.linear_qkv.weight
            layer = TELayer(config, layer_number=child.layer_number, dtype=weight.dtype, device=weight.device)
            layer.copy_from(child)
            layer.train(child.training)
            store = child.self_attention.linear_qkv.weight_grad_store
            for sub in layer.modules():
                if hasattr(sub, "weight_grad_store"):
                    sub.weight_grad_store = store
            setattr(parent, name, layer)
            replaced += 1
    return replaced
