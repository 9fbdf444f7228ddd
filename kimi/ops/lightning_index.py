"""The lightning indexer's scores and top-k selection (docs/numerics.md#indexer-scores, #top-k).

    I[b, t, s] = Σ_j w[b, t, j] · ReLU(<q[b, t, j], k[b, s]>)       fp32 accumulation (fp64 for fp64)

The selection contract every implementation keeps: int32 [B, T, topk]; row t holds min(topk, #candidates) key
positions ascending, then -1; every candidate when there are at most topk; ties go to the smaller position. Hard
top-k has no gradient: the op runs on detached inputs under no_grad (the indexer is frozen).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import compute_dtype
from .registry import traceable


def scores(q: Tensor, k: Tensor, w: Tensor, *, max_logits: int = 1 << 28) -> Tensor:
    """Index scores [B, T, S] from q [B, T, n, d], k [B, S, d], w [B, T, n] (scales folded in).

    The per-head logits [B, T, n, S] are formed for at most `max_logits` at a time (blocks of queries): whole, they
    would be the largest fp32 buffer of a training step."""
    ct = compute_dtype(w.dtype)
    B, T, n, _ = q.shape
    rows = max(1, max_logits // max(1, B * n * k.shape[1]))

    def block(qb: Tensor, wb: Tensor) -> Tensor:
        return torch.einsum("btns,btn->bts", torch.einsum("btnd,bsd->btns", qb.to(ct), k.to(ct)).relu(), wb.to(ct))
    if T <= rows:
        return block(q, w)
    return torch.cat([block(q[:, t:t + rows], w[:, t:t + rows]) for t in range(0, T, rows)], dim=1)


def topk_reference(scores: Tensor, valid: Tensor, topk: int) -> Tensor:
    """Top-k over the valid keys of each row, in the canonical form: scores [B, T, S] float, valid [B, T, S] bool
    -> int32 [B, T, topk]. A stable descending sort sends ties to the smaller key index."""
    S = scores.shape[-1]
    kk = min(topk, S)
    masked = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    chosen = valid.gather(-1, order)
    # Invalid slots get the sentinel S so an ascending sort moves them behind the valid prefix.
    idx = torch.where(chosen, order, torch.full_like(order, S)).sort(dim=-1).values
    idx = torch.where(idx == S, torch.full_like(idx, -1), idx).to(torch.int32)
    if kk < topk:  # fixed width even when fewer keys exist (torch.topk would raise)
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], topk - kk), -1)], dim=-1)
    return idx


def indexer_topk(q: Tensor, k: Tensor, w: Tensor, visible: Tensor, *, topk: int) -> Tensor:
    """Scores and the top-k over the candidates visible [B, T, S] bool (the `kimi::indexer_topk` op): without a
    cache the document-causal keys (S = T), with one the valid cache slots."""
    return topk_reference(scores(q, k, w), visible, topk)


traceable("indexer_topk(Tensor q, Tensor k, Tensor w, Tensor visible, *, int topk) -> Tensor", indexer_topk)


# ---------------------------------------------------------------------------------------------- from ranges

def range_mask(lo: Tensor, hi: Tensor, S: int) -> Tensor:
    """Candidate keys as a mask [B, T, S] from per-query ranges [lo, hi) (lo, hi [B, T] int64; lo = hi: none)."""
    s = torch.arange(S, device=lo.device)
    return (s >= lo[..., None]) & (s < hi[..., None])


def indexer_topk_blocked(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int,
                         block: int = 1024) -> Tensor:
    """`indexer_topk` over the candidates [lo_t, hi_t) of each query, `block` queries at a time: nothing of size
    T×S exists beyond one block's scores and mask [B, block, S]. Same selection as `indexer_topk` with
    visible = `range_mask(lo, hi, S)`. q [B, T, n, d], k [B, S, d], w [B, T, n], lo/hi [B, T] -> int32
    [B, T, topk]."""
    S = k.shape[1]
    out = [topk_reference(scores(q[:, t:t + block], k, w[:, t:t + block]),
                          range_mask(lo[:, t:t + block], hi[:, t:t + block], S), topk)
           for t in range(0, q.shape[1], block)]
    return torch.cat(out, dim=1) if out else q.new_empty(q.shape[0], 0, topk, dtype=torch.int32)
