"""The lightning indexer of DSA (docs/architecture.md#indexer): per query, score every visible key and keep the top
`index_topk`.

    q^I_t = wq_b(q_resid_t)                  [n, d]   (q_resid: the q LoRA latent after q_a_layernorm)
    k^I_s = LayerNorm(wk(x_s))               [d]      (one key head shared by all indexer heads)
    w_t   = weights_proj(x_t) · n^-1/2 · d^-1/2       (both positive scales folded into w)
    I[t,s] = Σ_j w_t[j] · ReLU(<q^I_t[j], k^I_s>)     (fp32 accumulation; w may be negative)

Candidates are causal, same-document, non-padding keys. The selection is `min(index_topk, #candidates)` keys,
written as int32 [B, T, index_topk]: valid key positions ascending, then -1 (docs/numerics.md#top-k; the scores
and the top-k are the op `kimi.ops.indexer_topk`). Hard top-k passes no gradient, so the indexer is frozen: it
runs under `no_grad` on detached inputs.

Documents: `seg` [B, T] is the run index of each token's document within its row, -1 for padding (built once
in `model.forward`). A key is visible to a query iff s <= t, seg[s] == seg[t] and seg[t] >= 0.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from . import ops
from .common import compute_dtype, layer_norm, linear
from .ops import lightning_index


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
    """Rotate the first `dim` channels of x [..., d] by position, half-split (NeoX) pairing."""
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
    q = rearrange(linear(q_resid, p["wq_b"]), "b t (n d) -> b t n d", n=n)
    k = layer_norm(linear(x, p["wk"]), p["k_norm"], eps=1e-6)
    if cfg.index_rope_dim:
        pos = positions_in_document(seg) if pos is None else pos
        q = _rope_half(q, pos, cfg.index_rope_dim, cfg.rope_theta)
        k = _rope_half(k, pos, cfg.index_rope_dim, cfg.rope_theta)
    w = linear(x, p["weights_proj"]).to(compute_dtype(x.dtype)) * (n ** -0.5 * d ** -0.5)
    return q, k, w


def indexer_scores(p: dict, x: Tensor, q_resid: Tensor, cfg, seg: Tensor) -> Tensor:
    """Index scores [B, T, S=T] of one layer (before masking)."""
    return lightning_index.scores(*indexer_inputs(p, x, q_resid, cfg, seg))


def select_keys(p: dict, x: Tensor, q_resid: Tensor, cfg, seg: Tensor) -> Tensor:
    """The indexer of one gated-MLA layer: int32 [B, T, index_topk] selected key positions (-1 padded)."""
    with torch.no_grad():
        q, k, w = indexer_inputs(p, x.detach(), q_resid.detach(), cfg, seg)
        return ops.indexer_topk(q, k, w, visible_keys(seg), topk=cfg.index_topk)
