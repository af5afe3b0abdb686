"""The B/W split primitive: B then W gives exactly the gradients of a full backward, for every layer type."""

from __future__ import annotations

import pytest
import torch
from model_configs import tiny_config

from megatron.model import GPTConfig
from megatron.model.embedding import PositionEmbedding
from megatron.model.init import initialize_parameters
from megatron.model.transformer_layer import TransformerLayer
from megatron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding
from zb_pipeline.runtime.deferrable_linear import (
    DeferrableLinear,
    deferrable_bias_add,
    deferrable_linear,
    register_grad_accumulated_hook,
)
from zb_pipeline.runtime.generic_split import GenericSplit, split_backward
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

torch.set_num_threads(1)
TP1 = TPContext()


def _fill(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        g = getattr(p, "main_grad", None)
        out[name] = (g if g is not None else p.grad).clone()
    return out


def _run(module, make_input, *, store: WeightGradStore | None, defer: bool, main_grad: bool, microbatches: int = 2):
    """Forward+backward ``microbatches`` times; returns (input grads, param grads). With ``defer`` each backward is
    a B inside ``store.defer`` and all W run afterwards, in microbatch order."""
    module.zero_grad(set_to_none=True)
    for p in module.parameters():
        if main_grad:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        elif hasattr(p, "main_grad"):
            del p.main_grad
    bind_weight_grad_store(module, store)
    input_grads = []
    for mb in range(microbatches):
        x = make_input(mb)
        y = module(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + mb))
        if defer:
            with store.defer(0, mb):
                y.backward(g)
        else:
            y.backward(g)
        input_grads.append(None if not x.is_floating_point() else x.grad.clone())
    if defer:
        assert store.pending(), "B should have left weight work in the store"
        for p in module.parameters():
            if not getattr(p, "zb_deferrable", False):
                continue  # e.g. norm weights: immediate, through autograd
            g = getattr(p, "main_grad", None)
            assert (g is None and p.grad is None) or (g is not None and not g.any()), "B must not touch weight grads"
        for mb in range(microbatches):
            store.run(0, mb)
        store.assert_empty()
    return input_grads, _grads(module)


def _float_input(shape):
    def make(mb):
        return torch.randn(shape, generator=torch.Generator().manual_seed(mb)).requires_grad_()

    return make


def _ids_input(shape, high):
    def make(mb):
        return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(mb))

    return make


class _BiasAdd(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(n))
        self.bias.zb_deferrable = True
        self.weight_grad_store = None

    def forward(self, x):
        return deferrable_bias_add(x, self.bias, self.weight_grad_store)


class _Positions(torch.nn.Module):  # positions + a float input, so there is an input gradient too
    def __init__(self) -> None:
        super().__init__()
        self.pos = PositionEmbedding(16, 8)
        self.pos.defer_weight_grad = True  # the tables' W runs in B by default (test_gpt_model covers that)

    def forward(self, x):  # x: [s, b, h]
        return x * 2 + self.pos(x.shape[0])


def _deferring(table: VocabParallelEmbedding) -> VocabParallelEmbedding:
    table.defer_weight_grad = True
    return table


