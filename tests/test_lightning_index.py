"""The indexer's top-k contract (kimi/ops/lightning_index.py) as property tests: causal, in-document, at most k,
every candidate kept when there are at most k, ties to the smaller index; query-blocked scores."""

import torch
from hypothesis import given, strategies as st

from helpers import run_ids, visible_of
from kimi.ops import lightning_index
from kimi.ops.lightning_index import topk_reference
from kimi.ranges import document_ranges


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
    seg = run_ids(doc)
    B, T = doc.shape
    scores = torch.randn(B, T, T, dtype=torch.float64)
    if ties:  # few distinct values: exact ties everywhere (as ReLU zeros produce)
        scores = scores.round().clamp(-1, 1)
    vis = visible_of(doc)
    assert torch.equal(document_ranges(doc).mask(T), vis)            # the ranges are the document-causal mask
    idx = topk_reference(scores, vis, topk)
    assert torch.equal(lightning_index.select_topk(scores, vis, topk), idx)   # same selection without a sort
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


def test_select_topk_ranks_nan_as_the_sort_does():
    """A NaN score (a diverged indexer) is selected as the stable sort ranks it, above every number; the row is
    not dropped."""
    scores = torch.tensor([[[0.5, float("nan"), -1.0, 2.0, float("inf")]]])
    valid = torch.tensor([[[True, True, True, True, False]]])
    for k in (1, 2, 3, 5):
        assert torch.equal(lightning_index.select_topk(scores, valid, k), topk_reference(scores, valid, k))


def test_scores_by_query_blocks_equal_one_block():
    """Bounding the per-head logits (`max_logits`) splits the queries into blocks (ragged last one) and gives the
    same scores as one block, bit for bit in float64."""
    B, T, S, n, d = 2, 13, 13, 4, 8
    q, k, w = torch.randn(B, T, n, d, dtype=torch.float64), torch.randn(B, S, d, dtype=torch.float64), \
        torch.randn(B, T, n, dtype=torch.float64)
    whole = lightning_index.scores(q, k, w)
    for rows in (1, 3, 5, 12):
        assert torch.equal(lightning_index.scores(q, k, w, max_logits=rows * B * n * S), whole)
    assert torch.equal(lightning_index.scores(q, k, w, max_logits=1), whole)
