"""`Backend(attn="cudnn")` (kimi/ops/cudnn_dsa.py): the choice and its errors, and the adapter around cuDNN
Frontend's DSA kernels and FlashMLA's forward: query blocks of a bounded score buffer, the ranges applied to the
scores, the selection compacted for the backward, rows without keys, head and slot padding. Without the packages
(CPU CI) the kernels are the documented-contract stand-ins of tests/fake_cudnn.py; the `gpu` tests run the real
ones on an SM90 GPU where cuDNN Frontend is installed."""

import pytest
import torch

import kimi
from kimi.ops import cudnn_dsa, lightning_index
from kimi.ops.sparse_attention import sparse_mla_gather, sparse_mla_gather_bwd
from kimi.ranges import cache_ranges, document_ranges

from fake_cudnn import fake_cudnn
from helpers import assert_backend_equals_gather, rel_err
from test_indexer_triton import _assert_valid_topk, _packed


def _ints(*shape):
    return torch.randint(-2, 3, shape).float()


def test_choosing_it_says_what_is_missing(monkeypatch):
    """One clear error when the backend is chosen: no GPU, a GPU older than Hopper, cuDNN's DSA kernels missing,
    FlashMLA asked for but not built; `sparse_fwd` without attn='cudnn' is refused."""
    monkeypatch.setattr(cudnn_dsa, "_READY", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cudnn_dsa.CudnnUnavailable, match="compute capability 9.0 or later"):
        kimi.Backend(attn="cudnn")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(cudnn_dsa.CudnnUnavailable, match="this GPU is 8.0"):
        kimi.Backend(attn="cudnn")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cudnn_dsa, "_load_dsa", lambda: (None, "ModuleNotFoundError: No module named 'cudnn'"))
    with pytest.raises(cudnn_dsa.CudnnUnavailable, match=r"pip install 'kimi\[cudnn\]'.*No module named 'cudnn'"):
        kimi.Backend(attn="cudnn")
    from fake_cudnn import FakeDSA
    monkeypatch.setattr(cudnn_dsa, "_load_dsa", lambda: (FakeDSA, ""))
    monkeypatch.setattr(cudnn_dsa, "_load_flash_mla", lambda: (None, "ModuleNotFoundError: no flash_mla"))
    with pytest.raises(cudnn_dsa.CudnnUnavailable, match="FlashMLA built from its repository"):
        kimi.Backend(attn="cudnn", sparse_fwd="flashmla")
    assert kimi.Backend(attn="cudnn").sparse_fwd == "auto"
    assert kimi.ops.resolve(kimi.Backend(attn="cudnn"), device=torch.device("cpu"),
                            dtype=torch.bfloat16).sparse_fwd == "triton"          # no FlashMLA: the Triton forward
    with pytest.raises(ValueError, match="chooses the forward under attn='cudnn'"):
        kimi.Backend(attn="triton", sparse_fwd="gather")
    with pytest.raises(ValueError, match="the gathering path attends over the shared latent"):
        kimi.Backend(attn="cudnn", mla_form="expanded")


def test_indexer_equals_the_blocked_reference(monkeypatch):
    """Packed causal documents with padding and a cached prefill chunk (rows starting mid-cache, padding queries):
    on integer scores (exact in every summation order, ties everywhere) the selection is the reference's, with
    the score buffer bounded so that rows run in several query blocks and top-k calls."""
    with fake_cudnn(monkeypatch) as dsa:
        monkeypatch.setattr(cudnn_dsa, "SCORE_BUFFER_BYTES", 7 * 40 * 4)      # 7 query rows a block at S = 40
        monkeypatch.setattr(cudnn_dsa, "TOPK_ROWS", 3)
        monkeypatch.setattr(cudnn_dsa, "TOPK_BUFFER_BYTES", 1)
        B, T = 2, 40
        r = document_ranges(_packed(B, T))
        q, k, w = _ints(B, T, 16, 128), _ints(B, T, 128), _ints(B, T, 16)
        for topk in (1, 5, 17):
            got = cudnn_dsa.indexer_topk_cudnn(q, k, w, r.lo, r.hi, topk=topk, causal=True)
            assert torch.equal(got, lightning_index.indexer_topk_blocked(q, k, w, r.lo, r.hi, topk=topk, causal=True))
        assert dsa.calls["indexer_forward_wrapper"] == B * 6 * 3 and dsa.calls["indexer_top_k_wrapper"] > B * 6 * 3
        S = 60
        q, w = q[:, :8], w[:, :8]
        k = _ints(B, S, 128)
        r = cache_ranges(torch.arange(50, 58), torch.tensor([3, 55]), S)
        got = torch.ops.kimi.indexer_topk_cudnn(q, k, w, r.lo, r.hi, topk=6, causal=False)
        assert torch.equal(got, lightning_index.indexer_topk_blocked(q, k, w, r.lo, r.hi, topk=6))
        with pytest.raises(ValueError, match="16, 32 or 64 heads of 128"):
            cudnn_dsa.indexer_topk_cudnn(q[..., :64], k[..., :64], w, r.lo, r.hi, topk=6)
        with pytest.raises(ValueError, match="must be in 0..2048"):
            cudnn_dsa.indexer_topk_cudnn(q, k, w, r.lo, r.hi, topk=4096)


