"""Model-variant flags against references written out here from their definitions: --qk-layernorm,
--apply-layernorm-1p, --rotary-percent, --squared-relu, --fp32-residual-connection, --position-embedding-type none
(--no-position-embedding), an explicit attention mask with position ids, and the flags' mapping onto GPTConfig.
Each test also checks that the result differs from the model without the flag, so an ignored flag fails it."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from model_configs import tiny_config

from megatron.arguments import parse_run_config
from megatron.checkpointing import _check_compatible
from megatron.config.errors import ConfigError
from megatron.config.kernels import KernelConfig
from megatron.model import build_gpt_model
from megatron.model.config import GPTConfig, model_flags
from megatron.model.mlp import MLP
from megatron.model.norms import LayerNorm, RMSNorm
from megatron.parallel.tensor_parallel import TPContext

BASE = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]


def _norm_ref(t: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """LayerNorm / RMSNorm over the last dimension, by hand; gamma = w (or 1 + w when zero-centred)."""
    gamma = module.weight + 1 if module.zero_centered else module.weight
    if isinstance(module, RMSNorm):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + module.eps) * gamma
    centred = t - t.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + module.eps) * gamma + module.bias


def _rope_ref(t: torch.Tensor, positions: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """Rotate channel pairs (i, i + rot/2), i < rot/2, of ``t [s, b, n, d]`` by ``position * base^(-2i/rot)``."""
    half = rot // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    angle = (positions.t().double()[..., None] * freq).float()[:, :, None, :]  # [s, b, 1, half]
    a, b = t[..., :half], t[..., half:rot]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin(), t[..., rot:]], dim=-1)


def _attention_ref(att, x, cfg: GPTConfig, *, positions=None, allowed=None, qk_norm=None, rot=None):
    """Self-attention of ``x [s, b, h]`` with ``att``'s weights, from the definitions: softmax(q k^T / sqrt(d))
    over the causal (and ``allowed [b, s, s]``) positions; q/k normalised per head when ``qk_norm``; RoPE on the
    first ``rot`` channels at ``positions [b, s]`` (default 0..s-1)."""
    s, b, _ = x.shape
    g, d = cfg.num_query_groups, cfg.kv_channels
    hpg = cfg.num_attention_heads // g
    qkv = (x @ att.linear_qkv.weight.t() + att.linear_qkv.bias).view(s, b, g, hpg + 2, d)
    q = qkv[:, :, :, :hpg].reshape(s, b, g * hpg, d)
    k, v = qkv[:, :, :, hpg], qkv[:, :, :, hpg + 1]
    if qk_norm:
        q, k = _norm_ref(q, att.q_layernorm), _norm_ref(k, att.k_layernorm)
    if rot:
        pos = torch.arange(s).expand(b, s) if positions is None else positions
        q, k = _rope_ref(q, pos, rot, cfg.rotary_base), _rope_ref(k, pos, rot, cfg.rotary_base)
    k, v = k.repeat_interleave(hpg, dim=2), v.repeat_interleave(hpg, dim=2)  # query head n reads group n // hpg
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(d)
    ok = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
    if allowed is not None:
        ok = ok & allowed
    probs = scores.masked_fill(~ok[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bnij,jbnd->ibnd", probs, v).reshape(s, b, -1)
    return out @ att.linear_proj.weight.t() + att.linear_proj.bias


def _first_attention(model, tokens, **inputs):
    """(input, output) of layer 0's self-attention during ``model(tokens, **inputs)``."""
    seen = {}
    att = model.layers[0].self_attention
    handle = att.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        model(tokens, **inputs)
    handle.remove()
    return att, seen["x"], seen["out"]


def _tokens(cfg: GPTConfig, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=torch.Generator().manual_seed(seed))


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_qk_layernorm_normalises_each_query_and_key_head(normalization: str) -> None:
    cfg = tiny_config(qk_layernorm=True, normalization=normalization, position_embedding_type="rope")
    model = build_gpt_model(cfg, seed=3)
    att = model.layers[0].self_attention
    assert att.q_layernorm.weight.shape == (cfg.kv_channels,)
    _randomise(att.q_layernorm, 1)
    _randomise(att.k_layernorm, 2)
    att, x, out = _first_attention(model, _tokens(cfg))
    rot = cfg.kv_channels
    assert _close(out, _attention_ref(att, x, cfg, qk_norm=True, rot=rot))
    assert not _close(out, _attention_ref(att, x, cfg, qk_norm=False, rot=rot))


