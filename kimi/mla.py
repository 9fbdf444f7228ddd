"""Gated MLA with DSA sparse attention (docs/architecture.md#gated-mla).

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))            [B, T, H, d_n + d_r]   (nope part first)
    c, k_r = split(kv_a_proj_with_mqa(x));  c = kv_a_layernorm(c)     [B, S, R], [B, S, d_r]
    k_nope, v = split(kv_b_proj(c))                           [B, S, H, d_n], [B, S, H, d_v]
    k      = [k_nope ; k_r broadcast over heads]              no rotary anywhere (NoPE)
    o      = softmax(σ q kᵀ over Sel(t)) v,  σ = (d_n + d_r)^-1/2
    y      = o_proj(o ⊙ sigmoid(g_proj(x)))

Sel(t) is every visible key (K3, or rows with at most index_topk candidates) or the indexer's top-k. The
attention itself is the op `kimi.ops.sparse_mla` (expanded or absorbed form, kimi/ops/sparse_attention.py).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from . import indexer, ops
from .common import linear, rms_norm


def gated_mla(p: dict, x: Tensor, cfg, backend, *, seg: Tensor | None, cache: dict | None = None,
              step=None) -> Tensor:
    """One gated-MLA layer (with its indexer when `cfg.has_indexer`). x [B, T, D] normalized -> [B, T, D].

    Args:
        p: the layer's `self_attn` subtree. seg: document run ids [B, T], -1 for padding (see indexer.py).
        cache, step: this layer's cache dict and the call's `cache.Step` (kimi/cache.py). The new tokens'
            latents [c ; k_r] and indexer keys are written at step.slots; queries then select and attend over
            all cache slots, masked by step.visible (docs/architecture.md#decode-cache). seg is unused.
    """
    backend = ops.resolve(backend, device=x.device, dtype=x.dtype, cached=cache is not None)
    H = cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q_resid, q = None, linear(x, p["q_proj"])
    else:
        q_resid = rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"], eps=1e-6)  # the LoRA norms' eps
        q = linear(q_resid, p["q_b_proj"])
    q = rearrange(q, "b t (h d) -> b t h d", h=H)
    c, k_pe = linear(x, p["kv_a_proj_with_mqa"]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, p["kv_a_layernorm"], eps=1e-6)
    if cache is None:
        topk_idx = indexer.select_keys(p["indexer"], x, q_resid, cfg, seg) if cfg.has_indexer else None
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
                topk_idx = ops.indexer_topk(qi, cache["index_k"], wi, step.visible, topk=cfg.index_topk)
        o = ops.sparse_mla(q, c_all, k_pe_all, p["kv_b_proj"]["weight"], step.visible, topk_idx,
                           scale=cfg.softmax_scale, backend=backend)
    o = rearrange(o, "b t h d -> b t (h d)")
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(linear(x, p["g_proj"]))
    return linear(o, p["o_proj"])
