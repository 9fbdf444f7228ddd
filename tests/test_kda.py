"""The KDA layer (kimi/kda.py): gate ranges, the short conv, the norms, and the whole layer (resets, backends,
dtypes at the core's inputs)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import kimi
from helpers import rel_err, resets, tiny
from kimi import kda
from kimi.config import Backend

F64 = torch.float64
SEEDS = st.integers(0, 2**31 - 1)
CORES = ("recurrent", "chunk")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
def test_gate_range_closed_form_and_dtype(dtype):
    """Bounded g ∈ [lb, 0], softplus g ≤ 0; at f + dt_bias = 0: lb/2 and −e^A·ln 2."""
    H, K = 3, 8
    f = (50 * torch.randn(2, 9, H, K)).to(dtype)
    a_log = (1 + 15 * torch.rand(H)).log()
    dt_bias = torch.randn(H * K)
    out_dtype = torch.promote_types(dtype, torch.float32)
    gb = kda.kda_gate(f, a_log, dt_bias, -5.0)
    gs = kda.kda_gate(f, a_log, dt_bias, None)
    assert gb.dtype == gs.dtype == out_dtype
    assert (gb >= -5.0).all() and (gb <= 0).all() and (gs <= 0).all()
    if dtype != torch.bfloat16:  # f + dt_bias = 0 exactly (−dt_bias is not representable in bf16)
        zero = -dt_bias.view(1, 1, H, K).to(dtype)
        a = a_log.exp().view(H, 1).to(out_dtype)
        assert torch.allclose(kda.kda_gate(zero, a_log, dt_bias, -5.0), torch.tensor(-2.5, dtype=out_dtype))
        ln2 = torch.log(torch.tensor(2.0, dtype=out_dtype))
        assert torch.allclose(kda.kda_gate(zero, a_log, dt_bias, None), -a * ln2)


def _conv_ref(x, w):
    """silu(F.conv1d) with padding W−1, truncated to the causal outputs, in float64."""
    T, W = x.shape[1], w.shape[-1]
    y = F.conv1d(x.double().transpose(1, 2), w.double(), groups=x.shape[-1], padding=W - 1)[..., :T]
    return F.silu(y).transpose(1, 2)


@pytest.mark.parametrize("W", [2, 4])
def test_short_conv_matches_conv1d(W):
    x, w = torch.randn(2, 13, 6, dtype=F64), torch.randn(6, 1, W)
    assert rel_err(kda.short_conv(x, w), _conv_ref(x, w)) < 1e-14
    xb = x.to(torch.bfloat16)
    yb = kda.short_conv(xb, w)
    assert yb.dtype == torch.bfloat16 and rel_err(yb, _conv_ref(xb, w)) < 1e-2


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 30), data=st.data(), W=st.sampled_from([2, 3, 4]), seed=SEEDS)
def test_short_conv_restarts_at_resets(T, data, W, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(2, T, 5, dtype=F64, generator=gen), torch.randn(5, 1, W, generator=gen)
    pos = st.lists(st.integers(0, T - 1), max_size=6)
    reset = resets(2, T, [data.draw(pos), data.draw(pos)])
    y = kda.short_conv(x, w, reset)
    for b in range(2):
        starts = sorted({0} | set(reset[b].nonzero().flatten().tolist()))
        for s, e in zip(starts, starts[1:] + [T]):
            assert rel_err(y[b:b + 1, s:e], _conv_ref(x[b:b + 1, s:e], w)) < 1e-14


def test_l2norm_and_gated_rms_norm():
    x = torch.randn(2, 5, 3, 16, dtype=F64) * 10
    n = kda.l2norm(x)
    assert torch.allclose(n.norm(dim=-1), torch.ones(2, 5, 3, dtype=F64), atol=1e-8)
    assert kda.l2norm(x.bfloat16()).dtype == torch.bfloat16
    # eps sits inside the sqrt: ‖x‖² = eps gives x / sqrt(2 eps)
    tiny_x = torch.zeros(16, dtype=F64).index_fill(0, torch.tensor([0]), 1e-3)
    assert torch.allclose(kda.l2norm(tiny_x, eps=1e-6)[0], torch.tensor(2 ** -0.5, dtype=F64))
    # weight = 1, gate → +∞ (sigmoid = 1): RMS of every head is 1; gate = 0 halves it; the weight multiplies.
    w = torch.ones(16, dtype=F64)
    y = kda.gated_rms_norm(x, torch.full_like(x, 1e4), w, 1e-12)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(2, 5, 3, dtype=F64))
    assert torch.allclose(kda.gated_rms_norm(x, torch.zeros_like(x), 3 * w, 1e-12), 1.5 * y)
    assert kda.gated_rms_norm(x.bfloat16(), x.bfloat16(), w.float(), 1e-5).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- the layer

LAYER_CFGS = {
    "k3": {},
    "kimi_linear": dict(use_full_rank_gate=False, gate_lower_bound=None),
}


def _layer_setup(variant="k3", dtype="float64", seed=None):
    cfg = tiny()
    cfg = dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(cfg.linear_attn_config,
                                                                         **LAYER_CFGS[variant]))
    assert cfg.layer_types[0] == "kda"
    seed = int(torch.randint(2**31, ())) if seed is None else seed
    params = kimi.init_params(cfg, seed=seed, dtype=dtype)
    p = params["model"]["layers"][0]["self_attn"]
    # Larger gate/beta spread than the 0.02 init so that decays and resets matter.
    p = {**p, "dt_bias": torch.randn_like(p["dt_bias"])}
    return cfg, p


@pytest.mark.parametrize("variant", list(LAYER_CFGS))
@pytest.mark.parametrize("name", list(CORES))
def test_layer_resets_equal_separate_documents(variant, name):
    cfg, p = _layer_setup(variant)
    T = 90
    x = torch.randn(2, T, cfg.hidden_size, dtype=F64)
    reset = resets(2, T, [[10, 11, 64, 70], [0, 33]])
    backend = Backend(kda=name)
    y = kda.kda_layer(p, x, cfg, backend, reset=reset)
    for b in range(2):
        starts = sorted({0} | set(reset[b].nonzero().flatten().tolist()))
        ref = torch.cat([kda.kda_layer(p, x[b:b + 1, s:e], cfg, backend) for s, e in zip(starts, starts[1:] + [T])], 1)
        assert rel_err(y[b:b + 1], ref) < 1e-12


def test_layer_backends_agree_and_fp32_matches_fp64():
    seed = int(torch.randint(2**31, ()))
    cfg, p64 = _layer_setup(dtype="float64", seed=seed)
    _, p32 = _layer_setup(dtype="float32", seed=seed)
    p32 = {**p32, "dt_bias": p64["dt_bias"].float()}
    x = torch.randn(2, 70, cfg.hidden_size, dtype=F64)
    reset = resets(2, 70, [[20], []])
    ref = kda.kda_layer(p64, x, cfg, Backend(kda="recurrent"), reset=reset)
    assert rel_err(kda.kda_layer(p64, x, cfg, Backend(kda="chunk"), reset=reset), ref) < 1e-12
    for name in CORES:
        y = kda.kda_layer(p32, x.float(), cfg, Backend(kda=name), reset=reset)
        assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-5, name


@pytest.mark.parametrize("variant", list(LAYER_CFGS))
def test_layer_dtypes_and_core_inputs(variant, monkeypatch):
    """bf16 in → bf16 out; at the core: beta ∈ (0, 1) fp32, g fp32 in its range, q/k unit rows, state fp32."""
    cfg, p = _layer_setup(variant, dtype="bfloat16")
    seen = {}
    core = kimi.ops.kda_core

    def spy(q, k, v, g, beta, *args, **kw):
        out = core(q, k, v, g, beta, *args, **kw)
        seen.update(q=q, k=k, v=v, g=g, beta=beta, S=out[1], scale=kw["scale"])
        return out

    monkeypatch.setattr(kimi.ops, "kda_core", spy)
    x = torch.randn(2, 20, cfg.hidden_size).bfloat16()
    y = kda.kda_layer(p, x, cfg, Backend(kda="chunk"))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and torch.isfinite(y).all()
    assert seen["q"].dtype == seen["k"].dtype == seen["v"].dtype == torch.bfloat16
    assert seen["beta"].dtype == seen["g"].dtype == seen["S"].dtype == torch.float32
    assert ((seen["beta"] > 0) & (seen["beta"] < 1)).all()
    lb = cfg.linear_attn_config.gate_lower_bound
    assert (seen["g"] <= 0).all() and (lb is None or (seen["g"] >= lb).all())
    for n in ("q", "k"):
        assert torch.allclose(seen[n].float().norm(dim=-1), torch.ones(()), atol=1e-2)
    assert seen["scale"] == cfg.linear_attn_config.head_dim ** -0.5


@pytest.mark.skipif(kimi.ops.registry.triton is None, reason="triton is not installed")
def test_layer_on_kda_triton_forward_and_backward():
    """Backend(kda='triton') through the layer (`kimi::kda_triton`: the Triton chunked forward and backward; on the
    CPU through the interpreter), fp32, resets inside a chunk and at its edge, against the float64 recurrence: the
    output and the gradients of x and of every parameter, to fp32 rounding."""
    seed = int(torch.randint(2**31, ()))
    cfg, p64 = _layer_setup(dtype="float64", seed=seed)
    _, p32 = _layer_setup(dtype="float32", seed=seed)
    p32 = {**p32, "dt_bias": p64["dt_bias"].float()}
    x = torch.randn(2, 80, cfg.hidden_size, dtype=F64)
    reset = resets(2, 80, [[20, 64], []])
    leaves = lambda p: {n: t for n, t in kimi.params.tree_items(p) if t.is_floating_point()}

    def run(p, x, kda_impl):
        ps = {n: t.detach().requires_grad_() for n, t in leaves(p).items()}
        x = x.detach().requires_grad_()
        y = kda.kda_layer(kimi.params.unflatten(ps), x, cfg, Backend(kda=kda_impl), reset=reset)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum(),
                                    [x, *ps.values()])
        return y, dict(zip(["x", *ps], grads))

    y, grads = run(p32, x.float(), "triton")
    y_ref, ref = run(p64, x, "recurrent")
    assert rel_err(y, y_ref) < 1e-5
    bad = {n: rel_err(grads[n], ref[n]) for n in ref if rel_err(grads[n], ref[n]) >= 1e-4}
    assert not bad, bad


def test_kda_triton_needs_the_bounded_gate():
    """kda='triton' on a softplus (unbounded) gate: one named error before any kernel runs."""
    cfg, p = _layer_setup("kimi_linear", dtype="float32")
    with pytest.raises(ValueError, match="needs the bounded gate"):
        kda.kda_layer(p, torch.randn(1, 8, cfg.hidden_size), cfg, Backend(kda="triton"))
