"""On a CUDA device: the model agrees with the CPU float64 reference, and the compiled model with eager.
Marked `gpu`: skipped without CUDA (conftest), run on the H200 through the device tool."""

import pytest
import torch

import kimi
from helpers import rel_err, tiny
from kimi.config import scaled

pytestmark = pytest.mark.gpu


def test_cuda_forward_matches_cpu_float64():
    cfg = kimi.preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 100))
    ref = kimi.forward(kimi.init_params(cfg, seed=0, dtype="float64"), ids, cfg,
                       kimi.Backend(attn="eager", kda="chunk", moe="dense"))
    p32 = kimi.init_params(cfg, seed=0, dtype="float32", device="cuda")
    for backend in (kimi.Backend(kda="chunk"), kimi.Backend(),
                    kimi.Backend(attn="eager", kda="recurrent", mla_form="absorbed")):
        out = kimi.forward(p32, ids.cuda(), cfg, backend)
        assert rel_err(out.cpu(), ref) < 1e-3      # TF32 matmuls may be on; fp32 CPU is tested at 1e-4


@pytest.mark.parametrize("kda", ["chunk", "chunk_triton"])
def test_cuda_compiled_forward_backward_equals_eager(kda):
    """float32 with TF32 off, every expert and every key selected: fused and unfused code round differently, and
    where a routing or top-k choice is near a tie that flips a discrete decision (measured 2.3e-3 on the tiny
    preset at T=256), which would hide real errors. The selection paths are compared exactly on the CPU."""
    cfg = scaled(tiny(index_topk=256, num_experts_per_token=8), num_layers=4)   # 3 KDA + 1 MLA: every kind,
                                                                                  # half the compile time
    params = kimi.init_params(cfg, seed=0, dtype="float32", device="cuda")
    leaves = [p for _, p in kimi.params.tree_items(params) if p.requires_grad]
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")

    backend = kimi.Backend(kda=kda)

    def run(fn):
        for p in leaves:
            p.grad = None
        out = fn(params, ids, cfg, backend)
        out.float().logsumexp(-1).mean().backward()
        return out.detach(), [p.grad for p in leaves if p.grad is not None]

    torch._dynamo.reset()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        out, grads = run(torch.compile(kimi.forward, fullgraph=True))
        ref, ref_grads = run(kimi.forward)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert rel_err(out, ref) < 1e-4 and len(grads) == len(ref_grads)
    assert max(rel_err(g, r) for g, r in zip(grads, ref_grads)) < 1e-3


