"""DSA.md §12 invariants 1-6 (index selection) as property tests, and the score formula against a loop."""

import dataclasses

import torch
from hypothesis import given, strategies as st

import kimi
from helpers import rel_err, tiny
from kimi import indexer
from kimi.indexer import indexer_scores, positions_in_document, topk_reference, visible_keys
from kimi.model import document_runs


@st.composite
def packed_rows(draw, max_T=40):
    """document_ids [B, T] with random document lengths and optional right padding (-1)."""
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, max_T))
    rows = []
    for _ in range(B):
        ids, doc = [], 0
        pad = draw(st.integers(0, T // 3))
        while len(ids) < T - pad:
            n = draw(st.integers(1, T))
            ids += [doc] * n
            doc += draw(st.integers(1, 3))   # ids need not be consecutive, only runs matter
        rows.append(ids[: T - pad] + [-1] * pad)
    return torch.tensor(rows)


def _oracle(scores, seg, topk):
    """Per-row python oracle: candidates sorted by (-score, index), first min(K, n), ascending, -1 padded."""
    B, T, S = scores.shape
    out = torch.full((B, T, topk), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            cand = [s for s in range(t + 1) if seg[b, t] >= 0 and seg[b, s] == seg[b, t]]
            best = sorted(cand, key=lambda s: (-scores[b, t, s].item(), s))[:topk]
            out[b, t, : len(best)] = torch.tensor(sorted(best), dtype=torch.int32)
    return out


@given(doc=packed_rows(), topk=st.integers(1, 45), ties=st.booleans())
def test_topk_invariants(doc, topk, ties):
    seg, _ = document_runs(doc)
    B, T = doc.shape
    scores = torch.randn(B, T, T, dtype=torch.float64)
    if ties:  # few distinct values: exact ties everywhere (as ReLU zeros produce)
        scores = scores.round().clamp(-1, 1)
    vis = visible_keys(seg)
    idx = topk_reference(scores, vis, topk)
    assert idx.dtype == torch.int32 and idx.shape == (B, T, topk)
    n = vis.sum(-1)                                                   # candidates per query
    valid = idx >= 0
    assert torch.equal(valid.sum(-1), n.clamp(max=topk))             # exactly min(K, #candidates)
    assert torch.equal(valid, torch.arange(topk) < valid.sum(-1, keepdim=True))   # valid prefix, -1 suffix
    t = torch.arange(T)[None, :, None]
    safe = idx.clamp(min=0).long()
    assert bool((~valid | (safe <= t)).all())                        # causal
    same = seg.gather(1, safe.view(B, -1)).view_as(idx) == seg[:, :, None]
    assert bool((~valid | (same & (seg[:, :, None] >= 0))).all())   # same document, never padding
    pref = torch.where(valid, idx, torch.iinfo(torch.int32).max)
    assert bool((pref[..., 1:] >= pref[..., :-1]).all())              # ascending prefix
    assert bool((pref[..., 1:] != pref[..., :-1]).logical_or(~valid[..., 1:]).all())  # no duplicates
    full = n <= topk                                                  # short rows keep every candidate
    kept = torch.zeros(B, T, T + 1, dtype=torch.bool).scatter(-1, torch.where(valid, idx, T).long(), True)[..., :T]
    assert torch.equal(kept[full], vis[full])
    assert torch.equal(idx, _oracle(scores, seg, topk))              # ties go to the smaller index


def _indexer_setup(dtype=torch.float64, rope=0, T=12):
    cfg = tiny(index_rope_dim=rope)
    p = kimi.init_params(cfg, dtype="float64" if dtype == torch.float64 else "float32")
    layer = p["model"]["layers"][3]["self_attn"]["indexer"]
    x = torch.randn(2, T, cfg.hidden_size, dtype=dtype)
    q_resid = torch.randn(2, T, cfg.q_lora_rank, dtype=dtype)
    with torch.no_grad():
        for leaf in (layer["k_norm"]["weight"], layer["k_norm"]["bias"]):
            leaf.add_(0.3 * torch.randn_like(leaf))
    return cfg, layer, x, q_resid


def test_scores_match_loop_formula():
    cfg, p, x, q_resid = _indexer_setup()
    seg = torch.zeros(2, x.shape[1], dtype=torch.long)
    scores = indexer_scores(p, x, q_resid, cfg, seg)
    n, d = cfg.index_n_heads, cfg.index_head_dim
    q = (q_resid @ p["wq_b"]["weight"].T).view(2, -1, n, d)
    k = torch.nn.functional.layer_norm(x @ p["wk"]["weight"].T, (d,), p["k_norm"]["weight"], p["k_norm"]["bias"], 1e-6)
    w = x @ p["weights_proj"]["weight"].T * n ** -0.5
    ref = torch.zeros_like(scores)
    for b in range(2):
        for t in range(x.shape[1]):
            for s in range(x.shape[1]):
                ref[b, t, s] = sum(w[b, t, j] * torch.relu(d ** -0.5 * q[b, t, j] @ k[b, s]) for j in range(n))
    assert rel_err(scores, ref) < 1e-12


def test_scores_by_query_blocks_equal_one_block():
    """Bounding the per-head logits (`max_logits`) splits the queries into blocks (ragged last one) and gives the
    same scores as one block, bit for bit in float64."""
    B, T, S, n, d = 2, 13, 13, 4, 8
    q, k, w = torch.randn(B, T, n, d, dtype=torch.float64), torch.randn(B, S, d, dtype=torch.float64), \
        torch.randn(B, T, n, dtype=torch.float64)
    whole = indexer.scores(q, k, w)
    for rows in (1, 3, 5, 12):
        assert torch.equal(indexer.scores(q, k, w, max_logits=rows * B * n * S), whole)
    assert torch.equal(indexer.scores(q, k, w, max_logits=1), whole)


def test_positive_scaling_of_weights_keeps_selection():
    cfg, p, x, q_resid = _indexer_setup(torch.float32, T=24)
    seg = torch.zeros(2, 24, dtype=torch.long)
    vis = visible_keys(seg)
    idx = topk_reference(indexer_scores(p, x, q_resid, cfg, seg), vis, 5)
    scaled = {**p, "weights_proj": {"weight": p["weights_proj"]["weight"] * 8.0}}   # exact power of two
    assert torch.equal(idx, topk_reference(indexer_scores(scaled, x, q_resid, cfg, seg), vis, 5))


def test_rope_positions_restart_per_document():
    doc = torch.tensor([[4, 4, 4, 7, 7, -1]])
    seg, _ = document_runs(doc)
    assert positions_in_document(seg).tolist() == [[0, 1, 2, 0, 1, 0]]
    # With rotary on, a document's scores do not depend on where it sits in the pack.
    cfg, p, x, q_resid = _indexer_setup(rope=8, T=10)
    seg2, _ = document_runs(torch.tensor([[0] * 4 + [1] * 6] * 2))
    packed = indexer_scores(p, x, q_resid, cfg, seg2)
    alone = indexer_scores(p, x[:, 4:], q_resid[:, 4:], cfg, torch.zeros(2, 6, dtype=torch.long))
    assert rel_err(packed[:, 4:, 4:], alone) < 1e-12
    norope = indexer_scores(p, x[:, 4:], q_resid[:, 4:], dataclasses.replace(cfg, index_rope_dim=0),
                            torch.zeros(2, 6, dtype=torch.long))
    assert rel_err(norope, alone) > 1e-3   # the rotation really changes the scores
