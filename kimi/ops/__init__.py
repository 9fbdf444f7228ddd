"""The op layer: every computation whose implementation `Backend` chooses, and the one table that maps choices to
implementations (docs/architecture.md#op-layer).

Each op family is one file holding its reference, its fast implementations and their registration as `kimi::` ops;
the layers (`kimi/kda.py`, `mla.py`, `indexer.py`, `moe.py`) call the functions below, and nothing here imports a
layer module.

| file                      | computes                               | ops (torch.ops.kimi.*)                        |
|---------------------------|----------------------------------------|-----------------------------------------------|
| delta_rule.py (+ _triton, | the KDA core: recurrence, step, chunks | kda_recurrent, kda_chunk, kda_chunk_opaque,   |
| kda_triton.py,            |                                        | kda_chunk_triton, kda_states, kda_step,       |
| kda_decode_triton.py)     |                                        | kda_triton (+_bwd), kda_decode_step           |
| lightning_index.py        | indexer scores and top-k, from ranges  | indexer_topk (blocked over queries),          |
| (+ indexer_triton.py)     |                                        | indexer_topk_triton (streaming top-k)         |
| sparse_attention.py       | attention over the selected keys       | sparse_mla_eager, _sdpa, _absorbed (dense     |
| (+ sparse_mla_triton.py)  |                                        | masks); sparse_mla_gathered (from ranges) on  |
|                           |                                        | sparse_mla_gather (+_bwd), the blocked        |
|                           |                                        | reference of the sparse kernels' contract;    |
|                           |                                        | sparse_mla_triton_ranges on sparse_mla_triton |
|                           |                                        | (+_bwd), that contract in Triton              |
| experts.py (+ _triton)    | routed experts, grouped matmuls        | moe_experts_dense, _grouped, _gemv,           |
|                           |                                        | grouped_mm, moe_gemv                          |

`resolve` is the one place an "auto" choice is made.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import BACKEND_CHECKS, Backend
from ..ranges import KeyRanges
from . import cudnn_dsa, delta_rule, experts, lightning_index, sparse_attention
from .registry import triton_available

IMPLEMENTATIONS: dict[str, dict] = {
    "kda": {
        "recurrent": torch.ops.kimi.kda_recurrent.default,
        "chunk": torch.ops.kimi.kda_chunk.default,
        "chunk_opaque": torch.ops.kimi.kda_chunk_opaque.default,
        "chunk_triton": torch.ops.kimi.kda_chunk_triton.default,
        "triton": torch.ops.kimi.kda_triton.default,
    },
    "attn": {   # keyed by (Backend.attn, Backend.mla_form)
        # the dense-mask references: (q, c, k_pe, kv_b, visible [B, T, S], topk_idx, *, scale)
        ("eager", "expanded"): torch.ops.kimi.sparse_mla_eager.default,
        ("sdpa", "expanded"): torch.ops.kimi.sparse_mla_sdpa.default,
        ("eager", "absorbed"): torch.ops.kimi.sparse_mla_absorbed.default,
        # from ranges, nothing of size T×S: (q, latent, kv_b, lo, hi, topk_idx, *, scale, span, causal, block)
        ("gather", "absorbed"): torch.ops.kimi.sparse_mla_gathered.default,
        ("triton", "absorbed"): torch.ops.kimi.sparse_mla_triton_ranges.default,
        ("cudnn", "absorbed"): torch.ops.kimi.sparse_mla_cudnn_ranges.default,     # (..., forward=sparse_fwd)
    },
    "moe": {
        "dense": torch.ops.kimi.moe_experts_dense.default,
        "grouped": torch.ops.kimi.moe_experts_grouped.default,
        "gemv": torch.ops.kimi.moe_experts_gemv.default,
    },
}
"""Backend field -> choice -> op. Every op of a field has the same signature (see the dispatch functions)."""

BACKEND_CHECKS["cudnn"] = lambda backend: cudnn_dsa.require(backend.sparse_fwd)

GEMV_MAX_TOKENS = 64
"""`moe="auto"` runs the gemv kernel for at most this many tokens (decoding), the grouped GEMM above."""

DENSE_MASK_MAX_KEYS = 32768
"""Without a cache and without the Triton kernels (a CPU, fp32) `attn="auto"` runs the dense-mask SDPA reference
for at most this many keys: up to 32K tokens it is faster than the torch 'gather' path and holds less memory
(docs/performance.md#sparse-attention); beyond, 'gather', and 'gather' whenever every candidate is attended (dense
attention over the ranges needs no T×T mask). Where the kernels run (a GPU, bf16/fp16) 'triton' is taken at every
length: its layer ties the dense mask at 2,048 tokens and is faster from there on."""

DENSE_MASK_MAX_SLOTS_CACHED = 8192
DENSE_MASK_MAX_PAIRS_CACHED = 1 << 24
"""With a cache the dense-mask reference is the absorbed form, whose fp32 scores are [B, H, T, S]: `attn="auto"`
keeps it for at most `DENSE_MASK_MAX_SLOTS_CACHED` cache slots and this many (query, key) pairs (decode steps over
short caches); otherwise (long caches, long prefill chunks) 'triton' on a GPU in bf16/fp16, else 'gather'."""

QUERY_BLOCK = 1024
"""Queries a block on the range-based paths (indexer scores and top-k, dense attention over the ranges)."""


def resolve(backend: Backend, *, device: torch.device, dtype: torch.dtype, tokens: int | None = None,
            cached: bool = False, queries: int | None = None, keys: int | None = None,
            every_candidate: bool = False, gate_lower_bound: float | None = None) -> Backend:
    """`backend` with every "auto" replaced by the implementation that runs here:

    - kda: on a CUDA device with Triton 'triton' (the Triton chunked kernels) for bf16 / fp16 activations and a
      bounded gate (`gate_lower_bound` ≥ `delta_rule.GATE_BOUND`), 'chunk_triton' for other gates and fp32 (not
      for float64); 'chunk_opaque' while torch.compile traces on a CPU (Inductor's CPU code generation for the
      traced chunk algebra takes minutes); else 'chunk'.
    - attn: 'triton' (a CUDA device with Triton, bf16 or fp16) without a cache at any length, with a cache for
      more than 8,192 slots or `DENSE_MASK_MAX_PAIRS_CACHED` (query, key) pairs; where the kernels do not run,
      'gather' without a cache for more than `DENSE_MASK_MAX_KEYS` keys and with a long cache as above; 'gather'
      when every candidate is attended (`every_candidate`: documents no longer than index_topk, or no indexer);
      all unless mla_form='expanded' is asked for. Otherwise 'sdpa' for the expanded form and 'eager' for the
      absorbed one.
    - sparse_fwd (attn='cudnn' only): 'flashmla' where FlashMLA imports, else 'triton'.
    - mla_form: 'absorbed' for attn='gather', 'triton' or 'cudnn' and with a decode cache (attention over the
      cached 576-wide latents, nothing re-expanded), 'expanded' without one (or with attn='sdpa').
    - moe: 'gemv' for at most `GEMV_MAX_TOKENS` tokens on a CUDA device with Triton; 'grouped' for
      float32/bfloat16; 'dense' otherwise.

    The facts are the call's: its device, activation dtype, routed tokens, whether it runs on a cache, its key
    count. Concrete choices are kept as given."""
    triton_here = device.type == "cuda" and triton_available(device)
    kda = backend.kda
    if kda == "auto":
        bounded = gate_lower_bound is not None and gate_lower_bound >= delta_rule.GATE_BOUND
        if triton_here and dtype in (torch.bfloat16, torch.float16) and bounded:
            kda = "triton"
        elif triton_here and dtype != torch.float64:
            kda = "chunk_triton"
        else:
            kda = "chunk_opaque" if device.type == "cpu" and torch.compiler.is_compiling() else "chunk"
    form, attn = backend.mla_form, backend.attn
    if attn == "auto" and form != "expanded" and keys is not None:
        # The Triton kernels beat the torch gather at every length measured, without a cache (an H200 layer) and
        # with one (prefill into a 131,072-token cache, decode steps against it), and the dense mask without a
        # cache from 2,048 tokens on (the layer, and training steps at 32K): docs/performance.md
        kernels = not every_candidate and triton_here and dtype in (torch.bfloat16, torch.float16)
        if cached:
            dense = keys <= DENSE_MASK_MAX_SLOTS_CACHED and (queries or 1) * keys <= DENSE_MASK_MAX_PAIRS_CACHED
        else:
            dense = keys <= DENSE_MASK_MAX_KEYS and not every_candidate and not kernels
        attn = attn if dense else ("triton" if kernels else "gather")
    if form == "auto":
        form = "absorbed" if attn in ("gather", "triton", "cudnn") or (cached and attn != "sdpa") else "expanded"
    sparse_fwd = backend.sparse_fwd
    if attn == "cudnn" and sparse_fwd == "auto":
        sparse_fwd = cudnn_dsa.default_forward()
    if attn == "auto":
        attn = "eager" if form == "absorbed" else "sdpa"
    moe = backend.moe
    if moe == "auto":
        grouped_dtype = dtype in (torch.float32, torch.bfloat16)
        if triton_here and grouped_dtype and tokens is not None and tokens <= GEMV_MAX_TOKENS:
            moe = "gemv"
        else:
            moe = "grouped" if grouped_dtype else "dense"
    return Backend(attn=attn, mla_form=form, kda=kda, moe=moe, sparse_fwd=sparse_fwd)


# ---------------------------------------------------------------------------------------------- dispatch points

def kda_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
             reset: Tensor | None = None, *, scale: float, backend: Backend,
             gate_lower_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """The KDA delta rule over a sequence (docs/numerics.md#kda-recurrence). q, k [B, T, H, K] (L2-normalized),
    v [B, T, H, V], g [B, T, H, K] log-decay, beta [B, T, H], initial_state [B, H, K, V] or None, reset [B, T]
    bool (state zeroed before token t); `gate_lower_bound`: the bound the gate guarantees (g ≥ it), which
    kda='triton' needs (≥ `delta_rule.GATE_BOUND`). Returns o [B, T, H, V] in v's dtype and the final state
    [B, H, K, V] (fp32, or fp64 for fp64 inputs)."""
    kda = resolve(backend, device=q.device, dtype=q.dtype, gate_lower_bound=gate_lower_bound).kda
    if kda == "triton" and (gate_lower_bound is None or gate_lower_bound < delta_rule.GATE_BOUND):
        raise ValueError(f"Backend(kda='triton') needs the bounded gate, log-decays >= {delta_rule.GATE_BOUND} "
                         f"(linear_attn_config.gate_lower_bound), got a lower bound of {gate_lower_bound}; use "
                         "kda='chunk_triton' for unbounded gates")
    return IMPLEMENTATIONS["kda"][kda](q, k, v, g, beta, initial_state, reset, scale=scale)


def kda_decode_fused(backend: Backend, *, device: torch.device, dtype: torch.dtype,
                     gate_lower_bound: float | None = None) -> bool:
    """Whether a KDA layer's cached one-token step runs as `kimi::kda_decode_step` (convs, norms and the
    recurrence in one launch, the cache updated in place): where `backend` resolves to kda='triton'."""
    return resolve(backend, device=device, dtype=dtype, gate_lower_bound=gate_lower_bound).kda == "triton"


def kda_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
             scale: float) -> tuple[Tensor, Tensor]:
    """One decode token of the delta rule: q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V] ->
    (o [B, H, V], new state), both in the compute dtype; `state` is not modified."""
    return torch.ops.kimi.kda_step.default(q, k, v, g, beta, state, scale=scale)


def indexer_topk(q: Tensor, k: Tensor, w: Tensor, ranges: KeyRanges, *, topk: int,
                 backend: Backend | None = None) -> Tensor:
    """Indexer scores and top-k (docs/numerics.md#top-k): q [B, T, n, d], k [B, S, d], w [B, T, n] (scales
    folded in), the queries' candidate ranges. Returns int32 [B, T, topk]: valid key positions ascending, then -1.
    With attn="cudnn" cuDNN's scores and top-k (a bounded dense buffer); where `backend` resolves to
    attn="triton" (asked for, or "auto" on long rows: `resolve`) the Triton kernel (streaming top-k, no score
    buffer; not for float64), else the blocked torch op, queries in blocks of `QUERY_BLOCK` (no T×S score buffer
    either)."""
    kernels = backend is not None and q.dtype != torch.float64 and resolve(
        backend, device=q.device, dtype=q.dtype, cached=not ranges.causal, queries=q.shape[1], keys=k.shape[1]
    ).attn == "triton"      # "auto" too: the rule that sends the attention to the Triton kernels
    if backend is not None and backend.attn == "cudnn":
        return torch.ops.kimi.indexer_topk_cudnn.default(q, k, w, ranges.lo, ranges.hi, topk=topk,
                                                         causal=ranges.causal)
    if kernels:
        return torch.ops.kimi.indexer_topk_triton.default(q, k, w, ranges.lo, ranges.hi, topk=topk,
                                                          causal=ranges.causal)
    return torch.ops.kimi.indexer_topk.default(q, k, w, ranges.lo, ranges.hi, topk=topk, causal=ranges.causal,
                                               block=QUERY_BLOCK)


def sparse_mla(q: Tensor, latent: Tensor, kv_b: Tensor, ranges: KeyRanges, topk_idx: Tensor | None, *,
               scale: float, backend: Backend) -> Tensor:
    """Gated MLA's attention over the selected keys (docs/numerics.md#sparse-attention): q [B, T, H, d_n + d_r],
    latent [B, S, R + d_r] = [c ; k_pe] (with a cache, the cache's buffer), the kv_b_proj weight [H·(d_n + d_v), R],
    the queries' candidate ranges, topk_idx int32 [B, T, k] or None (every candidate). Returns o [B, T, H, d_v].
    The dense-mask references get c and k_pe as views and the ranges as a [B, T, S] mask."""
    S, R = latent.shape[1], kv_b.shape[1]
    b = resolve(backend, device=q.device, dtype=q.dtype, cached=not ranges.causal, queries=q.shape[1], keys=S,
                every_candidate=topk_idx is None)
    fn = IMPLEMENTATIONS["attn"][b.attn, b.mla_form]
    if b.attn in ("gather", "triton", "cudnn"):
        extra = dict(forward=b.sparse_fwd) if b.attn == "cudnn" else {}
        return fn(q, latent, kv_b, ranges.lo, ranges.hi, topk_idx, scale=scale, span=ranges.span,
                  causal=ranges.causal, block=QUERY_BLOCK, **extra)
    return fn(q, latent[..., :R], latent[..., R:], kv_b, ranges.mask(S), topk_idx, scale=scale)


def moe_experts(z: Tensor, idx: Tensor, weight: Tensor, experts: dict, *, beta: float, beta_lin: float | None,
                backend: Backend) -> Tensor:
    """Routed latent experts weighted after their down projection (docs/numerics.md#latent-moe-combine): z [N, Z],
    idx [N, k] int64, weight [N, k] fp32, experts {w1, w3: [E, m, Z], w2: [E, Z, m]} -> [N, Z] in z's dtype."""
    moe = resolve(backend, device=z.device, dtype=z.dtype, tokens=z.shape[0]).moe
    return IMPLEMENTATIONS["moe"][moe](z, idx, weight, experts["w1"], experts["w2"], experts["w3"], beta=beta,
                                       beta_lin=beta_lin)
