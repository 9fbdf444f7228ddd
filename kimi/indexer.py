"""The lightning indexer of DSA (DSA.md §3): per query, score every visible key and keep the top `index_topk`.

    q^I_t = wq_b(q_resid_t)                  [n, d]   (q_resid: the q LoRA latent after q_a_layernorm)
    k^I_s = LayerNorm(wk(x_s))               [d]      (one key head shared by all indexer heads)
    w_t   = weights_proj(x_t) · n^-1/2 · d^-1/2       (both positive scales folded into w)
    I[t,s] = Σ_j w_t[j] · ReLU(<q^I_t[j], k^I_s>)     (fp32 accumulation; w may be negative)

Candidates are causal, same-document, non-padding keys (§3.4). The selection is `min(index_topk, #candidates)`
keys, written as int32 [B, T, index_topk]: valid key positions ascending, then -1 (§3.5). Ties go to the
smaller key index. Hard top-k passes no gradient, so the indexer is frozen: it runs under `no_grad` on detached
inputs (§3.7).

Documents: `seg` [B, T] is the run index of each token's document within its row, -1 for padding (built once
in `model.forward`). A key is visible to a query iff s <= t, seg[s] == seg[t] and seg[t] >= 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .common import compute_dtype, layer_norm, linear


def visible_keys(seg: Tensor) -> Tensor:
    """Document-causal candidate mask [B, T, S=T] (bool) from run ids seg [B, T] (-1 = padding)."""
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    same = seg[:, :, None] == seg[:, None, :]
    return causal & same & (seg >= 0)[:, :, None]


def positions_in_document(seg: Tensor) -> Tensor:
    """Position of each token within its document [B, T] (int64)."""
    T = seg.shape[1]
    t = torch.arange(T, device=seg.device).expand_as(seg)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - first


def _rope_half(x: Tensor, pos: Tensor, dim: int, theta: float) -> Tensor:
    """Rotate the first `dim` channels of x [..., d] by position, half-split (NeoX) pairing (DSA.md §3.3)."""
    ct = compute_dtype(x.dtype)
    inv = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=ct) / dim)
    ang = pos.to(ct)[..., None] * inv                              # [B, T, dim/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos(), ang.sin()
    xf = x[..., :dim].to(ct)
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rot, x[..., dim:]], dim=-1)


def indexer_inputs(p: dict, x: Tensor, q_resid: Tensor, cfg, seg: Tensor | None, *,
                   pos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The indexer's projections: (q [B, T, n, d], k [B, S, d], w [B, T, n]). q and k in the activation dtype
    (BF16 projections), w in fp32 with both positive scales n^-1/2 · d^-1/2 folded in.

    Args:
        p: the layer's `self_attn.indexer` subtree (wq_b, wk, k_norm, weights_proj).
        x: layer input after input_layernorm [B, T, D]; q_resid: q LoRA latent [B, T, q_lora_rank].
        seg: document run ids [B, T]; the RoPE position is the position in the document.
        pos: [B, T] RoPE positions given directly instead (the cached path: slot − start); seg is then unused.
    """
    B, T, _ = x.shape
    n, d = cfg.index_n_heads, cfg.index_head_dim
    q = linear(q_resid, p["wq_b"]).view(B, T, n, d)
    k = layer_norm(linear(x, p["wk"]), p["k_norm"], eps=1e-6)
    if cfg.index_rope_dim:
        pos = positions_in_document(seg) if pos is None else pos
        q = _rope_half(q, pos, cfg.index_rope_dim, cfg.rope_theta)
        k = _rope_half(k, pos, cfg.index_rope_dim, cfg.rope_theta)
    w = linear(x, p["weights_proj"]).to(compute_dtype(x.dtype)) * (n ** -0.5 * d ** -0.5)
    return q, k, w


def scores(q: Tensor, k: Tensor, w: Tensor, *, max_logits: int = 1 << 28) -> Tensor:
    """I[b, t, s] = Σ_j w[b, t, j] · ReLU(<q[b, t, j], k[b, s]>), accumulated in fp32 (fp64 for fp64).

    The per-head logits [B, T, n, S] are formed for at most `max_logits` at a time (blocks of queries): at 4096
    tokens and 64 heads they are 4 GiB in fp32, allocated when a training step's memory is at its highest."""
    ct = compute_dtype(w.dtype)
    B, T, n, _ = q.shape
    rows = max(1, max_logits // max(1, B * n * k.shape[1]))

    def block(qb: Tensor, wb: Tensor) -> Tensor:
        return torch.einsum("btns,btn->bts", torch.einsum("btnd,bsd->btns", qb.to(ct), k.to(ct)).relu(), wb.to(ct))
    if T <= rows:
        return block(q, w)
    return torch.cat([block(q[:, t:t + rows], w[:, t:t + rows]) for t in range(0, T, rows)], dim=1)


def indexer_scores(p: dict, x: Tensor, q_resid: Tensor, cfg, seg: Tensor) -> Tensor:
    """Index scores [B, T, S=T] of one layer (before masking)."""
    return scores(*indexer_inputs(p, x, q_resid, cfg, seg))


def indexer_topk(q: Tensor, k: Tensor, w: Tensor, visible: Tensor, topk: int) -> Tensor:
    """Scores and the top-k over the candidates visible [B, T, S] bool: int32 [B, T, topk] (the
    `kimi::indexer_topk` op). Without a cache visible = `visible_keys(seg)` (S = T); with one, T new queries
    see S cache slots."""
    return topk_reference(scores(q, k, w), visible, topk)


def topk_reference(scores: Tensor, valid: Tensor, topk: int) -> Tensor:
    """Top-k over the valid keys of each row, canonical form (DSA.md §3.5).

    Args: scores [B, T, S] float, valid [B, T, S] bool, topk: slot count K.
    Returns: int32 [B, T, K]; row t holds min(K, valid[t].sum()) key positions ascending, then -1.
    A stable descending sort makes ties go to the smaller key index.
    """
    S = scores.shape[-1]
    kk = min(topk, S)
    masked = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    chosen = valid.gather(-1, order)
    # Invalid slots get the sentinel S so an ascending sort moves them behind the valid prefix.
    idx = torch.where(chosen, order, torch.full_like(order, S)).sort(dim=-1).values
    idx = torch.where(idx == S, torch.full_like(idx, -1), idx).to(torch.int32)
    if kk < topk:  # fixed width K even when fewer keys exist (torch.topk would raise; DSA.md §3.5)
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], topk - kk), -1)], dim=-1)
    return idx


def select_keys(p: dict, x: Tensor, q_resid: Tensor, cfg, backend, seg: Tensor) -> Tensor:
    """The indexer of one gated-MLA layer: int32 [B, T, index_topk] selected key positions (-1 padded)."""
    with torch.no_grad():
        q, k, w = indexer_inputs(p, x.detach(), q_resid.detach(), cfg, seg)
        return ops.indexer_topk(q, k, w, visible_keys(seg), cfg.index_topk, backend)
