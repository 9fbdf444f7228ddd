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

Candidates come as ranges (`kimi.ranges.KeyRanges`, built once in `model.forward`): key s is a candidate of
query t iff lo_t <= s < hi_t, i.e. s <= t in t's document (or, with a cache, from the row's first real slot).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .common import compute_dtype, layer_norm, linear
from .ops import lightning_index
from .ranges import KeyRanges


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


def indexer_inputs(p: dict, x: Tensor, q_resid: Tensor, cfg, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The indexer's projections: (q [B, T, n, d], k [B, T, d], w [B, T, n]). q and k in the activation dtype
    (BF16 projections), w in fp32 with both positive scales n^-1/2 · d^-1/2 folded in.

    Args:
        p: the layer's `self_attn.indexer` subtree (wq_b, wk, k_norm, weights_proj).
        x: layer input after input_layernorm [B, T, D]; q_resid: q LoRA latent [B, T, q_lora_rank].
        pos: [B, T] RoPE positions: the position within the document, or since the row's start in a cache
            (`KeyRanges.positions`).
    """
    n, d = cfg.index_n_heads, cfg.index_head_dim
    q = linear(q_resid, p["wq_b"]).unflatten(-1, (n, d))
    k = layer_norm(linear(x, p["wk"]), p["k_norm"], eps=1e-6)
    if cfg.index_rope_dim:
        q = _rope_half(q, pos, cfg.index_rope_dim, cfg.rope_theta)
        k = _rope_half(k, pos, cfg.index_rope_dim, cfg.rope_theta)
    w = linear(x, p["weights_proj"]).to(compute_dtype(x.dtype)) * (n ** -0.5 * d ** -0.5)
    return q, k, w


def indexer_scores(p: dict, x: Tensor, q_resid: Tensor, cfg, ranges: KeyRanges) -> Tensor:
    """Index scores [B, T, S=T] of one layer without a cache (before masking; a test and analysis helper: it
    holds all T×T scores)."""
    return lightning_index.scores(*indexer_inputs(p, x, q_resid, cfg, ranges.positions()))


def select_keys(p: dict, x: Tensor, q_resid: Tensor, cfg, ranges: KeyRanges, backend=None, cp=None) -> Tensor:
    """The indexer of one gated-MLA layer without a cache: int32 [B, T, index_topk] selected key positions
    (-1 padded), by `ops.indexer_topk` for `backend`. `cp`: context parallelism (a `kimi.cp.Shard`): x holds
    this rank's tokens and the keys of the whole rows are all-gathered; positions are global."""
    with torch.no_grad():
        q, k, w = indexer_inputs(p, x.detach(), q_resid.detach(), cfg, ranges.positions())
        if cp is not None:
            k = cp.gather(k)
        return ops.indexer_topk(q, k, w, ranges, topk=cfg.index_topk, backend=backend)