def test_backward_equals_the_gathering_reference(monkeypatch):
    """dq, dlatent through the adapter: a selection with holes and out-of-range entries compacted into the valid
    prefix cuDNN reads, rows without a key left at zero, batch rows summed; an LSE gradient (which cuDNN does not
    take) added through the torch backward."""
    check = cudnn_dsa._check_widths
    with fake_cudnn(monkeypatch, widths_checked=False) as dsa:
        B, T, H, S, D, d_v = 2, 6, 3, 9, 24, 16
        q, lat = torch.randn(B, T, H, D), torch.randn(B, S, D)
        idx = torch.randint(-1, S + 2, (B, T, 5), dtype=torch.int32)
        idx[0, 2] = -1                                                       # a row without keys
        idx = torch.where(idx >= S, -1, idx)
        # distinct keys a row (the contract's): repeats become -1
        same = (idx[..., :, None] == idx[..., None, :]) & (idx[..., None, :] >= 0)
        idx = torch.where(same.tril(-1).any(-1), -1, idx)
        o, lse = sparse_mla_gather(q, lat, idx, scale=0.3, d_v=d_v)
        do = torch.randn_like(o)
        dq, dl = cudnn_dsa.sparse_mla_bwd_cudnn(q, lat, idx, o, lse, do, scale=0.3, d_v=d_v)
        want_q, want_l = sparse_mla_gather_bwd(q, lat, idx, o, lse, do, None, scale=0.3, d_v=d_v)
        assert rel_err(dq, want_q) < 1e-6 and rel_err(dl, want_l) < 1e-6
        assert torch.equal(dq[0, 2], torch.zeros_like(dq[0, 2]))
        assert dsa.calls["sparse_attention_backward_wrapper"] == B
        dlse = torch.randn_like(lse)                      # cuDNN takes none: added through the torch backward
        dq, dl = torch.ops.kimi.sparse_mla_cudnn_bwd(q, lat, idx, o, lse, do, dlse, scale=0.3, d_v=d_v,
                                                      forward="gather")
        want_q, want_l = sparse_mla_gather_bwd(q, lat, idx, o, lse, do, dlse, scale=0.3, d_v=d_v)
        assert rel_err(dq, want_q) < 1e-6 and rel_err(dl, want_l) < 1e-6
    with pytest.raises(ValueError, match="bf16 or fp16"):
        check(q, lat, d_v)
    with pytest.raises(ValueError, match="latents of 576"):
        check(q.bfloat16(), lat.bfloat16(), d_v)


def test_flashmla_forward_pads_heads_and_slots(monkeypatch):
    """FlashMLA's forward through the adapter: 96 heads run padded to 128, 2,000 slots padded to 2,048 with -1;
    o and the natural-log LSE equal the gathering reference's, a row without keys gives o = 0, LSE -inf (FlashMLA
    writes +inf there)."""
    with fake_cudnn(monkeypatch, widths_checked=False):
        B, T, H, S, D, d_v = 1, 3, 96, 40, 20, 16
        q, lat = torch.randn(B, T, H, D), torch.randn(B, S, D)
        idx = torch.full((B, T, 200), -1, dtype=torch.int32)
        idx[0, 0, :5] = torch.tensor([1, 4, 9, 16, 25])
        idx[0, 2, :3] = torch.tensor([0, 1, 2])
        o, lse = cudnn_dsa.sparse_mla_fwd_flashmla(q, lat, idx, scale=0.2, d_v=d_v)
        want_o, want_lse = sparse_mla_gather(q, lat, idx, scale=0.2, d_v=d_v)
        assert rel_err(o, want_o) < 1e-6 and torch.equal(lse.isneginf(), want_lse.isneginf())
        assert rel_err(lse[~lse.isneginf()], want_lse[~want_lse.isneginf()]) < 1e-6 and bool(lse[0, 1].isneginf().all())
        with pytest.raises(ValueError, match="at most 128 heads"):
            cudnn_dsa.sparse_mla_fwd_flashmla(torch.randn(1, 2, 130, D), lat, idx[:, :2], scale=0.2, d_v=d_v)