LAYERS = {
    "linear+bias": (lambda: DeferrableLinear(8, 12), _float_input((5, 3, 8))),
    "linear-no-bias": (lambda: DeferrableLinear(8, 12, bias=False), _float_input((5, 3, 8))),
    "column-parallel": (lambda: ColumnParallelLinear(8, 12, tp=TP1), _float_input((5, 3, 8))),
    "row-parallel": (lambda: RowParallelLinear(8, 12, tp=TP1), _float_input((5, 3, 8))),
    "bias-add": (lambda: _BiasAdd(8), _float_input((5, 3, 8))),
    "vocab-embedding": (lambda: _deferring(VocabParallelEmbedding(20, 8, tp=TP1)), _ids_input((3, 5), 20)),
    "position-embedding": (_Positions, _float_input((6, 2, 8))),
}


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_b_then_w_equals_full_backward(layer: str, main_grad: bool) -> None:
    build, make_input = LAYERS[layer]
    module = build()
    _fill(module)
    full_in, full_w = _run(module, make_input, store=WeightGradStore(), defer=False, main_grad=main_grad)
    split_in, split_w = _run(module, make_input, store=WeightGradStore(), defer=True, main_grad=main_grad)
    for a, b in zip(full_in, split_in):
        assert (a is None and b is None) or torch.equal(a, b)
    assert full_w.keys() == split_w.keys()
    for name in full_w:
        assert torch.equal(full_w[name], split_w[name]), name
    # and the immediate path is plain autograd: the same as without any store
    plain_in, plain_w = _run(module, make_input, store=None, defer=False, main_grad=main_grad)
    for name in full_w:
        torch.testing.assert_close(plain_w[name], full_w[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_tp1_one_node_equals_linear_then_bias_add(dtype: torch.dtype) -> None:
    """At tp = 1 a row-parallel layer adds its bias inside the linear's node (``separate_bias``): outputs and
    gradients bit-identical to the two-node form (linear, then ``deferrable_bias_add``) it replaces, full
    backward and B then W, with and without ``main_grad``."""

    class _TwoNodes(RowParallelLinear):
        def forward(self, x):
            y = deferrable_linear(x, self.weight, None, self.weight_grad_store)
            return deferrable_bias_add(y, self.bias, self.weight_grad_store)

    one, two = RowParallelLinear(24, 12, tp=TP1), _TwoNodes(24, 12, tp=TP1)
    _fill(one)
    two.load_state_dict(one.state_dict())
    one, two = one.to(dtype), two.to(dtype)
    make = _float_input((7, 3, 24))

    def make_input(mb):
        return make(mb).detach().to(dtype).requires_grad_()

    for defer in (False, True):
        for main_grad in (False, True):
            got = [_run(m, make_input, store=WeightGradStore(), defer=defer, main_grad=main_grad) for m in (one, two)]
            (in1, w1), (in2, w2) = got
            assert all(torch.equal(a, b) for a, b in zip(in1, in2))
            assert all(torch.equal(w1[n], w2[n]) for n in w1), (defer, main_grad)
    x = make_input(0)
    assert torch.equal(one(x), two(x))


def test_plain_mode_matches_torch_linear() -> None:
    lin = DeferrableLinear(8, 12)
    ref = torch.nn.Linear(8, 12)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(lin(x).square().sum(), x)  # plain mode: autograd.grad works
    (gx_ref,) = torch.autograd.grad(ref(x).square().sum(), x)
    torch.testing.assert_close(gx, gx_ref)
    gw = torch.autograd.grad(lin(x).square().sum(), lin.weight)[0]
    gw_ref = torch.autograd.grad(ref(x).square().sum(), ref.weight)[0]
    torch.testing.assert_close(gw, gw_ref)


def _tiny_config(**kw) -> GPTConfig:
    return tiny_config(**{"vocab_size": 50, **kw})


@pytest.mark.parametrize("swiglu", [False, True])
def test_transformer_layer_b_then_w_exact(swiglu: bool) -> None:
    cfg = _tiny_config(swiglu=swiglu, normalization="RMSNorm" if swiglu else "LayerNorm")
    layer = TransformerLayer(cfg, layer_number=0, tp=TP1)
    initialize_parameters(layer, seed=3, config=cfg, tp=TP1)
    make = _float_input((16, 2, 32))
    for main_grad in (False, True):
        full_in, full_w = _run(layer, make, store=WeightGradStore(), defer=False, main_grad=main_grad)
        split_in, split_w = _run(layer, make, store=WeightGradStore(), defer=True, main_grad=main_grad)
        assert all(torch.equal(a, b) for a, b in zip(full_in, split_in))
        for name in full_w:
            assert torch.equal(full_w[name], split_w[name]), name


def test_store_bookkeeping_and_isolation() -> None:
    a, b = WeightGradStore(), WeightGradStore()
    lin = DeferrableLinear(4, 4)
    bind_weight_grad_store(lin, a)
    x = torch.randn(2, 4, requires_grad=True)
    with a.defer(1, 7):
        lin(x).sum().backward()
    assert a.pending() == {(1, 7): 1} and b.pending() == {}
    with pytest.raises(RuntimeError, match="left over"):
        a.assert_empty()
    with pytest.raises(RuntimeError, match="nest"), a.defer(0, 0), a.defer(0, 1):
        pass
    assert a.run(0, 0) == 0  # nothing enqueued there: an empty W
    assert lin.weight.grad is None
    assert a.run(1, 7) == 1 and lin.weight.grad is not None
    a.assert_empty()


def test_grad_accumulated_hook_fires_at_w() -> None:
    store = WeightGradStore()
    lin = DeferrableLinear(4, 4)
    lin.weight.main_grad = torch.zeros(4, 4)
    lin.bias.main_grad = torch.zeros(4)
    seen: list[int] = []
    register_grad_accumulated_hook(lin.weight, lambda p: seen.append(id(p)))
    bind_weight_grad_store(lin, store)
    with store.defer(0, 0):
        lin(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert seen == []
    store.run(0, 0)
    assert seen == [id(lin.weight)]


def test_deferred_weight_needs_no_grad_when_frozen() -> None:
    store = WeightGradStore()
    w = torch.randn(4, 4)  # not a parameter, no grad
    x = torch.randn(3, 4, requires_grad=True)
    with store.defer(0, 0):
        deferrable_linear(x, w, None, store).sum().backward()
    assert store.pending() == {} and x.grad is not None


# -- generic split -------------------------------------------------------------------------------------------------
class _SharedWeight(torch.nn.Module):
    """One weight used in two places, plus a bias that does not touch the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
        self.pos = torch.nn.Parameter(torch.randn(8) * 0.3)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        h = torch.tanh(x @ self.w) + self.pos
        return self.norm(h @ self.w)


class _Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = DeferrableLinear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _FromIds(torch.nn.Module):  # no input gradient at all: the whole backward is W
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, ids):
        return self.lin(self.emb(ids))


GENERIC = {
    "encoder-layer": (lambda: torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0), _float_input((8, 2, 32)), True),
    "shared-weight": (_SharedWeight, _float_input((6, 8)), False),
    "mixed-deferrable": (_Mixed, _float_input((6, 8)), True),
    "from-ids": (_FromIds, _ids_input((3, 4), 10), True),
}


@pytest.mark.parametrize("case", list(GENERIC))
def test_generic_split_equals_full_backward(case: str) -> None:
    build, make_input, exact = GENERIC[case]
    torch.manual_seed(0)
    module = build()
    store = WeightGradStore()
    bind_weight_grad_store(module, store)
    ref_in, ref_w = [], None
    module.zero_grad(set_to_none=True)
    for mb in range(2):
        x = make_input(mb)
        y = module(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9 + mb)))
        ref_in.append(x.grad if x.is_floating_point() else None)
    ref_w = _grads(module)

    module.zero_grad(set_to_none=True)
    split = GenericSplit(module, store)
    got_in = []
    for mb in range(2):
        x = make_input(mb)
        y = module(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(9 + mb))
        inputs = [x] if x.is_floating_point() else []
        with store.defer(0, mb):
            got = split.backward_input([y], [g], inputs)
        got_in.append(got[0] if inputs else None)
        assert all(p.grad is None for p in module.parameters()), "B must not produce parameter gradients"
    for mb in range(2):
        store.run(0, mb)
    store.assert_empty()
    for a, b in zip(ref_in, got_in):
        assert (a is None and b is None) or torch.equal(a, b)
    got_w = _grads(module)
    for name in ref_w:
        if exact:
            assert torch.equal(ref_w[name], got_w[name]), name
        else:
            torch.testing.assert_close(got_w[name], ref_w[name], rtol=1e-6, atol=1e-7)


def test_split_backward_immediate_without_store() -> None:
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    (gx,) = split_backward([y], [torch.ones_like(y)], [x], list(lin.parameters()), None)
    torch.testing.assert_close(gx, torch.ones(2, 3) @ lin.weight)
    torch.testing.assert_close(lin.bias.grad, torch.full((3,), 2.0))


def test_direct_apply_matches_function_apply_and_keeps_the_full_path_under_functorch() -> None:
    """The hot path calls the autograd functions' C++ ``apply`` straight: same output, same gradients (bit for bit)
    as ``Function.apply``, with a store bound and not deferring (a BW); under a functorch transform it takes
    ``Function.apply``'s own path, which refuses these functions as before (no ``setup_context``)."""
    from zb_pipeline.runtime import deferrable_linear as dl

    g = torch.Generator().manual_seed(3)
    x0, w0, b0 = (torch.randn(shape, generator=g) for shape in ((5, 2, 8), (6, 8), (6,)))
    runs = []
    for apply in (dl._linear_apply, dl._DeferrableLinear.apply):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = apply(x, w, b, WeightGradStore(), None, False)
        dl.deferrable_bias_add(y, b, None).square().sum().backward()
        runs.append([y.detach(), x.grad, w.grad, b.grad])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: dl.deferrable_linear(x, w0, b0).sum())(x0)
