"""Deferrable-weight-gradient autograd functions: linear, bias add and embedding lookup with a B/W split.

Every linear of the trainer goes through ``deferrable_linear``.  Its backward always computes the input gradient
(``grad_x = grad_y @ W``: that is B).  The weight gradient (``grad_W = grad_y^T @ x``, ``grad_b = sum(grad_y)``:
that is W) goes one of three ways:

* a ``WeightGradStore`` is bound and deferring: a closure holding ``grad_y`` and ``x`` is enqueued and runs at W;
* a store is bound but not deferring, or the parameter has ``main_grad``: it is computed now and accumulated by
  this module into ``param.main_grad`` (fp32, in place) or ``param.grad``;
* neither: it is returned to autograd (plain ``torch.nn.functional.linear`` behaviour, ``torch.autograd.grad`` works).

Because B and W run exactly the same kernels as the immediate path on the same tensors, B then W gives bit-identical
gradients to a full backward.  Accumulation into an fp32 ``main_grad`` is ``addmm_`` in place when the activations
are fp32 (no temporary) and one layer-sized temporary otherwise.

``wgrad_fn`` (an argument of ``deferrable_linear``, an attribute of ``DeferrableLinear``; ``None`` by default) lets the
user of this library supply the weight-gradient computation: when the weight has a ``main_grad``, W calls
``wgrad_fn(main_grad, grad_y2d, x2d)``, which must add ``grad_y2d^T @ x2d`` into ``main_grad`` in place (e.g. a fused
kernel accumulating half-precision activations in fp32 without a temporary).  Without a ``main_grad`` the torch path
runs.  This library ships no such kernel; the trainer's is ``megatron.kernels.weight_grad``.

Parameters whose gradient this module may accumulate itself carry ``param.zb_deferrable = True`` so that other
machinery (the generic split, reducers) knows not to expect it from autograd.  Code that must know when a
gradient contribution has landed (a data-parallel reducer launching a bucket) registers
``register_grad_accumulated_hook(param, fn)``; it is called after every accumulation this module performs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zb_pipeline.runtime.weight_grad_store import WeightGradStore

_HOOKS_ATTR = "_zb_grad_accumulated_hooks"

# wgrad_fn(main_grad [out, in], grad_y2d [N, out], x2d [N, in]): main_grad += grad_y2d^T @ x2d, in place.
WeightGradFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def mark_deferrable(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Tag ``param`` as one whose gradient a deferrable function may accumulate outside autograd."""
    param.zb_deferrable = True
    return param


