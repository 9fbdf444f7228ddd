"""Gated MLA with DSA sparse attention (docs/architecture.md#gated-mla).

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))            [B, T, H, d_n + d_r]   (nope part first)
    c, k_r = split(kv_a_proj_with_mqa(x));  c = kv_a_layernorm(c)     [B, S, R], [B, S, d_r]
    k_nope, v = split(kv_b_proj(c))                           [B, S, H, d_n], [B, S, H, d_v]
    k      = [k_nope ; k_r broadcast over heads]              no rotary anywhere (NoPE)
    o      = softmax(σ q kᵀ over Sel(t)) v,  σ = (d_n + d_r)^-1/2
    y      = o_proj(o ⊙ sigmoid(g_proj(x)))

Sel(t) is every candidate key (K3, or documents of at most index_topk tokens) or the indexer's top-k among
them; the candidates are per-query ranges (kimi/ranges.py). The attention itself is `kimi.ops.sparse_mla`
(dense-mask references in the expanded or absorbed form, or the range-based 'gather' path:
kimi/ops/sparse_attention.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import indexer, ops
from .common import linear, rms_norm
from .ranges import KeyRanges


def gated_mla(p: dict, x: Tensor, cfg, backend, *, ranges: KeyRanges, cache: dict | None = None,
              step=None, cp=None) -> Tensor:
    """One gated-MLA layer (with its indexer when `cfg.has_indexer`). x [B, T, D] normalized -> [B, T, D].

    Args:
        p: the layer's `self_attn` subtree. ranges: each query's candidate keys (kimi/ranges.py), built once per
            forward. When no query can have more than index_topk candidates (`ranges.span`), the indexer would
            select all of them: it is skipped and attention is dense over the ranges.
        cache, step: this layer's cache dict and the call's `cache.Step` (kimi/cache.py). The new tokens' latents
            [c ; k_r] and indexer keys are written at step.slots; queries then select and attend within their
            ranges over all cache slots (docs/architecture.md#decode-cache).
        cp: context parallelism (a `kimi.cp.Shard`): x holds this rank's tokens, `ranges` their candidates among
            the whole rows' keys, whose latents and indexer keys are all-gathered.
    """
    H = cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q_resid, q = None, linear(x, p["q_proj"])
    else:
        q_resid = rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"], eps=1e-6)  # the LoRA norms' eps
        q = linear(q_resid, p["q_b_proj"])
    q = q.unflatten(-1, (H, -1))
    c, k_pe = linear(x, p["kv_a_proj_with_mqa"]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    latent = torch.cat([rms_norm(c, p["kv_a_layernorm"], eps=1e-6), k_pe], dim=-1)   # [B, T, R + d_r]
    select = cfg.has_indexer and ranges.span > cfg.index_topk
    topk_idx = None
    if cache is None:
        if select:
            topk_idx = indexer.select_keys(p["indexer"], x, q_resid, cfg, ranges, backend, cp=cp)
        if cp is not None:
            latent = cp.gather(latent)                        # [B, S, R + d_r]: every key of the rows
    else:
        slots = step.slots
        cache["kv"].index_copy_(1, slots, latent)
        latent = cache["kv"]                                  # attention reads the cache itself: no copy of it
        if cfg.has_indexer:      # the keys are cached even while every candidate is attended
            with torch.no_grad():
                qi, ki, wi = indexer.indexer_inputs(p["indexer"], x, q_resid, cfg, ranges.positions())
                cache["index_k"].index_copy_(1, slots, ki)
                if select:
                    topk_idx = ops.indexer_topk(qi, cache["index_k"], wi, ranges, topk=cfg.index_topk,
                                                backend=backend)
    o = ops.sparse_mla(q, latent, p["kv_b_proj"]["weight"], ranges, topk_idx, scale=cfg.softmax_scale,
                       backend=backend)
    o = o.flatten(-2)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(linear(x, p["g_proj"]))
    return linear(o, p["o_proj"])
