"""Compile contracts: every kimi:: op passes opcheck; the whole model compiles with fullgraph=True and no graph
break, forward and backward, for every CPU backend; compiled == eager (outputs and gradients); recompiles stay
bounded over a sweep of lengths and batch sizes.

Graph capture (Dynamo + AOTAutograd, which traces forward and backward) is tested for the whole backend matrix with
the `aot_eager_decomp_partition` backend: the graphs Inductor would see (its decompositions, the fwd/bwd
partition), run by eager kernels. Inductor code generation, which costs minutes of C++ compilation on 2 cores, runs
once, on the traced chunk core. Compile tests use a 2-layer model (KDA + dense MLP, gated MLA with indexer + MoE)
that keeps every kind of layer, and sequences of two KDA chunks (T > 64) so the chunk hand-off scan really loops.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kimi
from helpers import rel_err, tiny
from kimi.config import KDAConfig
from kimi.ops.lightning_index import topk_reference
from kimi.ranges import document_ranges

CFG = tiny(num_hidden_layers=2, attn_res_block_size=1,
           linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,), full_attn_layers=(2,)))
BACKENDS = [kimi.Backend(kda="chunk"), kimi.Backend(attn="eager", kda="recurrent", moe="dense"),
            kimi.Backend(attn="eager", mla_form="absorbed", kda="chunk", moe="dense"),
            kimi.Backend(kda="chunk_opaque"), kimi.Backend(kda="chunk_triton"),
            kimi.Backend(attn="gather", kda="chunk")]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def params():
    return kimi.init_params(CFG, seed=0)


def _batch(B=2, T=24, seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=gen)
    doc = torch.cat([torch.zeros(B, T // 3, dtype=torch.long), torch.ones(B, T - T // 3, dtype=torch.long)], 1)
    return ids, doc


def _selection_is_stable(params, ids, doc, tol=1e-5) -> bool:
    """Whether every gated-MLA layer's top-k selection for this batch survives fp32 rounding in any order: a gap
    above `tol` (relative to the row's largest score) between each query's k-th and (k+1)-th float64 score, or
    both exactly 0 (ties among zeros go to the smaller position in every path) with none of the row's zero-score
    keys within `tol` of the ReLU's kink (every head's q_h·k below −tol relative to the largest dot: one just
    above 0 in another rounding would jump the queue of zeros). Compiled and eager results of a batch that fails
    this may select other keys: they then differ by the attention over those keys, not by rounding."""
    import kimi.indexer as indexer
    seen = []
    select = indexer.select_keys

    def spy(p, x, q_resid, cfg, ranges, backend=None, cp=None):
        seen.append((p, x.detach(), q_resid.detach(), ranges))
        return select(p, x, q_resid, cfg, ranges, backend, cp)
    indexer.select_keys = spy
    try:
        with torch.no_grad():
            kimi.forward(params, ids, CFG, kimi.Backend(attn="eager", kda="chunk", moe="dense"), document_ids=doc)
    finally:
        indexer.select_keys = select
    for p, x, q_resid, ranges in seen:
        p64 = kimi.params.tree_map(lambda _, leaf: leaf.detach().double(), p)
        q, k, w = indexer.indexer_inputs(p64, x.double(), q_resid.double(), CFG, ranges.positions())
        valid = ranges.mask(k.shape[1])                                     # [B, T, S]
        dots = torch.einsum("btnd,bsd->btns", q, k)                         # [B, T, heads, S]
        scores = (dots.relu() * w[..., None]).sum(2).masked_fill(~valid, float("-inf"))
        top = scores.sort(-1, descending=True).values
        K = CFG.index_topk
        picks = valid.sum(-1) > K                                           # the queries that select
        kth, nxt = top[..., K - 1], top[..., K]
        zeros = picks & (kth == 0) & (nxt == 0)
        if (picks & ~zeros & (kth - nxt <= tol * top[..., 0].abs())).any():
            return False
        near_kink = valid & (scores == 0) & (dots.amax(2) > -tol * dots.abs().max())
        if (zeros[..., None] & near_kink).any():
            return False
    return bool(seen)


def _stable_batch(params, B, T):
    """A fresh batch whose top-k selections are stable under rounding (`_selection_is_stable`)."""
    for _ in range(20):
        ids, doc = _batch(B, T)
        if _selection_is_stable(params, ids, doc):
            return ids, doc
    raise AssertionError("20 batches in a row had a top-k selection on a rounding tie")


def _loss_and_grads(params, ids, doc, backend, fn):
    leaves = [leaf for _, leaf in kimi.params.tree_items(params) if leaf.requires_grad]
    for leaf in leaves:
        leaf.grad = None
    logits = fn(params, ids, CFG, backend, document_ids=doc)
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), [leaf.grad.clone() if leaf.grad is not None else None for leaf in leaves]


def _assert_as_accurate_as_eager(params, ids, doc, backend, out, grads, out_tol):
    """Compiled fp32 results against a float64 eager reference (`moe="dense"`: the grouped kernel has no float64),
    leaf by leaf: the compiled error may be at most ten times the fp32 eager error (both are fp32 roundings in
    different orders), plus 1e-5. A leaf whose
    gradient is a large cancellation (A_log: a sum over every token and channel) carries fp32 rounding noise far
    above 1e-5 of its own norm, in eager as much as compiled, so a fixed relative bound on compiled-vs-eager
    would flake on it while a real bug (errors of order 1) still fails this."""
    p64 = kimi.params.tree_map(lambda _, leaf: torch.nn.Parameter(leaf.detach().double(),
                                                                requires_grad=leaf.requires_grad), params)
    kda64 = "chunk" if backend.kda == "chunk_triton" else backend.kda          # the Triton state pass is fp32 only
    ref64, grads64 = _loss_and_grads(p64, ids, doc, dataclasses.replace(backend, moe="dense", kda=kda64),
                                     kimi.forward)
    eager, eager_grads = _loss_and_grads(params, ids, doc, backend, kimi.forward)
    assert rel_err(out, ref64) <= 10 * rel_err(eager, ref64) + out_tol
    for g, e, r in zip(grads, eager_grads, grads64):
        assert (g is None) == (r is None) == (e is None)
        if r is not None:
            assert rel_err(g, r) <= 10 * rel_err(e, r) + 1e-5, (rel_err(g, r), rel_err(e, r))


# ---------------------------------------------------------------------------------------------- ops

def _op_samples():
    B, T, H, K, V = 2, 6, 2, 8, 8
    r = lambda *s, dt=torch.float64: torch.randn(*s, dtype=dt)
    f32 = torch.float32
    q, k = (torch.nn.functional.normalize(r(B, T, H, K), dim=-1) for _ in range(2))
    g = -torch.rand(B, T, H, K, dtype=torch.float64) * 2
    beta, v, s0 = torch.rand(B, T, H, dtype=torch.float64), r(B, T, H, V), r(B, H, K, V)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 3] = True
    doc = torch.tensor([[0] * 2 + [1] * 4, [3] * 5 + [-1] * 1])
    rg = document_ranges(doc)
    cfg = tiny()
    Hm = cfg.num_attention_heads
    qm, c, kpe = r(B, T, Hm, cfg.qk_head_dim), r(B, T, cfg.kv_lora_rank), r(B, T, cfg.qk_rope_head_dim)
    lat = torch.cat([c, kpe], -1)
    kvb = r(Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank) * 0.2
    idx = topk_reference(r(B, T, T), rg.mask(T), 3)
    vis = rg.mask(T)[:, 3:]                                        # 3 queries over 6 keys (a cached call's shape)
    E, m, Z, N = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size, 12
    z = torch.randn(N, Z)
    eidx = torch.stack([torch.randperm(E)[:2] for _ in range(N)])
    w = torch.rand(N, 2)
    ex = [torch.randn(E, m, Z) * 0.2, torch.randn(E, Z, m) * 0.2, torch.randn(E, m, Z) * 0.2]
    offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)
    k_ops = torch.ops.kimi
    qg, latent = r(B, T, 2, 12), r(B, T, 12)
    gidx = torch.tensor([[[0, -1], [1, 0], [2, 1], [3, -1], [4, 2], [5, 0]]] * B, dtype=torch.int32)
    f32s = lambda ts: tuple(t.float() for t in ts)
    return {   # name: (op, positional args, keyword args)
        "kda_recurrent": (k_ops.kda_recurrent.default, (q, k, v, g, beta, s0, reset), dict(scale=0.3)),
        "kda_chunk": (k_ops.kda_chunk.default, (q, k, v, g, beta, s0, reset), dict(scale=0.3, chunk_size=4)),
        "kda_chunk_opaque": (k_ops.kda_chunk_opaque.default, (q, k, v, g, beta, s0, reset),
                             dict(scale=0.3, chunk_size=4)),
        "kda_chunk_opaque_bwd": (k_ops.kda_chunk_opaque_bwd.default, (q, k, v, g, beta, None, reset, v.clone(),
                                                                      s0.clone()), dict(scale=0.3, chunk_size=4)),
        "kda_chunk_triton": (k_ops.kda_chunk_triton.default, (*f32s((q, k, v, g, beta, s0)), reset),
                             dict(scale=0.3, chunk_size=4)),
        "kda_states": (k_ops.kda_states.default, (r(4, 3, 16, 8, dt=f32), r(4, 3, 16, 8, dt=f32) * 0.3,
                                                  r(4, 3, 16, 8, dt=f32) * 0.3, torch.rand(4, 3, 8),
                                                  r(4, 8, 8, dt=f32)), {}),
        "kda_states_bwd": (k_ops.kda_states_bwd.default,
                           (r(4, 3, 16, 8, dt=f32), r(4, 3, 16, 8, dt=f32), torch.rand(4, 3, 8),
                            r(4, 3, 8, 8, dt=f32), r(4, 3, 16, 8, dt=f32), r(4, 8, 8, dt=f32)), {}),
        "kda_step": (k_ops.kda_step.default, (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0), dict(scale=0.3)),
        "kda_triton": (k_ops.kda_triton.default, (*f32s((q, k, v, g, beta, s0)), reset), dict(scale=0.3)),
        "kda_triton[no initial state]": (k_ops.kda_triton.default, (*f32s((q, k, v, g, beta)), None, None),
                                         dict(scale=0.3)),
        "kda_triton_bwd": (k_ops.kda_triton_bwd.default, (*f32s((q, k, v, g, beta, s0)), reset,
                                                          *f32s((r(B, T, H, V), r(B, H, K, V)))), dict(scale=0.3)),
        "kda_decode_step": (k_ops.kda_decode_step.default,
                            (*f32s((r(B, H * K), r(B, H * K), r(B, H * V), r(H * K, 1, 4), r(H * K, 1, 4),
                                    r(H * V, 1, 4), r(B, 3, H * K), r(B, 3, H * K), r(B, 3, H * V))),
                             torch.tensor([[False] * 4, [False, True, False, False]]), g[:, 0].float(),
                             beta[:, 0].float(), s0.float()), dict(scale=0.3, eps=1e-6)),
        "indexer_topk": (k_ops.indexer_topk.default, (r(B, 3, 2, 8), r(B, T, 8), r(B, 3, 2), rg.lo[:, 3:],
                                                      rg.hi[:, 3:]), dict(topk=4, block=2)),
        "indexer_topk_triton": (k_ops.indexer_topk_triton.default,
                                (*f32s((r(B, 3, 2, 8), r(B, T, 8), r(B, 3, 2))), rg.lo[:, 3:], rg.hi[:, 3:]),
                                dict(topk=4)),
        "sparse_mla_eager": (k_ops.sparse_mla_eager.default, (qm, c, kpe, kvb, rg.mask(T), idx),
                             dict(scale=cfg.softmax_scale)),
        "sparse_mla_sdpa": (k_ops.sparse_mla_sdpa.default, (qm[:, 3:], c, kpe, kvb, vis, None),
                            dict(scale=cfg.softmax_scale)),
        "sparse_mla_absorbed": (k_ops.sparse_mla_absorbed.default, (qm, c, kpe, kvb, rg.mask(T), idx),
                                dict(scale=cfg.softmax_scale)),
        "sparse_mla_gathered": (k_ops.sparse_mla_gathered.default, (qm, lat, kvb, rg.lo, rg.hi, idx),
                                dict(scale=cfg.softmax_scale, span=T, causal=True, block=4)),
        "sparse_mla_gathered[dense]": (k_ops.sparse_mla_gathered.default, (qm, lat, kvb, rg.lo, rg.hi, None),
                                      dict(scale=cfg.softmax_scale, span=5, causal=True, block=4)),
        "sparse_mla_gathered[dense-cached]": (k_ops.sparse_mla_gathered.default,
                                              (qm[:, 3:], lat, kvb, rg.lo[:, 3:], rg.hi[:, 3:], None),
                                              dict(scale=cfg.softmax_scale, span=T, causal=False, block=2)),
        "sparse_mla_gather": (k_ops.sparse_mla_gather.default, (qg, latent, gidx), dict(scale=0.3, d_v=8, block=2)),
        "sparse_mla_gather_bwd": (k_ops.sparse_mla_gather_bwd.default,
                                  (qg, latent, gidx, *k_ops.sparse_mla_gather(qg, latent, gidx, scale=0.3, d_v=8),
                                   r(B, T, 2, 8), r(B, T, 2)), dict(scale=0.3, d_v=8, block=2)),
        "sparse_mla_triton": (k_ops.sparse_mla_triton.default, (*f32s((qg, latent)), gidx), dict(scale=0.3, d_v=8)),
        "sparse_mla_triton_bwd": (k_ops.sparse_mla_triton_bwd.default,
                                  (*f32s((qg, latent)), gidx,
                                   *k_ops.sparse_mla_triton(*f32s((qg, latent)), gidx, scale=0.3, d_v=8),
                                   *f32s((r(B, T, 2, 8), r(B, T, 2)))), dict(scale=0.3, d_v=8)),
        "sparse_mla_triton_ranges": (k_ops.sparse_mla_triton_ranges.default,
                                     (*f32s((qm, lat, kvb)), rg.lo, rg.hi, idx),
                                     dict(scale=cfg.softmax_scale, span=T, causal=True, block=4)),
        # cuDNN's adapter (kimi/ops/cudnn_dsa.py) over the documented-contract stand-ins of tests/fake_cudnn.py
        "indexer_topk_cudnn": (k_ops.indexer_topk_cudnn.default, (r(B, 3, 16, 128), r(B, T, 128), r(B, 3, 16),
                                                                  rg.lo[:, 3:], rg.hi[:, 3:]), dict(topk=4)),
        "sparse_mla_cudnn": (k_ops.sparse_mla_cudnn.default, (*f32s((qg, latent)), gidx),
                             dict(scale=0.3, d_v=8, forward="gather")),
        "sparse_mla_cudnn_bwd": (k_ops.sparse_mla_cudnn_bwd.default,
                                 (*f32s((qg, latent)), gidx,
                                  *k_ops.sparse_mla_gather(*f32s((qg, latent)), gidx, scale=0.3, d_v=8),
                                  r(B, T, 2, 8).float(), None), dict(scale=0.3, d_v=8, forward="gather")),
        "sparse_mla_cudnn_ranges": (k_ops.sparse_mla_cudnn_ranges.default, (*f32s((qm, lat, kvb)), rg.lo, rg.hi, idx),
                                    dict(scale=cfg.softmax_scale, span=T, causal=True, block=4, forward="gather")),
        "moe_experts_dense": (k_ops.moe_experts_dense.default, (z, eidx, w, *ex), dict(beta=4.0, beta_lin=25.0)),
        "moe_experts_grouped": (k_ops.moe_experts_grouped.default, (z, eidx, w, *ex), dict(beta=4.0, beta_lin=None)),
        "moe_experts_gemv": (k_ops.moe_experts_gemv.default, (z, eidx, w, *ex), dict(beta=4.0, beta_lin=25.0)),
        "moe_gemv": (k_ops.moe_gemv.default, (torch.randn(12, 16), torch.randn(4, 8, 16), offs), {}),
        "grouped_mm": (k_ops.grouped_mm.default, (torch.randn(12, 16), torch.randn(4, 16, 8), offs), {}),
        "grouped_mm_wgrad": (k_ops.grouped_mm_wgrad.default, (torch.randn(12, 16), torch.randn(12, 8), offs), {}),
    }


def test_every_registered_op_is_covered():
    registered = {name for name in dir(torch.ops.kimi) if not name.startswith("_") and
                  isinstance(getattr(torch.ops.kimi, name), torch._ops.OpOverloadPacket)}
    assert registered == {name.split("[")[0] for name in _op_samples()}   # "op[variant]": another sample


@pytest.mark.parametrize("name", sorted(_op_samples()))
def test_opcheck(name, monkeypatch):
    if "cudnn" in name:
        from fake_cudnn import fake_cudnn
        with fake_cudnn(monkeypatch, widths_checked=False):
            return _opcheck(name)
    _opcheck(name)


def _opcheck(name):
    op, args, kwargs = _op_samples()[name]
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() and name not in
                 ("indexer_topk", "indexer_topk_triton", "indexer_topk_cudnn", "kda_chunk_opaque_bwd",
                  "kda_states_bwd", "kda_triton_bwd", "kda_decode_step", "sparse_mla_gather_bwd",
                  "sparse_mla_triton_bwd", "sparse_mla_cudnn_bwd") else a
                 for a in args)
    if name == "kda_chunk_opaque_bwd":
        # It differentiates through torch.func.vjp, whose wrapper tensors opcheck's checkers (dispatch modes that
        # read every tensor's storage while the real kernel runs) cannot inspect. What they would check, directly:
        # the fake kernel's outputs match the real ones in shape, dtype and strides, and no input is mutated.
        from torch._subclasses.fake_tensor import FakeTensorMode
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        real = op(*args, **kwargs)
        assert all(not isinstance(a, torch.Tensor) or torch.equal(a, b) for a, b in zip(args, before))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
        assert [(t.shape, t.dtype, t.stride()) for t in real] == [(t.shape, t.dtype, t.stride()) for t in fake]
        assert all(t.data_ptr() != a.data_ptr() for t in real for a in args if isinstance(a, torch.Tensor))
        return
    torch.library.opcheck(op, args, kwargs)


def test_kda_step_continues_the_recurrence():
    B, T, H, K = 1, 9, 2, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) for _ in range(2))
    v, g = torch.randn(B, T, H, K, dtype=torch.float64), -torch.rand(B, T, H, K, dtype=torch.float64)
    beta = torch.rand(B, T, H, dtype=torch.float64)
    o, S = torch.ops.kimi.kda_recurrent(q, k, v, g, beta, scale=0.3)
    o8, S8 = torch.ops.kimi.kda_chunk(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], scale=0.3)
    o9, S9 = torch.ops.kimi.kda_step(q[:, 8], k[:, 8], v[:, 8], g[:, 8], beta[:, 8], S8, scale=0.3)
    assert rel_err(o9, o[:, 8]) < 1e-13 and rel_err(S9, S) < 1e-13


def test_scan_gradient_in_consumer_layout():
    """kimi.ops.delta_rule._scan under Inductor's decompositions when the gradient of the stacked outputs arrives in the
    consumer's layout (here [B, T, H, V] seen as [N, B, H, C, V], as KDA's o is). torch 2.13's scan backward
    replays a step graph traced for contiguous gradients; without `_ContiguousGrad` this fails with "Cannot view
    a tensor with shape [2, 3, 16, 8] and strides ..."."""
    from kimi.ops.delta_rule import _scan

    def f(S, xs, probe):
        def step(S, x):  # S [B, H, K, V], x = (a [B, H, C, K],): batched matmuls, as in KDA's hand-off
            a, = x
            return S * 0.9 + a.transpose(-1, -2) @ a, a @ S
        S, ys = _scan(step, S, (xs,))                                                      # ys [N, B, H, C, V]
        N, B, H, C, V = ys.shape
        return ((ys.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V) * probe).sum() + S.square().sum())

    S0, xs, probe = torch.randn(2, 3, 8, 8), torch.randn(2, 2, 3, 16, 8), torch.randn(2, 32, 3, 8)
    grads = []
    for fn in (torch.compile(f, fullgraph=True, backend="aot_eager_decomp_partition"), f):
        S, x = S0.clone().requires_grad_(), xs.clone().requires_grad_()
        fn(S, x, probe).backward()
        grads.append((S.grad, x.grad))
    assert rel_err(grads[0][0], grads[1][0]) < 1e-6 and rel_err(grads[0][1], grads[1][1]) < 1e-6


