"""``--optimizer sgd``: the update equals ``torch.optim.SGD`` exactly (momentum, L2 weight decay, no decay on biases),
through the update rule alone and through fp32 main parameters over a bf16 model; post-validation's
snapshot/restore puts the momentum buffers back exactly; a checkpoint written by one optimizer refuses to load
into the other with a one-line fix.  (Bit-exact resume with sgd + the distributed optimizer: test_checkpointing.)

Tolerance: exact (``torch.equal``), chosen before measuring -- the rule performs torch's single-tensor SGD
operations in the same order.
"""

from __future__ import annotations

import pytest
import torch

from megatron.config.optimizer import OptimizerConfig
from megatron.config.precision import PrecisionConfig
from megatron.optimizer import SGD, MainParamOptimizer, build_update_rule, optimizer_names

LRS = [0.05, 0.1, 0.02, 0.07, 0.03]


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(6, 5, generator=g).to(dtype))
    b = torch.nn.Parameter(torch.randn(6, generator=g).to(dtype))
    return [("layer.weight", w), ("layer.bias", b)]


def _torch_sgd(ref: list[tuple[str, torch.nn.Parameter]], momentum: float, wd: float) -> torch.optim.SGD:
    groups = [{"params": [ref[0][1]], "weight_decay": wd}, {"params": [ref[1][1]], "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=LRS[0], momentum=momentum, foreach=False)


def _grads(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("momentum", [0.8, 0.0])
def test_sgd_matches_torch_sgd_exactly(momentum: float) -> None:
    cfg = OptimizerConfig(optimizer="sgd", sgd_momentum=momentum, weight_decay=0.1)
    ours, ref = _params(), _params()
    opt = build_update_rule(ours, cfg)
    assert isinstance(opt, SGD) and [len(gr.params) for gr in opt.param_groups] == [1, 1]
    ref_opt = _torch_sgd(ref, momentum, 0.1)
    for step, lr in enumerate(LRS):
        for (_, p), (_, q), grad in zip(ours, ref, _grads(step, [p.shape for _, p in ours])):
            p.main_grad = grad.clone()
            q.grad = grad.clone()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        opt.step(lr)
        ref_opt.step()
        for (_, p), (_, q) in zip(ours, ref):
            assert torch.equal(p.detach(), q.detach()), f"step {step}"
            if momentum:
                assert torch.equal(opt.state[id(p)]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
    assert opt.step_count == len(LRS) and (momentum or not opt.state)


def _main_param_optimizer(dtype: torch.dtype, optimizer: str = "sgd") -> MainParamOptimizer:
    named = _params(dtype=dtype)
    for _, p in named:
        p.main_grad = torch.zeros(p.shape)
    cfg = OptimizerConfig(optimizer=optimizer, sgd_momentum=0.9, weight_decay=0.05, clip_grad=0.0)
    return MainParamOptimizer(named, cfg, PrecisionConfig(bf16=dtype == torch.bfloat16))


def _set_grads(opt: MainParamOptimizer, step: int) -> list[torch.Tensor]:
    grads = _grads(step, [s.param.shape for s in opt.shards])
    for s, grad in zip(opt.shards, grads):
        s.grad.copy_(grad)
    return grads


def test_sgd_on_fp32_main_params_of_a_bf16_model_matches_torch_sgd() -> None:
    opt = _main_param_optimizer(torch.bfloat16)
    ref = [(s.name, torch.nn.Parameter(s.main.detach().clone())) for s in opt.shards]
    assert all(s.main.dtype == torch.float32 and s.main is not s.param for s in opt.shards)
    ref_opt = _torch_sgd(ref, 0.9, 0.05)
    for step, lr in enumerate(LRS):
        for (_, q), grad in zip(ref, _set_grads(opt, step)):
            q.grad = grad.clone()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        assert not opt.step(lr).skipped
        ref_opt.step()
        for s, (_, q) in zip(opt.shards, ref):
            assert torch.equal(s.main.detach(), q.detach())
            assert torch.equal(s.param.detach(), q.detach().to(torch.bfloat16))  # published into the model


def test_sgd_snapshot_restore_puts_momentum_back_exactly() -> None:
    opt = _main_param_optimizer(torch.float32)
    _set_grads(opt, 0)
    opt.apply_update(0.1, 1.0)
    snap = opt.snapshot()
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.update_rule.state.items()}
    mains = [s.main.detach().clone() for s in opt.shards]
    _set_grads(opt, 1)
    opt.apply_update(0.1, 0.5)  # a clipped step that validation would roll back
    assert not all(torch.equal(a, s.main) for a, s in zip(mains, opt.shards))
    opt.restore(snap)
    assert opt.step_count == 1 and all(torch.equal(a, s.main) for a, s in zip(mains, opt.shards))
    assert before.keys() == opt.update_rule.state.keys()
    for k, st in before.items():
        assert torch.equal(st["momentum_buffer"], opt.update_rule.state[k]["momentum_buffer"])


def test_optimizer_state_of_one_rule_refuses_to_load_into_the_other() -> None:
    sgd = _main_param_optimizer(torch.float32)
    _set_grads(sgd, 0)
    sgd.step(0.1)
    state = sgd.sharded_state_dict()
    assert set(state["pieces"]["layer.weight"]) == {"lo", "hi", "numel", "shape", "main", "momentum_buffer"}
    again = _main_param_optimizer(torch.float32)
    again.load_sharded_state_dicts([state])
    for a, b in zip(sgd.shards, again.shards):
        assert torch.equal(a.main, b.main)
        assert torch.equal(
            sgd.update_rule.state[id(a.main)]["momentum_buffer"], again.update_rule.state[id(b.main)]["momentum_buffer"]
        )
    adam = _main_param_optimizer(torch.float32, optimizer="adam")
    with pytest.raises(ValueError, match="holds momentum_buffer but --optimizer adam needs exp_avg, exp_avg_sq"):
        adam.load_sharded_state_dicts([state])


def test_registry_names_and_config_checks() -> None:
    assert optimizer_names() == ("adam", "sgd")
    with pytest.raises(ValueError, match="--sgd-momentum=1.5 must be in"):
        OptimizerConfig(optimizer="sgd", sgd_momentum=1.5)
    with pytest.raises(ValueError, match="--optimizer 'adagrad' is not one of adam, sgd"):
        build_update_rule(_params(), OptimizerConfig(optimizer="adagrad"))
