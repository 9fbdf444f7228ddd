"""The range-based attention path at model level (`Backend(attn="gather")`, kimi/ops/sparse_attention.py): the whole
model equals the dense-mask reference with gradients, across several query blocks; documents no longer than
index_topk run dense without the indexer and give the same result; nothing of size T×T is ever allocated.
(The op-level contracts are in test_sparse_attention.py; decoding on this path in test_decode.py.)"""

import dataclasses
import math

import pytest
import torch

import kimi
from helpers import OpOutputs, drop_indexer, rel_err, tiny, without_indexer
from kimi import ops
from kimi.params import tree_items, unflatten
from kimi.config import KDAConfig

CFG = tiny(num_hidden_layers=4, index_topk=4, index_rope_dim=8,
           linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1, 3), full_attn_layers=(2, 4)))
GATHER = kimi.Backend(attn="gather", kda="chunk", moe="dense")
EAGER = kimi.Backend(attn="eager", mla_form="expanded", kda="chunk", moe="dense")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 8 queries, so every sequence below spans several blocks (ragged last one)."""
    monkeypatch.setattr(ops, "QUERY_BLOCK", 8)


@pytest.fixture(scope="module")
def params64():
    return kimi.init_params(CFG, seed=0, dtype="float64")


def _packed(lens: list[list[int]], pad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """document_ids [B, T] from per-row document lengths and right padding, and random token ids."""
    rows = [sum(([d * 10 + i] * n for i, n in enumerate(row)), []) + [-1] * p for d, (row, p) in
            enumerate(zip(lens, pad))]
    doc = torch.tensor(rows)
    return torch.randint(0, CFG.vocab_size, doc.shape), doc


def _loss_and_grads(params, ids, doc, cfg, backend, **kw):
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tree_items(params)}
    tree = unflatten(leaves)
    logits = kimi.forward(tree, ids, cfg, backend, document_ids=doc, **kw)
    probe = torch.randn_like(logits, generator=torch.Generator().manual_seed(1))
    (logits * probe * (doc >= 0)[..., None]).sum().backward()
    return logits.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}


def test_whole_model_gather_equals_eager_with_gradients(params64):
    """Packed documents (one longer than a block, several shorter than index_topk) and padding, float64: logits
    and the gradient of every parameter agree with the dense-mask reference."""
    ids, doc = _packed([[21, 3, 9], [2, 30]], [0, 1])
    out, grads = _loss_and_grads(params64, ids, doc, CFG, GATHER)
    ref, ref_grads = _loss_and_grads(params64, ids, doc, CFG, EAGER)
    real = doc >= 0
    assert rel_err(out[real], ref[real]) < 1e-12
    assert grads.keys() == ref_grads.keys()
    assert max(rel_err(grads[k], ref_grads[k]) for k in grads) < 1e-10


@pytest.mark.parametrize("backend", [GATHER, EAGER], ids=["gather", "eager"])
def test_short_documents_run_dense_and_equal_the_sparse_path(params64, backend):
    """Documents of at most index_topk = 16 tokens: with max_document_len the layers skip the indexer and attend
    densely over each document (for 'gather' in blocks of a key window index_topk wide); without it the indexer
    runs and must select every candidate. Same logits and gradients."""
    cfg = dataclasses.replace(CFG, index_topk=16)
    ids, doc = _packed([[16, 5, 11, 7], [3, 16, 14]], [0, 6])
    dense, dense_grads = _loss_and_grads(params64, ids, doc, cfg, backend, max_document_len=16)
    sparse, sparse_grads = _loss_and_grads(params64, ids, doc, cfg, backend)
    real = doc >= 0
    assert rel_err(dense[real], sparse[real]) < 1e-12
    assert max(rel_err(dense_grads[k], sparse_grads[k]) for k in dense_grads) < 1e-10
    # The bound is honoured, not checked: claiming 16 for 39-token documents really changes the attention.
    ids, doc = _packed([[39]], [0])
    wrong = kimi.forward(params64, ids, cfg, backend, document_ids=doc, max_document_len=16)
    assert rel_err(wrong, kimi.forward(params64, ids, cfg, backend, document_ids=doc)) > 1e-6


def test_max_document_len_is_checked(params64):
    """A positive integer; not with a cache; not below the one document a row is without document_ids."""
    ids, doc = _packed([[5]], [0])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_document_len must be a positive integer"):
            kimi.forward(params64, ids, CFG, GATHER, document_ids=doc, max_document_len=bad)
    with pytest.raises(ValueError, match="each row is one document of 5 tokens"):
        kimi.forward(params64, ids, CFG, GATHER, max_document_len=4)
    cache = kimi.init_cache(CFG, 1, 8, dtype=torch.float64)
    with pytest.raises(kimi.CacheError, match="a cache does not take"):
        kimi.forward(params64, ids, CFG, GATHER, cache=cache, max_document_len=5)


def _square(shapes, T):
    """The shapes with two dimensions of at least T (T exceeds every model width here), or one and at least T²
    elements (a T×T tensor with its dimensions merged)."""
    return [s for s in shapes if sum(d >= T for d in s) >= 2 or (max(s, default=0) >= T and math.prod(s) >= T * T)]


@pytest.mark.parametrize("short", [False, True], ids=["indexer", "short-documents"])
def test_no_tensor_of_size_t_by_t(short):
    """Forward and backward of the model without the head at T = 640 (above every width of the tiny model; 80
    query blocks): no op on the 'gather' path outputs a tensor of T×T size or shape, with the indexer
    selecting 4 of up to 300 keys or with short documents attended densely. The dense-mask reference does (the
    check can fail)."""
    cfg = dataclasses.replace(CFG, index_topk=16) if short else CFG
    params = kimi.init_params(cfg, seed=0)
    T = 640
    assert T > max(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_experts)
    ids, doc = _packed([[16] * 40] if short else [[400, 240]], [0])
    kw = dict(document_ids=doc, head=False, max_document_len=16 if short else None)
    for backend, expect_square in ((GATHER, False), (EAGER, True)):
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tree_items(params)}
        with OpOutputs() as mode:
            h = kimi.forward(unflatten(leaves), ids, cfg, backend, **kw)
            h.square().mean().backward()
        assert bool(_square(mode.shapes, T)) == expect_square, _square(mode.shapes, T)[:5]


def test_lora_on_kv_b_proj_trains_through_the_gather_path(params64):
    """A LoRA adapter on kv_b_proj enters the absorbed form (W_UK into the query, W_UV after the attention) through
    its effective weight: the adapters' gradients on the 'gather' path equal the dense-mask reference's."""
    from kimi import lora
    ids, doc = _packed([[21, 3, 9], [2, 30]], [0, 1])
    grads = []
    for backend in (GATHER, EAGER):
        adapters = lora.init_adapters(params64, ("kv_b_proj",), 4, seed=3, dtype=torch.float64)
        for a in adapters.values():   # B starts at zero: make the adapter change the model
            a["B"].data.normal_(generator=torch.Generator().manual_seed(4))
        leaves = [t for a in adapters.values() for t in a.values()]
        logits = kimi.forward(lora.apply(params64, adapters, 0.5), ids, CFG, backend, document_ids=doc)
        (logits.square() * (doc >= 0)[..., None]).sum().backward()
        grads.append([t.grad for t in leaves])
    assert len(grads[0]) == 4 and all(g is not None for g in grads[0])     # A and B of the two MLA layers
    assert max(rel_err(g, r) for g, r in zip(*grads)) < 1e-10


@pytest.mark.parametrize("no_indexer", [False, True], ids=["cache-within-index-topk", "no-indexer"])
def test_cached_dense_branch_equals_the_reference(params64, no_indexer):
    """With a cache of at most index_topk slots (or no indexer) every candidate is attended: 'gather' runs its dense
    branch over the cached latents (absorbed form, blocks of queries). A left-padded prefill over two query blocks
    and three decode steps give the dense-mask reference's logits on every real position."""
    cfg, params = (without_indexer(CFG), drop_indexer(params64)) if no_indexer else \
        (dataclasses.replace(CFG, index_topk=16), params64)
    B, T0, N = 2, 10, 3
    ids = torch.randint(0, cfg.vocab_size, (B, T0 + N))
    start = torch.tensor([0, 3])
    outs = []
    for backend in (GATHER, kimi.Backend(attn="eager", mla_form="absorbed", kda="chunk", moe="dense")):
        cache = kimi.init_cache(cfg, B, 16, dtype=torch.float64, start=start)
        logits, cache = kimi.forward(params, ids[:, :T0], cfg, backend, cache=cache)
        steps = [logits]
        for j in range(N):
            out, cache = kimi.forward(params, ids[:, T0 + j:T0 + j + 1], cfg, backend, cache=cache)
            steps.append(out)
        outs.append(torch.cat(steps, 1))
    real = torch.arange(T0 + N)[None, :] >= start[:, None]
    assert rel_err(outs[0][real], outs[1][real]) < 1e-12
