"""The decode cache: a preallocated pytree that `kimi.forward(..., cache=cache)` reads and extends in place.

    cache = kimi.init_cache(cfg, batch=B, max_len=L, dtype=torch.bfloat16, device="cuda")
    ids, start = kimi.left_pad(prompts, cfg.pad_token_id)       # [B, T0], [B]
    kimi.reset_cache(cache, start)                               # or init_cache(..., start=start)
    logits, cache = kimi.forward(params, ids, cfg, cache=cache)  # prefill (may be split into chunks)
    logits, cache = kimi.forward(params, next_ids[:, None], cfg, cache=cache)   # decode, T = 1

Layout (one dict; every leaf a tensor except `max_len`; W = short_conv_kernel_size, H·K the KDA width):

    pos      int64 []            next free slot, the same for every row
    start    int64 [B]           slot of each row's first real token (0 without padding)
    max_len  int                 slot count (the static length of the MLA caches)
    layers[i] for a KDA layer:
      conv_q, conv_k, conv_v   [B, W-1, H·K]   the last W-1 raw (pre-conv) projections, activation dtype
      state                    [B, H, K, V]    the recurrent state, fp32 (fp64 for an fp64 cache)
    layers[i] for a gated-MLA layer:
      kv                       [B, max_len, kv_lora_rank + qk_rope_head_dim]   [c ; k_r] per slot, c after
                               kv_a_layernorm: the 576-wide latent of the absorbed form
                               (docs/numerics.md#absorbed-form). The MLA is NoPE, so nothing is rotated
                               and the expanded form reads the same cache through kv_b_proj.
      index_k                  [B, max_len, index_head_dim]   indexer keys after k_norm (and RoPE), only when
                               the config has an indexer.

Design: every row writes the same slots [pos, pos + T) and rows of unequal prompts are LEFT-padded; start[b]
says where row b's real tokens begin. Why:
- One shared `pos` is a single 0-d device tensor, bumped in place by forward: a decode step has no per-row
  shapes and no host-side position, so it is captured once as a CUDA graph and replayed
  (docs/compile.md#cuda-graphs). Cache writes are `index_copy_` at slots pos + arange(T), never a Python-int slice (which would recompile per step).
- Left padding makes all rows end at the same slot, so every row's next token lands at `pos` and decode needs no
  per-row scatter. Padded slots are invisible rather than absent: an MLA key is visible to a query at slot t iff
  start[b] <= s <= t; queries before start see nothing (their outputs are exactly 0 in attention and are
  meaningless logits the caller ignores); the KDA recurrence and short conv restart at slot start[b] (the reset
  of packed documents), so the state accumulated over padding is dropped; indexer RoPE positions are
  slot − start[b]. Hence a padded row computes exactly what the row alone computes (tests/test_decode.py).
- The cost of left padding is wasted slots (the longest prompt decides) and a step that scores all max_len slots
  (the indexer's top-k over the full cache, each query's candidates given as a range, kimi/ranges.py): what a
  static-shape step needs anyway.

In-place updates: forward writes the new tokens into the cache's buffers (index_copy_/copy_) and returns the same
dict. The functional return value is for readability; callers must not expect the cache they passed to be
unchanged. Clone it (`clone_cache`) to branch. For CUDA graphs mark the leaves static once (`mark_static`).
Packed documents (`document_ids`) are a training feature and are not accepted together with a cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .common import compute_dtype, host_checks
from .config import ModelConfig
from .ranges import KeyRanges, cache_ranges


class CacheError(ValueError):
    """A cache that does not fit the model or the input (another config, batch, dtype, overflow)."""


def init_cache(cfg: ModelConfig, batch: int, max_len: int, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", start: Tensor | None = None) -> dict:
    """A zeroed cache for `batch` rows of up to `max_len` tokens (prompt and generated, padding included).

    Args:
        dtype: activation dtype, the parameters' (default `cfg.dtype`); KDA states are fp32 (fp64 for float64).
        start: [B] slot of each row's first real token (left padding; see `left_pad`). Default zeros.
    """
    dtype = getattr(torch, dtype or cfg.dtype) if not isinstance(dtype, torch.dtype) else dtype
    for name, v in (("batch", batch), ("max_len", max_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise CacheError(f"init_cache: {name} must be a positive integer, got {v!r}")
    la = cfg.linear_attn_config
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    layers = []
    for kind in cfg.layer_types:
        if kind == "kda":
            conv = lambda: torch.zeros(batch, W - 1, H * K, dtype=dtype, device=device)
            layers.append({"conv_q": conv(), "conv_k": conv(), "conv_v": conv(),
                           "state": torch.zeros(batch, H, K, K, dtype=compute_dtype(dtype), device=device)})
        else:
            layer = {"kv": torch.zeros(batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype,
                                       device=device)}
            if cfg.has_indexer:
                layer["index_k"] = torch.zeros(batch, max_len, cfg.index_head_dim, dtype=dtype, device=device)
            layers.append(layer)
    cache = {"pos": torch.zeros((), dtype=torch.int64, device=device),
             "start": torch.zeros(batch, dtype=torch.int64, device=device), "max_len": max_len, "layers": layers}
    if start is not None:
        reset_cache(cache, start)
    return cache


def reset_cache(cache: dict, start: Tensor | None = None) -> dict:
    """Empty the cache in place for a new batch (pos = 0, states zeroed, buffers kept) with row starts `start` [B]
    (default zeros). Returns the cache."""
    B = cache["start"].shape[0]
    if start is None:
        start = torch.zeros(B, dtype=torch.int64)
    start = torch.as_tensor(start)
    if start.shape != (B,) or start.dtype.is_floating_point or start.dtype == torch.bool:
        raise CacheError(f"start must be an integer tensor [{B}] (one slot per row), got {start.dtype} "
                         f"{list(start.shape)}")
    if start.numel() and (int(start.min()) < 0 or int(start.max()) >= cache["max_len"]):
        raise CacheError(f"start must lie in [0, max_len={cache['max_len']}), got {start.tolist()}")
    for layer in cache["layers"]:
        for t in layer.values():
            t.zero_()
    cache["pos"].zero_()
    cache["start"].copy_(start)
    return cache


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token lists -> (ids [B, T] int64 left-padded with pad_id, start [B] int64 = T − len(prompt))."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise CacheError("left_pad: every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.as_tensor(p, dtype=torch.int64)
    start = torch.tensor([T - len(p) for p in prompts], dtype=torch.int64)
    return ids, start


def clone_cache(cache: dict) -> dict:
    """A deep copy (new buffers)."""
    return {"pos": cache["pos"].clone(), "start": cache["start"].clone(), "max_len": cache["max_len"],
            "layers": [{k: t.clone() for k, t in layer.items()} for layer in cache["layers"]]}


def mark_static(cache: dict) -> dict:
    """Mark every buffer as a static address for CUDA graphs (docs/compile.md#cuda-graphs): replays then write the
    cache in place instead of copying it in, and in-place mutation does not make cudagraph trees skip the graph. Dynamo
    guards on these addresses, so a different cache recompiles: allocate one and `reset_cache` it."""
    for t in [cache["pos"], cache["start"], *(t for layer in cache["layers"] for t in layer.values())]:
        torch._dynamo.mark_static_address(t)
    return cache


# ---------------------------------------------------------------------------------------------- used by forward

class Step(NamedTuple):
    """Where the T new tokens of one forward call sit. Built once per call, shared by all layers."""
    slots: Tensor        # [T] int64: pos + arange(T), the slots written
    reset: Tensor        # [B, T] bool: the row's first real token (KDA state restarts before it)
    conv_reset: Tensor   # [B, W-1+T] bool: the same over the conv window (cached tail + new tokens)
    ranges: KeyRanges    # the queries' candidate slots [start[b], slot + 1), none for padding queries


def step_positions(cache: dict, T: int, cfg: ModelConfig) -> Step:
    W = cfg.linear_attn_config.short_conv_kernel_size
    pos, start = cache["pos"], cache["start"]
    dev = pos.device
    slots = pos + torch.arange(T, device=dev)
    window = pos + torch.arange(-(W - 1), T, device=dev)
    return Step(slots=slots, reset=slots[None, :] == start[:, None], conv_reset=window[None, :] == start[:, None],
                ranges=cache_ranges(slots, start, cache["max_len"]))


def check_cache(cache, cfg: ModelConfig, input_ids: Tensor, dtype: torch.dtype) -> None:
    """Named errors for a cache that does not fit cfg, the batch, the parameters' dtype or the free slots."""
    if not isinstance(cache, dict) or not all(k in cache for k in ("pos", "start", "max_len", "layers")):
        raise CacheError("cache must be the dict from kimi.init_cache (keys pos, start, max_len, layers)")
    layers, L = cache["layers"], cfg.num_hidden_layers
    if len(layers) != L:
        raise CacheError(f"cache has {len(layers)} layers, the model {L}: was it built for another config?")
    B, T = input_ids.shape
    la = cfg.linear_attn_config
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    max_len = cache["max_len"]
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, layers)):
        if kind == "kda":
            want = {"conv_q": (B, W - 1, H * K), "conv_k": (B, W - 1, H * K), "conv_v": (B, W - 1, H * K),
                    "state": (B, H, K, K)}
        else:
            want = {"kv": (B, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
            if cfg.has_indexer:
                want["index_k"] = (B, max_len, cfg.index_head_dim)
        got = {k: tuple(t.shape) for k, t in layer.items()}
        if sorted(got) != sorted(want):
            raise CacheError(f"cache layer {i} ({kind}) has buffers {sorted(got)}, expected {sorted(want)}: was it "
                             "built for another config?")
        for k, shape in want.items():
            if got[k][0] != B:
                raise CacheError(f"cache was built for batch {got[k][0]}, input_ids has batch {B}")
            if got[k] != shape:
                raise CacheError(f"cache layer {i} {k} has shape {list(got[k])}, expected {list(shape)}: was it "
                                 "built for another config?")
        act = layer["kv" if kind == "mla" else "conv_q"].dtype
        if act != dtype or (kind == "kda" and layer["state"].dtype != compute_dtype(dtype)):
            raise CacheError(f"cache layer {i} holds {act} activations, the parameters are {dtype}: "
                             f"build it with init_cache(..., dtype={dtype})")
    if cache["start"].shape != (B,):
        raise CacheError(f"cache start has shape {list(cache['start'].shape)}, expected [{B}]")
    if T == 0:
        raise CacheError("input_ids has no tokens (T = 0)")
    if host_checks():   # a host sync: eager only (a compiled or captured step trusts its caller)
        check_room(int(cache["pos"]), T, max_len)


def check_room(pos: int, T: int, max_len: int):
    """CacheError unless T new tokens fit after the `pos` used slots of a cache of `max_len` (the host-side check
    of `check_cache`; a caller that tracks `pos` itself, like generate.py's CUDA-graph step, calls it directly)."""
    if pos + T > max_len:
        raise CacheError(f"cache overflow: {pos} slots used + {T} new tokens > max_len={max_len}; allocate "
                         "a longer cache or stop generating")
