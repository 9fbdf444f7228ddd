"""Sparse attention (kimi/ops/sparse_attention.py): every implementation against a float64 loop oracle; absorbed ==
expanded with gradients; a full selection equals dense attention and a selection of future keys never leaks;
rows without keys give 0 with zero gradient."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import LargestTensor, rel_err, tiny, visible_of
from kimi.ops import IMPLEMENTATIONS, lightning_index, sparse_attention
from kimi.ops.lightning_index import topk_reference
from kimi.ops.sparse_attention import select_visible
from kimi.ranges import document_ranges

FORMS = sorted(f for f in IMPLEMENTATIONS["attn"] if f[0] != "cudnn")   # (attn, mla_form)
"""Every form but cuDNN's, whose kernels need the package and a GPU (test_cudnn_backend.py: the GPU tests, and on
the CPU the model through it against 'gather' over stand-ins of the kernels)."""


def precision(attn: str) -> tuple[torch.dtype, float]:
    """The dtype a form is checked in and its tolerance against the float64 oracle: the Triton kernels run fp32
    (their own tests: test_sparse_mla_triton.py), the references float64."""
    return (torch.float32, 1e-5) if attn == "triton" else (torch.float64, 1e-12)


def sparse_mla(q, c, k_pe, kv_b, doc, idx, *, scale, form, span=None, block=4):
    """One implementation on packed documents doc [B, T]: the dense-mask references get the mask, the range-based
    ones the ranges (queries in blocks of `block`)."""
    r = document_ranges(doc, span)
    if form[0] in ("gather", "triton"):
        return IMPLEMENTATIONS["attn"][form](q, torch.cat([c, k_pe], -1), kv_b, r.lo, r.hi, idx, scale=scale,
                                             span=r.span, causal=True, block=block)
    return IMPLEMENTATIONS["attn"][form](q, c, k_pe, kv_b, r.mask(doc.shape[1]), idx, scale=scale)


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
    dtype, tol = precision(attn)
    q, c, k_pe, kv_b = _inputs(cfg, 2, 14, dtype)
    idx = topk_reference(torch.randn(2, 14, 14, dtype=torch.float64), visible_of(doc), 4)
    out = sparse_mla(q, c, k_pe, kv_b, doc, idx, scale=cfg.softmax_scale, form=(attn, form))
    wide = [t.double() for t in (q, c, k_pe, kv_b)]
    ref = _oracle(*wide, select_visible(visible_of(doc), idx), cfg)
    assert rel_err(out, ref) < tol
    dense = sparse_mla(q, c, k_pe, kv_b, doc, None, scale=cfg.softmax_scale, form=(attn, form))
    assert rel_err(dense, _oracle(*wide, visible_of(doc), cfg)) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_absorbed_equals_expanded_with_gradients(dtype, tol):
    cfg = tiny()
    doc = torch.tensor([[0] * 7 + [1] * 10])
    idx = topk_reference(torch.randn(1, 17, 17), visible_of(doc), 5)
    base = _inputs(cfg, 1, 17, dtype)
    weight = torch.randn(1, 17, cfg.num_attention_heads, cfg.v_head_dim, dtype=dtype)
    results = []
    for attn, form in [f for f in FORMS if dtype != torch.float64 or f[0] != "triton"]:
        inputs = [t.clone().requires_grad_() for t in base]
        out = sparse_mla(*inputs, doc, idx, scale=cfg.softmax_scale, form=(attn, form))
        (out * weight).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        assert rel_err(out, out0) < tol
        for g, g0 in zip(grads, grads0):
            assert rel_err(g, g0) < tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_absorbed_query_is_the_concatenation(dtype):
    """`absorb_query` (eager: one head-batched matmul written into the result, `_AbsorbQuery`) against the
    definition [W_UKᵀ q_nope ; q_rope] as an einsum and a concatenation (what it runs under torch.compile): the
    result contiguous, it and the gradients of q and kv_b equal (the same products), q given non-contiguous."""
    B, T, H, dn, dr, R, dv = 2, 7, 3, 8, 4, 16, 6
    q0 = torch.randn(B, H, T, dn + dr, dtype=dtype).transpose(1, 2)
    kv_b0 = torch.randn(H * (dn + dv), R, dtype=dtype)
    g = torch.randn(B, T, H, R + dr, dtype=dtype)
    runs = []
    for fn in (sparse_attention.absorb_query, _absorb_definition):
        q, kv_b = q0.clone().requires_grad_(), kv_b0.clone().requires_grad_()
        out = fn(q, kv_b, dr)
        runs.append((out, *torch.autograd.grad((out * g).sum(), [q, kv_b])))
    assert runs[0][0].is_contiguous()
    for got, want in zip(*runs):
        assert torch.equal(got, want)


def _absorb_definition(q, kv_b, d_r):
    H, dn = q.shape[2], q.shape[-1] - d_r
    W_uk = kv_b.view(H, -1, kv_b.shape[1])[:, :dn]
    return torch.cat([torch.einsum("bthd,hdr->bthr", q[..., :dn], W_uk), q[..., dn:]], dim=-1)


@settings(max_examples=15)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), attn_form=st.sampled_from(FORMS))
def test_full_selection_equals_dense_and_future_keys_never_leak(lens, attn_form):
    attn, form = attn_form
    dtype, tol = precision(attn)
    tol /= 10
    cfg = tiny()
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    T = doc.shape[1]
    q, c, k_pe, kv_b = _inputs(cfg, 1, T, dtype)
    dense = sparse_mla(q, c, k_pe, kv_b, doc, None, scale=cfg.softmax_scale, form=(attn, form))
    full = topk_reference(torch.randn(1, T, T), visible_of(doc), T)            # every visible key selected
    assert rel_err(sparse_mla(q, c, k_pe, kv_b, doc, full, scale=cfg.softmax_scale, form=(attn, form)), dense) < tol
    everything = torch.arange(T, dtype=torch.int32).expand(1, T, T)             # a selection holding future keys
    leaked = sparse_mla(q, c, k_pe, kv_b, doc, everything, scale=cfg.softmax_scale, form=(attn, form))
    assert rel_err(leaked, dense) < tol
    # The dense path's key window: documents of at most max(lens) tokens need no key before t - max(lens) + 1.
    banded = sparse_mla(q, c, k_pe, kv_b, doc, None, scale=cfg.softmax_scale, form=(attn, form), span=max(lens),
                        block=2)
    assert rel_err(banded, dense) < tol


@pytest.mark.parametrize("attn,form", FORMS)
def test_rows_without_keys_are_zero_with_zero_gradient(attn, form):
    cfg = tiny()
    doc = torch.tensor([[0, 0, 0, -1, -1]])
    q, c, k_pe, kv_b = _inputs(cfg, 1, 5, torch.float32, grad=True)
    out = sparse_mla(q, c, k_pe, kv_b, doc, None, scale=cfg.softmax_scale, form=(attn, form))
    assert torch.equal(out[:, 3:], torch.zeros_like(out[:, 3:]))
    out.square().sum().backward()
    for t in (q, c, k_pe, kv_b):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, 3:], torch.zeros_like(q.grad[:, 3:]))


# ---------------------------------------------------------------------------------------------- gathering reference

def _dense_latent(q, latent, idx, scale, d_v):
    """float64 oracle of `kimi::sparse_mla_gather`: a dense [B, T, S] mask of the selected keys, softmax over it,
    LSE over the selected keys (-inf and o = 0 for a row without any)."""
    B, T, H, D = q.shape
    keep = select_visible(torch.ones(B, T, latent.shape[1], dtype=torch.bool), idx)
    s = torch.einsum("bthd,bsd->bths", q.double(), latent.double()) * scale
    s = s.masked_fill(~keep[:, :, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(keep[:, :, None], (s - lse.nan_to_num(neginf=0.0)[..., None]).exp(), 0.0)
    return torch.einsum("bths,bsv->bthv", p, latent.double()[..., :d_v]), lse


def _selection(B, T, S, k, gen):
    """Random selections: distinct positions per row, some rows short (-1 padded), some empty."""
    idx = torch.full((B, T, k), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n = int(torch.randint(0, min(k, S) + 1, (), generator=gen))
            idx[b, t, :n] = torch.randperm(S, generator=gen)[:n].sort().values.int()
    return idx


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 20), S=st.integers(1, 24), k=st.integers(1, 9), H=st.integers(1, 3),
       block=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_gather_matches_dense_float64_with_gradients(B, T, S, k, H, block, seed):
    """`kimi::sparse_mla_gather` against the dense float64 oracle: output, LSE, and the gradients of q and the
    latent through both (the backward recomputes from the LSE, block by block, and scatters onto the latent)."""
    gen = torch.Generator().manual_seed(seed)
    D, d_v, scale = 12, 8, 0.3
    q = torch.randn(B, T, H, D, dtype=torch.float64, generator=gen)
    latent = torch.randn(B, S, D, dtype=torch.float64, generator=gen)
    idx = _selection(B, T, S, k, gen)
    do = torch.randn(B, T, H, d_v, dtype=torch.float64, generator=gen)
    dl = torch.randn(B, T, H, dtype=torch.float64, generator=gen)
    results = []
    for fn in (lambda q, c: torch.ops.kimi.sparse_mla_gather(q, c, idx, scale=scale, d_v=d_v, block=block),
               lambda q, c: _dense_latent(q, c, idx, scale, d_v)):
        qq, cc = q.clone().requires_grad_(), latent.clone().requires_grad_()
        o, lse = fn(qq, cc)
        finite = torch.isfinite(lse)
        loss = (o * do).sum() + torch.where(finite, lse * dl, 0.0).sum()
        results.append((o, lse, *torch.autograd.grad(loss, (qq, cc))))
    (o, lse, dq, dc), (o_r, lse_r, dq_r, dc_r) = results
    empty = (idx < 0).all(-1)
    assert torch.equal(torch.isinf(lse), empty[..., None].expand_as(lse)) and (lse[empty] < 0).all()
    assert torch.equal(o[empty], torch.zeros_like(o[empty]))
    fin = torch.isfinite(lse_r)
    assert rel_err(o, o_r) < 1e-12 and rel_err(lse[fin], lse_r[fin]) < 1e-12
    assert rel_err(dq, dq_r) < 1e-12 and rel_err(dc, dc_r) < 1e-12


def test_gather_equals_the_absorbed_layer_form_in_float32():
    """The model's absorbed attention (W_UK folded into q, W_UV after) through the gathering op gives
    `sparse_mla_absorbed`'s output on the indexer's selection, with fp32 inputs."""
    cfg = tiny()
    doc = torch.tensor([[0] * 9 + [1] * 15, [2] * 20 + [-1] * 4])
    q, c, k_pe, kv_b = _inputs(cfg, 2, 24, torch.float32)
    idx = topk_reference(torch.randn(2, 24, 24), visible_of(doc), 6)
    want = sparse_mla(q, c, k_pe, kv_b, doc, idx, scale=cfg.softmax_scale, form=("eager", "absorbed"))
    H, dn, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    W = kv_b.view(H, -1, R)
    Q = torch.cat([torch.einsum("bthd,hdr->bthr", q[..., :dn], W[:, :dn]), q[..., dn:]], -1)
    o_lat, _ = torch.ops.kimi.sparse_mla_gather(Q, torch.cat([c, k_pe], -1), idx, scale=cfg.softmax_scale, d_v=R,
                                               block=5)
    got = torch.einsum("bthr,hdr->bthd", o_lat, W[:, dn:])
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("cached", [False, True])
def test_blocked_indexer_topk_equals_the_masked_one(cached):
    """Top-k from ranges, queries in blocks, equals the dense-mask top-k: documents and padding without a cache
    (causal: each block scores only the keys before its end), left-padded rows over a cache's slots with one."""
    from kimi.ranges import cache_ranges
    B, n, d = 2, 3, 8
    if cached:
        T, S = 6, 19
        r = cache_ranges(torch.arange(9, 9 + T), torch.tensor([0, 11]), S)      # row 1: slots 9, 10 are padding
    else:
        T = S = 19
        r = document_ranges(torch.tensor([[0] * 7 + [1] * 12, [4] * 15 + [-1] * 4]))
    q, k, w = torch.randn(B, T, n, d), torch.randn(B, S, d), torch.randn(B, T, n)
    want = topk_reference(lightning_index.scores(q, k, w), r.mask(S), 5)
    for block in (1, 4, 19, 64):
        got = lightning_index.indexer_topk_blocked(q, k, w, r.lo, r.hi, topk=5, causal=r.causal, block=block)
        assert torch.equal(got, want)


def test_gather_path_allocates_nothing_of_size_t_by_s():
    """With T = S = 256 and blocks of 32 queries, no tensor the blocked indexer or the gathering attention (forward
    and backward) creates holds as many elements as one [T, S] matrix."""
    T = S = 256
    q, latent = torch.randn(1, T, 2, 24, requires_grad=True), torch.randn(1, S, 24, requires_grad=True)
    qi, ki, wi = torch.randn(1, T, 2, 8), torch.randn(1, S, 8), torch.randn(1, T, 2)
    t = torch.arange(T)[None]
    with LargestTensor() as largest:
        idx = lightning_index.indexer_topk_blocked(qi, ki, wi, torch.zeros_like(t), t + 1, topk=8, causal=True,
                                                   block=32)
        o, lse = torch.ops.kimi.sparse_mla_gather(q, latent, idx, scale=0.2, d_v=16, block=32)
        o.square().sum().backward()
    assert 0 < largest.numel < T * S, largest.numel
