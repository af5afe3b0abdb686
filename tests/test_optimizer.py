"""Learning-rate schedule values, AdamW against torch.optim.AdamW, global grad-norm clipping (single and TP ranks)."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.config.lr_schedule import LRScheduleConfig
from megatron.config.optimizer import OptimizerConfig
from megatron.optimizer import AdamW, GradStats, LRScheduler, clip_grads, learning_rate_at, local_grad_stats
from zb_pipeline.optim.grad_stats import grad_stats
from zb_pipeline.testing.harness import run_multiprocess


def _lr(n, **kw):
    cfg = LRScheduleConfig(**{"lr": 1.0, "min_lr": 0.1, **kw})
    return learning_rate_at(n, cfg, train_iters=100)


def test_warmup_then_linear_decay():
    assert _lr(0, warmup_iters=10) == 0.0
    assert _lr(5, warmup_iters=10) == pytest.approx(0.5)
    assert _lr(10, warmup_iters=10) == pytest.approx(1.0)
    assert _lr(55, warmup_iters=10) == pytest.approx(0.1 + 0.5 * 0.9)
    assert _lr(100, warmup_iters=10) == pytest.approx(0.1)
    assert _lr(150, warmup_iters=10) == pytest.approx(0.1)


def test_cosine_decay_and_explicit_decay_iters():
    kw = dict(decay_style="cosine", warmup_iters=0, decay_iters=40)
    assert _lr(0, **kw) == pytest.approx(1.0)
    assert _lr(20, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert _lr(10, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1))
    assert _lr(40, **kw) == pytest.approx(0.1) and _lr(41, **kw) == pytest.approx(0.1)


def test_constant_and_inverse_sqrt():
    assert _lr(77, decay_style="constant", warmup_iters=5) == 1.0
    assert _lr(2, decay_style="constant", warmup_iters=5) == pytest.approx(0.4)
    assert _lr(16, decay_style="inverse-square-root", warmup_iters=4) == pytest.approx(0.5)
    assert _lr(10**6, decay_style="inverse-square-root", warmup_iters=4) == pytest.approx(0.1)


def test_scheduler_object_steps_and_round_trips():
    sched = LRScheduler(LRScheduleConfig(lr=2.0, warmup_iters=4), train_iters=10)
    seen = [sched.current_lr] + [sched.step() for _ in range(3)]
    assert seen == pytest.approx([0.0, 0.5, 1.0, 1.5])
    other = LRScheduler(LRScheduleConfig(lr=2.0, warmup_iters=4), train_iters=10)
    other.load_state_dict(sched.state_dict())
    assert other.current_lr == sched.current_lr


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(6, 5, generator=g))
    b = torch.nn.Parameter(torch.randn(6, generator=g))
    return [("layer.weight", w), ("layer.bias", b)]


def test_adamw_matches_torch_adamw_with_main_grad():
    cfg = OptimizerConfig(weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    ours, ref = _params(), _params()
    opt = AdamW(ours, cfg)
    ref_opt = torch.optim.AdamW(
        [{"params": [ref[0][1]], "weight_decay": 0.1}, {"params": [ref[1][1]], "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        lr = 0.01 * (step + 1)
        for (_, p), (_, q) in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g)
            p.main_grad = grad.clone()
            q.grad = grad.clone()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        opt.step(lr)
        ref_opt.step()
    for (_, p), (_, q) in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert [len(gr.params) for gr in opt.param_groups] == [1, 1]


def test_clip_matches_torch_and_reports_nonfinite():
    ours, ref = _params(), _params()
    g = torch.Generator().manual_seed(2)
    for (_, p), (_, q) in zip(ours, ref):
        grad = 3 * torch.randn(p.shape, generator=g)
        p.main_grad = grad.clone()
        q.grad = grad.clone()
    ps = [p for _, p in ours]
    stats = clip_grads(ps, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_([q for _, q in ref], 1.0)
    assert stats.norm == pytest.approx(float(ref_norm), rel=1e-6) and not stats.found_nonfinite
    for (_, p), (_, q) in zip(ours, ref):
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-7)
    before = [p.main_grad.clone() for p in ps]
    assert clip_grads(ps, 100.0).norm == pytest.approx(1.0, rel=1e-5)  # below the limit: untouched
    assert all(torch.equal(a, p.main_grad) for a, p in zip(before, ps))
    ps[1].main_grad[0] = float("nan")
    stats = clip_grads(ps, 1.0)
    assert stats.found_nonfinite and math.isnan(stats.norm)
    # +inf and -inf in different tensors: their squares add up to inf, they cannot cancel; finite grads flag nothing
    finite = [torch.ones(3), torch.full((2,), 2.0)]
    assert _local_stats_of(finite) == (11.0, GradStats(norm=11.0**0.5, found_nonfinite=False))
    assert _local_stats_of([torch.tensor([1.0, float("inf")]), torch.tensor([-float("inf")])])[1].found_nonfinite
    assert _local_stats_of([torch.tensor([float("-inf")])])[1].found_nonfinite


def _local_stats_of(grads: list[torch.Tensor]) -> tuple[float, GradStats]:
    """``local_grad_stats`` (the sum of squares) of parameters whose main gradients are ``grads``, and the
    statistics that ``grad_stats`` derives from it."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.main_grad = g
        params.append(p)
    sum_sq = local_grad_stats(params)
    return sum_sq.item(), grad_stats(sum_sq)


def _tp_norm_rank(rank: int, world_size: int) -> float:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    full_w = torch.randn(8, 4, generator=g)  # column-sharded over tp
    bias = torch.randn(4, generator=g)  # replicated over tp
    w = torch.nn.Parameter(full_w.chunk(world_size, 0)[rank].clone())
    w.tensor_model_parallel = True
    b = torch.nn.Parameter(torch.zeros(4))
    w.main_grad = w.detach().clone()
    b.main_grad = bias.clone()
    assert local_grad_stats([w, b], tp_rank=rank) > 0
    return clip_grads([w, b], 0.0, tp_rank=rank, mp_group=dist.group.WORLD).norm


@pytest.mark.slow  # the default run covers this through the TP=2 training-equivalence test (grad norms compared)
def test_norm_across_tensor_parallel_ranks_counts_replicas_once():
    g = torch.Generator().manual_seed(5)
    full_w = torch.randn(8, 4, generator=g)
    bias = torch.randn(4, generator=g)
    expected = math.sqrt(float(full_w.pow(2).sum() + bias.pow(2).sum()))
    norms = run_multiprocess(_tp_norm_rank, 2, timeout_s=60)
    assert norms == pytest.approx([expected, expected], rel=1e-6)  # fp32 sums of squares
