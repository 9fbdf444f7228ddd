"""SiTU-GLU, the router and the LatentMoE layer (kimi/moe.py, kimi/common.py)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kimi
from helpers import rel_err, router_params, tiny
from kimi.common import situ_glu
from kimi.moe import latent_moe, route


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


@settings(max_examples=20)
@given(groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]), renorm=st.booleans(), scale=st.sampled_from([1.0, 2.5]))
def test_router_against_brute_force(groups, renorm, scale):
    G, tg = groups
    cfg = tiny(num_expert_group=G, topk_group=tg, moe_renormalize=renorm, routed_scaling_factor=scale)
    p = router_params(cfg)
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
    p = router_params(cfg)
    x = torch.randn(32, cfg.hidden_size, dtype=torch.float64)
    idx0, w0 = route({**p, "e_score_correction_bias": torch.zeros_like(p["e_score_correction_bias"])}, x, cfg)
    big = torch.zeros_like(p["e_score_correction_bias"])
    big[5] = 10.0                                                    # expert 5 always chosen
    idx1, w1 = route({**p, "e_score_correction_bias": big}, x, cfg)
    assert bool((idx1 == 5).any(-1).all()) and not torch.equal(idx0, idx1)
    s = torch.sigmoid(x @ p["weight"].T)
    assert torch.equal(w1, s.gather(1, idx1))


def test_latent_moe_layer_shapes_and_backends():
    cfg = tiny()
    p = kimi.init_params(cfg, seed=3)["model"]["layers"][1]["block_sparse_moe"]
    x = torch.randn(2, 9, cfg.hidden_size)
    a = latent_moe(p, x, cfg, kimi.Backend(moe="dense"))
    b = latent_moe(p, x, cfg, kimi.Backend(moe="grouped"))
    assert a.shape == x.shape and rel_err(b, a) < 1e-6