def test_apply_layernorm_1p_stores_gamma_minus_one() -> None:
    cfg = tiny_config(apply_layernorm_1p=True, qk_layernorm=True)
    model = build_gpt_model(cfg, seed=3)
    norms = [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and all(n.zero_centered for n in norms)
    assert all(not n.weight.any() for n in norms)  # initialised to 0: gamma = 1
    plain = build_gpt_model(dataclasses.replace(cfg, apply_layernorm_1p=False), seed=3)
    tokens = _tokens(cfg)
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))  # the same function at initialisation
    x = torch.randn(3, 2, cfg.hidden_size)
    for kind in (LayerNorm, RMSNorm):
        norm = kind(cfg.hidden_size, eps=1e-5, zero_centered=True)
        _randomise(norm, 4)
        assert _close(norm(x), _norm_ref(x, norm))
        expected = _norm_ref(x, norm)
        norm.zero_centered = False  # the same stored weights read as a plain gamma: another output
        assert not _close(norm(x), expected)


def test_rotary_percent_rotates_the_first_channels_only() -> None:
    cfg = tiny_config(position_embedding_type="rope", rotary_percent=0.5, kv_channels=8)
    assert cfg.rotary_dim == 4
    model = build_gpt_model(cfg, seed=5)
    att, x, out = _first_attention(model, _tokens(cfg))
    assert _close(out, _attention_ref(att, x, cfg, rot=4))
    assert not _close(out, _attention_ref(att, x, cfg, rot=8))
    with pytest.raises(ConfigError, match="rotary-percent"):
        tiny_config(position_embedding_type="rope", rotary_percent=0.1)  # 0 rotary channels


def test_explicit_mask_and_position_ids_reach_the_attention() -> None:
    cfg = tiny_config(position_embedding_type="rope")
    model = build_gpt_model(cfg, seed=6)
    s = cfg.seq_length
    doc = (torch.arange(s) >= 5).long() + (torch.arange(s) >= 11).long()  # three documents
    doc = torch.stack([doc, torch.zeros(s, dtype=torch.long)])  # the second sample: one document
    allowed = doc[:, :, None] == doc[:, None, :]
    positions = torch.stack([torch.arange(s) - torch.tensor([0] * 5 + [5] * 6 + [11] * 5), torch.arange(s)])
    mask = ~(allowed & torch.ones(s, s, dtype=torch.bool).tril())[:, None]  # True = masked out (Megatron)
    att, x, out = _first_attention(model, _tokens(cfg), position_ids=positions, attention_mask=mask)
    rot = cfg.kv_channels
    assert _close(out, _attention_ref(att, x, cfg, positions=positions, allowed=allowed, rot=rot))
    assert not _close(out[:, 0], _attention_ref(att, x, cfg, rot=rot)[:, 0])
    assert _close(out[:, 1], _attention_ref(att, x, cfg, rot=rot)[:, 1])  # one document: the causal attention


def test_squared_relu_activation() -> None:
    cfg = tiny_config(squared_relu=True)
    mlp = MLP(cfg, tp=TPContext())
    _randomise(mlp, 7)
    x = torch.randn(4, 2, cfg.hidden_size)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    y = x @ fc1.weight.t() + fc1.bias
    with torch.no_grad():
        assert _close(mlp(x), F.relu(y).pow(2) @ fc2.weight.t() + fc2.bias)
        assert not _close(mlp(x), F.gelu(y) @ fc2.weight.t() + fc2.bias)
    with pytest.raises(ConfigError, match="--swiglu and --squared-relu"):
        tiny_config(squared_relu=True, swiglu=True)


def test_openai_gelu_is_the_tanh_approximation() -> None:
    cfg = parse_run_config([*BASE, *MODEL, "--openai-gelu"]).model
    assert cfg.openai_gelu and model_flags(cfg)[-1] == "--openai-gelu"
    mlp = MLP(cfg, tp=TPContext())
    _randomise(mlp, 7)
    x = torch.randn(4, 2, cfg.hidden_size) * 2
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    y = x @ fc1.weight.t() + fc1.bias
    tanh_gelu = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))  # GPT-2's gelu_new
    with torch.no_grad():
        assert _close(mlp(x), tanh_gelu @ fc2.weight.t() + fc2.bias)
        assert not _close(mlp(x), F.gelu(y) @ fc2.weight.t() + fc2.bias)  # the exact GeLU: another output
    for other in ("swiglu", "squared_relu"):
        with pytest.raises(ConfigError, match="--openai-gelu"):
            tiny_config(openai_gelu=True, **{other: True})