@pytest.mark.parametrize("sparse_fwd", ["gather", "flashmla"])
def test_the_model_on_it_equals_gather(monkeypatch, sparse_fwd):
    """`Backend(attn="cudnn")` through the whole model (packed documents, padding, several query blocks): the
    logits and every parameter's gradient of attn='gather', and under torch.compile (fullgraph, the adapter's
    ops opaque with fakes) the same logits. The forward is the `sparse_fwd` chosen. cuDNN's indexer takes bf16 q
    and k: the indexer's projections are rounded to bf16 on both paths, so that a near-tie in the fp32 model
    (measured: two keys' scores 0.6 % apart) cannot select other keys on the two paths."""
    from kimi import indexer, ops
    inputs = indexer.indexer_inputs

    def bf16_inputs(*args):
        q, k, w = inputs(*args)
        return q.bfloat16().to(q.dtype), k.bfloat16().to(k.dtype), w
    monkeypatch.setattr(indexer, "indexer_inputs", bf16_inputs)
    with fake_cudnn(monkeypatch, widths_checked=False) as dsa:
        monkeypatch.setattr(ops, "QUERY_BLOCK", 8)
        assert_backend_equals_gather(kimi.Backend(attn="cudnn", sparse_fwd=sparse_fwd, kda="chunk", moe="dense"),
                                     index_n_heads=16, index_head_dim=128)
        assert dsa.calls["indexer_top_k_wrapper"] and dsa.calls["sparse_attention_backward_wrapper"]


# ------------------------------------------------------------------------------------------ the real kernels

def _real_cudnn():
    if not torch.cuda.is_available():
        return False
    try:
        cudnn_dsa.require("triton")
    except cudnn_dsa.CudnnUnavailable:
        return False
    return True


cuda_cudnn = pytest.mark.skipif(not _real_cudnn(), reason="needs an SM90+ GPU with cuDNN Frontend's DSA kernels")


@pytest.mark.gpu
@cuda_cudnn
def test_gpu_indexer_is_a_valid_topk():
    """cuDNN's indexer at the release's sizes (64 x 128 heads, top 2048) on packed documents, bf16: counts and
    order of every row, and sampled rows a valid top-k of their float64 scores (overlap >= 0.97)."""
    from test_indexer_triton import _bf16
    B, T, n, d, topk = 1, 8192, 64, 128, 2048
    q, k, w = _bf16(B, T, T, n, d)
    w = w * (n * d) ** -0.5
    r = document_ranges(torch.tensor([[0] * 5000 + [1] * 3000 + [-1] * 192], device="cuda"))
    idx = torch.ops.kimi.indexer_topk_cudnn(q, k, w, r.lo, r.hi, topk=topk, causal=True)
    chosen = idx >= 0
    assert torch.equal(chosen.sum(-1), (r.hi - r.lo).clamp(min=0, max=topk))
    rows = torch.cat([torch.arange(2040, 2060, device="cuda"), torch.randint(5100, 8000, (100,), device="cuda")])
    _assert_valid_topk(idx[:, rows], q[:, rows], k, w[:, rows], r.lo[:, rows], r.hi[:, rows], topk)


