"""Activation recomputation that composes with the B/W split: B recomputes a segment's forward once, W never does.

``recompute(fn, *args)`` runs ``fn(*args)`` in F without building its autograd graph and keeps only the tensor
arguments (the segment's inputs).  When backward reaches the segment -- in a zero-bubble schedule, during B --
it re-runs ``fn`` on those inputs with the random-number state F started from (CPU and CUDA generators, plus any
tracker given: dropout masks are the same), then backpropagates through the recomputed graph:

* inside B (the runtime's ``WeightGradStore`` is deferring), the segment's deferrable layers enqueue their W work as
  they always do -- closures holding the recomputed input and the output gradient of each deferred weight GEMM --
  so W runs exactly the GEMMs it runs without recomputation, on the same tensors, and never recomputes anything.
  The rest of the recomputed graph is freed when the segment's backward returns.
* under the generic split (``GenericSplit``, for stages not built on deferrable layers) the segment's plain
  autograd parameters are deferred to W through ``split_backward`` on the recomputed graph (``params``).
* outside B (a fused ``BW``, plain autograd) everything is computed at once, as ``torch.autograd.backward`` would.

Parameters reached by the plain path get their gradients from autograd exactly as without recomputation (the
recomputed forward runs the same kernels on the same inputs), so losses are bit-identical with and without it.

``pack``/``unpack`` (optional) transform what F keeps of each floating-point input that needs a gradient: e.g.
keep only this tensor-parallel rank's slice and all-gather it at B (Megatron's ``--distribute-saved-activations``).

This is a reentrant checkpoint (one custom autograd function per segment) rather than ``torch.utils.checkpoint``'s
non-reentrant one: the latter recomputes on the first *read* of a saved tensor, which the profiler's graph walk
(``activation_memory.graph_saved_tensors``) would trigger in F.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from zb_pipeline.runtime.weight_grad_store import WeightGradStore

__all__ = ["RNGState", "RNGTracker", "Recompute", "recompute"]


class RNGTracker(Protocol):
    """A set of named generators (e.g. a tensor-parallel RNG tracker) whose state recomputation replays."""

    def get_states(self) -> Any: ...

    def set_states(self, states: Any) -> None: ...


class RNGState:
    """The CPU generator, the CUDA generators of ``devices`` and ``trackers``' states at one moment."""

    def __init__(self, devices: Sequence[torch.device], trackers: Sequence[RNGTracker]) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices]
        self.trackers = [(t, t.get_states()) for t in trackers]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda:
            torch.cuda.set_rng_state(state, d)
        for t, states in self.trackers:
            t.set_states(states)


def _cuda_devices(tensors: Sequence[torch.Tensor]) -> list[torch.device]:
    return list({t.device: None for t in tensors if t.is_cuda})


