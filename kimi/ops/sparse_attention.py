"""Gated MLA's attention over the selected keys: the dense-mask references (docs/numerics.md#sparse-attention).

    o = softmax(σ q kᵀ over Sel(t)) v,   σ = (d_nope + d_rope)^-1/2

Sel(t) is every visible key, or the indexer's selection intersected with them (so a selection can never reach a
future or foreign key). Three registered implementations with one signature
`(q, c, k_pe, kv_b, visible, topk_idx, *, scale) -> o [B, T, H, d_v]`:

- `sparse_mla_eager`: expanded form (per-head K/V through kv_b_proj), fp32 softmax; the reference.
- `sparse_mla_sdpa`: the expanded form through `F.scaled_dot_product_attention` with the boolean mask.
- `sparse_mla_absorbed`: W_UK folded into q and W_UV applied after attention over the shared 576-wide latent
  [c ; k_pe], the form sparse kernels and decoding run (docs/numerics.md#absorbed-form).

All build a [B, T, S] keep-mask: fine for tests and moderate lengths. Rows with no visible key (padding queries)
give exactly 0 and zero gradient, never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from ..common import compute_dtype
from .registry import traceable


def select_visible(visible: Tensor, topk_idx: Tensor | None) -> Tensor:
    """visible [B, T, S] bool intersected with the selected key positions topk_idx [B, T, k] (-1 = none)."""
    if topk_idx is None:
        return visible
    S = visible.shape[-1]
    # Scatter valid positions into S+1 columns with -1 sent to the spare last column: duplicates of the
    # sentinel never overwrite a real selection.
    cols = torch.where(topk_idx >= 0, topk_idx, S).long()
    sel = torch.zeros(*topk_idx.shape[:2], S + 1, dtype=torch.bool, device=visible.device)
    sel = sel.scatter(-1, cols, True)[..., :S]
    return sel & visible


def _attend_eager(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """q [B, H, T, E], k [B, H, S, E], v [B, H, S, F], keep [B, T, S] -> [B, H, T, F].
    Scores in the activation dtype, softmax in fp32."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.to(compute_dtype(s.dtype))
    has_key = keep.any(-1)[:, None, :, None]                                    # [B, 1, T, 1]
    # An all-masked row is replaced by zeros before the softmax (finite gradients), its probabilities zeroed after.
    s = s.masked_fill(~keep[:, None], float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    return torch.matmul(p.to(v.dtype), v)


def _attend_sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    has_key = keep.any(-1)                                                      # [B, T]
    # Rows with no key attend to everything and are zeroed after: SDPA kernels return NaN for fully masked rows.
    mask = (keep | ~has_key[..., None])[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o * has_key[:, None, :, None].to(o.dtype)


def _attend_shared(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """Attention with one K/V shared by all heads: q [B, H, T, E], k [B, S, E], v [B, S, F], keep [B, T, S] ->
    [B, H, T, F]. The queries of all heads are one batched matmul against the shared keys, so no per-head copy of K
    or V is made (SDPA's math path and broadcasting matmuls would expand K to every head)."""
    B, H, T, E = q.shape
    s = torch.bmm(rearrange(q, "b h t e -> b (t h) e"), k.transpose(1, 2)) * scale
    s = rearrange(s, "b (t h) s -> b t h s", h=H).to(compute_dtype(s.dtype))
    has_key = keep.any(-1)[:, :, None, None]                                   # [B, T, 1, 1]
    s = s.masked_fill(~keep[:, :, None], float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    o = torch.bmm(rearrange(p.to(v.dtype), "b t h s -> b (t h) s"), v)
    return rearrange(o, "b (t h) f -> b h t f", h=H)


def _expanded(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, keep: Tensor, scale: float, attend) -> Tensor:
    H = q.shape[2]
    dn = q.shape[-1] - k_pe.shape[-1]
    W = rearrange(kv_b, "(h d) r -> h d r", h=H)                               # [H, d_n + d_v, R]
    k_nope, v = torch.einsum("bsr,hdr->bhsd", c, W).split([dn, W.shape[1] - dn], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1, -1)], dim=-1)      # k_pe shared by all heads
    return attend(q.transpose(1, 2), k, v, keep, scale).transpose(1, 2)       # [B, T, H, d_v]


def sparse_mla_eager(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor, topk_idx: Tensor | None, *,
                     scale: float) -> Tensor:
    """The expanded form, fp32 softmax over the keep-mask: the reference.

    q [B, T, H, d_n + d_r] (nope part first), c [B, S, R] normalized latent, k_pe [B, S, d_r] shared key slice,
    kv_b the kv_b_proj weight [H·(d_n + d_v), R] (a LoRA effective weight works the same), visible [B, T, S] bool,
    topk_idx int32 [B, T, k] (-1 padded) or None (every visible key). Returns o [B, T, H, d_v] in q's dtype."""
    return _expanded(q, c, k_pe, kv_b, select_visible(visible, topk_idx), scale, _attend_eager)


def sparse_mla_sdpa(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor, topk_idx: Tensor | None, *,
                    scale: float) -> Tensor:
    """`sparse_mla_eager` through `F.scaled_dot_product_attention` with the same boolean mask."""
    return _expanded(q, c, k_pe, kv_b, select_visible(visible, topk_idx), scale, _attend_sdpa)


def sparse_mla_absorbed(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor,
                        topk_idx: Tensor | None, *, scale: float) -> Tensor:
    """`sparse_mla_eager` in the absorbed form: attention over the shared latent [c ; k_pe], same σ."""
    H = q.shape[2]
    dn = q.shape[-1] - k_pe.shape[-1]
    W = rearrange(kv_b, "(h d) r -> h d r", h=H)
    q_nope, q_pe = q.split([dn, k_pe.shape[-1]], dim=-1)
    q_lat = torch.einsum("bthd,hdr->bhtr", q_nope, W[:, :dn])                  # W_UK folded into q
    Q = torch.cat([q_lat, q_pe.transpose(1, 2)], dim=-1)                       # [B, H, T, R + d_r]
    KV = torch.cat([c, k_pe], dim=-1)                                          # [B, S, R + d_r]
    o_lat = _attend_shared(Q, KV, c, select_visible(visible, topk_idx), scale)  # [B, H, T, R]
    return torch.einsum("bhtr,hdr->bthd", o_lat, W[:, dn:])                    # W_UV after attention


_SCHEMA = "(Tensor q, Tensor c, Tensor k_pe, Tensor kv_b, Tensor visible, Tensor? topk_idx, *, float scale) -> Tensor"
for _fn in (sparse_mla_eager, sparse_mla_sdpa, sparse_mla_absorbed):
    traceable(_fn.__name__ + _SCHEMA, _fn)
