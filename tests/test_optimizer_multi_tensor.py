"""The multi-tensor (``torch._foreach_*``) update rules equal the per-tensor loops they replaced, bit for bit on the
CPU: AdamW and SGD directly (weight decay on and off, parameters without a gradient, a bf16 parameter with a bf16
``.grad`` instead of ``main_grad``, a non-contiguous one), through fp32 main parameters of bf16 and fp16
(loss-scaled) models with clipping, and over the distributed optimizer's flat shards, with a post-validation
snapshot/restore in the middle.

The reference is the per-tensor loop of torch's formulas, kept here (``_loop_adamw_step``, ``_loop_sgd_step``;
``torch.optim.AdamW`` itself only agrees to rounding, tests/test_optimizer.py).  Tolerance: exact
(``torch.equal``), chosen before measuring -- every element sees the same operations in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from megatron.config.optimizer import OptimizerConfig
from megatron.config.precision import PrecisionConfig
from megatron.optimizer import (
    SGD,
    AdamW,
    DistributedOptimizer,
    MainParamOptimizer,
    UpdateRule,
    build_update_rule,
    default_no_weight_decay,
    grad_of,
)
from megatron.parallel.data_parallel import DataParallelReducer

LRS = [0.01, 0.03, 0.02, 0.005, 0.04]


def _with_grads(rule: UpdateRule) -> Iterator[tuple[float, torch.nn.Parameter, torch.Tensor]]:
    """``(weight decay, parameter, fp32 gradient)`` of every parameter with a gradient, group by group, in order."""
    for group in rule.param_groups:
        for p in group.params:
            g = grad_of(p)
            if g is not None:
                yield group.weight_decay, p, g.float()


def _loop_adamw_step(rule: UpdateRule, lr: float) -> None:
    """The per-tensor AdamW loop (the reference): ``p <- p (1 - lr wd)``, Adam moments, bias-corrected update."""
    cfg = rule.config
    rule.step_count += 1
    t = rule.step_count
    b1, b2 = cfg.adam_beta1, cfg.adam_beta2
    step_size = lr / (1.0 - b1**t)
    bc2_sqrt = math.sqrt(1.0 - b2**t)
    for wd, p, g in _with_grads(rule):
        st = rule.state_of(p)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v.sqrt() / bc2_sqrt).add_(cfg.adam_eps)
        p.addcdiv_(m, denom, value=-step_size)


def _loop_sgd_step(rule: UpdateRule, lr: float) -> None:
    """The per-tensor SGD loop (the reference): L2 decay into the gradient, momentum buffer, ``p <- p - lr buf``."""
    momentum = rule.config.sgd_momentum
    rule.step_count += 1
    for wd, p, d in _with_grads(rule):
        if wd != 0.0:
            d = d.add(p, alpha=wd)
        if momentum != 0.0:
            st = rule.state.get(id(p))
            if st is None:
                rule.state[id(p)] = st = {"momentum_buffer": d.clone()}
            else:
                st["momentum_buffer"].mul_(momentum).add_(d)
            d = st["momentum_buffer"]
        p.add_(d, alpha=-lr)


class LoopAdamW(AdamW):
    @torch.no_grad()
    def step(self, lr: float) -> None:
        _loop_adamw_step(self, lr)


class LoopSGD(SGD):
    @torch.no_grad()
    def step(self, lr: float) -> None:
        _loop_sgd_step(self, lr)


LOOP_RULES = {"adam": LoopAdamW, "sgd": LoopSGD}


def _named(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    """Weights (decayed), a bias and a norm weight (not decayed) and an embedding, of a few shapes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embedding.weight": (11, 4),
        "layer.qkv.weight": (12, 4),
        "layer.qkv.bias": (12,),
        "layer.norm.weight": (4,),
        "layer.fc.weight": (3, 4, 2),
        "head.weight": (7, 4),
    }
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))) for n, s in shapes.items()]


def _grads(step: int, shapes: list[torch.Size], scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(s, generator=g) for s in shapes]


def _assert_rules_equal(ours: UpdateRule, ref: UpdateRule) -> None:
    assert ours.step_count == ref.step_count
    for p, q in zip(ours.params, ref.params):
        assert torch.equal(p, q)
        assert (id(p) in ours.state) == (id(q) in ref.state)
        if id(p) in ours.state:
            a, b = ours.state[id(p)], ref.state[id(q)]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("weight_decay,momentum", [(0.1, 0.9), (0.0, 0.0)])