def test_fp32_residual_connection_keeps_the_stream_in_fp32() -> None:
    def stream_dtypes(cfg: GPTConfig, dtype: torch.dtype):
        model = build_gpt_model(cfg, seed=8).to(dtype)
        seen = []
        for layer in model.layers:
            layer.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        with torch.no_grad():
            logits = model(_tokens(cfg))
        return seen, logits

    cfg = tiny_config(fp32_residual_connection=True, qk_layernorm=True, position_embedding_type="rope")
    seen, logits = stream_dtypes(cfg, torch.bfloat16)
    assert seen == [torch.float32] * 2 and logits.dtype == torch.bfloat16
    plain = dataclasses.replace(cfg, fp32_residual_connection=False)
    assert stream_dtypes(plain, torch.bfloat16)[0] == [torch.bfloat16] * 2
    assert torch.equal(stream_dtypes(cfg, torch.float32)[1], stream_dtypes(plain, torch.float32)[1])  # fp32: no-op


def test_no_position_embedding_means_no_position_information() -> None:
    cfg = tiny_config(position_embedding_type="none", num_layers=1)  # one layer: its last row sees a token set
    model = build_gpt_model(cfg, seed=9)
    assert model.embedding.position_embeddings is None
    a = torch.tensor([[5, 7, 9, 11]])
    b = torch.tensor([[7, 5, 9, 11]])  # the same prefix set in another order
    with torch.no_grad():
        assert _close(model(a)[-1], model(b)[-1])  # causal attention without positions: order-blind
        learned = build_gpt_model(dataclasses.replace(cfg, position_embedding_type="learned_absolute"), seed=9)
        assert not _close(learned(a)[-1], learned(b)[-1])


def test_model_variant_flags_map_onto_gptconfig() -> None:
    run = parse_run_config([*BASE, *MODEL])
    assert (run.model.position_embedding_type, run.model.rotary_percent) == ("learned_absolute", 1.0)
    assert not (run.model.qk_layernorm or run.model.apply_layernorm_1p or run.model.squared_relu)
    assert not run.model.fp32_residual_connection and run.model_flag_notes == ()
    flags = ["--qk-layernorm", "--apply-layernorm-1p", "--squared-relu", "--fp32-residual-connection"]
    m = parse_run_config([*BASE, *MODEL, *flags, "--use-rotary-position-embeddings", "--rotary-percent", "0.5"]).model
    assert (m.qk_layernorm, m.apply_layernorm_1p, m.squared_relu, m.fp32_residual_connection) == (True,) * 4
    assert (m.position_embedding_type, m.rotary_dim) == ("rope", 4)
    assert parse_run_config([*BASE, *MODEL, "--no-position-embedding"]).model.position_embedding_type == "none"
    rope = parse_run_config([*BASE, *MODEL, "--no-position-embedding", "--position-embedding-type", "rope"])
    assert rope.model.position_embedding_type == "rope"  # RoPE has no learned table to drop


@pytest.mark.parametrize("backend", ["auto", "local", "flash", "fused", "unfused"])
def test_attention_backend_is_accepted_and_changes_nothing(backend: str) -> None:
    run = parse_run_config([*BASE, *MODEL, "--attention-backend", backend])
    assert run.model == parse_run_config([*BASE, *MODEL]).model  # the model (hence the results) is the same
    warned = [w for w in run.ignored_flag_warnings() if "--attention-backend" in w]
    assert len(warned) == (backend in ("flash", "fused", "unfused"))
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_run_config([*BASE, *MODEL, "--attention-backend", "cudnn"])


