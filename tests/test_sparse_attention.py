"""Sparse attention (kimi/ops/sparse_attention.py): every implementation against a float64 loop oracle; absorbed ==
expanded with gradients; a full selection equals dense attention and a selection of future keys never leaks;
rows without keys give 0 with zero gradient."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import rel_err, tiny
from kimi.indexer import visible_keys
from kimi.model import document_runs
from kimi.ops import IMPLEMENTATIONS
from kimi.ops.lightning_index import topk_reference
from kimi.ops.sparse_attention import select_visible

FORMS = sorted(IMPLEMENTATIONS["attn"])   # (attn, mla_form)


def sparse_mla(q, c, k_pe, kv_b, seg, idx, *, scale, form):
    return IMPLEMENTATIONS["attn"][form](q, c, k_pe, kv_b, visible_keys(seg), idx, scale=scale)


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
    out = sparse_mla(q, c, k_pe, kv_b, seg, idx, scale=cfg.softmax_scale, form=(attn, form))
    ref = _oracle(q, c, k_pe, kv_b, select_visible(visible_keys(seg), idx), cfg)
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
        out = sparse_mla(*inputs, seg, idx, scale=cfg.softmax_scale, form=(attn, form))
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
    dense = sparse_mla(q, c, k_pe, kv_b, seg, None, scale=cfg.softmax_scale, form=(attn, form))
    full = topk_reference(torch.randn(1, T, T), visible_keys(seg), T)          # every visible key selected
    assert rel_err(sparse_mla(q, c, k_pe, kv_b, seg, full, scale=cfg.softmax_scale, form=(attn, form)), dense) < 1e-13
    everything = torch.arange(T, dtype=torch.int32).expand(1, T, T)             # a selection holding future keys
    leaked = sparse_mla(q, c, k_pe, kv_b, seg, everything, scale=cfg.softmax_scale, form=(attn, form))
    assert rel_err(leaked, dense) < 1e-13


@pytest.mark.parametrize("attn,form", FORMS)
def test_rows_without_keys_are_zero_with_zero_gradient(attn, form):
    cfg = tiny()
    seg, _ = document_runs(torch.tensor([[0, 0, 0, -1, -1]]))
    q, c, k_pe, kv_b = _inputs(cfg, 1, 5, torch.float32, grad=True)
    out = sparse_mla(q, c, k_pe, kv_b, seg, None, scale=cfg.softmax_scale, form=(attn, form))
    assert torch.equal(out[:, 3:], torch.zeros_like(out[:, 3:]))
    out.square().sum().backward()
    for t in (q, c, k_pe, kv_b):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, 3:], torch.zeros_like(q.grad[:, 3:]))