class _Options:
    __slots__ = ("store", "params", "trackers", "pack", "unpack")

    def __init__(self, store, params, trackers, pack, unpack) -> None:
        self.store, self.params, self.trackers, self.pack, self.unpack = store, params, trackers, pack, unpack


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, opts: _Options, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.fn, ctx.opts = fn, opts
        ctx.rng = RNGState(_cuda_devices(tensors), opts.trackers)
        ctx.layout = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.needs = [a.requires_grad for a in tensors]
        packs = opts.pack is not None
        packed = [
            i
            for i, t in enumerate(tensors)
            if packs and t.requires_grad and t.is_floating_point() and not isinstance(t, torch.nn.Parameter)
        ]
        ctx.packed = set(packed)
        ctx.shapes = {i: tensors[i].shape for i in packed}
        with torch.no_grad():
            out = fn(*args)
        kept = [opts.pack(t) if i in ctx.packed else t for i, t in enumerate(tensors)]
        ctx.save_for_backward(*kept)
        ctx.single = isinstance(out, torch.Tensor)
        return out

    @staticmethod
    def backward(ctx, *grads):
        opts: _Options = ctx.opts
        kept = ctx.saved_tensors
        tensors = []
        for i, t in enumerate(kept):
            if i in ctx.packed:
                t = opts.unpack(t, ctx.shapes[i])
            t = t.detach()
            t.requires_grad_(ctx.needs[i])
            tensors.append(t)
        it = iter(tensors)
        args = [next(it) if is_t else other for is_t, other in zip(ctx.layout, ctx.others)]
        now = RNGState([d for d, _ in ctx.rng.cuda], opts.trackers)
        ctx.rng.restore()
        try:
            with torch.enable_grad():
                out = ctx.fn(*args)
        finally:
            now.restore()
        outs = (out,) if ctx.single else tuple(out)
        store: WeightGradStore | None = opts.store
        if store is not None and store.on_recompute:
            for hook in store.on_recompute:
                hook(outs)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        diff = [t for t in tensors if t.requires_grad]
        if pairs and store is not None and store.deferring and store.split_autograd_params:
            from zb_pipeline.runtime.generic_split import split_backward  # generic_split imports nothing of ours

            got = split_backward([o for o, _ in pairs], [g for _, g in pairs], diff, opts.params, store)
            by_id = {id(t): g for t, g in zip(diff, got)}
            grads_in = [by_id.get(id(t)) for t in tensors]
        else:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads_in = [t.grad if t.requires_grad else None for t in tensors]
        it = iter(grads_in)
        return (None, None, *(next(it) if is_t else None for is_t in ctx.layout))


def recompute(
    fn: Callable[..., Any],
    *args: Any,
    store: WeightGradStore | None = None,
    params: Sequence[torch.nn.Parameter] = (),
    trackers: Sequence[RNGTracker] = (),
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None,
    unpack: Callable[[torch.Tensor, torch.Size], torch.Tensor] | None = None,
) -> Any:
    """``fn(*args)`` (a tensor or a tuple of tensors) whose internal activations are recomputed at backward.

    ``store``/``params``: the weight-gradient store and ``fn``'s parameters, for the generic split (see the module
    docstring); ``trackers``: extra generators to replay; ``pack(x)`` / ``unpack(kept, shape)``: what F keeps of
    each input that needs a gradient.  Without autograd (evaluation) ``fn`` simply runs.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not torch.is_grad_enabled():
        return fn(*args)
    inputs_need_grad = any(t.requires_grad for t in tensors)
    if not inputs_need_grad and not any(p.requires_grad for p in params):
        return fn(*args)
    if not inputs_need_grad:
        # Parameters inside but no input needing a gradient: pass them as (unused) inputs so that backward comes
        # (under the generic split the segment is then weight work only, recomputed once, at W).
        extra = [p for p in params if p.requires_grad]
        args = (*args, *extra)
        inner, k = fn, len(extra)
        fn = lambda *a: inner(*a[:-k])  # noqa: E731
    if (pack is None) != (unpack is None):
        raise ValueError("recompute: give both pack and unpack, or neither")
    opts = _Options(store, [p for p in params if p.requires_grad], tuple(trackers), pack, unpack)
    return _Recompute.apply(fn, opts, *args)


class Recompute(torch.nn.Module):
    """``module`` whose activations are recomputed at backward (see ``recompute``); for any ``nn.Module`` stage.

    It carries a ``weight_grad_store`` attribute, so ``bind_weight_grad_store`` (and ``GenericSplit``) bind it like
    a deferrable layer: under the generic split its plain parameters' gradients are deferred to W.
    """

    store_only = True  # not a deferrable layer itself: the executor still picks the generic split for its stage

    def __init__(self, module: torch.nn.Module, *, trackers: Sequence[RNGTracker] = ()) -> None:
        super().__init__()
        self.module = module
        self.trackers = tuple(trackers)
        self.weight_grad_store: WeightGradStore | None = None

    def forward(self, *args: Any) -> Any:
        params = [p for p in self.module.parameters() if not getattr(p, "zb_deferrable", False)]
        return recompute(self.module, *args, store=self.weight_grad_store, params=params, trackers=self.trackers)