def register_grad_accumulated_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook(param)`` each time a deferrable function accumulates a gradient contribution into ``param``."""
    hooks = getattr(param, _HOOKS_ATTR, None)
    if hooks is None:
        hooks = []
        setattr(param, _HOOKS_ATTR, hooks)
    hooks.append(hook)


def _notify(param: torch.Tensor) -> None:
    hooks = getattr(param, _HOOKS_ATTR, None)
    if hooks:
        for hook in hooks:
            hook(param)


def notify_grad_accumulated(param: torch.Tensor) -> None:
    """Call ``param``'s accumulation hooks: for code outside this module that has just accumulated a gradient
    contribution into ``param.main_grad`` itself (e.g. an external library's delayed weight-gradient GEMM)."""
    _notify(param)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.main_grad`` if present (in place), else into ``param.grad``."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    else:
        param.grad.add_(grad)
    _notify(param)


def _accumulate_weight_grad(
    weight: torch.Tensor, grad_y2d: torch.Tensor, x2d: torch.Tensor, wgrad_fn: WeightGradFn | None = None
) -> None:
    """``weight`` grad += grad_y^T @ x, fused into ``main_grad`` by ``wgrad_fn`` or when the dtypes allow."""
    main = getattr(weight, "main_grad", None)
    if main is not None and wgrad_fn is not None:
        wgrad_fn(main, grad_y2d, x2d)
        _notify(weight)
    elif main is not None and main.dtype == grad_y2d.dtype == x2d.dtype:
        main.addmm_(grad_y2d.t(), x2d)
        _notify(weight)
    else:
        accumulate_grad(weight, grad_y2d.t().mm(x2d))


def _weight_grad_goes_to_autograd(store: WeightGradStore | None, weight: torch.Tensor) -> bool:
    return store is None and getattr(weight, "main_grad", None) is None


def _direct_apply(fn: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """``fn.apply`` for the per-layer hot path: the C++ ``apply`` that ``torch.autograd.Function.apply`` ends in,
    called straight.  That method's Python preamble (a ``setup_context`` check and a pytree pass over the arguments
    that unwraps functorch's dead wrappers) was about half of a small linear's Python cost in forward (6 of 12 us
    on the 2-core benchmark machine).  Neither applies to these functions (no ``setup_context``), so the full path
    runs only under ``torch.compile``'s tracing, while a functorch transform is active, or for a functorch tensor."""
    base = super(torch.autograd.Function, fn).apply  # torch._C._FunctionBase.apply, bound to fn
    full = fn.apply
    transforms_active = torch._C._are_functorch_transforms_active
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    compiling = torch.compiler.is_compiling

    def apply(x: torch.Tensor, *rest: object) -> torch.Tensor:
        if transforms_active() or wrapped(x) or compiling():
            return full(x, *rest)
        return base(x, *rest)

    return apply


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store, wgrad_fn, separate_bias):
        # x: [..., in], weight: [out, in], bias: [out] | None
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.store, ctx.wgrad_fn = bias, store, wgrad_fn  # the bias: only the target of accumulation
        if separate_bias and bias is not None:  # (x W^T) + b as two kernels, not addmm's fused bias
            y = F.linear(x, weight)
            return y.add_(bias) if y.dtype == bias.dtype else y + bias
        return F.linear(x, weight, bias)  # [..., out]

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: [..., out]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]  # need_b is False without a bias
        grad_x = grad_y.matmul(weight) if need_x else None  # [..., in]
        if not (need_w or need_b):
            return grad_x, None, None, None, None, None
        grad_y2d = grad_y.reshape(-1, grad_y.shape[-1])  # [N, out]
        w_target, b_target = weight if need_w else None, ctx.bias if need_b else None
        grad_w, grad_b = _weight_grads(ctx.store, weight, w_target, b_target, grad_y2d, x, ctx.wgrad_fn)
        return grad_x, grad_w, grad_b, None, None, None


def _weight_grads(
    store: WeightGradStore | None,
    owner: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    grad_y2d: torch.Tensor,
    x: torch.Tensor | None,
    wgrad_fn: WeightGradFn | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """W of a linear, or of a bias add (``weight=None``): ``weight``'s grad += grad_y^T @ x and ``bias``'s +=
    sum(grad_y) (``None``: not wanted; grad_y2d: [N, out], x: [..., in]).

    Returned to autograd as ``(grad_w, grad_b)`` when ``owner`` (the op's first parameter) gets its gradient from
    autograd; otherwise accumulated by this module now (no deferring store) or enqueued on the store, and
    ``(None, None)`` is returned."""
    if _weight_grad_goes_to_autograd(store, owner):
        grad_w = grad_y2d.t().mm(x.reshape(-1, x.shape[-1])) if weight is not None else None
        grad_b = grad_y2d.sum(0) if bias is not None else None
        return grad_w, grad_b
    if store is None or not store.deferring:  # BW: now, without building the W closure
        _accumulate_weight_grads(weight, bias, grad_y2d, x, wgrad_fn)
    else:

        def weight_grad_work() -> None:
            _accumulate_weight_grads(weight, bias, grad_y2d, x, wgrad_fn)

        store.submit(weight_grad_work)
    return None, None


def _accumulate_weight_grads(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    grad_y2d: torch.Tensor,
    x: torch.Tensor | None,
    wgrad_fn: WeightGradFn | None,
) -> None:
    if weight is not None:
        _accumulate_weight_grad(weight, grad_y2d, x.reshape(-1, x.shape[-1]), wgrad_fn)
    if bias is not None:
        accumulate_grad(bias, grad_y2d.sum(0))


def deferrable_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    store: WeightGradStore | None = None,
    *,
    wgrad_fn: WeightGradFn | None = None,
    separate_bias: bool = False,
) -> torch.Tensor:
    """``y = x @ weight^T + bias`` whose weight/bias gradients may be deferred to W (see module docstring);
    ``wgrad_fn`` computes the weight gradient into ``main_grad`` when the weight has one.

    ``separate_bias=True`` adds the bias after the product, as ``deferrable_bias_add`` on the output would (the
    same kernels and bits, e.g. a row-parallel layer's bias when its reduction is the identity), in this one
    autograd node instead of two."""
    return _linear_apply(x, weight, bias, store, wgrad_fn, separate_bias)


