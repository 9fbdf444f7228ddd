"""Gated MLA and sparse attention: DSA.md §12 invariants 7-10 and the layer."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kimi
from helpers import drop_indexer, rel_err, tiny, without_indexer
from kimi.indexer import topk_reference, visible_keys
from kimi.mla import gated_mla, keep_mask, sparse_mla
from kimi.model import document_runs

FORMS = [(a, f) for a in ("eager", "sdpa") for f in ("expanded", "absorbed")]


def _inputs(cfg, B, T, dtype, grad=False):
    H = cfg.num_attention_heads
    mk = lambda *s: torch.randn(*s, dtype=dtype).requires_grad_(grad)
    q = mk(B, T, H, cfg.qk_head_dim)
    c = mk(B, T, cfg.kv_lora_rank)
    k_pe = mk(B, T, cfg.qk_rope_head_dim)
    kv_b = (torch.randn(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, dtype=dtype) * 0.2).requires_grad_(grad)
    return q, c, k_pe, kv_b


def _oracle(q, c, k_pe, kv_b, keep, cfg):
    """Loop over (b, t, h): softmax over the kept keys of the expanded per-head keys, in float64."""
    B, T, H, _ = q.shape
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = (c.double() @ kv_b.double().T).view(B, T, H, dn + dv)
    out = torch.zeros(B, T, H, dv, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            sel = keep[b, t].nonzero().flatten()
            if len(sel) == 0:
                continue
            for h in range(H):
                k = torch.cat([kv[b, sel, h, :dn], k_pe[b, sel].double()], -1)
                p = torch.softmax(cfg.softmax_scale * (k @ q[b, t, h].double()), 0)
                out[b, t, h] = p @ kv[b, sel, h, dn:]
    return out


@pytest.mark.parametrize("attn,form", FORMS)
def test_sparse_attention_matches_loop_oracle(attn, form):
    cfg = tiny()
    doc = torch.tensor([[0] * 5 + [1] * 9, [2] * 11 + [-1] * 3])
    seg, _ = document_runs(doc)
    q, c, k_pe, kv_b = _inputs(cfg, 2, 14, torch.float64)
    idx = topk_reference(torch.randn(2, 14, 14, dtype=torch.float64), visible_keys(seg), 4)
    out = sparse_mla(q, c, k_pe, kv_b, seg, idx, scale=cfg.softmax_scale, attn=attn, absorbed=form == "absorbed")
    ref = _oracle(q, c, k_pe, kv_b, keep_mask(seg, idx), cfg)
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_absorbed_equals_expanded_with_gradients(dtype, tol):
    cfg = tiny()
    seg, _ = document_runs(torch.tensor([[0] * 7 + [1] * 10]))
    idx = topk_reference(torch.randn(1, 17, 17), visible_keys(seg), 5)
    base = _inputs(cfg, 1, 17, dtype)
    weight = torch.randn(1, 17, cfg.num_attention_heads, cfg.v_head_dim, dtype=dtype)
    results = []
    for attn, form in FORMS:
        inputs = [t.clone().requires_grad_() for t in base]
        out = sparse_mla(*inputs, seg, idx, scale=cfg.softmax_scale, attn=attn, absorbed=form == "absorbed")
        (out * weight).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        assert rel_err(out, out0) < tol
        for g, g0 in zip(grads, grads0):
            assert rel_err(g, g0) < tol


@settings(max_examples=15)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), attn_form=st.sampled_from(FORMS))
def test_full_selection_equals_dense_and_future_keys_never_leak(lens, attn_form):
    attn, form = attn_form
    cfg = tiny()
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    T = doc.shape[1]
    seg, _ = document_runs(doc)
    q, c, k_pe, kv_b = _inputs(cfg, 1, T, torch.float64)
    dense = sparse_mla(q, c, k_pe, kv_b, seg, None, scale=cfg.softmax_scale, attn=attn, absorbed=form == "absorbed")
    full = topk_reference(torch.randn(1, T, T), visible_keys(seg), T)          # every visible key selected
    assert rel_err(sparse_mla(q, c, k_pe, kv_b, seg, full, scale=cfg.softmax_scale, attn=attn, absorbed=form == "absorbed"), dense) < 1e-13
    everything = torch.arange(T, dtype=torch.int32).expand(1, T, T)             # a selection holding future keys
    leaked = sparse_mla(q, c, k_pe, kv_b, seg, everything, scale=cfg.softmax_scale, attn=attn, absorbed=form == "absorbed")
    assert rel_err(leaked, dense) < 1e-13


@pytest.mark.parametrize("attn,form", FORMS)
def test_rows_without_keys_are_zero_with_zero_gradient(attn, form):
    cfg = tiny()
    seg, _ = document_runs(torch.tensor([[0, 0, 0, -1, -1]]))
    q, c, k_pe, kv_b = _inputs(cfg, 1, 5, torch.float32, grad=True)
    out = sparse_mla(q, c, k_pe, kv_b, seg, None, scale=cfg.softmax_scale, attn=attn, absorbed=form == "absorbed")
    assert torch.equal(out[:, 3:], torch.zeros_like(out[:, 3:]))
    out.square().sum().backward()
    for t in (q, c, k_pe, kv_b):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, 3:], torch.zeros_like(q.grad[:, 3:]))


def test_layer_indexer_with_large_topk_equals_dense_and_small_topk_differs():
    cfg = tiny(index_topk=64)
    p = kimi.init_params(cfg, seed=1, dtype="float64")["model"]["layers"][3]["self_attn"]
    x = torch.randn(2, 30, cfg.hidden_size, dtype=torch.float64)
    seg = torch.zeros(2, 30, dtype=torch.long)
    backend = kimi.Backend(attn="eager")
    dense = gated_mla(drop_indexer({"model": {"layers": [{"self_attn": p}]}})["model"]["layers"][0]["self_attn"],
                      x, without_indexer(cfg), backend, seg=seg)
    assert rel_err(gated_mla(p, x, cfg, backend, seg=seg), dense) < 1e-14
    sparse = gated_mla(p, x, tiny(index_topk=8), backend, seg=seg)
    assert rel_err(sparse[:, :8], dense[:, :8]) < 1e-14          # rows with <= 8 keys: all kept
    assert rel_err(sparse[:, 8:], dense[:, 8:]) > 1e-3           # longer rows really are sparse


def test_indexer_gets_no_gradient():
    cfg = tiny()
    p = kimi.init_params(cfg, seed=2)["model"]["layers"][3]["self_attn"]
    x = torch.randn(1, 24, cfg.hidden_size, requires_grad=True)
    gated_mla(p, x, cfg, kimi.Backend(), seg=torch.zeros(1, 24, dtype=torch.long)).sum().backward()
    assert all(leaf.grad is None and not leaf.requires_grad
               for leaf in [*p["indexer"]["wq_b"].values(), *p["indexer"]["k_norm"].values()])
    assert p["kv_b_proj"]["weight"].grad is not None and p["q_a_proj"]["weight"].grad is not None
