"""The bucketed data-parallel reducer: dp-mean gradients, launch-on-ready ordering, deferred (W) gradients."""

import copy
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.parallel.data_parallel import DataParallelReducer
from zb_pipeline.runtime.deferrable_linear import DeferrableLinear, deferrable_embedding, deferrable_linear
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store
from zb_pipeline.testing import run_multiprocess

VOCAB, HIDDEN, SEQ, BATCH = 32, 16, 6, 3
RTOL, ATOL = 1e-5, 1e-6  # fixed before measuring: fused addmm into main_grad vs mm then add


class TinyTiedLM(torch.nn.Module):
    """Embedding (deferrable) -> LayerNorm (plain autograd) -> 2 deferrable linears -> tied output head.

    The embedding table gets two gradient contributions per microbatch (lookup and head), the LayerNorm's come
    through autograd: both paths of the reducer are exercised.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)
        self.embed.zb_deferrable = True
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = DeferrableLinear(HIDDEN, 4 * HIDDEN)
        self.fc2 = DeferrableLinear(4 * HIDDEN, HIDDEN)
        self.store: WeightGradStore | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s] -> loss
        h = deferrable_embedding(ids, self.embed, self.store)  # [b, s, h]
        h = self.norm(h)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = deferrable_linear(h, self.embed, None, self.store)  # [b, s, V]
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _model() -> TinyTiedLM:
    torch.manual_seed(1234)
    return TinyTiedLM()


def _batch(dp_rank: int, iteration: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * iteration + 100 * dp_rank + k)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _reference_grads(model: torch.nn.Module, dp: int, iteration: int, m: int) -> dict[str, torch.Tensor]:
    """Gradient of the mean loss over every microbatch of every dp rank, in one process with plain autograd."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    for r in range(dp):
        for k in range(m):
            (ref(_batch(r, iteration, k)) / (m * dp)).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _assert_main_grads(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.main_grad, ref[n], rtol=RTOL, atol=ATOL, msg=lambda s, n=n: f"{n}: {s}")
        assert p.grad is None, n


def _dp_training(rank: int, world_size: int, bucket_numel: int, m: int, iterations: int) -> list[list[int]]:
    model = _model()
    pristine = copy.deepcopy(model)
    reducer = DataParallelReducer(model, dp_size=world_size, dp_rank=rank, bucket_numel=bucket_numel)
    assert len(reducer.buckets) > 1
    orders = []
    for it in range(iterations):
        reducer.zero_grad()
        for k in range(m):
            reducer.prepare_microbatch(is_last=k == m - 1)
            (model(_batch(rank, it, k)) / m).backward()
        launched_in_backward = list(reducer.launch_order)
        reducer.finish()
        _assert_main_grads(model, _reference_grads(pristine, world_size, it, m))
        orders.append(launched_in_backward)
    return orders


def _dp_training_both(rank: int, world_size: int) -> dict[int, list[list[int]]]:
    return {m: _dp_training(rank, world_size, 2000, m, 2) for m in (1, 3)}


def test_dp2_equals_mean_of_per_rank_gradients():
    out = run_multiprocess(_dp_training_both, 2, timeout_s=120)
    n_buckets = len(DataParallelReducer(_model(), bucket_numel=2000).buckets)
    for m in (1, 3):
        orders = [out[0][m], out[1][m]]
        assert orders[0] == orders[1]  # both ranks issue their collectives in the same order
        first, second = orders[0]
        # From the second microbatch on (or the second iteration with m = 1) every bucket launches during backward.
        assert sorted(second) == list(range(n_buckets))
        assert sorted(first) == (list(range(n_buckets)) if m > 1 else [])
        # Backward reaches the last layers first, which sit in the first buckets.
        assert second[0] == 0


def _explicit_order(rank: int, world_size: int, seed: int) -> tuple[list[int], list[int]]:
    model = _model()
    pristine = copy.deepcopy(model)
    reducer = DataParallelReducer(model, dp_size=world_size, dp_rank=rank, bucket_numel=1500)
    reducer.zero_grad()
    (model(_batch(rank, 0, 0))).backward()  # no prepare_microbatch: nothing is final until marked
    assert reducer.launch_order == []
    params = list(reducer.params)
    random.Random(seed).shuffle(params)  # same permutation on every rank
    expected, remaining = [], {b.index: len(b.params) for b in reducer.buckets}
    for p in params:
        bi = reducer.param_range(p)[0]
        remaining[bi] -= 1
        reducer.mark_grad_ready(p)
        if remaining[bi] == 0:
            expected.append(bi)
            assert reducer.buckets[bi].launched  # launches the moment its last gradient is final
        else:
            assert not reducer.buckets[bi].launched
    assert reducer.launch_order == expected
    reducer.finish(strict=True)
    _assert_main_grads(model, _reference_grads(pristine, world_size, 0, 1))
    return reducer.launch_order, expected


