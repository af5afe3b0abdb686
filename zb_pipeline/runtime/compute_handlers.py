"""The built-in action handlers: what F, B, W, BW, an F+BW pair and the plain transfers do on one rank.

Each is ``fn(executor, action)`` and works only through the executor's public plumbing (``fetch_input``,
``deliver_output``, ``save_for_backward``, ...), the way a user's handler registered with ``set_handler`` would.
See ``zb_pipeline.runtime.executor`` for what each kind does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from zb_pipeline.runtime.hooks import Handler
from zb_pipeline.schedule.ir import Action, Kind, PairAction

# ``ex`` is a ``zb_pipeline.runtime.executor.PipelineExecutor`` (not imported: the executor imports this table).
PipelineExecutor = Any


def _forward(ex: PipelineExecutor, a: Action) -> None:
    s, mb = a.stage, a.microbatch
    x = ex.fetch_input(a)
    if s > 0 and not x.requires_grad and x.is_floating_point():
        x.requires_grad_()
    out = ex.forward_fn(ex.stages[s], x, s, mb)
    if s == ex.num_stages - 1:
        got = ex.loss_fn(out, mb)
        loss, report = got if isinstance(got, tuple) else (got, got)
        ex.losses[mb] = report.detach()
        ex.save_for_backward(a, x if s > 0 else None, loss)
        return
    if not out.requires_grad:
        raise RuntimeError(f"rank {ex.rank}: {a}: the output of stage {s} does not require grad (no parameters?)")
    ex.deliver_output(a, out)
    # Generic splits need the output tensor; otherwise its autograd edge is enough and the tensor can go once sent.
    root = out if ex.split_of(s) is not None else get_gradient_edge(out)
    ex.save_for_backward(a, x if s > 0 else None, root)


def _backward(ex: PipelineExecutor, a: Action, defer: bool) -> None:
    s, mb = a.stage, a.microbatch
    x, root = ex.pop_saved(a)
    grad = ex.fetch_output_grad(a)
    split = ex.split_of(s)
    if split is not None and defer:
        if isinstance(root, torch.Tensor) and grad is None and root.dim() == 0:
            grad = torch.ones_like(root)
        with ex.store.defer(s, mb):
            got = split.backward_input([root], [grad], [x] if x is not None else [])
        gx = got[0] if x is not None else None
    else:
        if defer:
            with ex.store.defer(s, mb):
                torch.autograd.backward([root], None if grad is None else [grad])
        else:
            torch.autograd.backward([root], None if grad is None else [grad])
        gx = x.grad if x is not None else None
    if defer:
        ex.defer_w(a)
    if s > 0:
        if gx is None:
            raise RuntimeError(f"rank {ex.rank}: {a}: stage {s}'s output does not depend on its input")
        ex.deliver_input_grad(a, gx)


def _b(ex: PipelineExecutor, a: Action) -> None:
    _backward(ex, a, defer=True)


def _bw(ex: PipelineExecutor, a: Action) -> None:
    _backward(ex, a, defer=False)


def _w(ex: PipelineExecutor, a: Action) -> None:
    ex.complete_w(a)
    ex.store.run(a.stage, a.microbatch)


def _pair(ex: PipelineExecutor, a: PairAction) -> None:
    """An overlapped pair, back to back: its forward, then its full backward (each traced as a half of ``a``)."""
    ex.run_compute(a.forward, pair=a)
    ex.run_compute(a.backward, pair=a)


def _send(ex: PipelineExecutor, a: Action) -> torch.Tensor:
    return ex.take_payload(a)


def _recv(ex: PipelineExecutor, a: Action) -> None:
    return None


DEFAULT_HANDLERS: dict[Kind, Handler] = {
    Kind.F: _forward,
    Kind.B: _b,
    Kind.W: _w,
    Kind.BW: _bw,
    Kind.PAIR: _pair,
    Kind.SEND_F: _send,
    Kind.SEND_B: _send,
    Kind.RECV_F: _recv,
    Kind.RECV_B: _recv,
}
