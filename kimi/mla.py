"""Gated MLA with DSA sparse attention (MODEL.md §4, DSA.md §2 and §4).

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))            [B, T, H, d_n + d_r]   (nope first)
    c, k_r = split(kv_a_proj_with_mqa(x));  c = kv_a_layernorm(c)     [B, S, R], [B, S, d_r]
    k_nope, v = split(kv_b_proj(c))                           [B, S, H, d_n], [B, S, H, d_v]
    k      = [k_nope ; k_r broadcast over heads]              no rotary anywhere (NoPE)
    o      = softmax(σ q kᵀ over Sel(t)) v,  σ = (d_n + d_r)^-1/2
    y      = o_proj(o ⊙ sigmoid(g_proj(x)))

Sel(t) is every visible key (K3, or K3.1 rows with <= index_topk candidates) or the indexer's top-k. The
references here build a dense boolean keep-mask [B, T, S] and re-apply causality and document bounds to it, so
a selection can never leak a future key (DSA.md §4.5). Two algebraically equal forms:
- expanded: per-head K/V through kv_b_proj (what dense attention runs);
- absorbed: W_UK folded into q and W_UV applied after attention over the shared 576-wide latent [c ; k_r]
  (what sparse kernels run, DSA.md §4.2). Same σ.
Rows with no visible key (padding queries) give exactly 0 and zero gradient, never NaN (§4.6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import indexer, ops
from .common import compile_region, compute_dtype, linear, rms_norm


def keep_mask(seg: Tensor, topk_idx: Tensor | None) -> Tensor:
    """Boolean [B, T, S]: visible keys, intersected with the selection when one is given."""
    return select_visible(indexer.visible_keys(seg), topk_idx)


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
    Scores in the activation dtype (as Automodel's eager path), softmax in fp32."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.to(compute_dtype(s.dtype))
    has_key = keep.any(-1)[:, None, :, None]                                    # [B, 1, T, 1]
    # Masked entries get -inf; an all-masked row is replaced by zeros before the softmax (finite
    # gradients) and its probabilities are zeroed after.
    s = s.masked_fill(~keep[:, None], float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    return torch.matmul(p.to(v.dtype), v)


def _attend_sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    has_key = keep.any(-1)                                                      # [B, T]
    # Rows with no key attend to everything (a valid softmax) and are zeroed after: SDPA kernels return NaN
    # for fully masked rows.
    mask = (keep | ~has_key[..., None])[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, )
    return o * has_key[:, None, :, None].to(o.dtype)


def _attend_shared(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """Attention with one K/V shared by all heads (the absorbed form): q [B, H, T, E], k [B, S, E], v [B, S, F],
    keep [B, T, S] -> [B, H, T, F]. The queries of all heads are one batched matmul against the shared keys, so no
    per-head copy of K or V is ever made (SDPA's math path and broadcasting matmuls expand K to every head: for a
    batch-32 decode over 4k cached latents that is a 27 GB fp32 buffer). Scores in the activation dtype, softmax
    in fp32, rows without keys give 0 (as `_attend_eager`)."""
    B, H, T, E = q.shape
    S = k.shape[1]
    s = torch.bmm(q.transpose(1, 2).reshape(B, T * H, E), k.transpose(1, 2)) * scale     # rows (t, h)
    s = s.view(B, T, H, S).to(compute_dtype(s.dtype))
    has_key = keep.any(-1)[:, :, None, None]                                           # [B, T, 1, 1]
    s = s.masked_fill(~keep[:, :, None], float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    o = torch.bmm(p.to(v.dtype).view(B, T * H, S), v)                                  # [B, T·H, F]
    return o.view(B, T, H, -1).transpose(1, 2)


def sparse_mla(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, seg: Tensor, topk_idx: Tensor | None, *,
               scale: float, attn: str, absorbed: bool) -> Tensor:
    """Attention over the selected keys (all visible keys when topk_idx is None).

    Args:
        q: [B, T, H, d_n + d_r] queries (nope part first).
        c: [B, S, R] normalized latent (after kv_a_layernorm); k_pe: [B, S, d_r] shared key slice.
        kv_b: kv_b_proj weight [H·(d_n + d_v), R] (a LoRA effective weight works the same).
        seg: document run ids [B, T] (-1 padding); topk_idx: int32 [B, T, k] selected keys, -1 padded.
        scale: softmax scale (d_n + d_r)^-1/2 in both forms. attn: 'eager' | 'sdpa' (the expanded form's kernel;
            the absorbed form always runs `_attend_shared`); absorbed: the latent form.
    Returns: o [B, T, H, d_v] in q's dtype.
    """
    return sparse_mla_masked(q, c, k_pe, kv_b, indexer.visible_keys(seg), topk_idx, scale=scale, attn=attn,
                             absorbed=absorbed)


def sparse_mla_masked(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor, topk_idx: Tensor | None,
                      *, scale: float, attn: str, absorbed: bool) -> Tensor:
    """`sparse_mla` with the visible keys given as a mask visible [B, T, S] bool instead of document ids, so the
    S keys need not be the T queries: the cached path attends from T new tokens over all S cache slots."""
    B, T, H, dqk = q.shape
    R, dr = c.shape[-1], k_pe.shape[-1]
    dn = dqk - dr
    dv = kv_b.shape[0] // H - dn
    attend = {"eager": _attend_eager, "sdpa": _attend_sdpa}[attn]
    keep = select_visible(visible, topk_idx)
    W = kv_b.view(H, dn + dv, R)
    q_nope, q_pe = q.split([dn, dr], dim=-1)
    if not absorbed:
        kv = torch.einsum("bsr,hdr->bhsd", c, W)                                # [B, H, S, d_n + d_v]
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1, -1)], dim=-1)
        return attend(q.transpose(1, 2), k, v, keep, scale).transpose(1, 2)    # [B, T, H, d_v]
    q_lat = torch.einsum("bthd,hdr->bhtr", q_nope, W[:, :dn])                  # W_UK folded into q
    Q = torch.cat([q_lat, q_pe.transpose(1, 2)], dim=-1)                       # [B, H, T, R + d_r]
    KV = torch.cat([c, k_pe], dim=-1)                                          # [B, S, R + d_r]
    # One latent K/V for all heads: both `attn` backends run the shared-KV kernel (SDPA would expand it per head).
    o_lat = _attend_shared(Q, KV, c, keep, scale)                              # [B, H, T, R]
    return torch.einsum("bhtr,hdr->bthd", o_lat, W[:, dn:])                    # W_UV after attention


@compile_region
def gated_mla(p: dict, x: Tensor, cfg, backend, *, seg: Tensor | None, cache: dict | None = None,
              step=None) -> Tensor:
    """One gated-MLA layer (with its indexer when `cfg.has_indexer`). x [B, T, D] normalized -> [B, T, D].

    Args:
        p: the layer's `self_attn` subtree. seg: document run ids [B, T], -1 for padding (see indexer.py).
        cache, step: this layer's cache dict and the call's `cache.Step` (kimi/cache.py). The new tokens'
            latents [c ; k_r] and indexer keys are written at step.slots; queries then select and attend over
            all cache slots, masked by step.visible (DSA.md §8). seg is unused.
    """
    B, T, _ = x.shape
    H = cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q_resid, q = None, linear(x, p["q_proj"])
    else:
        q_resid = rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"], eps=1e-6)  # 1e-6: MODEL.md §2
        q = linear(q_resid, p["q_b_proj"])
    q = q.view(B, T, H, cfg.qk_head_dim)
    c, k_pe = linear(x, p["kv_a_proj_with_mqa"]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, p["kv_a_layernorm"], eps=1e-6)
    if cache is None:
        topk_idx = indexer.select_keys(p["indexer"], x, q_resid, cfg, backend, seg) if cfg.has_indexer else None
        o = ops.sparse_mla(q, c, k_pe, p["kv_b_proj"]["weight"], indexer.visible_keys(seg), topk_idx,
                           scale=cfg.softmax_scale, backend=backend)
    else:
        kv = cache["kv"]
        kv.index_copy_(1, step.slots, torch.cat([c, k_pe], dim=-1))
        c_all, k_pe_all = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        topk_idx = None
        if cfg.has_indexer:
            with torch.no_grad():
                qi, ki, wi = indexer.indexer_inputs(p["indexer"], x, q_resid, cfg, None, pos=step.index_pos)
                cache["index_k"].index_copy_(1, step.slots, ki)
                topk_idx = ops.indexer_topk(qi, cache["index_k"], wi, step.visible, cfg.index_topk, backend)
        o = ops.sparse_mla(q, c_all, k_pe_all, p["kv_b_proj"]["weight"], step.visible, topk_idx,
                           scale=cfg.softmax_scale, backend=backend)
    o = o.reshape(B, T, H * cfg.v_head_dim)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(linear(x, p["g_proj"]))
    return linear(o, p["o_proj"])
