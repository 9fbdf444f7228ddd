"""SiTU, the router and the latent experts (MODEL.md §6, §11 test plan)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kimi
from helpers import rel_err, tiny
from kimi.moe import experts_dense, experts_grouped, latent_moe, route, situ_glu


def test_situ_closed_form_saturation_and_clamp():
    g = torch.tensor([-30.0, -1.22, 0.0, 3.0, 60.0, 60.0], dtype=torch.float64)
    u = torch.tensor([1.0, 1.0, 1.0, -2.0, 1e4, -1e4], dtype=torch.float64)
    out = situ_glu(g, u, 4.0, 25.0)
    expect = [4 * math.tanh(a / 4) / (1 + math.exp(-a)) * 25 * math.tanh(b / 25) for a, b in zip(g.tolist(), u.tolist())]
    assert torch.allclose(out, torch.tensor(expect, dtype=torch.float64), rtol=1e-14, atol=0)
    assert out[-2] == pytest.approx(4 * 25, rel=1e-6)            # gate saturates at β, up clamps at β_lin
    assert out[-1] == pytest.approx(-4 * 25, rel=1e-6)
    grid = torch.linspace(-3, 0, 3001, dtype=torch.float64)
    a = situ_glu(grid, torch.ones_like(grid), 4.0, None)
    assert a.min() == pytest.approx(-0.27, abs=0.01) and grid[a.argmin()] == pytest.approx(-1.22, abs=0.02)
    assert situ_glu(torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16), 4.0, 25.0).dtype == torch.bfloat16


def _router(cfg, dtype=torch.float64):
    E, D = cfg.num_experts, cfg.hidden_size
    return {"weight": torch.randn(E, D, dtype=dtype) * 0.3, "e_score_correction_bias": torch.randn(E, dtype=dtype) * 0.3}


@settings(max_examples=20)
@given(groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]), renorm=st.booleans(), scale=st.sampled_from([1.0, 2.5]))
def test_router_against_brute_force(groups, renorm, scale):
    G, tg = groups
    cfg = tiny(num_expert_group=G, topk_group=tg, moe_renormalize=renorm, routed_scaling_factor=scale)
    p = _router(cfg)
    x = torch.randn(16, cfg.hidden_size, dtype=torch.float64)
    idx, w = route(p, x, cfg)
    s = torch.sigmoid(x @ p["weight"].T)
    c = s + p["e_score_correction_bias"]
    E, k = cfg.num_experts, cfg.num_experts_per_token
    for n in range(16):
        allowed = list(range(E))
        if G > 1 and G > tg:
            size = E // G
            gscore = [sorted(c[n, g * size:(g + 1) * size].tolist())[-2:] for g in range(G)]
            top = sorted(range(G), key=lambda g: -sum(gscore[g]))[:tg]
            allowed = [e for e in range(E) if e // size in top]
        best = sorted(allowed, key=lambda e: -c[n, e].item())[:k]
        assert sorted(idx[n].tolist()) == sorted(best)
        ww = s[n, idx[n]]                                            # weights from the bias-free scores
        if renorm:
            ww = ww / ww.sum()
        assert torch.allclose(w[n], ww * scale, rtol=1e-12)


def test_bias_changes_choice_but_not_weights():
    cfg = tiny(moe_renormalize=False)
    p = _router(cfg)
    x = torch.randn(32, cfg.hidden_size, dtype=torch.float64)
    idx0, w0 = route({**p, "e_score_correction_bias": torch.zeros_like(p["e_score_correction_bias"])}, x, cfg)
    big = torch.zeros_like(p["e_score_correction_bias"])
    big[5] = 10.0                                                    # expert 5 always chosen
    idx1, w1 = route({**p, "e_score_correction_bias": big}, x, cfg)
    assert bool((idx1 == 5).any(-1).all()) and not torch.equal(idx0, idx1)
    s = torch.sigmoid(x @ p["weight"].T)
    assert torch.equal(w1, s.gather(1, idx1))


def _experts(cfg, dtype):
    E, m, Z = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    return {"w1": torch.randn(E, m, Z, dtype=dtype) * 0.2, "w3": torch.randn(E, m, Z, dtype=dtype) * 0.2,
            "w2": torch.randn(E, Z, m, dtype=dtype) * 0.2}


def _run(impl, z, idx, w, ex, cfg):
    return impl(z, idx, w, ex["w1"], ex["w2"], ex["w3"], beta=cfg.activation_situ_beta,
                beta_lin=cfg.activation_situ_linear_beta)


def _loop_reference(z, idx, w, experts, cfg):
    """HF moe_infer order: each chosen expert's output rounded to the activation dtype, then
    fp32 weight multiply and fp32 sum over slots, rounded once."""
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32 if z.dtype != torch.float64 else torch.float64)
    for n in range(z.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            h = situ_glu(z[n] @ experts["w1"][e].T, z[n] @ experts["w3"][e].T, cfg.activation_situ_beta,
                         cfg.activation_situ_linear_beta)
            out[n] += (h @ experts["w2"][e].T).to(out.dtype) * w[n, j].to(out.dtype)
    return out.to(z.dtype)


@pytest.mark.parametrize("impl", [experts_dense, experts_grouped])
def test_experts_match_loop_reference(impl):
    cfg = tiny()
    for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-13)]:
        if impl is experts_grouped and dtype == torch.float64:
            with pytest.raises(ValueError, match="dense"):
                _run(impl, torch.zeros(2, cfg.routed_expert_hidden_size, dtype=dtype),
                     torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), _experts(cfg, dtype), cfg)
            continue
        z = torch.randn(24, cfg.routed_expert_hidden_size, dtype=dtype)
        idx, w = route(_router(cfg, torch.float32), torch.randn(24, cfg.hidden_size), cfg)
        ex = _experts(cfg, dtype)
        assert rel_err(_run(impl, z, idx, w, ex, cfg), _loop_reference(z, idx, w, ex, cfg)) < tol


def test_grouped_gradients_equal_dense():
    cfg = tiny()
    z0 = torch.randn(40, cfg.routed_expert_hidden_size)
    idx, w0 = route(_router(cfg, torch.float32), torch.randn(40, cfg.hidden_size), cfg)
    ex0 = _experts(cfg, torch.float32)
    probe = torch.randn(40, cfg.routed_expert_hidden_size)
    grads = []
    for impl in (experts_dense, experts_grouped):
        z, w = z0.clone().requires_grad_(), w0.clone().requires_grad_()
        ex = {k: v.clone().requires_grad_() for k, v in ex0.items()}
        (_run(impl, z, idx, w, ex, cfg) * probe).sum().backward()
        grads.append([z.grad, w.grad, *(ex[k].grad for k in ("w1", "w2", "w3"))])
    for a, b in zip(*grads):
        assert rel_err(a, b) < 1e-5


def test_latent_moe_layer_shapes_and_backends():
    cfg = tiny()
    p = kimi.init_params(cfg, seed=3)["model"]["layers"][1]["block_sparse_moe"]
    x = torch.randn(2, 9, cfg.hidden_size)
    a = latent_moe(p, x, cfg, kimi.Backend(moe="dense"))
    b = latent_moe(p, x, cfg, kimi.Backend(moe="grouped"))
    assert a.shape == x.shape and rel_err(b, a) < 1e-6
