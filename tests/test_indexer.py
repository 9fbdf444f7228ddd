"""The indexer layer (kimi/indexer.py): the score formula against a loop, scale invariance of the selection, RoPE
positions per document."""

import dataclasses

import torch
from hypothesis import given, strategies as st

import kimi
from helpers import rel_err, tiny, visible_of
from kimi import indexer
from kimi.indexer import indexer_scores
from kimi.ops.lightning_index import topk_reference
from kimi.ranges import document_ranges


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
    scores = indexer_scores(p, x, q_resid, cfg, document_ranges(torch.zeros(2, x.shape[1], dtype=torch.long)))
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


def test_positive_scaling_of_weights_keeps_selection():
    cfg, p, x, q_resid = _indexer_setup(torch.float32, T=24)
    doc = torch.zeros(2, 24, dtype=torch.long)
    ranges, vis = document_ranges(doc), visible_of(doc)
    idx = topk_reference(indexer_scores(p, x, q_resid, cfg, ranges), vis, 5)
    scaled = {**p, "weights_proj": {"weight": p["weights_proj"]["weight"] * 8.0}}   # exact power of two
    assert torch.equal(idx, topk_reference(indexer_scores(scaled, x, q_resid, cfg, ranges), vis, 5))


def test_rope_positions_restart_per_document():
    doc = torch.tensor([[4, 4, 4, 7, 7, -1]])
    assert document_ranges(doc).positions().tolist() == [[0, 1, 2, 0, 1, 0]]
    # With rotary on, a document's scores do not depend on where it sits in the pack.
    cfg, p, x, q_resid = _indexer_setup(rope=8, T=10)
    alone_ranges = document_ranges(torch.zeros(2, 6, dtype=torch.long))
    packed = indexer_scores(p, x, q_resid, cfg, document_ranges(torch.tensor([[0] * 4 + [1] * 6] * 2)))
    alone = indexer_scores(p, x[:, 4:], q_resid[:, 4:], cfg, alone_ranges)
    assert rel_err(packed[:, 4:, 4:], alone) < 1e-12
    norope = indexer_scores(p, x[:, 4:], q_resid[:, 4:], dataclasses.replace(cfg, index_rope_dim=0), alone_ranges)
    assert rel_err(norope, alone) > 1e-3   # the rotation really changes the scores