# ---------------------------------------------------------------------------------------------- whole model

@pytest.mark.parametrize("backend", [None, *BACKENDS[1:]])
def test_no_graph_breaks(params, backend):
    ids, doc = _batch()
    ex = torch._dynamo.explain(kimi.forward)(params, ids, CFG, backend, document_ids=doc)
    assert ex.graph_break_count == 0, [b.reason for b in ex.break_reasons]
    assert ex.graph_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_forward_backward_equals_eager(params, backend):
    """T = 100: two KDA chunks, the second right-padded, a document boundary inside the first; the indexer's top-k
    selections of the batch are not on a rounding tie."""
    ids, doc = _stable_batch(params, 2, 100)
    compiled = torch.compile(kimi.forward, fullgraph=True, backend="aot_eager_decomp_partition")
    out, grads = _loss_and_grads(params, ids, doc, backend, compiled)
    _assert_as_accurate_as_eager(params, ids, doc, backend, out, grads, out_tol=1e-6)


def test_inductor_forward_backward_equals_eager():
    """The traced chunk core (`kda="chunk"`: its chunk hand-off scan) through Inductor's generated code, the slow
    part of the suite (C++ compilation: the core alone, about half the time of the model; the whole model's graphs
    are captured above). T = 128 is two full KDA chunks: nothing is padded, so the gradient reaching the scan keeps
    the consumer's [B, T, H, V] layout; without `kimi.ops.delta_rule._ContiguousGrad` this fails to compile
    ("Cannot view a tensor with shape [2, 4, 64, 32] and strides (16384, 32, 128, 1) as (8, 64, 32)"). Document
    starts inside a chunk and at a chunk edge, an initial state. The loss and every input's gradient against float64
    eager: the compiled error at most ten times eager fp32's, plus 1e-6. Inductor's C++ is generated without SIMD
    (`cpp.vec_isa_ok`: the same graphs and fusions, each kernel's loops scalar), which compiles in half the time;
    the loss is summed in float64, since a scalar fp32 sum of its 32,768 terms in one thread (a pytest-xdist
    worker's) alone is 4e-6 off, where the core's outputs are not."""
    B, T, H, K, V = 2, 128, 4, 32, 32
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 42] = reset[1, 64] = True
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) for _ in range(2))
    x = [q, k, torch.randn(B, T, H, V, dtype=torch.float64), -5 * torch.rand(B, T, H, K, dtype=torch.float64),
         torch.rand(B, T, H, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)]
    probe = torch.randn(B, T, H, V, dtype=torch.float64)

    def loss(q, k, v, g, beta, S0, probe):
        o, S = kimi.ops.kda_core(q, k, v, g, beta, S0, reset, scale=K ** -0.5, backend=kimi.Backend(kda="chunk"))
        return (o.double() * probe.double()).sum() + S.double().square().sum()   # summed in float64 (docstring)

    def run(fn, dtype):
        xs = [t.to(dtype).requires_grad_() for t in x]
        out = fn(*xs, probe.to(dtype))
        out.backward()
        return [out.detach()] + [t.grad for t in xs]

    from torch._inductor import config as inductor_config
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        compiled = run(torch.compile(loss, fullgraph=True), torch.float32)
    eager, ref = run(loss, torch.float32), run(loss, torch.float64)
    for i, (c, e, r) in enumerate(zip(compiled, eager, ref)):
        assert rel_err(c, r) <= 10 * rel_err(e, r) + 1e-6, (i, rel_err(c, r), rel_err(e, r))