def test_update_rule_equals_the_per_tensor_loop(optimizer: str, weight_decay: float, momentum: float) -> None:
    cfg = OptimizerConfig(optimizer=optimizer, weight_decay=weight_decay, sgd_momentum=momentum, adam_beta2=0.95)
    ours, ref = _named(), _named()
    for named in (ours, ref):  # a bf16 parameter among fp32 ones (its own group), a non-contiguous one
        named[4] = (named[4][0], torch.nn.Parameter(named[4][1].detach().bfloat16()))
        named[5] = (named[5][0], torch.nn.Parameter(named[5][1].detach().t()))
    assert not ours[5][1].is_contiguous()
    rule = build_update_rule(ours, cfg)
    loop = LOOP_RULES[optimizer](ref, cfg)
    assert [(len(g.params), g.weight_decay) for g in rule.param_groups] == [(4, weight_decay), (2, 0.0)]
    for step, lr in enumerate(LRS):
        grads = _grads(step, [p.shape for _, p in ours])
        for i, ((_, p), (_, q), grad) in enumerate(zip(ours, ref, grads)):
            if i == 1 and step % 2:  # a parameter without a gradient this step: left alone
                p.main_grad = q.main_grad = None
            elif i == 4:  # no main_grad: the bf16 .grad (grad_of falls back to it, cast to fp32)
                p.grad, q.grad = grad.bfloat16(), grad.bfloat16()
            else:
                p.main_grad, q.main_grad = grad.clone(), grad.clone()
        rule.step(lr)
        loop.step(lr)
        _assert_rules_equal(rule, loop)
    # zero_grad: every main_grad zeroed in place, every .grad dropped
    held = [p.main_grad for _, p in ours if getattr(p, "main_grad", None) is not None]
    rule.zero_grad()
    assert all(not m.any() for m in held) and all(p.grad is None for _, p in ours)


class LoopScaleMainParams(MainParamOptimizer):
    """The per-tensor unscale/clip loop (the reference for ``_scale_grads``)."""

    def _scale_grads(self, factor: float) -> None:
        for s in self.shards:
            s.grad.mul_(factor)


def _main_params(cls: type, optimizer: str, precision: str, loop: bool) -> MainParamOptimizer:
    named = _named(dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32))
    reducer = DataParallelReducer(named, reduce_op="reduce_scatter" if cls is DistributedOptimizer else "all_reduce")
    cfg = OptimizerConfig(optimizer=optimizer, weight_decay=0.05, clip_grad=1.0)
    prec = PrecisionConfig(bf16=precision == "bf16", fp16=precision == "fp16", loss_scale=1024.0)
    opt = cls(named, cfg, prec, reducer=reducer) if cls is DistributedOptimizer else cls(named, cfg, prec)
    opt.reducer = reducer
    if loop:
        if cls is MainParamOptimizer:
            opt.__class__ = LoopScaleMainParams
        by_name = {s.name: s for s in opt.shards}
        opt.update_rule = LOOP_RULES[optimizer](
            ((s.name, s.main) for s in opt.shards),
            cfg,
            no_weight_decay=lambda name, _main: default_no_weight_decay(name, by_name[name].param),
        )
    return opt


def _set_grads(opt: MainParamOptimizer, step: int) -> None:
    scale = (1e-3 if step % 2 else 1.0) * opt.loss_scale  # odd steps below the clip threshold
    for s, grad in zip(opt.shards, _grads(step, [s.grad.shape for s in opt.shards], scale)):
        s.grad.copy_(grad)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize(
    "cls,precision", [(MainParamOptimizer, "bf16"), (MainParamOptimizer, "fp16"), (DistributedOptimizer, "fp32")]
)
def test_main_param_step_equals_the_per_tensor_loop(cls: type, precision: str, optimizer: str) -> None:
    ours, ref = (_main_params(cls, optimizer, precision, loop) for loop in (False, True))
    assert type(ref.update_rule) is LOOP_RULES[optimizer] and type(ours.update_rule) is not LOOP_RULES[optimizer]
    if cls is DistributedOptimizer:
        assert all(s.main.dim() == 1 for s in ours.shards)  # flat shards
    for step, lr in enumerate(LRS):
        if step == 3:  # post-validation: step optimistically, roll back, step again
            snaps = ours.snapshot(), ref.snapshot()
            for opt in (ours, ref):
                _set_grads(opt, 99)
                opt.apply_update(lr, 0.5)
            ours.restore(snaps[0])
            ref.restore(snaps[1])
        for opt in (ours, ref):
            _set_grads(opt, step)
        a, b = ours.step(lr), ref.step(lr)
        assert a == b and not a.skipped
        _assert_rules_equal(ours.update_rule, ref.update_rule)
        for s, t in zip(ours.shards, ref.shards):
            assert torch.equal(s.param, t.param) and torch.equal(s.grad, t.grad)
    keys = set(ours.update_rule.state)
    state = dict(ours.update_rule.state)
    _set_grads(ours, 0)
    ours.step(0.01)  # the state dict keeps its keys and tensors across steps (snapshot/restore and checkpoints)
    assert set(ours.update_rule.state) == keys
    assert all(ours.update_rule.state[k] is state[k] for k in keys)