@pytest.mark.gpu
@cuda_cudnn
@pytest.mark.parametrize("T", [4096])
def test_gpu_backward_matches_the_triton_kernels(T):
    """cuDNN's SM90 sparse backward through the adapter at 96 heads x 576 / 512, top 2048, bf16: dq and dlatent
    within bf16 rounding of the float64 reference (the same bound as the Triton kernels' test)."""
    from test_sparse_mla_triton import TOL, _selection
    q = (torch.randn(1, T, 96, 576, device="cuda") * 0.5).bfloat16()
    lat = torch.randn(1, T, 576, device="cuda").bfloat16()
    idx = _selection(1, T, T, 2048, "prefix", device="cuda")
    do = torch.randn(1, T, 96, 512, device="cuda").bfloat16()
    o, lse = sparse_mla_gather(q.double(), lat.double(), idx, scale=192 ** -0.5, d_v=512)
    want = sparse_mla_gather_bwd(q.double(), lat.double(), idx, o, lse, do.double(), None, scale=192 ** -0.5, d_v=512)
    dq, dl = cudnn_dsa.sparse_mla_bwd_cudnn(q, lat, idx, o.to(q.dtype), lse.float(), do, scale=192 ** -0.5, d_v=512)
    assert rel_err(dq, want[0]) < TOL[torch.bfloat16] and rel_err(dl, want[1]) < TOL[torch.bfloat16]


REAL_WIDTH_CASES = {   # T, document lengths (None: one document), padding at the end
    "4K": (4096, None),
    "8K": (8192, None),
    "4K packed, a document shorter than top-k": (4096, [1000, 2500]),
}


@pytest.mark.gpu
@cuda_cudnn
@pytest.mark.parametrize("case", REAL_WIDTH_CASES)
def test_gpu_four_real_width_layers_match_the_reference(case):
    """K3.1 Pro's first four layers at its per-layer widths (hidden 7168, 3 KDA layers of 96 heads, one gated MLA
    of 96 heads with 64 x 128 index heads and top 2,048; 8 routed experts), one row: attn='cudnn' in bf16 against
    the float32 gathering reference (attn='gather', the same weights in fp32). The logits and the gradients of the
    MLA layer's weights and of the first KDA layer's q_proj (which flows back through the MLA layer) must be within
    1.5x the error of the same bf16 model on attn='gather': that run rounds as cuDNN's does apart from the kernels,
    so its error is the bf16 floor, and a wrong selection, scale or LSE convention is a multiple of it. Packed: a
    document of 1,000 tokens (fewer than top-k: every key kept), one of 2,500, then 596 padding tokens."""
    import torch.nn.functional as F
    from kimi.config import scaled
    from kimi.model import recomputed
    from kimi.params import tree_items, tree_map

    T, docs = REAL_WIDTH_CASES[case]
    cfg = scaled(kimi.preset("k3_1_pro"), num_layers=4, num_experts=8)
    p16 = kimi.init_params(cfg, seed=0, dtype="bfloat16", device="cuda", draw_on_device=True)
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    labels = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    doc = None
    if docs is not None:
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)] + [torch.full((T - sum(docs),), -1)])
        doc = doc[None].cuda()
        labels = labels.masked_fill(doc < 0, -100)
    names = ["model.layers.0.self_attn.q_proj.weight"] + [
        f"model.layers.3.self_attn.{n}.weight" for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                          "g_proj", "o_proj")]

    def run(params, backend):
        leaves = dict(tree_items(params))
        # every layer recomputed in the backward (the fp32 reference at 8K would not fit otherwise); the results
        # kept on the host
        logits = kimi.forward(params, ids, cfg, backend, document_ids=doc, layer=recomputed())
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        grads = torch.autograd.grad(loss, [leaves[n] for n in names])
        return [logits.detach().cpu()] + [g.float().cpu() for g in grads]

    kda = "chunk_opaque"    # the KDA core recomputed in its backward: three layers' chunk intermediates at 8K
                            # would not fit beside the fp32 reference
    got = run(p16, kimi.Backend(attn="cudnn", kda=kda))
    floor = run(p16, kimi.Backend(attn="gather", kda=kda))
    p32 = tree_map(lambda _, t: t.detach().float().requires_grad_(t.requires_grad), p16)
    del p16
    torch.cuda.empty_cache()
    ref = run(p32, kimi.Backend(attn="gather", kda=kda))
    print(f"\n{case}: rel. error against fp32 gather, cudnn (bf16) / gather (bf16); cudnn against gather (bf16)")
    for name, a, b, r in zip(["logits"] + names, got, floor, ref):
        e_got, e_floor = rel_err(a, r), rel_err(b, r)
        print(f"  {name}: {e_got:.2e} / {e_floor:.2e}; {rel_err(a, b):.2e}")
        assert e_got <= 1.5 * e_floor, (name, e_got, e_floor)