def _graphs_of(fn) -> int:
    """Compiled graphs Dynamo holds for fn's code object (one per guard set)."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


@pytest.mark.parametrize("attn", ["auto", "gather"])
def test_recompiles_are_bounded_over_lengths_and_batches(params, attn):
    """With dynamic=True one graph serves every batch size > 1 and every length above one KDA chunk; the two
    0/1 specializations (batch 1, a single 64-token chunk) add one graph each, not one per length. Recompiles are
    Dynamo's decision (its guards), so Dynamo's `eager` backend counts them without paying for AOT tracing;
    compiled == eager through AOT and Inductor is tested above. 'gather' passes the length as its ranges' span:
    it stays symbolic (a SymInt in the op's schema)."""
    compiled = torch.compile(kimi.forward, fullgraph=True, dynamic=True, backend="eager")
    backend = kimi.Backend(attn=attn, kda="chunk")   # the scan over chunks, whose length stays symbolic

    def check(B, T):
        ids, doc = _batch(B, T)
        with torch.no_grad():
            want = kimi.forward(params, ids, CFG, backend, document_ids=doc)
            assert rel_err(compiled(params, ids, CFG, backend, document_ids=doc), want) < 1e-5

    for B, T in [(2, 70), (3, 101), (2, 130), (4, 81)]:
        check(B, T)
    assert _graphs_of(kimi.forward) == 1
    check(1, 90)
    check(1, 77)
    assert _graphs_of(kimi.forward) == 2


@pytest.mark.parametrize("depth, block, graphs", [(8, 3, 6), (12, 2, 6)])
def test_compile_layers_reuses_graphs_across_layers(depth, block, graphs):
    """Regional compilation: layers with the same plan share a graph, the count of closed attention-residual
    entries (a stacked tensor) being dynamic from 2 on: tiny's 8 layers make 6 graphs; 12 layers in blocks of 2
    also make 6 where a static count would make 12. The result equals eager, gradients included. Dynamo's `eager`
    backend is enough to count graphs; what AOT and Inductor do with `layer_step` is tested above (the whole
    forward traces the same function)."""
    from kimi.config import scaled
    from kimi.model import compile_layers, layer_plan, layer_step

    cfg = dataclasses.replace(scaled(tiny(), num_layers=depth), attn_res_block_size=block)
    params = kimi.init_params(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    doc = torch.cat([torch.zeros(2, 15, dtype=torch.long), torch.ones(2, 25, dtype=torch.long)], 1)
    leaves = [leaf for _, leaf in kimi.params.tree_items(params) if leaf.requires_grad]

    def run(fn):
        for leaf in leaves:
            leaf.grad = None
        out = fn(params, ids, cfg, document_ids=doc)
        out.float().logsumexp(-1).mean().backward()
        return out.detach(), [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]

    out, grads = run(compile_layers(fullgraph=True, dynamic=False, backend="eager"))
    ref, ref_grads = run(kimi.forward)
    assert rel_err(out, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None) and (g is None or rel_err(g, r) < 1e-5)
    n_closed, signatures = 0, set()
    for i in range(cfg.num_hidden_layers):
        plan = layer_plan(cfg, i)
        signatures.add((plan, min(n_closed, 2)))
        n_closed += plan[2]
    assert _graphs_of(layer_step) == len(signatures) == graphs


def test_compile_options_inductor_workaround(monkeypatch):
    """Before torch 2.13 Inductor's mix-order reduction miscompiles an RMSNorm backward whose row count is
    symbolic (the stacked-R count compile_layers marks dynamic): kimi.compile_options (used by compile_layers and
    train.py) switches it off there, folding a `mode` into the options (torch.compile takes one or the other);
    other backends and newer torch are untouched."""
    import kimi.model as model
    monkeypatch.setattr(model, "_torch_version", lambda: (2, 11))
    got = kimi.compile_options(fullgraph=True, mode="max-autotune-no-cudagraphs")
    assert got == {"fullgraph": True, "options": {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"),
                                                  "triton.mix_order_reduction": False}}
    assert kimi.compile_options(options={"triton.mix_order_reduction": True}) == \
        {"options": {"triton.mix_order_reduction": True}}           # an explicit choice wins
    assert kimi.compile_options(backend="eager") == {"backend": "eager"}
    monkeypatch.setattr(model, "_torch_version", lambda: (2, 13))
    assert kimi.compile_options(mode="reduce-overhead") == {"mode": "reduce-overhead"}
