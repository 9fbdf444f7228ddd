"""The gated-MLA layer (kimi/mla.py): the indexer's selection inside the layer, and its frozen gradient."""

import torch

import kimi
from helpers import drop_indexer, rel_err, tiny, without_indexer
from kimi.mla import gated_mla
from kimi.ranges import document_ranges


def test_layer_indexer_with_large_topk_equals_dense_and_small_topk_differs():
    cfg = tiny(index_topk=64)
    p = kimi.init_params(cfg, seed=1, dtype="float64")["model"]["layers"][3]["self_attn"]
    x = torch.randn(2, 30, cfg.hidden_size, dtype=torch.float64)
    ranges = document_ranges(torch.zeros(2, 30, dtype=torch.long))
    backend = kimi.Backend(attn="eager")
    dense = gated_mla(drop_indexer({"model": {"layers": [{"self_attn": p}]}})["model"]["layers"][0]["self_attn"],
                      x, without_indexer(cfg), backend, ranges=ranges)
    assert rel_err(gated_mla(p, x, cfg, backend, ranges=ranges), dense) < 1e-14      # 30 <= 64: indexer skipped
    # The indexer itself keeps every candidate of a row with at most index_topk (a span bound it cannot use).
    assert rel_err(gated_mla(p, x, cfg, backend, ranges=ranges._replace(span=10**6)), dense) < 1e-14
    sparse = gated_mla(p, x, tiny(index_topk=8), backend, ranges=ranges)
    assert rel_err(sparse[:, :8], dense[:, :8]) < 1e-14          # rows with <= 8 keys: all kept
    assert rel_err(sparse[:, 8:], dense[:, 8:]) > 1e-3           # longer rows really are sparse


def test_indexer_gets_no_gradient():
    cfg = tiny()
    p = kimi.init_params(cfg, seed=2)["model"]["layers"][3]["self_attn"]
    x = torch.randn(1, 24, cfg.hidden_size, requires_grad=True)
    gated_mla(p, x, cfg, kimi.Backend(), ranges=document_ranges(torch.zeros(1, 24, dtype=torch.long))).sum().backward()
    assert all(leaf.grad is None and not leaf.requires_grad
               for leaf in [*p["indexer"]["wq_b"].values(), *p["indexer"]["k_norm"].values()])
    assert p["kv_b_proj"]["weight"].grad is not None and p["q_a_proj"]["weight"].grad is not None