class _DeferrableBiasAdd(torch.autograd.Function):
    """``y = x + bias`` (bias broadcast over leading dims) with the bias gradient deferrable; for row-parallel
    layers, where the bias is added after the tensor-parallel reduction."""

    @staticmethod
    def forward(ctx, x, bias, store):  # x: [..., n], bias: [n]
        ctx.bias_ref = bias
        ctx.store = store
        return x + bias

    @staticmethod
    def backward(ctx, grad_y):
        bias, store = ctx.bias_ref, ctx.store
        if not ctx.needs_input_grad[1]:
            return grad_y, None, None
        _, grad_b = _weight_grads(store, bias, None, bias, grad_y.reshape(-1, grad_y.shape[-1]), None, None)
        return grad_y, grad_b, None


def deferrable_bias_add(x: torch.Tensor, bias: torch.Tensor, store: WeightGradStore | None = None) -> torch.Tensor:
    """``x + bias`` with the bias gradient handled like a linear's (deferrable, main_grad aware)."""
    return _bias_add_apply(x, bias, store)


class _DeferrableEmbedding(torch.autograd.Function):
    """Row lookup ``weight[ids]``.  Its backward has no input gradient at all (ids are integers), so with a
    deferring store and ``defer`` the whole backward (a scatter-add into the table) moves to W."""

    @staticmethod
    def forward(ctx, ids, weight, store, defer):  # ids: [...] int64 in [0, rows), weight: [rows, h]
        ctx.save_for_backward(ids)
        ctx.weight_ref = weight
        ctx.store, ctx.defer = store, defer
        return F.embedding(ids, weight)  # [..., h]

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: [..., h]
        (ids,) = ctx.saved_tensors
        weight, store = ctx.weight_ref, ctx.store
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        h = grad_y.shape[-1]
        flat_ids, grad2d = ids.reshape(-1), grad_y.reshape(-1, h)

        def table_grad() -> torch.Tensor:
            grad = torch.zeros(weight.shape, dtype=grad2d.dtype, device=grad2d.device)
            return grad.index_add_(0, flat_ids, grad2d)

        if _weight_grad_goes_to_autograd(store, weight):
            return None, table_grad(), None, None

        def embedding_grad_work() -> None:
            main = getattr(weight, "main_grad", None)
            if main is not None and main.dtype == grad2d.dtype:
                main.index_add_(0, flat_ids, grad2d)  # in place, no table-sized temporary
                _notify(weight)
            else:
                accumulate_grad(weight, table_grad())

        if store is None or not ctx.defer:
            embedding_grad_work()
        else:
            store.submit(embedding_grad_work)
        return None, None, None, None


def deferrable_embedding(
    ids: torch.Tensor, weight: torch.Tensor, store: WeightGradStore | None = None, *, defer: bool = True
) -> torch.Tensor:
    """``weight[ids]`` with the table gradient deferrable (the whole embedding backward is weight work).

    ``defer=False`` accumulates the table gradient during B even with a deferring store bound (still into
    ``main_grad``/``grad`` by this module, so the parameter stays ``zb_deferrable``).  Deferring holds the output
    gradient ``[..., h]`` of every microbatch until its W, for a W that is one scatter-add: on a first pipeline stage
    that can leave a microbatch holding more after B than after F, which lifts a zero-bubble schedule's peak above
    the bound it states in F's activations.
    """
    return _embedding_apply(ids, weight, store, defer)


_linear_apply = _direct_apply(_DeferrableLinear)
_bias_add_apply = _direct_apply(_DeferrableBiasAdd)
_embedding_apply = _direct_apply(_DeferrableEmbedding)


class DeferrableLinear(torch.nn.Module):
    """A drop-in ``nn.Linear`` built on ``deferrable_linear``; bind a store with ``bind_weight_grad_store``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = mark_deferrable(
            torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        )
        self.bias = (
            mark_deferrable(torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))) if bias else None
        )
        self.weight_grad_store: WeightGradStore | None = None
        self.wgrad_fn: WeightGradFn | None = None
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return deferrable_linear(x, self.weight, self.bias, self.weight_grad_store, wgrad_fn=self.wgrad_fn)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
