"""The lightning indexer's scores and top-k selection (docs/numerics.md#indexer-scores, #top-k).

    I[b, t, s] = Σ_j w[b, t, j] · ReLU(<q[b, t, j], k[b, s]>)       fp32 accumulation (fp64 for fp64)

The selection contract every implementation keeps (the blocked torch op `kimi::indexer_topk`, the Triton kernel
`kimi::indexer_topk_triton` and cuDNN's `kimi::indexer_topk_cudnn`): int32 [B, T, topk]; row t holds min(topk, #candidates) key
positions ascending, then -1; every candidate when there are at most topk; ties go to the smaller position. Hard
top-k has no gradient: the op runs on detached inputs under no_grad (the indexer is frozen).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import compute_dtype
from ..ranges import range_mask
from . import cudnn_dsa, indexer_triton


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


def select_topk(scores: Tensor, valid: Tensor, topk: int) -> Tensor:
    """`topk_reference`'s selection without sorting whole rows: the k-th largest valid score by `torch.topk`,
    every key above it, and of the keys equal to it the ones with the smallest positions; then the chosen
    positions compacted in ascending order. scores [..., S], valid [..., S] bool -> int32 [..., topk]. A NaN score
    ranks above every number, as in the sort."""
    S = scores.shape[-1]
    kk = min(topk, S)
    inf = float("inf")
    masked = scores.nan_to_num(nan=inf, posinf=inf, neginf=-inf).masked_fill(~valid, -inf)
    kth = masked.topk(kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)   # -inf when < kk candidates
    above = masked > kth
    tie = valid & (masked == kth)
    room = kk - above.sum(-1, keepdim=True, dtype=torch.int32)
    keep = above | (tie & (tie.cumsum(-1, dtype=torch.int32) <= room))
    pos = torch.arange(S, dtype=torch.int32, device=scores.device)
    idx = torch.where(keep, pos, S).topk(kk, dim=-1, largest=False, sorted=True).values
    idx = torch.where(idx == S, -1, idx)
    if kk < topk:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], topk - kk), -1)], dim=-1)
    return idx


@torch.library.custom_op("kimi::indexer_topk", mutates_args=())
def indexer_topk_blocked(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int,
                         causal: bool = False, block: int = 1024) -> Tensor:
    """Scores and the top-k over each query's candidates [lo_t, hi_t) (the `kimi::indexer_topk` op), `block`
    queries at a time: nothing of size T×S exists beyond one block's scores [B, block, S].

    q [B, T, n, d], k [B, S, d] (without a cache the layer's own keys, S = T; with one the cached keys),
    w [B, T, n] (scales folded in), lo, hi [B, T] int64 -> int32 [B, T, topk]. `causal`: query t is key t
    (no cache), so a block of queries scores only the keys before its end.

    An opaque op (the block loop is not traced: one graph serves every length) without a gradient."""
    S = k.shape[1]
    out = []
    for t in range(0, q.shape[1], block):
        end = min(t + block, S) if causal else S
        s = scores(q[:, t:t + block], k[:, :end], w[:, t:t + block])
        valid = range_mask(lo[:, t:t + block], hi[:, t:t + block], end)
        out.append(select_topk(s, valid, topk))
    return torch.cat(out, dim=1) if out else q.new_empty(q.shape[0], 0, topk, dtype=torch.int32)


@indexer_topk_blocked.register_fake
def _(q, k, w, lo, hi, *, topk, causal=False, block=1024):
    return q.new_empty(*q.shape[:2], topk, dtype=torch.int32)


@torch.library.custom_op("kimi::indexer_topk_triton", mutates_args=())
def indexer_topk_triton(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int,
                        causal: bool = False) -> Tensor:
    """`kimi::indexer_topk`'s contract as one Triton kernel with a streaming top-k: no score buffer at all, the keys
    past a query block never scored with `causal`, and a split-and-merge launch for decoding
    (kimi/ops/indexer_triton.py). Same arguments less `block`; no gradient (the indexer is frozen)."""
    return indexer_triton.indexer_topk_triton(q, k, w.float(), lo, hi, topk=topk, causal=causal)


@indexer_topk_triton.register_fake
def _(q, k, w, lo, hi, *, topk, causal=False):
    return q.new_empty(*q.shape[:2], topk, dtype=torch.int32)


@torch.library.custom_op("kimi::indexer_topk_cudnn", mutates_args=())
def indexer_topk_cudnn(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int,
                       causal: bool = False) -> Tensor:
    """`kimi::indexer_topk`'s contract on cuDNN Frontend's indexer scores and radix top-k (`Backend(attn="cudnn")`,
    kimi/ops/cudnn_dsa.py): a dense fp32 score buffer of at most 4 GiB at a time. No gradient (frozen indexer)."""
    return cudnn_dsa.indexer_topk_cudnn(q, k, w, lo, hi, topk=topk, causal=causal)


@indexer_topk_cudnn.register_fake
def _(q, k, w, lo, hi, *, topk, causal=False):
    return q.new_empty(*q.shape[:2], topk, dtype=torch.int32)