def test_checkpoint_of_an_older_model_config_still_loads() -> None:
    model = tiny_config()
    tr = SimpleNamespace(
        run=SimpleNamespace(model=model, pipeline_layout=None), ctx=SimpleNamespace(tp_size=1, pp_size=1)
    )
    old = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("qk_layernorm", "rotary_percent")}
    _check_compatible(tr, {"layout": {"tp": 1, "pp": 1}, "model_args": old}, "ckpt")  # missing = the defaults
    new = dataclasses.replace(model, qk_layernorm=True)
    tr.run.model = new
    with pytest.raises(ConfigError, match="qk_layernorm"):
        _check_compatible(tr, {"layout": {"tp": 1, "pp": 1}, "model_args": old}, "ckpt")


def test_architecture_flags_shape_the_model() -> None:
    """Each architecture flag, set away from its default, is visible in the built model."""
    argv = [*BASE, "--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "6", "--seq-length", "12"]
    argv += ["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "10", "--ffn-hidden-size", "40"]
    argv += ["--max-position-embeddings", "20", "--vocab-size", "50", "--make-vocab-size-divisible-by", "16"]
    argv += ["--untie-embeddings-and-output-weights", "--normalization", "RMSNorm", "--norm-epsilon", "1e-3"]
    argv += ["--swiglu", "--disable-bias-linear", "--attention-dropout", "0.2", "--hidden-dropout", "0.3"]
    argv += ["--init-method-std", "0.05"]
    run = parse_run_config(argv)
    model = build_gpt_model(run.model, seed=1)
    layer = model.layers[0]
    att, mlp = layer.self_attention, layer.mlp
    assert len(model.layers) == 3 and model.embedding.word_embeddings.weight.shape == (64, 48)  # 50 -> 64
    assert att.linear_qkv.weight.shape == ((6 + 2 * 2) * 10, 48) and att.linear_proj.weight.shape == (48, 60)
    assert mlp.linear_fc1.weight.shape == (2 * 40, 48) and mlp.swiglu and att.linear_qkv.bias is None
    assert model.embedding.position_embeddings.weight.shape == (20, 48) and run.model.seq_length == 12
    assert model.output_layer.weight is not None  # untied: its own table
    assert isinstance(layer.input_layernorm, RMSNorm) and layer.input_layernorm.eps == 1e-3
    assert (att.dropout_p, layer.dropout.p, model.embedding.dropout.p) == (0.2, 0.3, 0.3)
    assert abs(att.linear_qkv.weight.std().item() - 0.05) < 0.005
    rope = parse_run_config([*BASE, *MODEL, "--position-embedding-type", "rope", "--rotary-base", "500"]).model
    rotary = build_gpt_model(rope, seed=1).rotary
    assert torch.allclose(rotary.inv_freq, 500.0 ** (-torch.arange(0, 8, 2) / 8))


def test_kernel_selection_respects_the_variants(monkeypatch) -> None:
    import megatron.kernels.select as select

    monkeypatch.setattr(select, "triton_importable", lambda: True)
    plain = select.resolve_kernels(KernelConfig(kernels="triton"), tiny_config(), on_cuda=True)
    assert plain.bias_gelu and plain.norms
    k = select.resolve_kernels(
        KernelConfig(kernels="triton"), tiny_config(squared_relu=True, fp32_residual_connection=True), on_cuda=True
    )
    assert not k.bias_gelu and not k.norms  # no fused squared ReLU; the Triton norms take one dtype
    assert "squared ReLU (no fused kernel)" in k.torch_notes
    k = select.resolve_kernels(KernelConfig(kernels="triton"), tiny_config(openai_gelu=True), on_cuda=True)
    assert k.bias_gelu and k.gelu_approximate == "tanh" and "bias-GeLU (tanh)" in k.describe()
    monkeypatch.setattr(select, "transformer_engine_problem", lambda: None)
    monkeypatch.setattr(select, "transformer_engine_version", lambda: "2.3")
    te = KernelConfig(kernels="torch", transformer_impl="transformer_engine")
    assert select.resolve_kernels(te, tiny_config(), on_cuda=True).transformer_impl == "transformer_engine"
    with pytest.raises(ConfigError, match="does not build --qk-layernorm, --squared-relu here"):
        select.resolve_kernels(te, tiny_config(qk_layernorm=True, squared_relu=True), on_cuda=True)
    # TE's GeLU is the tanh approximation (transformer_engine/common/util/math.h): --openai-gelu is its own
    assert select.resolve_kernels(te, tiny_config(openai_gelu=True), on_cuda=True).transformer_impl != "local"