@pytest.mark.parametrize("inductor", [False, True])
def test_generate_decode_cuda_graph_equals_eager(inductor):
    """kimi.generation's compiled decode (generate.py's): layers compiled per kind, the whole step captured as one
    CUDA graph and replayed. Each replay's logits equal eager decode on a copy of the cache, the cache advances once
    per call (the warm-up that compiles runs on a scratch copy), and a greedy generate() gives the eager tokens.
    Dynamo's eager backend isolates the capture logic; Inductor adds the generated kernels."""
    from kimi import generation as gen
    from kimi.config import KDAConfig
    cfg = tiny(num_hidden_layers=2, attn_res_block_size=1, index_topk=4, index_rope_dim=8,
               linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,), full_attn_layers=(2,)))
    torch._dynamo.reset()
    params = kimi.init_params(cfg, seed=0, device="cuda")
    backend = kimi.Backend(mla_form="absorbed", kda="chunk_opaque")
    prefill, decode = gen.make_steps(cfg, backend, True, {} if inductor else {"backend": "eager"})
    cache = kimi.init_cache(cfg, 2, 16, device="cuda", start=torch.tensor([0, 3]))
    prefill(params, torch.randint(0, 256, (2, 6), device="cuda"), cache)
    ref = kimi.clone_cache(cache)
    for i in range(4):
        tok = torch.randint(0, 256, (2, 1), device="cuda")
        out = decode(params, tok, cache).clone()
        want, ref = kimi.forward(params, tok, cfg, backend, cache=ref)
        assert int(cache["pos"]) == 7 + i
        assert rel_err(out, want[:, -1].float()) < 1e-4
    assert decode.graph is not None and decode.pos[2] == int(cache["pos"]) == 10    # the host copy kept up
    cache["pos"].fill_(16)                      # written outside the graph: the next call re-reads it
    with pytest.raises(kimi.CacheError, match="cache overflow"):
        decode(params, tok, cache)
    cache["pos"].fill_(15)
    decode(params, tok, cache)
    assert int(cache["pos"]) == decode.pos[2] == 16
    if not inductor:   # an inference-mode cache has no version counter: pos is read every call
        with torch.inference_mode():
            icache = kimi.init_cache(cfg, 2, 8, device="cuda", start=torch.tensor([0, 3]))
            prefill(params, torch.randint(0, 256, (2, 6), device="cuda"), icache)
            for _ in range(2):
                decode(params, tok, icache)
            assert int(icache["pos"]) == 8 and decode.pos is None
            with pytest.raises(kimi.CacheError, match="cache overflow"):
                decode(params, tok, icache)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (9, 4)]
    greedy = gen.Sampling(temperature=0)
    want = gen.generate(params, cfg, prompts, max_new_tokens=5, sampling=greedy, backend=backend)
    got = gen.generate(params, cfg, prompts, max_new_tokens=5, sampling=greedy, backend=backend, compile=True,
                       steps=gen.make_steps(cfg, backend, True, {} if inductor else {"backend": "eager"}))
    assert got.tokens == want.tokens
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_head_loss_equals_float64(dtype):
    """The blockwise head loss (kimi/loss.py) on a GPU, where each block's softmax statistics and logits gradient
    are generated kernels (compiled, dynamic block width and offset): loss and both gradients against float64
    cross-entropy, logits kept and recomputed, ragged last block, ignored rows."""
    from kimi.loss import IGNORE, token_loss_sum
    N, D, V = 300, 64, 1000
    h = torch.randn(N, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (N,))
    labels[::7] = IGNORE
    labels[1], labels[2] = 0, V - 1
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, ignore_index=IGNORE, reduction="sum")
    (want / N).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for keep_logits in (0, N * V):
        hd = h.to("cuda", dtype).requires_grad_()
        wd = w.to("cuda", dtype).requires_grad_()
        # blocks of 256 words (not N: Dynamo would specialize on width == rows) and a ragged last one of 232
        got = token_loss_sum(hd[None], wd, labels.cuda()[None], block_logits=N * 256, keep_logits=keep_logits)
        (got / N).backward()
        assert got.dtype == torch.float32 and rel_err(got.cpu(), want) < max(tol, 1e-6)
        assert rel_err(hd.grad.cpu(), h64.grad) < tol and rel_err(wd.grad.cpu(), w64.grad) < tol


def test_cuda_gather_path_matches_float64_at_real_widths():
    """The range-based path on the GPU at K3.1's attention widths (96 heads, 576-wide latent, top-2048 of 6,144
    keys in blocks of 1,024 queries): the indexer's selection overlaps the float64 one by >= 0.97 (bf16 inputs,
    fp32 scores), and the gathering attention (forward, LSE, both gradients) on that selection matches float64."""
    from kimi.ops import lightning_index
    T, H, D, d_v, n, d, k = 6144, 96, 576, 512, 64, 128, 2048
    dev = "cuda"
    qi, ki = torch.randn(1, T, n, d, device=dev).bfloat16(), torch.randn(1, T, d, device=dev).bfloat16()
    wi = torch.randn(1, T, n, device=dev) * (n * d) ** -0.5
    t = torch.arange(T, device=dev)[None]
    lo, hi = torch.zeros_like(t), t + 1
    idx = lightning_index.indexer_topk_blocked(qi, ki, wi, lo, hi, topk=k, causal=True)
    ref = lightning_index.indexer_topk_blocked(qi.double(), ki.double(), wi.double(), lo, hi, topk=k,
                                               causal=True)
    hit = torch.zeros(1, T, T + 1, dtype=torch.bool, device=dev)
    hit.scatter_(-1, torch.where(ref >= 0, ref, T).long(), True)
    common = hit[..., :T].gather(-1, idx.clamp(min=0).long()) & (idx >= 0)
    overlap = common.sum(-1) / (ref >= 0).sum(-1)
    assert overlap.mean() >= 0.97 and bool(((idx >= 0).sum(-1) == (ref >= 0).sum(-1)).all())

    q = torch.randn(1, T, H, D, device=dev).bfloat16().requires_grad_()
    latent = torch.randn(1, T, D, device=dev).bfloat16().requires_grad_()
    do = torch.randn(1, T, H, d_v, device=dev).bfloat16()
    results = []
    for qq, cc in ((q, latent), (q.detach().double().requires_grad_(), latent.detach().double().requires_grad_())):
        o, lse = torch.ops.kimi.sparse_mla_gather(qq, cc, idx, scale=192 ** -0.5, d_v=d_v)
        dq, dc = torch.autograd.grad((o * do.to(o.dtype)).sum(), (qq, cc))
        results.append((o, lse, dq, dc))
    for got, want in zip(*results):
        assert rel_err(got, want) < 1e-2, (rel_err(got, want))
