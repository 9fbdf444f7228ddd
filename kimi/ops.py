"""The backend dispatch points: the one place where implementations plug in.

Each backend-dependent computation is one function here that picks the implementation named by `Backend`.
The lookup is plain Python on a frozen config, so under `torch.compile` it is resolved at trace time.
Nothing falls back silently: a backend that cannot run the given inputs raises.

| op             | backends                                   | defined by (the reference)         |
|----------------|--------------------------------------------|------------------------------------|
| `kda_core`     | recurrent, chunk                           | `kda.kda_recurrent`                |
| `indexer_topk` | torch                                      | `indexer.indexer_topk_reference`   |
| `sparse_mla`   | eager, sdpa  x  expanded, absorbed         | `mla.sparse_mla_eager` (expanded)  |
| `moe_experts`  | dense, grouped                             | `moe.experts_dense`                |
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import indexer, kda, mla, moe
from .config import Backend


def kda_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float, backend: Backend,
             initial_state: Tensor | None = None, reset: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The KDA delta-rule recurrence (KDA.md §7). q, k [B, T, H, K] (already L2-normalized), v [B, T, H, V],
    g [B, T, H, K] log-decay, beta [B, T, H], reset [B, T] bool (state zeroed before token t).
    Returns o [B, T, H, V] in v's dtype and the final state [B, H, K, V] (fp32, or fp64 for fp64 inputs)."""
    fn = {"recurrent": kda.kda_recurrent, "chunk": kda.kda_chunk}[backend.kda]
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, reset=reset)


def indexer_topk(scores: Tensor, valid: Tensor, topk: int, backend: Backend) -> Tensor:
    """Top-k key positions per query from fp32 index scores [B, T, S] and a candidate mask [B, T, S].
    Returns int32 [B, T, topk]: valid entries ascending, then -1 (DSA.md §3.5)."""
    return indexer.topk_reference(scores, valid, topk)


def sparse_mla(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, seg: Tensor, topk_idx: Tensor | None, *, cfg,
               backend: Backend) -> Tensor:
    """Gated MLA's attention over the selected keys (DSA.md §4): q [B, T, H, d_qk], latent c [B, S, R],
    k_pe [B, S, d_r], kv_b_proj weight, document run ids seg [B, T], top-k [B, T, k] or None (all visible keys).
    Returns o [B, T, H, d_v]. See `mla.sparse_mla`."""
    return mla.sparse_mla(q, c, k_pe, kv_b, seg, topk_idx, cfg=cfg, attn=backend.attn, form=backend.mla_form)


def moe_experts(z: Tensor, idx: Tensor, weight: Tensor, experts: dict, *, cfg, backend: Backend) -> Tensor:
    """Routed latent experts with post-down-projection weighting (MODEL.md §6.4). z [N, Z], idx [N, k] int64,
    weight [N, k] fp32. Returns the weighted sum [N, Z] in z's dtype."""
    fn = {"dense": moe.experts_dense, "grouped": moe.experts_grouped}[backend.moe]
    return fn(z, idx, weight, experts, cfg=cfg)