def test_buckets_launch_in_the_order_gradients_become_ready():
    out = run_multiprocess(_explicit_order, 2, args=(7,), timeout_s=120)
    assert out[0] == out[1]
    assert out[0][0] != sorted(out[0][0])  # the permutation really reordered the launches


def _deferred_w(rank: int, world_size: int, m: int, reduce_op: str) -> None:
    model = _model()
    pristine = copy.deepcopy(model)
    reducer = DataParallelReducer(model, dp_size=world_size, dp_rank=rank, bucket_numel=1500, reduce_op=reduce_op)
    store = WeightGradStore()
    model.store = store
    bind_weight_grad_store(model, store)
    reducer.zero_grad()
    for k in range(m):  # B: input gradients only, weight-gradient work queued
        with store.defer(0, k):
            (model(_batch(rank, 0, k)) / m).backward()
    deferred = [p for p in reducer.params if getattr(p, "zb_deferrable", False)]
    assert deferred and all(p.main_grad.abs().sum() == 0 for p in deferred)  # nothing has arrived yet
    assert model.norm.weight.main_grad.abs().sum() > 0  # plain autograd parameters did
    deferred_ids = {id(p) for p in deferred}
    for p in reducer.params:
        if id(p) not in deferred_ids:
            reducer.mark_grad_ready(p)
    for k in range(m):  # W, later: weight gradients land in main_grad
        store.run(0, k)
    store.assert_empty()
    for p in deferred:
        reducer.mark_grad_ready(p)
    assert sorted(reducer.launch_order) == list(range(len(reducer.buckets)))
    reducer.finish(strict=True)
    ref = _reference_grads(pristine, world_size, 0, m)
    if reduce_op == "all_reduce":
        _assert_main_grads(model, ref)
    else:  # only this rank's shard of each bucket holds the mean
        flat = torch.zeros_like(reducer.buffer)
        for n, p in model.named_parameters():
            _, start, end = reducer.param_range(p)
            flat[start:end] = ref[n].reshape(-1)
        for b in reducer.buckets:
            shard = b.shard(rank)
            lo = b.start + rank * shard.numel()
            torch.testing.assert_close(shard, flat[lo : lo + shard.numel()], rtol=RTOL, atol=ATOL)


def _deferred_w_both(rank: int, world_size: int) -> None:
    for reduce_op in ("all_reduce", "reduce_scatter"):
        _deferred_w(rank, world_size, 2, reduce_op)


def test_deferred_weight_gradients_all_reduce_and_reduce_scatter():
    run_multiprocess(_deferred_w_both, 2, timeout_s=120)


def test_dp1_needs_no_process_group_and_checks_late_gradients():
    assert not dist.is_initialized()
    model = _model()
    pristine = copy.deepcopy(model)
    reducer = DataParallelReducer(model, bucket_numel=1000)
    for it in range(2):
        reducer.zero_grad()
        for k in range(2):
            reducer.prepare_microbatch(is_last=k == 1)
            (model(_batch(0, it, k)) / 2).backward()
        reducer.finish(strict=True)
        _assert_main_grads(model, _reference_grads(pristine, 1, it, 2))
    # main_grad is a view into the buffer, buckets tile it, padding only at bucket ends
    assert all(p.main_grad.data_ptr() >= reducer.buffer.data_ptr() for p in reducer.params)
    assert [b.start for b in reducer.buckets[1:]] == [b.end for b in reducer.buckets[:-1]]
    # a gradient arriving after its parameter was declared final is an error, not a silent miss
    reducer.zero_grad()
    reducer.mark_grad_ready(model.norm.weight)
    with pytest.raises(RuntimeError, match=r"norm\.weight arrived after it was marked final"):
        model(_batch(0, 5, 0)).backward()
    reducer.zero_grad()
    reducer.mark_grad_ready(model.embed)
    with pytest.raises(RuntimeError, match=r"embed arrived after it was marked final"):
        model(_batch(0, 5, 0)).backward()


def test_strict_finish_and_bad_arguments():
    model = _model()
    reducer = DataParallelReducer(model)
    reducer.zero_grad()
    model(_batch(0, 0, 0)).backward()
    with pytest.raises(RuntimeError, match="never marked ready"):
        reducer.finish(strict=True)
    with pytest.raises(KeyError, match="not managed"):
        reducer.mark_grad_ready(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="reduce_op"):
        DataParallelReducer(_model(), reduce_op="mean")
    with pytest.raises(ValueError, match="needs a data-parallel process group"):
        DataParallelReducer(_model(), dp_size=2)
    reducer.remove_hooks()
