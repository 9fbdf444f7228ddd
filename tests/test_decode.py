"""The decode cache (kimi/cache.py) and the cached path of `kimi.forward`.

Contracts: prefill + decode steps == the full forward at every step; chunked prefill (uneven chunks, chunks of
padding only, T = 1 chunks) == one-shot prefill, logits and cache contents; a left-padded batch of unequal
prompts == each prompt alone (prefill and decode); a decode step compiles with fullgraph=True and does not
recompile as pos advances; bad caches get a CacheError. The tiny model runs with index_topk = 4, below every
sequence length used, and indexer RoPE on, so the indexer's selection and positions matter (checked).
Float64 comparisons are near-exact (observed ~3e-15); float32 ones see ~1e-7.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kimi
from helpers import rel_err, tiny
from kimi.cache import CacheError
from kimi.config import KDAConfig

# 4 layers (KDA, MLA, KDA, MLA) keep every kind of layer, an attention-residual block boundary (blocks of 3) and
# the dense first layer, at half the cost of the 8-layer preset.
CFG = tiny(num_hidden_layers=4, index_topk=4, index_rope_dim=8,
           linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1, 3), full_attn_layers=(2, 4)))
F64 = [kimi.Backend(attn="eager", mla_form="expanded", kda="recurrent", moe="dense"),
       kimi.Backend(mla_form="absorbed", kda="chunk", moe="dense"),
       kimi.Backend(attn="gather", kda="chunk", moe="dense")]
F64_IDS = ["eager-expanded-recurrent", "eager-absorbed-chunk", "gather-chunk"]
TOL64 = 1e-12


@pytest.fixture(scope="module")
def params64():
    return kimi.init_params(CFG, seed=0, dtype="float64")


def _ids(B, T, cfg=CFG):
    return torch.randint(0, cfg.vocab_size, (B, T))


def _cache_leaves(cache):
    return [cache["pos"], cache["start"], *(t for layer in cache["layers"] for t in layer.values())]


def test_selection_matters(params64):
    """Guard for the tests below: with index_topk = 4 the indexer changes the logits of a 13-token sequence."""
    ids = _ids(1, 13)
    sparse = kimi.forward(params64, ids, CFG, F64[0])
    dense = kimi.forward(params64, ids, dataclasses.replace(CFG, index_topk=64), F64[0])
    assert rel_err(sparse[:, 4:], dense[:, 4:]) > 1e-3
    assert rel_err(sparse[:, :4], dense[:, :4]) < TOL64      # up to 4 keys everything is selected


@pytest.mark.parametrize("backend", F64, ids=F64_IDS)
def test_prefill_then_decode_equals_forward(params64, backend):
    B, T0, N = 2, 7, 6
    ids = _ids(B, T0 + N)
    full = kimi.forward(params64, ids, CFG, backend)
    cache = kimi.init_cache(CFG, B, 16, dtype=torch.float64)
    logits, cache = kimi.forward(params64, ids[:, :T0], CFG, backend, cache=cache)
    errs = [rel_err(logits, full[:, :T0])]
    for t in range(T0, T0 + N):
        logits, cache = kimi.forward(params64, ids[:, t:t + 1], CFG, backend, cache=cache)
        assert logits.shape == (B, 1, CFG.vocab_size)
        errs.append(rel_err(logits, full[:, t:t + 1]))
    print("prefill + decode vs forward, float64:", max(errs))
    assert max(errs) < TOL64
    assert int(cache["pos"]) == T0 + N


def test_prefill_then_decode_float32_default_backend():
    """The default backend (sdpa, expanded, chunked KDA, grouped experts) in float32."""
    params = kimi.init_params(CFG, seed=1)
    B, T0, N = 2, 6, 4
    ids = _ids(B, T0 + N)
    full = kimi.forward(params, ids, CFG)
    cache = kimi.init_cache(CFG, B, T0 + N)
    out, cache = kimi.forward(params, ids[:, :T0], CFG, cache=cache)
    steps = [out]
    for t in range(T0, T0 + N):
        out, cache = kimi.forward(params, ids[:, t:t + 1], CFG, cache=cache)
        steps.append(out)
    err = rel_err(torch.cat(steps, 1), full)
    print("prefill + decode vs forward, float32:", err)
    assert err < 1e-5


@pytest.mark.skipif(kimi.ops.registry.triton is None, reason="triton is not installed")
def test_prefill_then_decode_on_kda_triton():
    """Backend(kda='triton') (the Triton chunked forward for the prefill from the cache, then the fused decode
    kernel: convs, norms and the step in one launch, the cache updated in place; on the CPU through Triton's
    interpreter) against kda='chunk', float32, left-padded rows (the row starts reach the convs and the state):
    logits at every step and every cache buffer, to fp32 rounding."""
    params = kimi.init_params(CFG, seed=1)
    B, T0, N = 2, 6, 3
    ids, start = _ids(B, T0 + N), torch.tensor([0, 2])
    outs, caches = [], []
    for kda in ("triton", "chunk"):
        backend = kimi.Backend(attn="gather", kda=kda, moe="dense")
        cache = kimi.init_cache(CFG, B, T0 + N, start=start)
        out, cache = kimi.forward(params, ids[:, :T0], CFG, backend, cache=cache)
        steps = [out]
        for t in range(T0, T0 + N):
            out, cache = kimi.forward(params, ids[:, t:t + 1], CFG, backend, cache=cache)
            steps.append(out)
        outs.append(torch.cat(steps, 1))
        caches.append(cache)
    real = torch.arange(T0 + N)[None, :] >= start[:, None]
    err = rel_err(outs[0][real], outs[1][real])
    cache_err = max(rel_err(a, b) for a, b in zip(_cache_leaves(caches[0]), _cache_leaves(caches[1])))
    print("kda='triton' vs 'chunk', prefill + decode, float32: logits", err, "cache", cache_err)
    assert err < 1e-5 and cache_err < 1e-5


def test_chunked_prefill_equals_one_shot(params64):
    """Uneven chunks, a chunk of padding only (row 1 starts at slot 5), a T = 1 chunk (the kda_step path) and
    chunks shorter than the conv width; logits and every cache buffer agree with one prefill call."""
    backend = F64[1]
    B, T = 2, 12
    ids, start = _ids(B, T), torch.tensor([0, 5])
    one = kimi.init_cache(CFG, B, 14, dtype=torch.float64, start=start)
    ref, one = kimi.forward(params64, ids, CFG, backend, cache=one)
    chunked = kimi.init_cache(CFG, B, 14, dtype=torch.float64, start=start)
    outs, t = [], 0
    for n in (2, 1, 5, 4):
        out, chunked = kimi.forward(params64, ids[:, t:t + n], CFG, backend, cache=chunked)
        outs.append(out)
        t += n
    real = torch.arange(T)[None, :] >= start[:, None]          # logits of padding slots are meaningless
    err = rel_err(torch.cat(outs, 1)[real], ref[real])
    cache_err = max(rel_err(a, b) for a, b in zip(_cache_leaves(chunked), _cache_leaves(one)))
    print("chunked vs one-shot prefill, float64: logits", err, "cache", cache_err)
    assert err < TOL64 and cache_err < TOL64
    assert int(chunked["pos"]) == T


@pytest.mark.parametrize("backend", [F64[0], F64[2]], ids=[F64_IDS[0], F64_IDS[2]])
def test_unequal_prompts_equal_each_alone(params64, backend):
    prompts = [_ids(1, n)[0].tolist() for n in (3, 10, 6)]
    ids, start = kimi.left_pad(prompts, CFG.pad_token_id)
    assert start.tolist() == [7, 0, 4] and ids[0, :7].eq(CFG.pad_token_id).all()
    N = 4
    nxt = _ids(len(prompts), N)
    cache = kimi.init_cache(CFG, len(prompts), 16, dtype=torch.float64, start=start)
    batch_prefill, cache = kimi.forward(params64, ids, CFG, backend, cache=cache)
    batch_steps = []
    for j in range(N):
        out, cache = kimi.forward(params64, nxt[:, j:j + 1], CFG, backend, cache=cache)
        batch_steps.append(out)
    batch_steps = torch.cat(batch_steps, 1)
    errs = []
    alone = kimi.init_cache(CFG, 1, 16, dtype=torch.float64)
    for b, p in enumerate(prompts):
        kimi.reset_cache(alone)                                   # one buffer reused across prompts
        ref, alone = kimi.forward(params64, torch.tensor([p]), CFG, backend, cache=alone)
        errs.append(rel_err(batch_prefill[b, int(start[b]):], ref[0]))
        for j in range(N):
            ref, alone = kimi.forward(params64, nxt[b:b + 1, j:j + 1], CFG, backend, cache=alone)
            errs.append(rel_err(batch_steps[b, j], ref[0, 0]))
    print("left-padded batch vs each prompt alone, float64:", max(errs))
    assert max(errs) < TOL64
    assert torch.isfinite(batch_prefill).all()


# ---------------------------------------------------------------------------------------------- compile

CFG2 = tiny(num_hidden_layers=2, attn_res_block_size=1, index_topk=4, index_rope_dim=8,
            linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,), full_attn_layers=(2,)))


@pytest.mark.parametrize("attn, kda", [("eager", "chunk"), ("gather", "chunk"), ("gather", "triton"),
                                       ("triton", "chunk")])
def test_decode_step_compiles_fullgraph(attn, kda):
    """One graph for a decode step (fullgraph=True: a graph break raises), no recompile as pos advances, and the
    compiled step equals eager. Left-padded rows, so the row starts are live; with index_topk = 4 below the cache's
    length, so the indexer selects. kda='triton': the fused decode kernel, an op that writes the cache in place;
    attn='triton': the Triton indexer's split decode path and sparse attention over the cache (what `auto` takes
    for long caches on a GPU)."""
    if "triton" in (attn, kda) and kimi.ops.registry.triton is None:
        pytest.skip("triton is not installed")
    torch._dynamo.reset()
    params = kimi.init_params(CFG2, seed=0)
    backend = kimi.Backend(attn=attn, mla_form="absorbed", kda=kda, moe="dense")
    B = 2
    start = torch.tensor([0, 3])
    cache = kimi.init_cache(CFG2, B, 12, start=start)
    _, cache = kimi.forward(params, _ids(B, 6, CFG2), CFG2, backend, cache=cache)
    ref = kimi.clone_cache(cache)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(kimi.forward, fullgraph=True, backend=counter)
    try:
        for j in range(3):
            tok = _ids(B, 1, CFG2)
            out, cache = step(params, tok, CFG2, backend, cache=cache)
            want, ref = kimi.forward(params, tok, CFG2, backend, cache=ref)
            assert rel_err(out, want) < 1e-6
            if j == 0:
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(_cache_leaves(cache), _cache_leaves(ref)))
    assert int(cache["pos"]) == 9


@pytest.mark.gpu
@pytest.mark.parametrize("kda", ["chunk", "triton"])
def test_decode_step_cuda_graphs(kda):
    """On CUDA: the decode step under mode="reduce-overhead" (CUDA graphs) with static cache buffers, replayed,
    equals eager, with no cudagraph skips (kda='triton': the fused decode kernel writing the cache in place)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    params = kimi.init_params(CFG2, seed=0, device="cuda")
    backend = kimi.Backend(mla_form="absorbed", kda=kda, moe="dense")
    B = 2
    cache = kimi.init_cache(CFG2, B, 16, device="cuda", start=torch.tensor([0, 3]))
    _, cache = kimi.forward(params, _ids(B, 6, CFG2).cuda(), CFG2, backend, cache=cache)
    ref = kimi.clone_cache(cache)
    kimi.mark_static(cache)
    step = torch.compile(kimi.forward, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        tok = _ids(B, 1, CFG2).cuda()
        torch.compiler.cudagraph_mark_step_begin()
        out, cache = step(params, tok, CFG2, backend, cache=cache)
        out = out.clone()
        want, ref = kimi.forward(params, tok, CFG2, backend, cache=ref)
        assert rel_err(out, want) < 1e-4
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def small():
    return kimi.init_params(CFG2, seed=0)


@pytest.mark.parametrize("other, match", [
    (CFG, "cache has 4 layers, the model 2"),
    (dataclasses.replace(CFG2, kv_lora_rank=16), "layer 1 kv has shape"),
    (dataclasses.replace(CFG2, index_n_heads=None, index_head_dim=None, index_topk=None), "buffers"),
])
def test_cache_from_another_config(small, other, match):
    cache = kimi.init_cache(other, 1, 8)
    with pytest.raises(CacheError, match=match):
        kimi.forward(small, _ids(1, 2, CFG2), CFG2, cache=cache)


def test_cache_errors(small):
    ids = _ids(2, 5, CFG2)
    with pytest.raises(CacheError, match="batch 3, input_ids has batch 2"):
        kimi.forward(small, ids, CFG2, cache=kimi.init_cache(CFG2, 3, 8))
    with pytest.raises(CacheError, match="float64 activations, the parameters are torch.float32"):
        kimi.forward(small, ids, CFG2, cache=kimi.init_cache(CFG2, 2, 8, dtype=torch.float64))
    with pytest.raises(CacheError, match="document_ids"):
        kimi.forward(small, ids, CFG2, document_ids=torch.zeros_like(ids), cache=kimi.init_cache(CFG2, 2, 8))
    with pytest.raises(CacheError, match="no tokens"):
        kimi.forward(small, ids[:, :0], CFG2, cache=kimi.init_cache(CFG2, 2, 8))
    with pytest.raises(CacheError, match="kimi.init_cache"):
        kimi.forward(small, ids, CFG2, cache={"layers": []})
    # Overflow is refused before anything is written.
    cache = kimi.init_cache(CFG2, 2, 8)
    _, cache = kimi.forward(small, ids, CFG2, cache=cache)
    before = [t.clone() for t in _cache_leaves(cache)]
    with pytest.raises(CacheError, match=r"overflow: 5 slots used \+ 4 new tokens > max_len=8"):
        kimi.forward(small, ids[:, :4], CFG2, cache=cache)
    assert all(torch.equal(a, b) for a, b in zip(before, _cache_leaves(cache)))
    _, cache = kimi.forward(small, ids[:, :3], CFG2, cache=cache)   # exactly full is fine
    assert int(cache["pos"]) == 8


def test_setup_errors():
    with pytest.raises(CacheError, match="max_len must be a positive integer"):
        kimi.init_cache(CFG2, 1, 0)
    with pytest.raises(CacheError, match="batch must be a positive integer"):
        kimi.init_cache(CFG2, 0, 8)
    with pytest.raises(CacheError, match=r"start must lie in \[0, max_len=8\)"):
        kimi.init_cache(CFG2, 2, 8, start=torch.tensor([0, 8]))
    with pytest.raises(CacheError, match="integer tensor \\[2\\]"):
        kimi.init_cache(CFG2, 2, 8, start=torch.tensor([0, 1, 2]))
    with pytest.raises(CacheError, match="at least one token"):
        kimi.left_pad([[1, 2], []], 0)
